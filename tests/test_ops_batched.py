"""Batched KDA ops (decode, conv decode, varlen prefill over state slots) and MLAPO: fast paths against their
``*_ref`` twins, and MLAPO against what ``layers.mla.MLAttention`` computes. Tolerance ≤ 1e-5 fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.layers.batch import StepBatch
from deltaserve.layers.mla import MLAttention
from deltaserve.layers.rope import RotaryEmbedding
from deltaserve.ops.kda import kda_gate, kda_recurrent_ref, l2_normalize
from deltaserve.ops.kda_batched import (
    kda_decode_batched,
    kda_decode_batched_ref,
    kda_prefill_varlen,
    kda_prefill_varlen_ref,
    short_conv_decode_batched,
    short_conv_decode_batched_ref,
)
from deltaserve.ops import native
from deltaserve.ops.mla import mla_attention_ref
from deltaserve.ops.mlapo import MLAWeights, mla_preprocess, mla_preprocess_native, mla_preprocess_ref
from deltaserve.ops.opset import get_ops
from deltaserve.tools.presets import get_preset

TOL = 1e-5
H, K, V = 3, 16, 24          # K != V: a transposed state layout cannot pass by accident
NUM_SLOTS = 12


def _inputs(T: int, gen: torch.Generator, lower_bound: float | None = -5.0):
    q = l2_normalize(torch.randn(T, H, K, generator=gen))
    k = l2_normalize(torch.randn(T, H, K, generator=gen))
    v = torch.randn(T, H, V, generator=gen)
    u = torch.randn(T, H, K, generator=gen) * 2
    g = kda_gate(u, torch.randn(H, generator=gen) * 0.5, lower_bound)
    beta = torch.rand(T, H, generator=gen)
    return q, k, v, g, beta


def _states(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(NUM_SLOTS, H, K, V, generator=gen) * 0.5


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.0 if a.numel() == 0 else (a - b).abs().max().item()


# ---------------------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [[3, 7, 0, 11, 5], [4, -1, 9], [2], [-1, -1], []])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_decode_batched(slots, lower_bound):
    gen = torch.Generator().manual_seed(1)
    st = _states(gen)
    q, k, v, g, beta = _inputs(len(slots), gen, lower_bound)
    s_ref, s_fast = st.clone(), st.clone()
    sl = torch.tensor(slots, dtype=torch.long)
    o_ref = kda_decode_batched_ref(q, k, v, g, beta, None, s_ref, sl)
    o_fast = kda_decode_batched(q, k, v, g, beta, None, s_fast, sl)
    assert o_fast.shape == (len(slots), H, V)
    assert _maxdiff(o_ref, o_fast) <= TOL
    assert _maxdiff(s_ref, s_fast) <= TOL
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(s_fast[untouched], st[untouched])
    for i, s in enumerate(slots):
        if s < 0:
            assert torch.all(o_fast[i] == 0)
            continue
        # independent check: the one-sequence recurrence from the original state
        o1, S1 = kda_recurrent_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], None, st[s])
        assert _maxdiff(o1[0], o_fast[i]) <= TOL and _maxdiff(S1, s_fast[s]) <= TOL


def test_kda_decode_on_state_slot_view():
    """The pool view StateSlots.recurrent[:, layer] (non-contiguous in dim 0) is updated in place."""
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(NUM_SLOTS, 3, H, K, V, generator=gen)
    ref_pool = pool.clone()
    q, k, v, g, beta = _inputs(4, gen)
    sl = torch.tensor([10, 1, 6, 3])
    o_f = kda_decode_batched(q, k, v, g, beta, 0.3, pool[:, 1], sl)
    o_r = kda_decode_batched_ref(q, k, v, g, beta, 0.3, ref_pool[:, 1], sl)
    before = torch.randn(NUM_SLOTS, 3, H, K, V, generator=torch.Generator().manual_seed(2))
    assert _maxdiff(o_f, o_r) <= TOL and _maxdiff(pool, ref_pool) <= TOL
    assert not torch.equal(pool[sl, 1], before[sl, 1])                    # written through the view
    assert torch.equal(pool[:, [0, 2]], before[:, [0, 2]])                # other layers untouched


@pytest.mark.parametrize("W", [4, 2, 1])
@pytest.mark.parametrize("slots", [[5, 0, 9, 2], [3, -1, 7], []])
def test_short_conv_decode_batched(W, slots):
    gen = torch.Generator().manual_seed(3)
    P = 10
    pool = torch.randn(NUM_SLOTS, 2, 3, P, W - 1, generator=gen)      # StateSlots.conv layout
    weight = torch.randn(3 * P, W, generator=gen)
    x = torch.randn(len(slots), 3 * P, generator=gen)
    sl = torch.tensor(slots, dtype=torch.long)
    p_ref, p_fast = pool.clone(), pool.clone()
    y_ref = short_conv_decode_batched_ref(x, weight, p_ref[:, 1].view(NUM_SLOTS, 3 * P, W - 1), sl)
    y_fast = short_conv_decode_batched(x, weight, p_fast[:, 1].view(NUM_SLOTS, 3 * P, W - 1), sl)
    assert _maxdiff(y_ref, y_fast) <= TOL
    assert _maxdiff(p_ref, p_fast) <= TOL
    for i, s in enumerate(slots):
        if s >= 0 and W > 1:
            assert torch.equal(p_fast[s, 1].reshape(3 * P, W - 1)[:, -1], x[i])   # newest input shifted in
        if s < 0:
            assert torch.all(y_fast[i] == 0)


# ---------------------------------------------------------------------------------------------------------------
# varlen prefill
# ---------------------------------------------------------------------------------------------------------------

PREFILL_CASES = [
    # (lengths, slots, chunk_size)
    ([1, 5, 64, 0, 100, 130, 63], [3, 7, 0, 5, 11, 1, 9], 64),     # T=1, < C, = C, empty, not multiples, > 2C
    ([65, 1, 1, 200], [8, 2, -1, 4], 64),                            # a padding slot
    ([17], [6], 64),
    ([40, 3, 33], [1, 10, 4], 16),                                   # smaller chunk size
    ([13, 30], [2, 1], 12),                                          # chunk size not a multiple of the sub-chunk
    ([0, 0], [1, 2], 64),                                            # nothing to do
    ([], [], 64),                                                    # empty batch
]


@pytest.mark.parametrize("lengths,slots,chunk_size", PREFILL_CASES)
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_prefill_varlen(lengths, slots, chunk_size, lower_bound):
    gen = torch.Generator().manual_seed(4)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    q, k, v, g, beta = _inputs(cu[-1], gen, lower_bound)
    st = _states(gen)
    s_ref, s_fast = st.clone(), st.clone()
    cu_t, sl = torch.tensor(cu, dtype=torch.int32), torch.tensor(slots, dtype=torch.long)
    o_ref = kda_prefill_varlen_ref(q, k, v, g, beta, None, cu_t, s_ref, sl, chunk_size)
    o_fast = kda_prefill_varlen(q, k, v, g, beta, None, cu_t, s_fast, sl, chunk_size)
    assert o_fast.shape == (cu[-1], H, V)
    assert _maxdiff(o_ref, o_fast) <= TOL
    assert _maxdiff(s_ref, s_fast) <= TOL
    for b, s in enumerate(slots):
        a, e = cu[b], cu[b + 1]
        if s < 0:
            assert torch.all(o_fast[a:e] == 0)
        elif e == a:
            assert torch.equal(s_fast[s], st[s])
    used = {s for b, s in enumerate(slots) if s >= 0 and lengths[b] > 0}
    untouched = [s for s in range(NUM_SLOTS) if s not in used]
    assert torch.equal(s_fast[untouched], st[untouched])


def test_kda_prefill_varlen_matches_recurrence():
    """Independent of the chunked ref: token-by-token recurrence per sequence from the slot's state."""
    gen = torch.Generator().manual_seed(5)
    slots = [9, 0, 5]
    cu = [0, 70, 72, 201]                    # lengths 70, 2, 129
    q, k, v, g, beta = _inputs(cu[-1], gen)
    st = _states(gen)
    s_fast = st.clone()
    o = kda_prefill_varlen(q, k, v, g, beta, None, torch.tensor(cu), s_fast, torch.tensor(slots))
    for b, s in enumerate(slots):
        a, e = cu[b], cu[b + 1]
        o1, S1 = kda_recurrent_ref(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], None, st[s])
        assert _maxdiff(o1, o[a:e]) <= TOL and _maxdiff(S1, s_fast[s]) <= TOL


