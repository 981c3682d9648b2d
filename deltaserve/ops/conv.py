"""Depthwise causal short convolution with SiLU for the KDA q/k/v paths (docs/model.md §8.2), one sequence at a time.

Contract shared by all functions here:

* ``x [T, C]`` (any float dtype), ``weight [C, W]`` (tap ``W-1`` multiplies the current token),
  ``state [C, W-1]`` or ``None`` = the previous ``W-1`` pre-conv inputs per channel, oldest first
  (``None`` ⇒ zeros, i.e. the start of the sequence).
* ``y_t[c] = SiLU(Σ_j weight[c, j] · x_{t-W+1+j}[c])``, accumulated in fp32, returned in ``x.dtype``.
* ``new_state [C, W-1]`` fp32 = the last ``W-1`` inputs of (state ++ x); values are the inputs upcast, so
  carrying it across any split point reproduces the one-pass result.

Inputs are never modified in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["short_conv_ref", "short_conv", "short_conv_update"]


def _window(x: Tensor, weight: Tensor, state: Tensor | None) -> Tensor:
    """fp32 ``[C, W-1+T]``: the carried inputs followed by the new ones (channels first)."""
    C, W = weight.shape
    if x.shape[-1] != C:
        raise ValueError(f"x has {x.shape[-1]} channels, weight has {C}")
    if state is None:
        state = x.new_zeros(C, W - 1, dtype=torch.float32)
    elif state.shape != (C, W - 1):
        raise ValueError(f"state shape {tuple(state.shape)} != {(C, W - 1)}")
    return torch.cat([state.float(), x.float().t()], dim=1)


def short_conv_ref(x: Tensor, weight: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Readable reference: one shifted multiply-add per tap.

    Returns ``(y [T, C] in x.dtype, new_state [C, W-1] fp32)``.
    """
    T = x.shape[0]
    W = weight.shape[1]
    xp = _window(x, weight, state)                      # xp[:, W-1+t] is x_t
    w = weight.float()
    acc = torch.zeros(x.shape[1], T, dtype=torch.float32, device=x.device)
    for j in range(W):
        # tap j sees x_{t-W+1+j}, i.e. column t+j of the window
        acc = acc + w[:, j:j + 1] * xp[:, j:j + T]
    y = F.silu(acc).t().to(x.dtype)
    return y, xp[:, xp.shape[1] - (W - 1):].clone()


def short_conv(x: Tensor, weight: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Fast twin of :func:`short_conv_ref` (prefill): one grouped ``F.conv1d`` over the fp32 window."""
    C, W = weight.shape
    xp = _window(x, weight, state)
    # cross-correlation over the window with no padding yields exactly T outputs, oldest tap first
    acc = F.conv1d(xp.unsqueeze(0), weight.float().unsqueeze(1), groups=C).squeeze(0)   # [C, T]
    y = F.silu(acc).t().to(x.dtype)
    return y, xp[:, xp.shape[1] - (W - 1):].clone()


def short_conv_update(x: Tensor, weight: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """Decode / spec-verify path for a few tokens (T=1 typical), same contract as :func:`short_conv`.

    Uses a sliding-window view and one multiply-reduce instead of a convolution launch.
    """
    W = weight.shape[1]
    xp = _window(x, weight, state)
    win = xp.unfold(1, W, 1)                                   # [C, T, W]: window ending at each token
    acc = (win * weight.float().unsqueeze(1)).sum(-1)          # [C, T]
    y = F.silu(acc).t().to(x.dtype)
    return y, xp[:, xp.shape[1] - (W - 1):].clone()
