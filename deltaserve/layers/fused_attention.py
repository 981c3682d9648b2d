"""The attention side of the fused decode blocks (layers/fused_blocks.py): KDA, Kimi's dense NoPE MLA and DSA
layers, each a plan (modules, switches, weights, descriptor builder) and a runner that checks the step and calls its
native block (native_src/blocks.c)."""

from __future__ import annotations

import math

import torch

from ..ops import native
from ..ops.native_contract import DsaBlock, KdaBlock, MlaBlock
from .batch import StepBatch
from .fused_plan import Descriptor, Plan, address, column_pack, has_switches, native_pack
from .kda import KimiDeltaAttention
from .mla import MLAttention
from .native_path import BLOCK_MAX_ROWS, LINEAR_MAX_ROWS
from .norm import RMSNorm


def attention_plan(attn: torch.nn.Module, norm: RMSNorm) -> Plan | None:
    """The plan of a layer's attention block, or None when its kind or parts cannot be fused."""
    if isinstance(attn, KimiDeltaAttention):
        return _kda_plan(attn, norm)
    if isinstance(attn, MLAttention):
        return _mla_plan(attn, norm) if attn.indexer is None else _dsa_plan(attn, norm)
    return None


def _kda_descriptor(attn: KimiDeltaAttention, norm: RMSNorm) -> Descriptor:
    """The block's descriptor (`KdaBlock`) over the layer's current packed weights."""
    c = attn.config
    inputs = [m.weight for m in attn.input_linears()]
    w_in, c_in = attn._inputs.get_native(inputs), attn._inputs.get_columns(inputs)
    w_fb, w_o, c_fb, c_o = native_pack(attn.f_b_proj), native_pack(attn.o_proj), column_pack(attn.f_b_proj), \
        column_pack(attn.o_proj)
    w_gb, c_gb = (None, None) if c.kda_full_rank_gate else (native_pack(attn.g_b_proj), column_pack(attn.g_b_proj))
    dt_bias, a_log = attn.dt_bias.detach().float().contiguous(), attn.A_log.detach().float().contiguous()
    conv_w, o_norm = attn._conv_weight(), attn.o_norm.weight.detach().float().contiguous()
    n_in = sum(m.out_features for m in attn.input_linears())
    keep = [t for t in (norm.weight, w_in, w_fb, w_gb, dt_bias, a_log, conv_w, o_norm, w_o, c_in, c_fb, c_gb, c_o)
            if t is not None]
    lower = c.kda_gate_lower_bound
    block = KdaBlock(
        hidden=c.hidden_size, heads=attn.H, head_dim=attn.K, conv_width=attn.W, in_width=n_in,
        norm_w=norm.weight.data_ptr(), w_in=w_in.data_ptr(), w_fb=w_fb.data_ptr(), w_gb=address(w_gb),
        dt_bias=dt_bias.data_ptr(), a_log=a_log.data_ptr(), conv_w=conv_w.data_ptr(), onorm_w=o_norm.data_ptr(),
        w_o=w_o.data_ptr(), c_in=c_in.data_ptr(), c_fb=c_fb.data_ptr(), c_gb=address(c_gb), c_o=c_o.data_ptr(),
        eps=norm.eps, onorm_eps=c.rms_norm_eps, lower_bound=math.nan if lower is None else lower,
        scale=attn.K ** -0.5)
    return Descriptor(block, keep)


def kda_pools(attn: KimiDeltaAttention, cache) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layer's conv and recurrent slot pools when they are in the layout the block reads."""
    pool = cache.kda_slot_pool(attn.layer)
    if pool is None:
        return None
    conv, rec = pool
    P, W, K = attn.P, attn.W, attn.K
    if (conv.dtype != torch.float32 or rec.dtype != torch.float32 or conv.device.type != "cpu"
            or conv.stride()[1:] != (P * (W - 1), W - 1, 1) or rec.stride()[1:] != (K * K, K, 1)):
        return None
    return conv, rec


