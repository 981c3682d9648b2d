"""Gated MLP (dense layers and shared experts), SiLU-GLU or SiTU (docs/model.md §6)."""

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.activation import silu_glu, situ_glu
from ..ops.native import moe_bf16
from .linear import Linear
from .native_path import MLP_MAX_ROWS, takes_native
from .prepack import PackedWeights, module_group


def situ_params(config: ModelConfig) -> tuple[float, float | None] | None:
    """(beta, linear_beta) for the native kernels when the activation is SiTU, else None (SiLU-GLU)."""
    return (config.situ_beta, config.situ_linear_beta) if config.hidden_act == "situ" else None


def glu_activation(config: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The configured gated activation act(gate, up)."""
    if config.hidden_act == "situ":
        return situ_glu(gate, up, config.situ_beta, config.situ_linear_beta)
    return silu_glu(gate, up)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, in_dim: int, width: int):
        super().__init__()
        self.config = config
        self.gate_proj = Linear(in_dim, width)
        self.up_proj = Linear(in_dim, width)
        self.down_proj = Linear(width, in_dim)
        self._gate_up = PackedWeights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linears = (self.gate_proj, self.up_proj, self.down_proj)
        if all(getattr(m, "native", False) for m in linears) and takes_native(x, None):
            # the fused expert kernel with one expert of weight 1: the same roundings as the three products, on
            # their row packs (the dot tiles) up to MLP_MAX_ROWS rows and their column packs above, the forms the
            # linears take there (so one copy of each pack serves both; the fused blocks follow the same rule).
            # One call applies the activation to the gate and up sums as they come, where two column products
            # around torch's activation write both out to memory and read them back.
            T = x.shape[0]
            few = T <= MLP_MAX_ROWS
            packed = tuple((m._packed.get_native if few else m._packed.get_columns)([m.weight]).unsqueeze(0)
                           for m in linears)
            return moe_bf16(x.contiguous(), torch.zeros(T, 1, dtype=torch.int64), torch.ones(T, 1),
                            *(m.weight.unsqueeze(0) for m in linears), packed=packed, situ=situ_params(self.config))
        gate, up = module_group(x, [self.gate_proj, self.up_proj], self._gate_up)  # one product when prepacked
        return self.down_proj(glu_activation(self.config, gate, up))

    def shared_expert_packs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """(`pack_columns` of the gate, up and down weights, width) when all three linears are on the native kernels,
        for the routed experts' kernel to run this MLP as the MoE's shared expert in its own pass (`moe_bf16`'s
        `shared`); else None. Packed on first use, rebuilt when a weight changes (`PackedWeights`)."""
        linears = (self.gate_proj, self.up_proj, self.down_proj)
        if not all(getattr(m, "native", False) for m in linears):
            return None
        # the linears' own column packs: the copies they multiply with above 4 rows, so no second copy is kept
        return (*(m._packed.get_columns([m.weight]) for m in linears), self.gate_proj.out_features)
