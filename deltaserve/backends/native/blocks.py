"""The fused native blocks of a decoder layer (native_src/blocks.c): `r + f(rmsnorm(x))` of one sub-block as one
call, r = x = h in a plain pre-norm layer; K3's AttnRes layers pass the mixed x and the block's partial sum r, or
none. The program (backends/native/program.py) writes them as its ops.

A block runs the same kernels in the same order as the native modules (backends/native/modules.py), so its output
equals theirs bit for bit (tests/test_native_program.py); the DSA block computes its index-key LayerNorm, output-gate
sigmoid and index scores in C, equal to fp32 rounding.

A layer's `Plan` per sub-block says which module it fuses, the weights its descriptor reads, how to build that
descriptor (a struct of ops/native_contract.py: dimensions, the packed weights' addresses, epsilons and scales,
rebuilt when a weight changes) and the most rows it takes. A plan exists when every part of the sub-block runs on the
native kernels (native modules: bf16 weights, or MX weights the kernels decode: a block's `mx` slots then point at
the modules' own column matrices, so no weight is copied) and its form is one the blocks compute:
* KDA attention, on any step whose prefix-cache snapshots fall at its sequences' ends;
* Kimi's dense NoPE MLA over paged bf16/fp32 latents, on a pure decode step;
* a DSA layer (K3's NoPE, DeepSeek-V3.2's RoPE) over plain bf16/fp32 latent and index-key pages, on a pure decode step
  of at most `LINEAR_MAX_ROWS` rows (past the indexer's top-k the block scores the keys and selects in C);
* the FFN: a routed MoE and/or a shared or dense MLP, on any step (`LINEAR_MAX_ROWS` rows for K3's latent MoE,
  whose down and up projections are plain linears).
Above `LINEAR_MAX_ROWS` rows the blocks' products read the column packs (`MLP_MAX_ROWS` for the dense and shared
MLPs), as the modules' products do, so one form of each product runs at each row count. An MX weight takes the MX
product at every row count, as its module does. The KDA and MLA blocks take their projections all bf16 or all MX;
the DSA block bf16 only (its stacked q_a / kv_a / indexer product mixes the two under MX schemes).
"""

from __future__ import annotations

import ctypes
import math

import torch

from ...config import ModelConfig
from ...layers.derived import Derived
from ...layers.kda import KimiDeltaAttention
from ...layers.mla import MLAttention
from ...layers.mlp import MLP
from ...layers.moe import MoE
from ...layers.norm import RMSNorm
from ...ops.native import ColumnMatrix, pack_rows
from ...ops.native_contract import (DSA_MX_SLOTS, KDA_MX_SLOTS, LINEAR_MAX_ROWS, MLA_MX_SLOTS, MOE_MX_SLOTS, DsaBlock,
                                    KdaBlock, MlaBlock, MoeBlock, MxMatrix)
from .modules import (NativeExperts, NativeKimiDeltaAttention, NativeLinear, NativeMLAttention, NativeMLP, NativeMoE,
                      NativeMXExperts, NativeMXLinear, NativeRMSNorm, NativeRouter, situ_params)

# The most rows a KDA, dense MLA or plain FFN block takes: it caps a block's scratch (~25 KiB a row on
# kimi-linear-small's KDA block). Above LINEAR_MAX_ROWS their products read the column packs, as the modules do.
BLOCK_MAX_ROWS = 8192


def address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _all_native(*modules: torch.nn.Module | None) -> bool:
    """Every module exists and runs on the native kernels (a quantised one does not)."""
    native = (NativeLinear, NativeRMSNorm, NativeRouter, NativeExperts, NativeMLP, NativeMoE, NativeKimiDeltaAttention,
              NativeMLAttention, NativeMXLinear, NativeMXExperts)
    return all(m is not None and type(m) in native for m in modules)


def _one_kind(*linears: torch.nn.Module) -> bool:
    """The linears are all bf16 (NativeLinear) or all MX (NativeMXLinear): a stacked product serves them."""
    kinds = {type(m) for m in linears}
    return kinds == {NativeLinear} or kinds == {NativeMXLinear}


def _mx_mlp(mlp: MLP) -> bool:
    return any(type(m) is NativeMXLinear for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))