def _kda_plan(attn: KimiDeltaAttention, norm: RMSNorm) -> Plan | None:
    linears = [*attn.input_linears(), attn.f_b_proj, attn.o_proj]
    if not attn.config.kda_full_rank_gate:
        linears.append(attn.g_b_proj)
    if not has_switches(attn, norm, *linears):
        return None
    sources = [norm.weight, attn.dt_bias, attn.A_log, attn.o_norm.weight, *(m.weight for m in linears),
               *(conv.weight for conv in (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d))]
    return Plan("kda", attn, [attn, norm, *linears], sources, lambda: _kda_descriptor(attn, norm), BLOCK_MAX_ROWS,
                 _run_kda)


def _run_kda(plan: Plan, desc: Descriptor, x: torch.Tensor, batch: StepBatch,
             residual: torch.Tensor | None) -> torch.Tensor | None:
    sequences = batch.kda_sequences
    pools = kda_pools(plan.module, batch.cache) if sequences is not None else None
    if pools is None or batch.query_start[-1] != x.shape[0]:
        return None
    nseq, cu, slots = sequences
    conv, rec = pools
    out = torch.empty_like(x)
    native.native_library().ds_kda_block(desc.block, x.data_ptr(), address(residual), x.shape[0], nseq, address(cu),
                                         slots.data_ptr(), conv.data_ptr(), conv.stride(0), rec.data_ptr(),
                                         rec.stride(0), out.data_ptr(), torch.get_num_threads())
    save_step_checkpoints(plan.module, batch, conv, rec)
    return out


def save_step_checkpoints(attn: KimiDeltaAttention, batch: StepBatch, conv: torch.Tensor,
                            rec: torch.Tensor) -> None:
    """The prefix-cache snapshots of a step the KDA block ran (the module's rule for which steps those are:
    `StepBatch.kda_sequences`), each at the end of its sequence's rows (one token on a decode step): the slot's
    state after the step copied into the checkpoint, as the layer's module does (layers/kda.py)."""
    if not any(batch.kda_snapshots):
        return
    for handle, snapshots in zip(batch.handles, batch.kda_snapshots):
        for _, checkpoint in snapshots:
            batch.cache.save_kda_checkpoint(attn.layer, checkpoint, conv[handle.slot], rec[handle.slot])


def _mla_linears(attn: MLAttention) -> list[torch.nn.Module] | None:
    """q_proj, kv_a_proj, kv_a_layernorm, kv_b_proj and o_proj of the MLA form the block computes (Kimi's: no
    query LoRA, no RoPE, no output gate, no indexer), else None."""
    c = attn.config
    if attn.indexer is not None or attn.rotary is not None or c.q_lora_rank is not None or c.mla_use_output_gate:
        return None
    return [attn.q_proj, attn.kv_a_proj_with_mqa, attn.kv_a_layernorm, attn.kv_b_proj, attn.o_proj]


def _mla_descriptor(attn: MLAttention, norm: RMSNorm) -> Descriptor:
    """The block's descriptor (`MlaBlock`) over the layer's current packed weights."""
    linears = (attn.q_proj, attn.kv_a_proj_with_mqa, attn.o_proj)
    w_q, w_kva, w_o = map(native_pack, linears)
    c_q, c_kva, c_o = map(column_pack, linears)
    (w_uk, w_uv), (c_uk, c_uv) = attn._kv_b_packs(columns=False), attn._kv_b_packs(columns=True)
    kva_norm = attn.kv_a_layernorm
    keep = [norm.weight, w_q, w_kva, kva_norm.weight, w_uk, w_uv, w_o, c_q, c_kva, c_uk, c_uv, c_o]
    block = MlaBlock(
        hidden=attn.config.hidden_size, heads=attn.H, nope=attn.n, rope=attn.rho, v_dim=attn.v, rank=attn.r,
        norm_w=norm.weight.data_ptr(), w_q=w_q.data_ptr(), w_kva=w_kva.data_ptr(),
        kva_norm_w=kva_norm.weight.data_ptr(), w_uk=w_uk.data_ptr(), w_uv=w_uv.data_ptr(), w_o=w_o.data_ptr(),
        c_q=c_q.data_ptr(), c_kva=c_kva.data_ptr(), c_uk=c_uk.data_ptr(), c_uv=c_uv.data_ptr(), c_o=c_o.data_ptr(),
        eps=norm.eps, kva_eps=kva_norm.eps, scale=attn.scale)
    return Descriptor(block, keep)


