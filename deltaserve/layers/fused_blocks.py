"""Fused residual blocks at decode (native_src/blocks.c): `r + f(rmsnorm(x))` of a decoder layer as one native call
(r = x = h in a plain pre-norm layer; K3's AttnRes layers pass the mixed x and the block's partial sum r, or none).

At batch 1 a kimi-linear-small step spent about as long in the Python and torch glue between the native kernels
(~10 calls and ~40 small ops a layer: norms, projections, gate math, views, the router's dozen ops, the residual
adds) as in the kernels themselves. A fused block runs the same kernels in the same order from C, so its output
equals the modules' bit for bit: the modules' forward is its twin (tests/test_fused_blocks.py). The DSA block is
the exception: its index-key LayerNorm, output-gate sigmoid and index scores are computed in C, equal to fp32
rounding.

A block applies when every part it composes runs on the native kernels (`native` switched on, bf16, unquantised):
KDA attention on any step whose prefix-cache snapshots fall at its sequences' ends (decode steps and prefill chunks
alike) and Kimi's dense NoPE MLA over paged bf16/fp32 latents on a pure decode step, of at most `BLOCK_MAX_ROWS`
rows; a DSA layer (K3's NoPE, DeepSeek-V3.2's RoPE) over plain bf16/fp32 latent and
index-key pages (past the indexer's top-k the block scores the keys and selects in C, native_src/indexer.c) on one
of at most `LINEAR_MAX_ROWS`; a MoE or dense-MLP FFN over at most `BLOCK_MAX_ROWS` rows of any step
(`LINEAR_MAX_ROWS` for K3's latent MoE, whose down and up projections are plain linears). Above `LINEAR_MAX_ROWS`
rows the blocks' products read the column packs (`MLP_MAX_ROWS` for the dense and shared MLPs), as the modules'
products do, so one form of each product runs at each row count and the results stay the modules'. Otherwise the
calls return None and the layer runs its modules.

Each layer keeps a `BlockPlans`: per block, gathered at its first use, the modules whose `native` switches
it needs (read on every call), the weights it reads and its descriptor (a struct of ops/native_contract.py:
dimensions, the packed weights' addresses, epsilons and scales), rebuilt when any of those weights changes.
Gathering once keeps the Python of a call to a few lookups, where walking the modules on every call is a visible
share of a batch-1 step; it relies on the layer's structure (which modules, quantised or not) being fixed at load,
as the engine does.
"""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig
from ..ops import native
from ..ops.native_contract import MoeBlock
from .batch import StepBatch
from .fused_attention import attention_plan
from .fused_plan import Descriptor, Plan, address, column_pack, has_switches, native_pack
from .mlp import MLP, situ_params
from .moe import MoE
from .native_path import BLOCK_MAX_ROWS, LINEAR_MAX_ROWS
from .norm import RMSNorm


def attention_block(layer: torch.nn.Module, x: torch.Tensor, batch: StepBatch,
                    residual: torch.Tensor | None) -> torch.Tensor | None:
    """`residual + self_attn(input_layernorm(x))` (no residual: the attention output) in one call: a KDA layer
    (states updated in their slots; decode or prefill rows), or on a pure decode step a dense NoPE MLA or a DSA layer
    (the step's cache rows written); None when the block does not apply (layers/fused_attention.py)."""
    plan = layer.block_plans.attention(layer)
    desc = plan.descriptor(x, residual) if plan is not None else None
    if desc is None:
        return None
    return plan.run(plan, desc, x, batch, residual)


