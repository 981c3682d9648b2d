"""Gated MLP (dense layers and shared experts), SiLU-GLU or SiTU (docs/model.md §6)."""

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed import Shard
from ..ops.activation import silu_glu, situ_glu
from .linear import Linear


def glu_activation(config: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The configured gated activation act(gate, up)."""
    if config.hidden_act == "situ":
        return situ_glu(gate, up, config.situ_beta, config.situ_linear_beta)
    return silu_glu(gate, up)


class MLP(nn.Module):
    """Over a tensor-parallel group each rank holds its share of the width (`shard`) and returns a partial sum."""

    def __init__(self, config: ModelConfig, in_dim: int, width: int, shard: Shard = Shard()):
        super().__init__()
        self.config = config
        width = shard.part(width)
        self.gate_proj = Linear(in_dim, width)
        self.up_proj = Linear(in_dim, width)
        self.down_proj = Linear(width, in_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu_activation(self.config, self.gate_proj(x), self.up_proj(x)))