def _mla_plan(attn: MLAttention, norm: RMSNorm) -> Plan | None:
    parts = _mla_linears(attn)
    if parts is None or not has_switches(attn, norm, *parts):
        return None
    return Plan("mla", attn, [attn, norm, *parts], [norm.weight, *(m.weight for m in parts)],
                 lambda: _mla_descriptor(attn, norm), BLOCK_MAX_ROWS, _run_mla)


def step_rows(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A pure decode step's cache rows of every sequence [B, width] and of its new token [B] (int64), read by the
    MLA and DSA blocks; None when the step is not one."""
    context_rows = batch.decode_context_rows
    if context_rows is None or batch.write_rows is None:
        return None
    return context_rows, batch.write_rows.to(torch.int64).contiguous()


def mla_pages(attn: MLAttention, cache) -> torch.Tensor | None:
    """The layer's latent page rows when they are plain bf16/fp32 rows the block reads (not an 8-bit cache, not a
    cache that stores sequences contiguously)."""
    pages = cache.mla_pages(attn.layer)
    return pages[0] if pages is not None and _page_rows(pages[0], attn.r + attn.rho) else None


def _run_mla(plan: Plan, desc: Descriptor, x: torch.Tensor, batch: StepBatch,
             residual: torch.Tensor | None) -> torch.Tensor | None:
    rows = step_rows(batch)
    latent = mla_pages(plan.module, batch.cache) if rows is not None else None
    if latent is None:
        return None
    context_rows, write_rows = rows
    out = torch.empty_like(x)
    if native.native_library().ds_mla_block(desc.block, x.data_ptr(), address(residual), x.shape[0],
                                            context_rows.data_ptr(), context_rows.shape[1], write_rows.data_ptr(),
                                            latent.data_ptr(), latent.stride(0), latent.shape[0],
                                            latent.dtype == torch.bfloat16, out.data_ptr(), torch.get_num_threads()):
        raise IndexError(f"fused MLA block: a cache row lies outside the {latent.shape[0]} page rows")
    return out


def _dsa_plan(attn: MLAttention, norm: RMSNorm) -> Plan | None:
    """A DSA layer with query LoRA on the MLAPO path (K3's NoPE; DeepSeek-V3.2's RoPE, the indexer's rotated part
    as wide as the MLA's) with bf16 weights and norms."""
    c = attn.config
    if (c.q_lora_rank is None or not attn._fusable() or not has_switches(attn, norm, attn.o_proj)
            or attn.indexer.rope_dim not in (0, attn.rho) or (attn.rotary is not None and not c.uses_rope)):
        return None
    ix = attn.indexer
    if not all(t.dtype == torch.bfloat16 for t in (attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight,
                                                   ix.k_norm.weight, ix.k_norm.bias)):
        return None
    attn._fused_weights()  # gathers the layer's parameters: the block's sources
    return Plan("dsa", attn, [attn, norm, attn.o_proj], [norm.weight, *attn._mlapo_sources],
                 lambda: _dsa_descriptor(attn, norm), LINEAR_MAX_ROWS, _run_dsa)


def _dsa_descriptor(attn: MLAttention, norm: RMSNorm) -> Descriptor | None:
    """The block's descriptor (`DsaBlock`); None when the MLAPO weights have no native packs."""
    W = attn._fused_weights()
    if not {"w_a", "q_b_proj", "w_uk_t", "index_wq_b"} <= set(W.packed):
        return None
    w_uv, w_o = attn._kv_b_packs(columns=False)[1], native_pack(attn.o_proj)
    keep = [norm.weight, W.packed["w_a"], W.packed["q_b_proj"], W.packed["w_uk_t"], W.packed["index_wq_b"], w_uv,
            w_o, W.q_a_norm, W.kv_a_norm, W.index_k_norm_weight, W.index_k_norm_bias]
    c = attn.config
    block = DsaBlock(
        hidden=c.hidden_size, heads=attn.H, nope=attn.n, rope=attn.rho, v_dim=attn.v, rank=attn.r,
        q_rank=c.q_lora_rank, a_width=sum(W.split_a), gate_width=attn.H * attn.v if W.g_proj is not None else 0,
        index_dim=W.index_head_dim, index_rope=W.index_rope_dim, index_heads=W.index_n_heads,
        index_topk=c.index_topk, norm_w=norm.weight.data_ptr(), w_a=W.packed["w_a"].data_ptr(),
        qa_norm_w=W.q_a_norm.data_ptr(), w_qb=W.packed["q_b_proj"].data_ptr(), kva_norm_w=W.kv_a_norm.data_ptr(),
        ik_norm_w=W.index_k_norm_weight.data_ptr(), ik_norm_b=W.index_k_norm_bias.data_ptr(),
        w_uk=W.packed["w_uk_t"].data_ptr(), w_uv=w_uv.data_ptr(), w_o=w_o.data_ptr(),
        w_iq=W.packed["index_wq_b"].data_ptr(), eps=norm.eps, q_eps=c.mla_norm_eps, kv_eps=c.mla_norm_eps,
        index_eps=c.index_norm_eps, scale=attn.scale, index_weight_scale=W.index_n_heads ** -0.5,
        index_dim_scale=W.index_head_dim ** -0.5)
    return Descriptor(block, keep)


def _page_rows(t, width: int) -> bool:
    """A plain bf16/fp32 CPU page tensor of rows of `width` (not an 8-bit cache)."""
    return (isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float32) and t.device.type == "cpu"
            and t.stride(-1) == 1 and t.shape[-1] == width)


