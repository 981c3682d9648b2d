"""A decoder layer shared by every family: plain pre-norm residual (Kimi-Linear, DeepSeek) or one layer of block
AttnRes (K3, K3.1) — docs/model.md §4, §5.3."""

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.batch import StepBatch
from ..layers.fused_blocks import BlockPlans, attention_block, ffn_block
from ..layers.kda import KimiDeltaAttention
from ..layers.linear import Linear
from ..layers.mla import MLAttention
from ..layers.mlp import MLP
from ..layers.moe import MoE
from ..layers.norm import RMSNorm


class AttnResQuery(nn.Module):
    """A pseudo-query `proj.weight [1, d]` and its key norm weight `norm.weight [d]` for one AttnRes mixture."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.proj = Linear(dim, 1)
        self.norm = RMSNorm(dim, eps)
        self.eps = eps

    def mix(self, sources: list[torch.Tensor], batch: StepBatch) -> torch.Tensor:
        return batch.ops.attn_res_mix(sources, self.proj.weight[0], self.norm.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, attn_res: bool = True):
        super().__init__()
        self.config, self.layer = config, layer
        d, eps = config.hidden_size, config.rms_norm_eps
        kind = config.attn_kind(layer)
        self.self_attn = KimiDeltaAttention(config, layer) if kind == "kda" else MLAttention(config, layer, kind == "dsa")
        self.ffn = MoE(config) if config.ffn_kind(layer) == "moe" else MLP(config, d, config.intermediate_size)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.attn_res = attn_res and config.attn_res_block_size is not None
        self.fuse_blocks = True
        self.block_plans = BlockPlans()
        if self.attn_res:
            self.self_attention_res = AttnResQuery(d, eps)
            self.mlp_res = AttnResQuery(d, eps)

    def forward(self, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Ordinary pre-norm residual block. At decode, a sub-block whose parts all run on the native kernels runs as
        one fused call with the same result (layers/fused_blocks.py); `fuse_blocks = False` keeps the modules."""
        fused = attention_block(self, h, batch, h) if self.fuse_blocks else None
        h = fused if fused is not None else h + self.self_attn(self.input_layernorm(h), batch)
        fused = ffn_block(self, h, h) if self.fuse_blocks else None
        return fused if fused is not None else h + self.ffn(self.post_attention_layernorm(h))

    def forward_attn_res(self, p: torch.Tensor, bank: list[torch.Tensor], batch: StepBatch) -> torch.Tensor:
        """One layer of docs/model.md §5.3. `p` is the current block's partial sum; `bank` is extended in place on a
        block-write layer. Returns the next partial sum."""
        x = self.self_attention_res.mix(bank + [p], batch) if bank else p
        write = self.config.attnres_write(self.layer)
        if write:
            bank.append(p)
        fused = attention_block(self, x, batch, None if write else p) if self.fuse_blocks else None
        if fused is not None:
            p = fused
        else:
            a = self.self_attn(self.input_layernorm(x), batch)
            p = a if write else p + a
        y = self.mlp_res.mix(bank + [p], batch)
        fused = ffn_block(self, y, p) if self.fuse_blocks else None
        return fused if fused is not None else p + self.ffn(self.post_attention_layernorm(y))