def test_prefill_then_decode_equals_one_prefill():
    gen = torch.Generator().manual_seed(6)
    cu = [0, 30, 31, 101]
    q, k, v, g, beta = _inputs(cu[-1] + 3, gen)
    st = _states(gen)
    slots = torch.tensor([2, 7, 4])
    last = [cu[1], cu[2], cu[3]]
    extra = [cu[-1], cu[-1] + 1, cu[-1] + 2]  # one more token per sequence, stored after the prefills
    # reference: each sequence's full token list in one prefill
    s_one = st.clone()
    idx = torch.cat([torch.arange(0, 30), torch.tensor([extra[0]]), torch.arange(30, 31), torch.tensor([extra[1]]),
                     torch.arange(31, 101), torch.tensor([extra[2]])])
    cu_full = torch.tensor([0, 31, 33, 104])
    o_one = kda_prefill_varlen(*(t[idx] for t in (q, k, v, g, beta)), None, cu_full, s_one, slots)
    s_two = st.clone()
    kda_prefill_varlen(q[:last[2]], k[:last[2]], v[:last[2]], g[:last[2]], beta[:last[2]], None, torch.tensor(cu),
                       s_two, slots)
    e = torch.tensor(extra)
    o_dec = kda_decode_batched(q[e], k[e], v[e], g[e], beta[e], None, s_two, slots)
    assert _maxdiff(s_one, s_two) <= TOL
    assert _maxdiff(o_one[cu_full[1:] - 1], o_dec) <= TOL


