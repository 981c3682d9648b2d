"""The three op sets (ops/opset.py): the same fields in each; "reference" made of the `_ref` twins, "fast" of plain
torch forms that never call the native library, "native" of the `_native` forms where an op has one.

"Fast never calls native" is shown by running every op of the fast set on bf16 CPU inputs (the inputs the native
kernels take) with `native.native_library` replaced by a function that raises: each op still runs and agrees with
its reference twin to bf16 rounding (bf16 inputs and intermediates, unit-scale data: a few roundings of 2^-8
relative each, asserted at 2^-5 of the output's largest magnitude; each op's own tests hold the tight bounds).
The same replacement makes every `_native` form of the native set raise on those inputs, so the check bites: those
forms do reach for the library.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import pytest
import torch

from deltaserve.ops import native
from deltaserve.ops.kda import kda_gate, l2_normalize
from deltaserve.ops.mlapo import MLAWeights
from deltaserve.ops.opset import OP_SETS, OpSet, get_ops

OPS = [f.name for f in dataclasses.fields(OpSet) if f.name != "name"]
BF16 = torch.bfloat16


def test_three_sets_with_the_same_fields():
    assert set(OP_SETS) == {"reference", "fast", "native"}
    fields = [f.name for f in dataclasses.fields(OpSet)]
    for name, ops in OP_SETS.items():
        assert ops.name == name and get_ops(name) is ops
        assert [f.name for f in dataclasses.fields(ops)] == fields
        assert all(callable(getattr(ops, op)) for op in OPS)
    ref, fast, on_native = get_ops("reference"), get_ops("fast"), get_ops("native")
    native_forms = {getattr(on_native, op) for op in OPS if getattr(on_native, op).__name__.endswith("_native")}
    for op in OPS:
        assert getattr(ref, op).__name__.endswith("_ref"), op
        fast_op = getattr(fast, op)
        assert not fast_op.__name__.endswith("_native") and fast_op not in native_forms, op
        # the native set takes an op's `_native` form where its module has one, else the fast form itself
        twin = getattr(importlib.import_module(fast_op.__module__), fast_op.__name__ + "_native", None)
        assert getattr(on_native, op) is (fast_op if twin is None else twin), op
    assert {getattr(on_native, op).__name__ for op in ("attn_res_mix", "kda_decode_step", "kda_step_varlen",
                                                       "kda_gate_beta", "qsfa", "mla_preprocess")} == {
        "attn_res_mix_native", "kda_decode_step_native", "kda_step_varlen_native", "kda_gate_beta_native",
        "qsfa_native", "mla_preprocess_native"}


# ---------------------------------------------------------------------------------------------------------------
# bf16 CPU inputs for every op of the set, built afresh from a seed (several ops update their state in place)
# ---------------------------------------------------------------------------------------------------------------

H, K, V, T = 2, 16, 16, 9


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _kda_core(g: torch.Generator) -> tuple:
    q = l2_normalize(torch.randn(T, H, K, generator=g)).to(BF16)
    k = l2_normalize(torch.randn(T, H, K, generator=g)).to(BF16)
    v = torch.randn(T, H, V, generator=g).to(BF16)
    gate = kda_gate(torch.randn(T, H, K, generator=g) * 2, torch.randn(H, generator=g) * 0.5, -5.0)
    beta = torch.rand(T, H, generator=g).to(BF16)
    return q, k, v, gate, beta, None, torch.randn(H, K, V, generator=g) * 0.5


def _short_conv(g: torch.Generator) -> tuple:
    C, W = 24, 4
    return (torch.randn(T, C, generator=g).to(BF16), torch.randn(C, W, generator=g).to(BF16),
            torch.randn(C, W - 1, generator=g))


def _attn_res(g: torch.Generator) -> tuple:
    d = 64
    sources = [(torch.randn(5, d, generator=g) * (0.5 + i)).to(BF16) for i in range(3)]
    return sources, torch.randn(d, generator=g).to(BF16), (1 + 0.1 * torch.randn(d, generator=g)).to(BF16), 1e-5


def _mla(g: torch.Generator) -> tuple:
    Hm, n, rho, r, v, S = 2, 16, 8, 32, 16, T
    allowed = torch.ones(T, S, dtype=torch.bool).tril()  # causal: every row allows a key
    return (torch.randn(T, Hm, n, generator=g).to(BF16), torch.randn(T, Hm, rho, generator=g).to(BF16),
            torch.randn(S, r, generator=g).to(BF16), torch.randn(S, rho, generator=g).to(BF16),
            (torch.randn(Hm * (n + v), r, generator=g) * r ** -0.5).to(BF16), v, (n + rho) ** -0.5, allowed)


def _kda_step_state(g: torch.Generator, tokens: int) -> tuple:
    P, W, slots = H * K, 4, 5
    x = torch.randn(tokens, 3 * P, generator=g).to(BF16)
    weight = torch.randn(3 * P, W, generator=g) * 0.5
    conv_states = torch.randn(slots, 3 * P, W - 1, generator=g)
    rec = torch.randn(slots, H, K, K, generator=g) * 0.1
    gate = -torch.rand(tokens, H, K, generator=g)
    beta = torch.rand(tokens, H, generator=g)
    return x, weight, conv_states, gate, beta, K ** -0.5, rec


def _kda_decode_step(g: torch.Generator) -> tuple:
    x, weight, conv_states, gate, beta, scale, rec = _kda_step_state(g, 3)
    return x, weight, conv_states, gate, beta, scale, rec, torch.tensor([4, -1, 1])


def _kda_step_varlen(g: torch.Generator) -> tuple:
    x, weight, conv_states, gate, beta, scale, rec = _kda_step_state(g, 7)
    return x, weight, conv_states, gate, beta, scale, torch.tensor([0, 2, 2, 7]), rec, torch.tensor([3, 0, 1])


def _kda_gate_beta(g: torch.Generator) -> tuple:
    u = (torch.randn(T, H * K, generator=g) * 8).to(BF16)
    b = torch.randn(T, 3 * H, generator=g).to(BF16)[:, :H]  # a column slice, as the layer's b is
    return u, b, torch.randn(H * K, generator=g) * 5, torch.randn(H, generator=g), -5.0


def _qsfa(g: torch.Generator) -> tuple:
    rows, r, rho, k = 40, 32, 8, 6
    sel = torch.stack([torch.randperm(rows, generator=g)[:k] for _ in range(4)])
    sel[1, 3:] = -1
    return (torch.randn(4, H, r, generator=g).to(BF16), torch.randn(4, H, rho, generator=g).to(BF16),
            torch.randn(rows, r + rho, generator=g).to(BF16), sel, (16 + rho) ** -0.5)


def _mla_preprocess(g: torch.Generator) -> tuple:
    d, Hm, n, rho, r, v, rq, HI, DI = 48, 2, 16, 8, 32, 12, 24, 3, 16

    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(BF16)

    def norm(size):
        return (1 + 0.1 * torch.randn(size, generator=g)).to(BF16)

    weights = MLAWeights(
        num_heads=Hm, qk_nope_head_dim=n, qk_rope_head_dim=rho, kv_lora_rank=r, v_head_dim=v, kv_a_proj=w(r + rho, d),
        kv_a_norm=norm(r), kv_b_proj=w(Hm * (n + v), r), q_a_proj=w(rq, d), q_a_norm=norm(rq),
        q_b_proj=w(Hm * (n + rho), rq), g_proj=w(Hm * v, d), index_wq_b=w(HI * DI, rq), index_wk=w(DI, d),
        index_k_norm_weight=norm(DI), index_k_norm_bias=(0.1 * torch.randn(DI, generator=g)).to(BF16),
        index_weights_proj=w(HI, d), index_n_heads=HI, index_head_dim=DI)
    rows = torch.tensor([5, 0, -1])
    return (torch.randn(3, d, generator=g).to(BF16), weights, None, None, 1e-6, 1e-6, 1e-5, rows,
            torch.zeros(2, 4, r + rho, dtype=BF16), torch.zeros(2, 4, DI, dtype=BF16))


INPUTS: dict[str, Callable[[torch.Generator], tuple]] = {
    "kda_chunk": _kda_core, "kda_recurrent": _kda_core, "short_conv": _short_conv, "attn_res_mix": _attn_res,
    "mla_decode": _mla, "mla_prefill": _mla, "kda_decode_step": _kda_decode_step,
    "kda_step_varlen": _kda_step_varlen, "kda_gate_beta": _kda_gate_beta, "qsfa": _qsfa,
    "mla_preprocess": _mla_preprocess,
}


def test_every_op_has_inputs():
    assert set(INPUTS) == set(OPS)


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of an op's output or arguments, in order (caches and states included)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


class NativeCalled(RuntimeError):
    pass


@pytest.fixture
def no_native(monkeypatch):
    def refuse():
        raise NativeCalled("the native library was asked for")

    monkeypatch.setattr(native, "native_library", refuse)


@pytest.mark.parametrize("op", OPS)
def test_fast_never_calls_native(no_native, op):
    fast_args, ref_args = INPUTS[op](_gen(5)), INPUTS[op](_gen(5))
    got = getattr(get_ops("fast"), op)(*fast_args)
    want = getattr(get_ops("reference"), op)(*ref_args)
    # outputs, then the arguments the ops update in place (states, caches): equal shapes, values to bf16 rounding
    pairs = list(zip(_tensors(got), _tensors(want))) + list(zip(_tensors(fast_args), _tensors(ref_args)))
    assert len(_tensors(got)) == len(_tensors(want)) > 0
    for a, b in pairs:
        assert a.shape == b.shape and a.dtype == b.dtype, op
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a)), op
        if finite.any():
            scale = max(b[finite].float().abs().max().item(), 1.0)
            assert (a[finite].float() - b[finite].float()).abs().max().item() <= 2.0 ** -5 * scale, op


@pytest.mark.parametrize("op", [op for op in OPS if getattr(get_ops("native"), op).__name__.endswith("_native")])
def test_native_forms_reach_for_the_library(no_native, op):
    with pytest.raises(NativeCalled):
        getattr(get_ops("native"), op)(*INPUTS[op](_gen(5)))