def _weight(m: torch.nn.Module) -> torch.Tensor:
    """The tensor a linear's products read (a plan's source: the descriptor is rebuilt when it changes)."""
    return m.weight_columns if type(m) is NativeMXLinear else m.weight


def _expert_stacks(experts: torch.nn.Module) -> list[torch.Tensor]:
    if type(experts) is NativeMXExperts:
        return [experts.w1_columns, experts.w3_columns, experts.w2_columns]
    return [experts.w1, experts.w3, experts.w2]


def _attach_slots(block: ctypes.Structure, count: int, matrices: dict[int, ColumnMatrix]) -> list:
    """Point the block's `mx` at an array whose slot i holds matrices[i] (zero for a weight kept as a bf16 pack;
    no array when every weight is); returns what the descriptor must keep alive."""
    if not matrices:
        return []
    slots = (MxMatrix * count)()
    for i, m in matrices.items():
        slots[i] = m.struct()
    block.mx = ctypes.addressof(slots)
    return [slots, *(m.data for m in matrices.values()), *(m.scales for m in matrices.values() if m.scales is not None)]


class Descriptor:
    """One block's descriptor struct (`KdaBlock`, `MoeBlock`, `MlaBlock` or `DsaBlock`), its address, and the
    tensors whose addresses it holds (kept alive)."""

    def __init__(self, block: ctypes.Structure, keep: list[torch.Tensor]):
        self.block, self.address, self.keep = block, ctypes.addressof(block), keep


class Plan:
    """One sub-block of one layer: its `kind` ("kda", "mla", "dsa" or "ffn"), the `module` it fuses, the weights
    its descriptor reads, the descriptor's builder (which may give None: no native packs) and the most rows it
    takes."""

    def __init__(self, kind: str, module: torch.nn.Module, sources: list[torch.Tensor], build, max_rows: int):
        self.kind, self.module, self.sources, self.build, self.max_rows = kind, module, sources, build, max_rows
        self._descriptor = Derived()

    def descriptor(self) -> Descriptor | None:
        """The descriptor of the current weights (None when the builder found no native packs)."""
        return self._descriptor.get(self.sources, self.build)


def attention_plan(attn: torch.nn.Module, norm: RMSNorm) -> Plan | None:
    """The plan of a layer's attention sub-block, or None when its kind or parts cannot be fused."""
    if isinstance(attn, KimiDeltaAttention):
        return _kda_plan(attn, norm)
    if isinstance(attn, MLAttention):
        return _mla_plan(attn, norm) or _dsa_plan(attn, norm)  # Kimi-Linear's MLA form, else the DSA block's
    return None


def _kda_descriptor(attn: KimiDeltaAttention, norm: RMSNorm) -> Descriptor:
    """The block's descriptor (`KdaBlock`) over the layer's current weights: the stacked input projections as one
    bf16 pack pair or as MX slots; f_b, g_b and o_proj each as its bf16 packs or its MX slot."""
    c = attn.config
    keep: list = [norm.weight]
    mx: dict[int, ColumnMatrix] = {}
    packs: dict[str, int] = {}
    inputs = attn.input_linears()
    if type(inputs[0]) is NativeMXLinear:
        mx.update((i, m.columns()) for i, m in enumerate(inputs))
    else:
        weights = [m.weight for m in inputs]
        w_in, c_in = attn.input_packs.rows(weights), attn.input_packs.columns(weights)
        keep += [w_in, c_in]
        packs.update(w_in=w_in.data_ptr(), c_in=c_in.data_ptr())
    gb = None if c.kda_full_rank_gate else attn.g_b_proj
    for slot, name, m in ((6, "fb", attn.f_b_proj), (7, "gb", gb), (8, "o", attn.o_proj)):
        if m is None:
            continue
        if type(m) is NativeMXLinear:
            mx[slot] = m.columns()
        else:
            rows, cols = m.row_pack(), m.column_pack()
            keep += [rows, cols]
            packs.update({f"w_{name}": rows.data_ptr(), f"c_{name}": cols.data_ptr()})
    dt_bias, a_log = attn.dt_bias.detach().float().contiguous(), attn.A_log.detach().float().contiguous()
    conv_w, o_norm = attn._conv_weight(), attn.o_norm.weight.detach().float().contiguous()
    keep += [dt_bias, a_log, conv_w, o_norm]
    lower = c.kda_gate_lower_bound
    block = KdaBlock(
        hidden=c.hidden_size, heads=attn.H, head_dim=attn.K, conv_width=attn.W,
        in_width=sum(m.out_features for m in inputs), norm_w=norm.weight.data_ptr(), dt_bias=dt_bias.data_ptr(),
        a_log=a_log.data_ptr(), conv_w=conv_w.data_ptr(), onorm_w=o_norm.data_ptr(), eps=norm.eps,
        onorm_eps=c.rms_norm_eps, lower_bound=math.nan if lower is None else lower, scale=attn.K ** -0.5, **packs)
    return Descriptor(block, keep + _attach_slots(block, KDA_MX_SLOTS, mx))