# ---------------------------------------------------------------------------------------------------------------
# MLAPO
# ---------------------------------------------------------------------------------------------------------------


def _rand_weights(gen, *, q_lora: bool, indexer: bool, gate: bool, rope_index: int = 0) -> MLAWeights:
    d, Hh, n, rho, r, v, rq, HI, DI = 48, 4, 16, 8, 32, 12, 24, 3, 16

    def w(*shape):
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

    return MLAWeights(
        num_heads=Hh, qk_nope_head_dim=n, qk_rope_head_dim=rho, kv_lora_rank=r, v_head_dim=v,
        kv_a_proj=w(r + rho, d), kv_a_norm=1 + 0.1 * torch.randn(r, generator=gen), kv_b_proj=w(Hh * (n + v), r),
        q_a_proj=w(rq, d) if q_lora else None, q_a_norm=1 + 0.1 * torch.randn(rq, generator=gen) if q_lora else None,
        q_b_proj=w(Hh * (n + rho), rq) if q_lora else None, q_proj=None if q_lora else w(Hh * (n + rho), d),
        g_proj=w(Hh * v, d) if gate else None,
        index_wq_b=w(HI * DI, rq) if indexer else None, index_wk=w(DI, d) if indexer else None,
        index_k_norm_weight=1 + 0.1 * torch.randn(DI, generator=gen) if indexer else None,
        index_k_norm_bias=0.1 * torch.randn(DI, generator=gen) if indexer else None,
        index_weights_proj=w(HI, d) if indexer else None,
        index_n_heads=HI if indexer else 0, index_head_dim=DI if indexer else 0, index_rope_dim=rope_index,
    )


def _compare(a, b):
    for name, x, y in zip(a._fields, a, b):
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.shape == y.shape, name
            assert _maxdiff(x, y) <= TOL, (name, _maxdiff(x, y))


@pytest.mark.parametrize("q_lora,indexer,gate", [(True, True, True), (True, False, False), (False, False, True),
                                                 (True, True, False)])
# fp32 weights take no packs: the native form runs as the torch form
@pytest.mark.parametrize("pre", [mla_preprocess, mla_preprocess_native], ids=["fast", "native"])
def test_mlapo_fast_vs_ref_and_page_write(q_lora, indexer, gate, pre):
    gen = torch.Generator().manual_seed(7)
    Wt = _rand_weights(gen, q_lora=q_lora, indexer=indexer, gate=gate)
    N, nblk, bs = 7, 5, 4
    x = torch.randn(N, 48, generator=gen)
    rows = torch.tensor([13, 0, -1, 7, 19, 4, 8])            # scattered flat rows, one padding row
    lat_r = torch.zeros(nblk, bs, 40)
    lat_f = torch.zeros(nblk, bs, 40)
    ik_r = torch.zeros(nblk, bs, 16) if indexer else None
    ik_f = torch.zeros(nblk, bs, 16) if indexer else None
    ref = mla_preprocess_ref(x, Wt, None, None, 1e-6, 1e-6, 1e-5, rows, lat_r, ik_r)
    fast = pre(x, Wt.fuse(), None, None, 1e-6, 1e-6, 1e-5, rows, lat_f, ik_f)
    _compare(ref, fast)
    assert fast.q_lat.shape == (N, 4, 32) and fast.latent.shape == (N, 40)
    assert _maxdiff(lat_r, lat_f) <= TOL
    flat = lat_f.view(-1, 40)
    for i, row in enumerate(rows.tolist()):
        if row >= 0:
            assert torch.equal(flat[row], fast.latent[i])
            if indexer:
                assert torch.equal(ik_f.view(-1, 16)[row], fast.index_k[i])
    written = {r for r in rows.tolist() if r >= 0}
    others = [r for r in range(nblk * bs) if r not in written]
    assert torch.all(flat[others] == 0)
    # without caches: no write, same outputs
    _compare(ref, pre(x, Wt, None, None, 1e-6, 1e-6, 1e-5))
    # a single token, and an empty batch
    _compare(mla_preprocess_ref(x[:1], Wt), pre(x[:1], Wt))
    empty = pre(x[:0], Wt, out_rows=rows[:0], latent_cache=lat_f)
    assert empty.q_lat.shape == (0, 4, 32)


