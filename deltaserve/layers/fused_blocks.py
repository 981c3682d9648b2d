"""Fused residual blocks at decode (native_src/blocks.c): `r + f(rmsnorm(x))` of a decoder layer as one native call
(r = x = h in a plain pre-norm layer; K3's AttnRes layers pass the mixed x and the block's partial sum r, or none).

At batch 1 a kimi-linear-small step spent about as long in the Python and torch glue between the native kernels
(~10 calls and ~40 small ops a layer: norms, projections, gate math, views, the router's dozen ops, the residual
adds) as in the kernels themselves. A fused block runs the same kernels in the same order from C, so its output
equals the modules' bit for bit: the modules' forward is its twin (tests/test_fused_blocks.py). The DSA block is
the exception: its index-key LayerNorm and output-gate sigmoid are computed in C, equal to fp32 rounding.

A block applies when every part it composes runs on the native kernels (`native` switched on, bf16, unquantised)
and the step is small: KDA attention, Kimi's dense NoPE MLA over paged bf16/fp32 latents, or a DSA layer (K3's
NoPE, DeepSeek-V3.2's RoPE) while the indexer's top-k covers every sequence's whole context (then it selects every
row: only its key is computed and stored), on a pure decode step of at most `LINEAR_MAX_ROWS` sequences; a MoE
or dense-MLP FFN over at most `MLP_MAX_ROWS` rows (`LINEAR_MAX_ROWS` for K3's latent MoE, whose down and up
projections are plain linears). Otherwise the calls return None and the layer runs its modules.

Each layer keeps a `BlockPlans`: per block, gathered at its first decode step, the modules whose `native` switches
it needs (read on every call), the weights it reads and its descriptor (dimensions and the packed weights'
addresses, int64; epsilons and scales, fp32), rebuilt when any of those weights changes. Gathering once keeps the
Python of a call to a few microseconds (walking the modules cost ~60 us a block at batch 1); it relies on the
layer's structure (which modules, quantised or not) being fixed at load, as the engine does.
"""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig
from ..ops import native
from .batch import StepBatch
from .kda import KimiDeltaAttention
from .mla import MLAttention
from .mlp import MLP, situ_params
from .moe import MoE
from .native_path import LINEAR_MAX_ROWS, MLP_MAX_ROWS
from .norm import RMSNorm
from .prepack import Derived


def _has_switches(*modules: torch.nn.Module | None) -> bool:
    """Every module exists and has a native switch (quantised modules have none)."""
    return all(m is not None and hasattr(m, "native") for m in modules)


def _packed(linear: torch.nn.Module) -> torch.Tensor:
    return linear._packed.get_native([linear.weight])


def _takes(x: torch.Tensor, residual: torch.Tensor | None, max_rows: int) -> bool:
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous() and 0 < x.shape[0] <= max_rows
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape
                                      and residual.is_contiguous())))


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class _Descriptor:
    """Integer and float descriptor vectors of one block, and the tensors whose addresses they hold (kept alive)."""

    def __init__(self, ints: list[int], floats: list[float], keep: list[torch.Tensor]):
        self.ints = torch.tensor(ints, dtype=torch.int64)
        self.floats = torch.tensor(floats, dtype=torch.float32)
        self.ints_address, self.floats_address = self.ints.data_ptr(), self.floats.data_ptr()
        self.keep = keep


class _Plan:
    """One block of one layer: `module` (the attention or FFN it fuses), the modules whose native switches must be
    on, the weights the descriptor reads and its builder (which may give None: the block does not apply),
    `max_rows` it takes and, for attention, the function that runs it."""

    def __init__(self, module: torch.nn.Module, switches: list[torch.nn.Module], sources: list[torch.Tensor],
                 build, max_rows: int, run=None):
        self.module, self.switches, self.sources, self.build, self.max_rows = module, switches, sources, build, max_rows
        self.run = run  # attention blocks: (plan, descriptor, x, batch, residual) -> output or None
        self._descriptor = Derived()

    def descriptor(self, x: torch.Tensor, residual: torch.Tensor | None) -> _Descriptor | None:
        """The descriptor when the block takes these inputs and every switch is on, else None."""
        if not _takes(x, residual, self.max_rows):
            return None
        for m in self.switches:
            if not m.native:
                return None
        return self._descriptor.get(self.sources, self.build)  # None when the builder found no native packs