def _kda_plan(attn: KimiDeltaAttention, norm: RMSNorm) -> Plan | None:
    linears = [*attn.input_linears(), attn.f_b_proj, attn.o_proj]
    if not attn.config.kda_full_rank_gate:
        linears.append(attn.g_b_proj)
    if not (_all_native(attn, norm, *linears) and _one_kind(*attn.input_linears())):
        return None
    sources = [norm.weight, attn.dt_bias, attn.A_log, attn.o_norm.weight, *(_weight(m) for m in linears),
               *(conv.weight for conv in (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d))]
    return Plan("kda", attn, sources, lambda: _kda_descriptor(attn, norm), BLOCK_MAX_ROWS)


def _mla_linears(attn: MLAttention) -> list[torch.nn.Module] | None:
    """q_proj, kv_a_proj, kv_a_layernorm, kv_b_proj and o_proj of the MLA form the block computes (Kimi's: no
    query LoRA, no RoPE, no output gate, no indexer), else None."""
    c = attn.config
    if attn.indexer is not None or attn.rotary is not None or c.q_lora_rank is not None or c.mla_use_output_gate:
        return None
    return [attn.q_proj, attn.kv_a_proj_with_mqa, attn.kv_a_layernorm, attn.kv_b_proj, attn.o_proj]


def _mla_descriptor(attn: MLAttention, norm: RMSNorm) -> Descriptor:
    """The block's descriptor (`MlaBlock`) over the layer's current weights: q_proj, kv_a_proj and o_proj each as
    its bf16 packs or its MX slot."""
    (w_uk, w_uv), (c_uk, c_uv) = attn.kv_b_packs(columns=False), attn.kv_b_packs(columns=True)
    kva_norm = attn.kv_a_layernorm
    block = MlaBlock(
        hidden=attn.config.hidden_size, heads=attn.H, nope=attn.n, rope=attn.rho, v_dim=attn.v, rank=attn.r,
        norm_w=norm.weight.data_ptr(), kva_norm_w=kva_norm.weight.data_ptr(), w_uk=w_uk.data_ptr(),
        w_uv=w_uv.data_ptr(), c_uk=c_uk.data_ptr(), c_uv=c_uv.data_ptr(), eps=norm.eps, kva_eps=kva_norm.eps,
        scale=attn.scale)
    keep: list = [norm.weight, kva_norm.weight, w_uk, w_uv, c_uk, c_uv]
    mx: dict[int, ColumnMatrix] = {}
    for slot, name, m in ((0, "q", attn.q_proj), (1, "kva", attn.kv_a_proj_with_mqa), (2, "o", attn.o_proj)):
        if type(m) is NativeMXLinear:
            mx[slot] = m.columns()
        else:
            rows, cols = m.row_pack(), m.column_pack()
            keep += [rows, cols]
            setattr(block, f"w_{name}", rows.data_ptr())
            setattr(block, f"c_{name}", cols.data_ptr())
    return Descriptor(block, keep + _attach_slots(block, MLA_MX_SLOTS, mx))


def _mla_plan(attn: MLAttention, norm: RMSNorm) -> Plan | None:
    parts = _mla_linears(attn)
    if parts is None or not _all_native(attn, norm, *parts) or type(parts[3]) is not NativeLinear:
        return None
    return Plan("mla", attn, [norm.weight, *(_weight(m) for m in parts)], lambda: _mla_descriptor(attn, norm),
                BLOCK_MAX_ROWS)