def dsa_pages(attn: MLAttention, cache) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layer's latent and index-key page rows when both are plain bf16/fp32 rows (not an 8-bit cache, not a
    cache that stores sequences contiguously)."""
    pages = cache.mla_pages(attn.layer)
    if pages is None:
        return None
    latent, keys, scales = pages
    if scales is not None or not (_page_rows(latent, attn.r + attn.rho) and _page_rows(keys, attn.indexer.head_dim)):
        return None
    return latent, keys


def rotation(attn: MLAttention, batch: StepBatch) -> torch.Tensor | None:
    """[2, N, rho / 2] fp32 cos and sin at the step's positions (DeepSeek-V3.2's RoPE), None for NoPE."""
    return torch.stack(attn.rotary.cos_sin(batch.positions)).float().contiguous() if attn.rotary else None


def _run_dsa(plan: Plan, desc: Descriptor, x: torch.Tensor, batch: StepBatch,
             residual: torch.Tensor | None) -> torch.Tensor | None:
    """The indexer's selection runs inside the block (native_src/indexer.c) for contexts past its top-k."""
    attn = plan.module
    rows = step_rows(batch)
    pages = dsa_pages(attn, batch.cache) if rows is not None else None
    if pages is None:
        return None
    (context_rows, write_rows), (latent, keys) = rows, pages
    cos_sin = rotation(attn, batch)
    out = torch.empty_like(x)
    if native.native_library().ds_dsa_block(desc.block, x.data_ptr(), address(residual), x.shape[0],
                                            context_rows.data_ptr(), context_rows.shape[1], write_rows.data_ptr(),
                                            latent.data_ptr(), latent.stride(0), latent.shape[0],
                                            latent.dtype == torch.bfloat16, keys.data_ptr(), keys.stride(0),
                                            keys.dtype == torch.bfloat16, address(cos_sin), out.data_ptr(),
                                            torch.get_num_threads()):
        raise IndexError(f"fused DSA block: a cache row lies outside the {latent.shape[0]} page rows")
    return out
