"""Op sets: every op the layers call, by name. `fast` is the default; `reference` swaps every op for its readable
`*_ref` twin (same signatures), for debugging (`--ops reference`). Layers get the set through the StepBatch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import attn_res, conv, kda, kda_native, mla, mlapo, qsfa


@dataclass(frozen=True)
class OpSet:
    name: str
    kda_chunk: Callable
    kda_recurrent: Callable
    short_conv: Callable
    attn_res_mix: Callable
    mla_decode: Callable  # attention of single-token queries over cached latents
    mla_prefill: Callable  # attention of a chunk's queries over the sequence's latents (expanded form)
    kda_decode_step: Callable  # convs + normalisation + delta rule for one token of many sequences, in place
    kda_step_varlen: Callable  # the same for several tokens of several sequences (a prefill round)
    kda_gate_beta: Callable
    qsfa: Callable
    mla_preprocess: Callable


OP_SETS: dict[str, OpSet] = {
    "fast": OpSet("fast", kda.kda_chunk, kda.kda_recurrent, conv.short_conv, attn_res.attn_res_mix,
                  mla.mla_attention_absorbed, mla.mla_attention_expanded, kda_native.kda_decode_step,
                  kda_native.kda_step_varlen, kda_native.kda_gate_beta, qsfa.qsfa, mlapo.mla_preprocess),
    "reference": OpSet("reference", kda.kda_chunk_ref, kda.kda_recurrent_ref, conv.short_conv_ref,
                       attn_res.attn_res_mix_ref, mla.mla_attention_ref, mla.mla_attention_ref,
                       kda_native.kda_decode_step_ref, kda_native.kda_step_varlen_ref,
                       kda_native.kda_gate_beta_ref, qsfa.qsfa_ref, mlapo.mla_preprocess_ref),
}


def get_ops(name: str) -> OpSet:
    if name not in OP_SETS:
        raise ValueError(f"unknown op set {name!r}; choose from {', '.join(OP_SETS)}")
    return OP_SETS[name]

OP_SETS["native"] = OpSet("native", *[getattr(OP_SETS["fast"], f) for f in list(OpSet.__dataclass_fields__)[1:]])