def _dsa_linears(attn: MLAttention) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """The layer's linears the block reads from x (q_a, kv_a and the gate when there is one) and the others (q_b,
    o_proj, kv_b and the indexer's wq_b, wk and weights_proj)."""
    ix = attn.indexer
    first = [attn.q_a_proj, attn.kv_a_proj_with_mqa, *([attn.g_proj] if attn.config.mla_use_output_gate else [])]
    return first, [attn.q_b_proj, attn.o_proj, attn.kv_b_proj, ix.wq_b, ix.wk, ix.weights_proj]


def _dsa_plan(attn: MLAttention, norm: RMSNorm) -> Plan | None:
    """A DSA layer with query LoRA on the MLAPO path (K3's NoPE; DeepSeek-V3.2's RoPE, the indexer's rotated part
    as wide as the MLA's) with bf16 norms and bf16 weights, or under an MX scheme: q_a, kv_a and the gate all MX, q_b
    and o_proj each MX or bf16, kv_b and the indexer bf16. K3's MLA layers (query LoRA and output gate, no indexer:
    the MTP layer's among them) take the same block without its index key, on bf16 weights."""
    c, ix = attn.config, attn.indexer
    if (c.q_lora_rank is None or not _all_native(attn, norm) or (ix is not None and ix.rope_dim not in (0, attn.rho))
            or (attn.rotary is not None and not c.uses_rope)):
        return None
    norms = [attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight, *([] if ix is None else [ix.k_norm.weight,
                                                                                             ix.k_norm.bias])]
    if not all(t.dtype == torch.bfloat16 for t in norms):
        return None
    if attn._fusable() and type(attn.o_proj) is NativeLinear:
        attn._fused_weights()  # gathers the layer's parameters: the block's sources
        return Plan("dsa", attn, [norm.weight, *attn._mlapo_sources], lambda: _dsa_descriptor(attn, norm),
                    LINEAR_MAX_ROWS)
    if ix is None:  # the MX form reads the index rows through w_a
        return None
    first, rest = _dsa_linears(attn)
    if (not _all_native(*first, *rest) or {type(m) for m in first} != {NativeMXLinear}
            or any(type(m) is not NativeLinear for m in rest[2:])):
        return None
    sources = [norm.weight, attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight, ix.k_norm.weight, ix.k_norm.bias,
               *(_weight(m) for m in (*first, *rest))]
    return Plan("dsa", attn, sources, lambda: _dsa_mx_descriptor(attn, norm), LINEAR_MAX_ROWS)


def _dsa_block(attn: MLAttention, norm: RMSNorm, a_width: int, gate_width: int, **weights: int) -> DsaBlock:
    c, ix = attn.config, attn.indexer
    index = {} if ix is None else dict(  # no indexer: index_dim 0, every row attended
        index_dim=ix.head_dim, index_rope=ix.rope_dim, index_heads=ix.heads, index_topk=c.index_topk,
        index_eps=c.index_norm_eps, index_weight_scale=ix.heads ** -0.5, index_dim_scale=ix.head_dim ** -0.5)
    return DsaBlock(
        hidden=c.hidden_size, heads=attn.H, nope=attn.n, rope=attn.rho, v_dim=attn.v, rank=attn.r,
        q_rank=c.q_lora_rank, a_width=a_width, gate_width=gate_width, norm_w=norm.weight.data_ptr(), eps=norm.eps,
        q_eps=c.mla_norm_eps, kv_eps=c.mla_norm_eps, scale=attn.scale, **index, **weights)