def _kda_descriptor(attn: KimiDeltaAttention, norm: RMSNorm) -> _Descriptor:
    """native_src/blocks.c KB_* / KBF_* order."""
    c = attn.config
    w_in = attn._inputs.get_native([m.weight for m in attn.input_linears()])
    w_fb, w_o = _packed(attn.f_b_proj), _packed(attn.o_proj)
    w_gb = None if c.kda_full_rank_gate else _packed(attn.g_b_proj)
    dt_bias, a_log = attn.dt_bias.detach().float().contiguous(), attn.A_log.detach().float().contiguous()
    conv_w, o_norm = attn._conv_weight(), attn.o_norm.weight.detach().float().contiguous()
    n_in = sum(m.out_features for m in attn.input_linears())
    keep = [t for t in (norm.weight, w_in, w_fb, w_gb, dt_bias, a_log, conv_w, o_norm, w_o) if t is not None]
    ints = [c.hidden_size, attn.H, attn.K, attn.W, n_in, norm.weight.data_ptr(), w_in.data_ptr(), w_fb.data_ptr(),
            0 if w_gb is None else w_gb.data_ptr(), dt_bias.data_ptr(), a_log.data_ptr(), conv_w.data_ptr(),
            o_norm.data_ptr(), w_o.data_ptr()]
    lower = c.kda_gate_lower_bound
    return _Descriptor(ints, [norm.eps, c.rms_norm_eps, math.nan if lower is None else lower, attn.K ** -0.5], keep)