@pytest.mark.parametrize("N", [1, 3, 6])
def test_mlapo_bf16_few_rows_native_vs_ref(N):
    """bf16 weights: up to 4 rows the native form runs the products on the native kernels over MLAWeights.packed
    (built on its first call: `fuse` builds no packs; above 4 rows, oneDNN as the torch form). The native form, its
    torch twin and the reference chain agree to bf16 rounding."""
    gen = torch.Generator().manual_seed(9)
    Wt = _rand_weights(gen, q_lora=True, indexer=True, gate=True)
    for name in [f.name for f in dataclasses.fields(Wt)]:
        value = getattr(Wt, name)
        if isinstance(value, torch.Tensor):
            setattr(Wt, name, value.to(torch.bfloat16))
    x = torch.randn(N, 48, generator=gen).to(torch.bfloat16)
    ref, fast = mla_preprocess_ref(x, Wt), mla_preprocess(x, Wt.fuse())
    assert Wt.packed == {}
    on_native = mla_preprocess_native(x, Wt)
    assert set(Wt.packed) == ({"w_a", "q_b_proj", "index_wq_b", "w_uk_t"} if native.native_library() else set())
    for name, a, b, c in zip(ref._fields, ref, fast, on_native):
        if a is not None:
            torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2, msg=name)
            torch.testing.assert_close(c.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)
    Wt.fuse()  # fusing anew drops the packs (copies of the previous fused weights)
    assert Wt.packed == {}


def test_mlapo_rope_fast_vs_ref():
    gen = torch.Generator().manual_seed(8)
    Wt = _rand_weights(gen, q_lora=True, indexer=True, gate=False, rope_index=8)
    x = torch.randn(5, 48, generator=gen)
    pos = torch.tensor([0, 3, 9, 100, 2])
    rot = RotaryEmbedding(8, 10000.0, None)
    ref = mla_preprocess_ref(x, Wt, pos, rot)
    _compare(ref, mla_preprocess(x, Wt, pos, rot))
    assert _maxdiff(ref.q_pe, mla_preprocess_ref(x, Wt).q_pe) > 1e-3      # the rotation did something


def _tiny_config(**text_overrides) -> ModelConfig:
    cfg = get_preset("k31-tiny").config
    if text_overrides:
        import copy
        cfg = copy.deepcopy(cfg)
        target = cfg.get("text_config", cfg)
        target.update(text_overrides)
    return ModelConfig.from_dict(cfg)