def _dsa_descriptor(attn: MLAttention, norm: RMSNorm) -> Descriptor | None:
    """The block's descriptor (`DsaBlock`) over bf16 weights; None when the MLAPO weights have no native packs."""
    W = attn._fused_weights().pack_native()
    if not {"w_a", "q_b_proj", "w_uk_t", *(["index_wq_b"] if W.has_indexer else [])} <= set(W.packed):
        return None
    w_uv, w_o = attn.kv_b_packs(columns=False)[1], attn.o_proj.row_pack()
    keep = [norm.weight, W.packed["w_a"], W.packed["q_b_proj"], W.packed["w_uk_t"], w_uv, w_o, W.q_a_norm,
            W.kv_a_norm]
    index = {}
    if W.has_indexer:
        keep += [W.packed["index_wq_b"], W.index_k_norm_weight, W.index_k_norm_bias]
        index = dict(ik_norm_w=W.index_k_norm_weight.data_ptr(), ik_norm_b=W.index_k_norm_bias.data_ptr(),
                     w_iq=W.packed["index_wq_b"].data_ptr())
    block = _dsa_block(
        attn, norm, a_width=sum(W.split_a), gate_width=attn.H * attn.v if W.g_proj is not None else 0,
        w_a=W.packed["w_a"].data_ptr(), qa_norm_w=W.q_a_norm.data_ptr(), w_qb=W.packed["q_b_proj"].data_ptr(),
        kva_norm_w=W.kv_a_norm.data_ptr(), w_uk=W.packed["w_uk_t"].data_ptr(), w_uv=w_uv.data_ptr(),
        w_o=w_o.data_ptr(), **index)
    return Descriptor(block, keep)


def _dsa_mx_descriptor(attn: MLAttention, norm: RMSNorm) -> Descriptor:
    """The block's descriptor under an MX scheme: q_a, kv_a and the gate in slots 0-2 (the modules' own column
    matrices), q_b and o_proj in slots 3 and 4 or as their bf16 row packs, w_a the index wk | weights rows."""
    first, (q_b, o_proj, _, wq_b, wk, weights_proj) = _dsa_linears(attn)
    ix = attn.indexer
    index_rows = pack_rows(torch.cat([wk.weight.detach(), weights_proj.weight.detach()]))
    w_uk, w_uv = attn.kv_b_packs(columns=False)
    w_iq = wq_b.row_pack()
    keep: list = [norm.weight, attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight, ix.k_norm.weight,
                  ix.k_norm.bias, index_rows, w_uk, w_uv, w_iq]
    mx: dict[int, ColumnMatrix] = dict(enumerate(m.columns() for m in first))
    packs: dict[str, int] = {}
    for slot, name, m in ((3, "w_qb", q_b), (4, "w_o", o_proj)):
        if type(m) is NativeMXLinear:
            mx[slot] = m.columns()
        else:
            keep.append(m.row_pack())
            packs[name] = keep[-1].data_ptr()
    block = _dsa_block(
        attn, norm, a_width=sum(m.out_features for m in (*first, wk, weights_proj)),
        gate_width=first[2].out_features if len(first) == 3 else 0, w_a=index_rows.data_ptr(),
        qa_norm_w=attn.q_a_layernorm.weight.data_ptr(), kva_norm_w=attn.kv_a_layernorm.weight.data_ptr(),
        ik_norm_w=ix.k_norm.weight.data_ptr(), ik_norm_b=ix.k_norm.bias.data_ptr(), w_uk=w_uk.data_ptr(),
        w_uv=w_uv.data_ptr(), w_iq=w_iq.data_ptr(), **packs)
    return Descriptor(block, keep + _attach_slots(block, DSA_MX_SLOTS, mx))