def _ffn_plan(ffn: torch.nn.Module, norm: RMSNorm, config: ModelConfig) -> Plan | None:
    """The routed MoE (plain or latent) and/or the shared or dense MLP, when every part has its native switch."""
    moe = ffn if isinstance(ffn, MoE) else None
    mlp = ffn if isinstance(ffn, MLP) else ffn.shared_experts if moe is not None else None
    if moe is None and mlp is None:
        return None
    latent = _latent_parts(moe) if moe is not None else []
    switches = [norm, *([moe.gate, moe.experts, *latent] if moe is not None else []),
                *([mlp.gate_proj, mlp.up_proj, mlp.down_proj] if mlp is not None else [])]
    if not has_switches(*switches):  # a quantised part (no switch) keeps the modules
        return None
    sources = [norm.weight]
    if moe is not None:
        sources += [moe.gate.weight, moe.gate.e_score_correction_bias, moe.experts.w1, moe.experts.w3,
                    moe.experts.w2, *(m.weight for m in latent)]
    if mlp is not None:
        sources += [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    max_rows = LINEAR_MAX_ROWS if moe is not None and moe.latent else BLOCK_MAX_ROWS
    return Plan("ffn", ffn, switches, sources, lambda: _ffn_descriptor(config, norm, moe, mlp), max_rows)


def _latent_parts(moe: MoE) -> list[torch.nn.Module]:
    """K3's latent projections (and norm, when there is one) around the experts; none for a plain MoE."""
    if not moe.latent:
        return []
    parts = [moe.routed_expert_down_proj, moe.routed_expert_up_proj]
    return parts + ([moe.routed_expert_norm] if moe.routed_expert_norm is not None else [])


def _ffn_descriptor(c: ModelConfig, norm: RMSNorm, moe: MoE | None, mlp: MLP | None) -> Descriptor:
    """The block's descriptor (`MoeBlock`): fields of absent parts stay 0."""
    keep: list[torch.Tensor] = [norm.weight]
    situ = situ_params(c)
    block = MoeBlock(hidden=c.hidden_size, norm_w=norm.weight.data_ptr(), situ=int(situ is not None), eps=norm.eps,
                     routed_scale=c.routed_scaling_factor, situ_beta=situ[0] if situ else 0.0,
                     situ_linear_beta=math.nan if situ is None or situ[1] is None else situ[1])
    if moe is not None:
        router_w, bias = moe.gate._weight_f32(), moe.gate._bias_f32()
        w1, w3, w2 = stacks = moe.experts._native_weights()
        keep += [router_w, bias, *stacks]
        block.experts, block.expert_width, block.topk = c.num_experts, moe.experts.w1.shape[1], c.num_experts_per_token
        block.router_w, block.router_bias = router_w.data_ptr(), bias.data_ptr()
        block.softmax, block.renorm = int(c.router_activation != "sigmoid"), int(c.moe_renormalize)
        block.groups, block.topk_group = c.num_expert_group, c.topk_group
        block.w1, block.w3, block.w2 = w1.data_ptr(), w3.data_ptr(), w2.data_ptr()
    if mlp is not None:
        linears = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        (s1, s3, s2), (c_s1, c_s3, c_s2) = [native_pack(m) for m in linears], [column_pack(m) for m in linears]
        keep += [s1, s3, s2, c_s1, c_s3, c_s2]
        block.shared_width = mlp.gate_proj.out_features
        block.s1, block.s3, block.s2 = s1.data_ptr(), s3.data_ptr(), s2.data_ptr()
        block.c_s1, block.c_s3, block.c_s2 = c_s1.data_ptr(), c_s3.data_ptr(), c_s2.data_ptr()
    if moe is not None and moe.latent:
        down, up = native_pack(moe.routed_expert_down_proj), native_pack(moe.routed_expert_up_proj)
        keep += [down, up]
        block.latent, block.w_down, block.w_up = moe.latent, down.data_ptr(), up.data_ptr()
        if moe.routed_expert_norm is not None:
            keep.append(moe.routed_expert_norm.weight)
            block.latent_norm_w = moe.routed_expert_norm.weight.data_ptr()
            block.latent_eps = moe.routed_expert_norm.eps
    return Descriptor(block, keep)


def ffn_block(layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
    """`residual + ffn(post_attention_layernorm(x))` (no residual: the FFN output) in one call for a few rows; None
    when the block does not apply."""
    plan = layer.block_plans.ffn(layer)
    desc = plan.descriptor(x, residual) if plan is not None else None
    if desc is None:
        return None
    out = torch.empty_like(x)
    if native.native_library().ds_moe_block(desc.block, x.data_ptr(), address(residual), x.shape[0], out.data_ptr(),
                                            torch.get_num_threads()):
        raise ValueError("fused FFN block: the router's expert and group counts are not valid")
    return out


_UNSET = object()


class BlockPlans:
    """A decoder layer's block plans, gathered at first use (None: the block never applies to the layer)."""

    def __init__(self):
        self._attention = self._ffn = _UNSET

    def attention(self, layer: torch.nn.Module) -> Plan | None:
        if self._attention is _UNSET:
            self._attention = attention_plan(layer.self_attn, layer.input_layernorm)
        return self._attention

    def ffn(self, layer: torch.nn.Module) -> Plan | None:
        if self._ffn is _UNSET:
            self._ffn = _ffn_plan(layer.ffn, layer.post_attention_layernorm, layer.config)
        return self._ffn
