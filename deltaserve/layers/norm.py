"""Normalisation layers in the reference rounding order (docs/model.md §3)."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """w * round(x_f32 * rsqrt(mean(x_f32^2) + eps)): the normalised vector is cast to x's dtype before the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA o_norm: fp32 throughout, round(w * x * rsqrt(mean(x^2) + eps) * sigmoid(gate)) over the last dim."""
    xf = x.float()
    y = weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


class LayerNorm(nn.Module):
    """Mean/variance LayerNorm with weight and bias, fp32 statistics (DSA indexer k_norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)