def ffn_plan(ffn: torch.nn.Module, norm: RMSNorm, config: ModelConfig) -> Plan | None:
    """The routed MoE (plain or latent) and/or the shared or dense MLP, when every part runs on the native kernels."""
    moe = ffn if isinstance(ffn, MoE) else None
    mlp = ffn if isinstance(ffn, MLP) else ffn.shared_experts if moe is not None else None
    if moe is None and mlp is None:
        return None
    latent = _latent_parts(moe) if moe is not None else []
    parts = [norm, *([moe.gate, moe.experts, *latent] if moe is not None else []),
             *([mlp.gate_proj, mlp.up_proj, mlp.down_proj] if mlp is not None else [])]
    if not _all_native(*parts):  # a part the kernels do not take keeps the modules
        return None
    if mlp is not None and _mx_mlp(mlp) and mlp.column_matrices() is None:
        return None
    sources = [norm.weight]
    if moe is not None:
        sources += [moe.gate.weight, moe.gate.e_score_correction_bias, *_expert_stacks(moe.experts),
                    *(_weight(m) if isinstance(m, (NativeLinear, NativeMXLinear)) else m.weight for m in latent)]
    if mlp is not None:
        sources += [_weight(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    max_rows = LINEAR_MAX_ROWS if moe is not None and moe.latent else BLOCK_MAX_ROWS
    return Plan("ffn", ffn, sources, lambda: _ffn_descriptor(config, norm, moe, mlp), max_rows)


def _latent_parts(moe: MoE) -> list[torch.nn.Module]:
    """K3's latent projections (and norm, when there is one) around the experts; none for a plain MoE."""
    if not moe.latent:
        return []
    parts = [moe.routed_expert_down_proj, moe.routed_expert_up_proj]
    return parts + ([moe.routed_expert_norm] if moe.routed_expert_norm is not None else [])


def _ffn_descriptor(c: ModelConfig, norm: RMSNorm, moe: MoE | None, mlp: MLP | None) -> Descriptor:
    """The block's descriptor (`MoeBlock`): fields of absent parts stay 0; MX parts (routed stacks, the MLP's
    linears, each latent projection) in the `mx` slots, their bf16 fields 0."""
    keep: list = [norm.weight]
    mx: dict[int, ColumnMatrix] = {}
    situ = situ_params(c)
    block = MoeBlock(hidden=c.hidden_size, norm_w=norm.weight.data_ptr(), situ=int(situ is not None), eps=norm.eps,
                     routed_scale=c.routed_scaling_factor, situ_beta=situ[0] if situ else 0.0,
                     situ_linear_beta=math.nan if situ is None or situ[1] is None else situ[1])
    if moe is not None:
        router_w, bias = moe.gate.weight_f32(), moe.gate.bias_f32()
        keep += [router_w, bias]
        block.experts, block.topk = c.num_experts, c.num_experts_per_token
        block.router_w, block.router_bias = router_w.data_ptr(), bias.data_ptr()
        block.softmax, block.renorm = int(c.router_activation != "sigmoid"), int(c.moe_renormalize)
        block.groups, block.topk_group = c.num_expert_group, c.topk_group
        if type(moe.experts) is NativeMXExperts:
            stacks = moe.experts.column_matrices()
            mx.update(enumerate(stacks))
            block.expert_width = stacks[0].shape[-2]
        else:
            w1, w3, w2 = stacks = moe.experts.column_packs()
            keep += list(stacks)
            block.expert_width = moe.experts.w1.shape[1]
            block.w1, block.w3, block.w2 = w1.data_ptr(), w3.data_ptr(), w2.data_ptr()
    if mlp is not None:
        linears = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        block.shared_width = mlp.gate_proj.out_features
        if _mx_mlp(mlp):  # as NativeMLP runs it: the expert kernel over its column matrices (MX or bf16 packs)
            mx.update({3 + j: m for j, m in enumerate(mlp.column_matrices())})
        else:
            (s1, s3, s2), (c_s1, c_s3, c_s2) = [m.row_pack() for m in linears], [m.column_pack() for m in linears]
            keep += [s1, s3, s2, c_s1, c_s3, c_s2]
            block.s1, block.s3, block.s2 = s1.data_ptr(), s3.data_ptr(), s2.data_ptr()
            block.c_s1, block.c_s3, block.c_s2 = c_s1.data_ptr(), c_s3.data_ptr(), c_s2.data_ptr()
    if moe is not None and moe.latent:
        block.latent = moe.latent
        for slot, field, proj in ((6, "w_down", moe.routed_expert_down_proj), (7, "w_up", moe.routed_expert_up_proj)):
            if type(proj) is NativeMXLinear:
                mx[slot] = proj.columns()
            else:
                pack = proj.row_pack()
                keep.append(pack)
                setattr(block, field, pack.data_ptr())
        if moe.routed_expert_norm is not None:
            keep.append(moe.routed_expert_norm.weight)
            block.latent_norm_w = moe.routed_expert_norm.weight.data_ptr()
            block.latent_eps = moe.routed_expert_norm.eps
    return Descriptor(block, keep + _attach_slots(block, MOE_MX_SLOTS, mx))