def _slot_pools(attn: KimiDeltaAttention, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layer's conv and recurrent slot pools when they are in the layout the block reads."""
    pool = batch.cache.kda_slot_pool(attn.layer)
    if pool is None:
        return None
    conv, rec = pool
    P, W, K = attn.P, attn.W, attn.K
    if (conv.dtype != torch.float32 or rec.dtype != torch.float32 or conv.device.type != "cpu"
            or conv.stride()[1:] != (P * (W - 1), W - 1, 1) or rec.stride()[1:] != (K * K, K, 1)):
        return None
    return conv, rec


def _kda_plan(attn: KimiDeltaAttention, norm: RMSNorm) -> _Plan | None:
    linears = [*attn.input_linears(), attn.f_b_proj, attn.o_proj]
    if not attn.config.kda_full_rank_gate:
        linears.append(attn.g_b_proj)
    if not _has_switches(attn, norm, *linears):
        return None
    sources = [norm.weight, attn.dt_bias, attn.A_log, attn.o_norm.weight, *(m.weight for m in linears),
               *(conv.weight for conv in (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d))]
    return _Plan(attn, [attn, norm, *linears], sources, lambda: _kda_descriptor(attn, norm), LINEAR_MAX_ROWS,
                 _run_kda)


def _run_kda(plan: _Plan, desc: _Descriptor, x: torch.Tensor, batch: StepBatch,
             residual: torch.Tensor | None) -> torch.Tensor | None:
    slots = batch.decode_slots
    if slots is None or slots.numel() != x.shape[0]:
        return None
    pools = _slot_pools(plan.module, batch)
    if pools is None:
        return None
    conv, rec = pools
    out = torch.empty_like(x)
    native.native_library().ds_kda_block(desc.ints_address, desc.floats_address, x.data_ptr(), _address(residual),
                                         x.shape[0], slots.data_ptr(), conv.data_ptr(), conv.stride(0),
                                         rec.data_ptr(), rec.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def _mla_linears(attn: MLAttention) -> list[torch.nn.Module] | None:
    """q_proj, kv_a_proj, kv_a_layernorm, kv_b_proj and o_proj of the MLA form the block computes (Kimi's: no
    query LoRA, no RoPE, no output gate, no indexer), else None."""
    c = attn.config
    if attn.indexer is not None or attn.rotary is not None or c.q_lora_rank is not None or c.mla_use_output_gate:
        return None
    return [attn.q_proj, attn.kv_a_proj_with_mqa, attn.kv_a_layernorm, attn.kv_b_proj, attn.o_proj]


def _mla_descriptor(attn: MLAttention, norm: RMSNorm) -> _Descriptor:
    """native_src/blocks.c AB_* / ABF_* order."""
    w_q, w_kva, w_o = _packed(attn.q_proj), _packed(attn.kv_a_proj_with_mqa), _packed(attn.o_proj)
    w_uk, w_uv = attn._kv_b_native()
    kva_norm = attn.kv_a_layernorm
    keep = [norm.weight, w_q, w_kva, kva_norm.weight, w_uk, w_uv, w_o]
    ints = [attn.config.hidden_size, attn.H, attn.n, attn.rho, attn.v, attn.r, norm.weight.data_ptr(),
            w_q.data_ptr(), w_kva.data_ptr(), kva_norm.weight.data_ptr(), w_uk.data_ptr(), w_uv.data_ptr(),
            w_o.data_ptr()]
    return _Descriptor(ints, [norm.eps, kva_norm.eps, attn.scale], keep)


def _mla_plan(attn: MLAttention, norm: RMSNorm) -> _Plan | None:
    parts = _mla_linears(attn)
    if parts is None or not _has_switches(attn, norm, *parts):
        return None
    return _Plan(attn, [attn, norm, *parts], [norm.weight, *(m.weight for m in parts)],
                 lambda: _mla_descriptor(attn, norm), LINEAR_MAX_ROWS, _run_mla)


def _run_mla(plan: _Plan, desc: _Descriptor, x: torch.Tensor, batch: StepBatch,
             residual: torch.Tensor | None) -> torch.Tensor | None:
    attn = plan.module
    context_rows = batch.decode_context_rows
    if context_rows is None or batch.write_rows is None:
        return None
    latent = batch.cache.mla_pages(attn.layer)[0]
    if not (isinstance(latent, torch.Tensor) and latent.dtype in (torch.bfloat16, torch.float32)
            and latent.device.type == "cpu" and latent.stride(-1) == 1 and latent.shape[-1] == attn.r + attn.rho):
        return None
    write_rows = batch.write_rows.to(torch.int64).contiguous()
    out = torch.empty_like(x)
    if native.native_library().ds_mla_block(desc.ints_address, desc.floats_address, x.data_ptr(),
                                            _address(residual), x.shape[0], context_rows.data_ptr(),
                                            context_rows.shape[1], write_rows.data_ptr(), latent.data_ptr(),
                                            latent.stride(0), latent.shape[0], latent.dtype == torch.bfloat16,
                                            out.data_ptr(), torch.get_num_threads()):
        raise IndexError(f"fused MLA block: a cache row lies outside the {latent.shape[0]} page rows")
    return out


def _dsa_plan(attn: MLAttention, norm: RMSNorm) -> _Plan | None:
    """A DSA layer with query LoRA on the MLAPO path (K3's NoPE; DeepSeek-V3.2's RoPE, the indexer's rotated part
    as wide as the MLA's) with bf16 weights and norms."""
    c = attn.config
    if (c.q_lora_rank is None or not attn._fusable() or not _has_switches(attn, norm, attn.o_proj)
            or attn.indexer.rope_dim not in (0, attn.rho) or (attn.rotary is not None and not c.uses_rope)):
        return None
    ix = attn.indexer
    if not all(t.dtype == torch.bfloat16 for t in (attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight,
                                                   ix.k_norm.weight, ix.k_norm.bias)):
        return None
    attn._fused_weights()  # gathers the layer's parameters: the block's sources
    return _Plan(attn, [attn, norm, attn.o_proj], [norm.weight, *attn._mlapo_sources],
                 lambda: _dsa_descriptor(attn, norm), LINEAR_MAX_ROWS, _run_dsa)


def _dsa_descriptor(attn: MLAttention, norm: RMSNorm) -> _Descriptor | None:
    """native_src/blocks.c DB_* / DBF_* order; None when the MLAPO weights have no native packs."""
    W = attn._fused_weights()
    if not {"w_a", "q_b_proj", "w_uk_t"} <= set(W.packed):
        return None
    w_uv, w_o = attn._kv_b_native()[1], _packed(attn.o_proj)
    keep = [norm.weight, W.packed["w_a"], W.packed["q_b_proj"], W.packed["w_uk_t"], w_uv, w_o, W.q_a_norm,
            W.kv_a_norm, W.index_k_norm_weight, W.index_k_norm_bias]
    c = attn.config
    ints = [c.hidden_size, attn.H, attn.n, attn.rho, attn.v, attn.r, c.q_lora_rank, sum(W.split_a),
            attn.H * attn.v if W.g_proj is not None else 0, W.index_head_dim, W.index_rope_dim, norm.weight.data_ptr(),
            W.packed["w_a"].data_ptr(), W.q_a_norm.data_ptr(), W.packed["q_b_proj"].data_ptr(),
            W.kv_a_norm.data_ptr(), W.index_k_norm_weight.data_ptr(), W.index_k_norm_bias.data_ptr(),
            W.packed["w_uk_t"].data_ptr(), w_uv.data_ptr(), w_o.data_ptr()]
    floats = [norm.eps, c.mla_norm_eps, c.mla_norm_eps, c.index_norm_eps, attn.scale]
    return _Descriptor(ints, floats, keep)


def _page_rows(t, width: int) -> bool:
    """A plain bf16/fp32 CPU page tensor of rows of `width` (not an 8-bit cache)."""
    return (isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float32) and t.device.type == "cpu"
            and t.stride(-1) == 1 and t.shape[-1] == width)


def _run_dsa(plan: _Plan, desc: _Descriptor, x: torch.Tensor, batch: StepBatch,
             residual: torch.Tensor | None) -> torch.Tensor | None:
    """Only when the indexer would select every row of every sequence (all contexts within its top-k)."""
    attn = plan.module
    meta, context_rows = batch.index_meta, batch.decode_context_rows
    if meta is None or not meta.all_short or context_rows is None or batch.write_rows is None:
        return None
    latent, keys, scales = batch.cache.mla_pages(attn.layer)
    if scales is not None or not (_page_rows(latent, attn.r + attn.rho)
                                  and _page_rows(keys, attn.indexer.head_dim)):
        return None
    write_rows = batch.write_rows.to(torch.int64).contiguous()
    cos_sin = torch.stack(attn.rotary.cos_sin(batch.positions)).float().contiguous() if attn.rotary else None
    out = torch.empty_like(x)
    if native.native_library().ds_dsa_block(desc.ints_address, desc.floats_address, x.data_ptr(),
                                            _address(residual), x.shape[0], context_rows.data_ptr(),
                                            context_rows.shape[1], write_rows.data_ptr(), latent.data_ptr(),
                                            latent.stride(0), latent.shape[0], latent.dtype == torch.bfloat16,
                                            keys.data_ptr(), keys.stride(0), keys.dtype == torch.bfloat16,
                                            _address(cos_sin), out.data_ptr(), torch.get_num_threads()):
        raise IndexError(f"fused DSA block: a cache row lies outside the {latent.shape[0]} page rows")
    return out


def attention_block(layer: torch.nn.Module, x: torch.Tensor, batch: StepBatch,
                    residual: torch.Tensor | None) -> torch.Tensor | None:
    """`residual + self_attn(input_layernorm(x))` (no residual: the attention output) in one call on a pure decode
    step: a KDA layer (states updated in their slots) or a dense NoPE MLA layer (the step's cache rows written);
    None when the block does not apply."""
    plan = layer.block_plans.attention(layer)
    desc = plan.descriptor(x, residual) if plan is not None else None
    if desc is None:
        return None
    return plan.run(plan, desc, x, batch, residual)


def _ffn_plan(ffn: torch.nn.Module, norm: RMSNorm, config: ModelConfig) -> _Plan | None:
    """The routed MoE (plain or latent) and/or the shared or dense MLP, when every part has its native switch."""
    moe = ffn if isinstance(ffn, MoE) else None
    mlp = ffn if isinstance(ffn, MLP) else ffn.shared_experts if moe is not None else None
    if moe is None and mlp is None:
        return None
    latent = _latent_parts(moe) if moe is not None else []
    switches = [norm, *([moe.gate, moe.experts, *latent] if moe is not None else []),
                *([mlp.gate_proj, mlp.up_proj, mlp.down_proj] if mlp is not None else [])]
    if not _has_switches(*switches):  # a quantised part (no switch) keeps the modules
        return None
    sources = [norm.weight]
    if moe is not None:
        sources += [moe.gate.weight, moe.gate.e_score_correction_bias, moe.experts.w1, moe.experts.w3,
                    moe.experts.w2, *(m.weight for m in latent)]
    if mlp is not None:
        sources += [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    max_rows = LINEAR_MAX_ROWS if moe is not None and moe.latent else MLP_MAX_ROWS
    return _Plan(ffn, switches, sources, lambda: _ffn_descriptor(config, norm, moe, mlp), max_rows)


def _latent_parts(moe: MoE) -> list[torch.nn.Module]:
    """K3's latent projections (and norm, when there is one) around the experts; none for a plain MoE."""
    if not moe.latent:
        return []
    parts = [moe.routed_expert_down_proj, moe.routed_expert_up_proj]
    return parts + ([moe.routed_expert_norm] if moe.routed_expert_norm is not None else [])


def _ffn_descriptor(c: ModelConfig, norm: RMSNorm, moe: MoE | None, mlp: MLP | None) -> _Descriptor:
    """native_src/blocks.c MB_* / MBF_* order."""
    keep: list[torch.Tensor] = [norm.weight]
    routed = [0] * 12  # E, I, k, router w, bias, softmax, groups, topk_group, renorm, w1, w3, w2
    if moe is not None:
        router_w, bias = moe.gate._weight_f32(), moe.gate._bias_f32()
        stacks = moe.experts._native_weights()
        keep += [router_w, bias, *stacks]
        routed = [c.num_experts, moe.experts.w1.shape[1], c.num_experts_per_token, router_w.data_ptr(),
                  bias.data_ptr(), int(c.router_activation != "sigmoid"), c.num_expert_group, c.topk_group,
                  int(c.moe_renormalize), *(w.data_ptr() for w in stacks)]
    shared = [0, 0, 0, 0]
    if mlp is not None:
        packs = [_packed(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
        keep += packs
        shared = [mlp.gate_proj.out_features, *(p.data_ptr() for p in packs)]
    latent, latent_eps = [0, 0, 0, 0], 0.0
    if moe is not None and moe.latent:
        down, up, latent_norm = _packed(moe.routed_expert_down_proj), _packed(moe.routed_expert_up_proj), None
        if moe.routed_expert_norm is not None:
            latent_norm, latent_eps = moe.routed_expert_norm.weight, moe.routed_expert_norm.eps
        keep += [t for t in (down, up, latent_norm) if t is not None]
        latent = [moe.latent, down.data_ptr(), _address(latent_norm), up.data_ptr()]
    situ = situ_params(c)
    ints = [c.hidden_size, norm.weight.data_ptr(), *routed, *shared, int(situ is not None), *latent]
    floats = [norm.eps, c.routed_scaling_factor, situ[0] if situ else 0.0,
              math.nan if situ is None or situ[1] is None else situ[1], latent_eps]
    return _Descriptor(ints, floats, keep)


def ffn_block(layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
    """`residual + ffn(post_attention_layernorm(x))` (no residual: the FFN output) in one call for a few rows; None
    when the block does not apply."""
    plan = layer.block_plans.ffn(layer)
    desc = plan.descriptor(x, residual) if plan is not None else None
    if desc is None:
        return None
    out = torch.empty_like(x)
    if native.native_library().ds_moe_block(desc.ints_address, desc.floats_address, x.data_ptr(), _address(residual),
                                            x.shape[0], out.data_ptr(), torch.get_num_threads()):
        raise ValueError("fused FFN block: the router's expert and group counts are not valid")
    return out


_UNSET = object()


class BlockPlans:
    """A decoder layer's block plans, gathered at first use (None: the block never applies to the layer)."""

    def __init__(self):
        self._attention = self._ffn = _UNSET

    def attention(self, layer: torch.nn.Module) -> _Plan | None:
        if self._attention is _UNSET:
            attn, norm = layer.self_attn, layer.input_layernorm
            self._attention = (_kda_plan(attn, norm) if isinstance(attn, KimiDeltaAttention)
                               else None if not isinstance(attn, MLAttention)
                               else _mla_plan(attn, norm) if attn.indexer is None else _dsa_plan(attn, norm))
        return self._attention

    def ffn(self, layer: torch.nn.Module) -> _Plan | None:
        if self._ffn is _UNSET:
            self._ffn = _ffn_plan(layer.ffn, layer.post_attention_layernorm, layer.config)
        return self._ffn
