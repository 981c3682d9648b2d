"""A decoder layer shared by every family: plain pre-norm residual (Kimi-Linear, DeepSeek) or one layer of block
AttnRes (K3, K3.1) — docs/model.md §4, §5.3."""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed import Shard
from ..layers.batch import StepBatch
from ..layers.kda import KimiDeltaAttention
from ..layers.linear import Linear
from ..layers.mla import MLAttention
from ..layers.mlp import MLP
from ..layers.moe import MoE
from ..layers.norm import RMSNorm

V = TypeVar("V")


class AttnResQuery(nn.Module):
    """A pseudo-query `proj.weight [1, d]` and its key norm weight `norm.weight [d]` for one AttnRes mixture."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.proj = Linear(dim, 1)
        self.norm = RMSNorm(dim, eps)
        self.eps = eps


class SubBlocks(Protocol[V]):
    """How a decoder stack's sub-blocks are applied to values of type V. The stack's structure (which sub-block
    reads which values, docs/model.md §4, §5.3) is written once, in `DecoderLayer.apply*` and `CausalLM.run_layers`;
    `Eager` applies it to tensors, and the native backend's program writer (backends/native/program.py) to
    registers, recording the same calls as a program."""

    def attention(self, layer: "DecoderLayer", x: V, residual: V | None) -> V:
        """residual + self_attn(input_layernorm(x)) (no residual: the attention output)."""

    def ffn(self, layer: "DecoderLayer", x: V, residual: V | None) -> V:
        """residual + ffn(post_attention_layernorm(x)) (no residual: the FFN output)."""

    def mix(self, query: AttnResQuery, sources: list[V]) -> V:
        """AttnRes's softmax mixture of `sources` over depth (one source: itself)."""


class Eager:
    """The sub-blocks applied to tensors by the modules, for one step."""

    def __init__(self, batch: StepBatch):
        self.batch = batch

    def attention(self, layer: "DecoderLayer", x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        a = layer.shard.all_reduce(layer.self_attn(layer.input_layernorm(x), self.batch))
        return a if residual is None else residual + a

    def ffn(self, layer: "DecoderLayer", x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        f = layer.shard.all_reduce(layer.ffn(layer.post_attention_layernorm(x)))
        return f if residual is None else residual + f

    def mix(self, query: AttnResQuery, sources: list[torch.Tensor]) -> torch.Tensor:
        return self.batch.ops.attn_res_mix(sources, query.proj.weight[0], query.norm.weight, query.eps)


class DecoderLayer(nn.Module):
    """Over a tensor-parallel group (`shard`) its attention and FFN each return this rank's partial sum, and the
    sub-blocks all-reduce it before the residual add (docs/parallel.md §3)."""

    def __init__(self, config: ModelConfig, layer: int, attn_res: bool = True, shard: Shard = Shard()):
        super().__init__()
        self.config, self.layer, self.shard = config, layer, shard
        d, eps = config.hidden_size, config.rms_norm_eps
        kind = config.attn_kind(layer)
        self.self_attn = (KimiDeltaAttention(config, layer, shard) if kind == "kda"
                          else MLAttention(config, layer, kind == "dsa", shard))
        self.ffn = (MoE(config, shard) if config.ffn_kind(layer) == "moe"
                    else MLP(config, d, config.intermediate_size, shard))
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.attn_res = attn_res and config.attn_res_block_size is not None
        if self.attn_res:
            self.self_attention_res = AttnResQuery(d, eps)
            self.mlp_res = AttnResQuery(d, eps)

    def forward(self, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Ordinary pre-norm residual block over tensors."""
        return self.apply(h, Eager(batch))

    def apply(self, h: V, blocks: SubBlocks[V]) -> V:
        """Ordinary pre-norm residual block."""
        h = blocks.attention(self, h, h)
        return blocks.ffn(self, h, h)

    def apply_attn_res(self, p: V, bank: list[V], blocks: SubBlocks[V]) -> V:
        """One layer of docs/model.md §5.3. `p` is the current block's partial sum; `bank` is extended in place on a
        block-write layer. Returns the next partial sum."""
        x = blocks.mix(self.self_attention_res, bank + [p]) if bank else p
        write = self.config.attnres_write(self.layer)
        if write:
            bank.append(p)
        p = blocks.attention(self, x, None if write else p)
        y = blocks.mix(self.mlp_res, bank + [p])
        return blocks.ffn(self, y, p)