# The DSA indexer reads c_q, so it only exists with q_lora_rank.
@pytest.mark.parametrize("use_indexer, q_lora", [(True, True), (False, True), (False, False)])
def test_mlapo_matches_mla_layer(monkeypatch, use_indexer, q_lora):
    config = _tiny_config() if q_lora else _tiny_config(q_lora_rank=None)
    assert (config.q_lora_rank is not None) == q_lora
    torch.manual_seed(9)
    layer = MLAttention(config, config.mla_layers[0], use_indexer)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p) if "bias" not in name else 0.1 * torch.randn_like(p))
    captured = {}

    def spy(q_nope, q_pe, latent, k_pe, w_kv_b, v_dim, scale, allowed):
        captured.setdefault("calls", []).append((q_nope, q_pe, latent, k_pe))
        return mla_attention_ref(q_nope, q_pe, latent, k_pe, w_kv_b, v_dim, scale, allowed)

    ops = dataclasses.replace(get_ops("reference"), mla_prefill=spy, mla_decode=spy)
    if use_indexer:
        orig_project = layer.indexer.project

        def project_spy(x, c_q, cos_sin):
            captured["index"] = orig_project(x, c_q, cos_sin)
            captured["c_q"] = c_q
            return captured["index"]

        monkeypatch.setattr(layer.indexer, "project", project_spy)
    lengths = [5, 1, 9]
    N = sum(lengths)
    x = torch.randn(N, config.hidden_size)
    qs = [0, 5, 6, 15]
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        layer(x, StepBatch(positions, qs, [0, 0, 0], ops=ops))
        Wt = MLAWeights.from_layer(layer).fuse()
        out = mla_preprocess(x, Wt, positions, None, config.mla_norm_eps, config.mla_norm_eps, config.index_norm_eps)
        ref = mla_preprocess_ref(x, Wt, positions, None, config.mla_norm_eps, config.mla_norm_eps,
                                 config.index_norm_eps)
    _compare(ref, out)
    r, H, n, v = layer.r, layer.H, layer.n, layer.v
    w_uk = layer.kv_b_proj.weight.detach().view(H, n + v, r)[:, :n]
    assert len(captured["calls"]) == len(lengths)
    for (a, b), (q_nope, q_pe, latent, k_pe) in zip(zip(qs, qs[1:]), captured["calls"]):
        q_lat_layer = torch.einsum("thn,hnr->thr", q_nope, w_uk)   # the absorbed query of mla_attention_absorbed
        assert _maxdiff(q_lat_layer, out.q_lat[a:b]) <= TOL
        assert _maxdiff(q_pe, out.q_pe[a:b]) <= TOL
        assert _maxdiff(latent, out.latent[a:b, :r]) <= TOL
        assert _maxdiff(k_pe, out.latent[a:b, r:]) <= TOL
    if use_indexer:
        iq, ik, iw = captured["index"]
        assert _maxdiff(iq, out.index_q) <= TOL and _maxdiff(ik, out.index_k) <= TOL
        assert _maxdiff(iw, out.index_w) <= TOL and _maxdiff(captured["c_q"], out.c_q) <= TOL
    if config.mla_use_output_gate:
        assert _maxdiff(layer.g_proj(x).detach(), out.gate) <= TOL


def test_cpu_grouping_paths(monkeypatch):
    """Force the CPU cache-blocking of the fast paths into many small groups (sequences / chunks)."""
    import deltaserve.ops.kda_batched as kb
    monkeypatch.setattr(kb, "_CPU_GROUP_BYTES", 2 * H * K * V * 4)      # 2 sequences per decode group
    monkeypatch.setattr(kb, "_CHUNK_GROUP_FLOATS", 1)                    # 1 chunk per intra-chunk batch
    gen = torch.Generator().manual_seed(10)
    st = _states(gen)
    slots = torch.tensor([4, -1, 9, 0, 11, 2, 7])
    q, k, v, g, beta = _inputs(7, gen)
    s_ref, s_fast = st.clone(), st.clone()
    o_ref = kda_decode_batched_ref(q, k, v, g, beta, None, s_ref, slots)
    o_fast = kda_decode_batched(q, k, v, g, beta, None, s_fast, slots)
    assert _maxdiff(o_ref, o_fast) <= TOL and _maxdiff(s_ref, s_fast) <= TOL
    cu = torch.tensor([0, 130, 131, 195, 260])
    q, k, v, g, beta = _inputs(260, gen)
    s_ref, s_fast = st.clone(), st.clone()
    o_ref = kda_prefill_varlen_ref(q, k, v, g, beta, 0.2, cu, s_ref, slots[2:6])
    o_fast = kda_prefill_varlen(q, k, v, g, beta, 0.2, cu, s_fast, slots[2:6])
    assert _maxdiff(o_ref, o_fast) <= TOL and _maxdiff(s_ref, s_fast) <= TOL


def test_mlapo_bf16():
    """bf16 activations and weights (the engine's dtype): fused GEMM vs separate GEMMs differ by bf16 rounding only."""
    gen = torch.Generator().manual_seed(11)
    Wt = _rand_weights(gen, q_lora=True, indexer=True, gate=True)
    for f in ("kv_a_proj", "kv_a_norm", "kv_b_proj", "q_a_proj", "q_a_norm", "q_b_proj", "g_proj", "index_wq_b",
              "index_wk", "index_k_norm_weight", "index_k_norm_bias", "index_weights_proj"):
        setattr(Wt, f, getattr(Wt, f).bfloat16())
    x = torch.randn(9, 48, generator=gen).bfloat16()
    lat = torch.zeros(4, 4, 40, dtype=torch.bfloat16)
    rows = torch.arange(9) + 3
    ref = mla_preprocess_ref(x, Wt)
    fast = mla_preprocess(x, Wt.fuse(), out_rows=rows, latent_cache=lat)
    for name, a, b in zip(ref._fields, ref, fast):
        assert a.dtype == b.dtype, name
        assert _maxdiff(a.float(), b.float()) <= 3e-2 * max(1.0, a.float().abs().max().item()), name
    assert torch.equal(lat.view(-1, 40)[3:12], fast.latent)
