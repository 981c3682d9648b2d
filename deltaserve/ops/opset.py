"""Op sets: every op the layers call through the StepBatch (`batch.ops.<op>`), by name. Three sets, the same
fields and signatures, chosen with `get_ops(name)`:

* "reference": every op's readable `*_ref` twin, for debugging (`--ops reference`) and as the tests' yardstick;
* "fast": the fast forms in plain torch (device-agnostic). The "fast" set never calls the native library
  (ops/native.py `native_library()`), even where it loads: what it computes does not depend on a C build;
* "native": each op's `*_native` form where it has one (the native CPU kernels where the inputs take them, else
  exactly the op's fast torch form), the fast form for ops without a kernel.
"""

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
    kda_gate_beta: Callable  # KDA's forget gate g and beta from the gate projections
    qsfa: Callable  # sparse absorbed MLA attention over selected latent rows of the paged cache
    mla_preprocess: Callable  # MLAPO: an MLA/DSA layer's projections, norms, absorption and cache writes


OP_SETS: dict[str, OpSet] = {
    "reference": OpSet(
        "reference", kda_chunk=kda.kda_chunk_ref, kda_recurrent=kda.kda_recurrent_ref,
        short_conv=conv.short_conv_ref, attn_res_mix=attn_res.attn_res_mix_ref, mla_decode=mla.mla_attention_ref,
        mla_prefill=mla.mla_attention_ref, kda_decode_step=kda_native.kda_decode_step_ref,
        kda_step_varlen=kda_native.kda_step_varlen_ref, kda_gate_beta=kda_native.kda_gate_beta_ref,
        qsfa=qsfa.qsfa_ref, mla_preprocess=mlapo.mla_preprocess_ref),
    "fast": OpSet(
        "fast", kda_chunk=kda.kda_chunk, kda_recurrent=kda.kda_recurrent, short_conv=conv.short_conv,
        attn_res_mix=attn_res.attn_res_mix, mla_decode=mla.mla_attention_absorbed,
        mla_prefill=mla.mla_attention_expanded, kda_decode_step=kda_native.kda_decode_step,
        kda_step_varlen=kda_native.kda_step_varlen, kda_gate_beta=kda_native.kda_gate_beta, qsfa=qsfa.qsfa,
        mla_preprocess=mlapo.mla_preprocess),
    "native": OpSet(
        "native", kda_chunk=kda.kda_chunk, kda_recurrent=kda.kda_recurrent, short_conv=conv.short_conv,
        attn_res_mix=attn_res.attn_res_mix_native, mla_decode=mla.mla_attention_absorbed,
        mla_prefill=mla.mla_attention_expanded, kda_decode_step=kda_native.kda_decode_step_native,
        kda_step_varlen=kda_native.kda_step_varlen_native, kda_gate_beta=kda_native.kda_gate_beta_native,
        qsfa=qsfa.qsfa_native, mla_preprocess=mlapo.mla_preprocess_native),
}


def get_ops(name: str) -> OpSet:
    if name not in OP_SETS:
        raise ValueError(f"unknown op set {name!r}; choose from {', '.join(OP_SETS)}")
    return OP_SETS[name]
