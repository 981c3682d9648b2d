"""DSA ops over paged storage: QLI (quantized lightning indexer + top-k) and QSFA (sparse absorbed MLA), fast vs
readable reference (docs/ops.md §3, §4, §11; docs/model.md §9.4–9.5).

Tolerances
* fast vs ref on the same precision: the fast path regroups fp32 sums (int8 dots exact, scales folded into the head
  weights) so scores differ by a few fp32 ulps; selections are compared exactly on rows whose reference scores
  have no near-tie at the cut (gap > 1e-5 relative), and on all rows the reference scores of what was picked
  must match the reference's own picked scores to the same tolerance.
* int8 vs full precision: with per-token symmetric int8, each element's rounding error is ≤ s/2 = amax/254,
  so for one head |q·k − q̃·k̃| ≤ ‖q − q̃‖‖k‖ + ‖q̃‖‖k − k̃‖ ≤ √D (amax_q ‖k‖ + amax_k ‖q̃‖)/254 (Cauchy–Schwarz);
  ReLU is 1-Lipschitz, so |I − Ĩ| ≤ Σ_h |w_h| D^-1/2 · that bound (computed per row and key below, in fp64). We
  assert the measured error stays under this bound, and require equal top-k sets only on rows whose full-precision
  gap between the k-th and (k+1)-th score exceeds twice the row's bound (anything closer is a near-tie).
* QSFA fp32: 1e-5 absolute on unit-scale data, for the torch form and the native form (its kernel where the library
  builds) alike; C8 (int8 per-128/per-row tiles) vs fp32 cache: the latent error per element is ≤ amax/254, giving
  ≲ 1e-2 on the outputs of these unit-scale inputs (asserted at 3e-2).
"""

from __future__ import annotations

import math

import pytest
import torch

import deltaserve.ops.qli as qli_mod
from deltaserve.ops.indexer import indexer_scores_ref
from deltaserve.ops.qli import (
    build_index_meta,
    hadamard,
    hadamard_matrix,
    qli_topk,
    qli_topk_ref,
    quantize_index_keys,
    quantize_index_queries,
    write_index_keys,
)
from deltaserve.ops.qsfa import (C8Latent, dequantize_latent, qsfa, qsfa_native, qsfa_ref, quantize_latent,
                                 write_latent)

B = 4          # block size (small so that many queries sit on page boundaries)
NUM_BLOCKS = 96
H, D = 4, 32
TOPK = 8


# ---------------------------------------------------------------------------------------------------------------
# A step: several requests, different lengths, non-contiguous block tables, mixed prefill + decode
# ---------------------------------------------------------------------------------------------------------------

# (ctx_len after this step's writes, new tokens this step)
REQUESTS = [
    (1, 1),     # length-1 sequence: a single candidate
    (5, 1),     # decode, fewer candidates than top-k
    (9, 1),     # decode, one more candidate than top-k (page boundary: pos 8 = first slot of block 2)
    (70, 70),   # long prefill: rows with ≤ top-k and with many more candidates, every page boundary
    (27, 9),    # chunked prefill over a cached prefix of 18
    (8, 1),     # decode with exactly top-k candidates
    (13, 0),    # request in the batch without queries this step (its keys are still there)
    (40, 1),    # long decode
]


def make_step(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=g)
    tables, used = [], 0
    for ctx, _ in REQUESTS:
        nb = -(-ctx // B) + 1          # one spare block at the end, like a real table
        tables.append(perm[used:used + nb])
        used += nb
    assert used <= NUM_BLOCKS
    seq_ids, positions = [], []
    # decode rows first, then prefill chunks: query rows need not be grouped in request order
    order = sorted(range(len(REQUESTS)), key=lambda b: REQUESTS[b][1])
    for b in order:
        ctx, qlen = REQUESTS[b]
        seq_ids += [b] * qlen
        positions += list(range(ctx - qlen, ctx))
    return tables, torch.tensor(seq_ids), torch.tensor(positions)


def flat_rows(table: torch.Tensor, n: int) -> torch.Tensor:
    pos = torch.arange(n)
    return table[pos // B] * B + pos % B


def make_keys(tables, g, d=D):
    """Raw keys per request position + the flat rows they live at."""
    keys = [torch.randn(ctx, d, generator=g) for ctx, _ in REQUESTS]
    rows = [flat_rows(t, ctx) for t, (ctx, _) in zip(tables, REQUESTS)]
    return keys, rows


def filled_caches(keys, rows, rotate=True):
    k8 = torch.zeros(NUM_BLOCKS, B, D, dtype=torch.int8)
    ks = torch.zeros(NUM_BLOCKS, B)
    kf = torch.zeros(NUM_BLOCKS, B, D)
    k_all, slots = torch.cat(keys), torch.cat(rows)
    write_index_keys(k_all, slots, k8, ks, quantized=True, rotate=rotate)
    write_index_keys(k_all, slots, kf, None, quantized=False, rotate=rotate)
    return k8, ks, kf


def full_precision_scores(q, w, keys, meta):
    """fp64 docs/model.md §9.4 scores (no quantisation, no rotation) per request: list of [n_q, ctx]."""
    return [indexer_scores_ref(q[qi].double(), keys[b].double(), w[qi].double()) if qi.numel() else None
            for b, qi in enumerate(meta.queries)]


def row_to_pos(meta):
    inv = {}
    for b, rows in enumerate(meta.rows):
        for p, r in enumerate(rows.tolist()):
            inv[r] = (b, p)
    return inv


def gap_at_cut(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Per row of causal-masked scores: (k-th best) − ((k+1)-th best); +inf where ≤ k candidates."""
    if scores.shape[1] <= topk:
        return torch.full((scores.shape[0],), float("inf"), dtype=scores.dtype)
    top = torch.topk(scores, topk + 1, dim=1).values
    gap = top[:, topk - 1] - top[:, topk]
    return torch.where(torch.isfinite(top[:, topk]), gap, torch.full_like(gap, float("inf")))


def causal_scores(scores, bounds):
    ar = torch.arange(scores.shape[1])
    return scores.masked_fill(ar.unsqueeze(0) >= bounds.unsqueeze(1), float("-inf"))


# ---------------------------------------------------------------------------------------------------------------
# Hadamard and quantisation
# ---------------------------------------------------------------------------------------------------------------

def test_hadamard_matches_matrix_and_is_orthonormal():
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    hm = hadamard_matrix(64, torch.float64)
    torch.testing.assert_close(hadamard(x), x @ hm, rtol=0, atol=1e-12)
    torch.testing.assert_close(hm @ hm, torch.eye(64, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(hadamard(hadamard(x)), x, rtol=0, atol=1e-12)
    assert hadamard(torch.ones(1, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        hadamard(torch.randn(2, 24))


def test_int8_quantisation_rules_and_fused_write():
    k = torch.randn(6, D) * torch.tensor([0.01, 1, 100, 1, 1, 1]).unsqueeze(1)
    k[3] = 0
    q8, s = quantize_index_keys(k, rotate=False)
    assert q8.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (6,)
    assert s[3] == 1 and (q8[3] == 0).all()
    assert (q8.abs() <= 127).all() and (q8.abs().amax(1)[[0, 1, 2, 4, 5]] == 127).all()
    err = (q8.float() * s.unsqueeze(1) - k).abs()
    assert (err <= s.unsqueeze(1) / 2 * (1 + 1e-6)).all()
    # round half to even on exact halves: amax 127 -> s = 1
    q8h, sh = quantize_index_keys(torch.tensor([[127.0, 0.5, 1.5, -2.5]]), rotate=False)
    assert sh.item() == 1 and q8h.tolist() == [[127, 0, 2, -2]]
    # queries: per token per head
    qq, sq = quantize_index_queries(torch.randn(3, H, D))
    assert qq.shape == (3, H, D) and sq.shape == (3, H)
    # fused write: rotated + quantised at the flat rows; slot < 0 skipped
    pages = torch.zeros(4, B, D, dtype=torch.int8)
    scales = torch.zeros(4, B)
    slots = torch.tensor([5, -1, 0, 15, 9, 3])
    write_index_keys(k, slots, pages, scales, quantized=True, rotate=True)
    q8r, sr = quantize_index_keys(k, rotate=True)
    for i, sl in enumerate(slots.tolist()):
        if sl >= 0:
            assert torch.equal(pages.view(-1, D)[sl], q8r[i]) and scales.view(-1)[sl] == sr[i]
    written = set(s for s in slots.tolist() if s >= 0)
    untouched = [r for r in range(4 * B) if r not in written]
    assert (pages.view(-1, D)[untouched] == 0).all() and (scales.view(-1)[untouched] == 0).all()


# ---------------------------------------------------------------------------------------------------------------
# QLI
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def step():
    g = torch.Generator().manual_seed(1)
    tables, seq_ids, positions = make_step(1)
    keys, rows = make_keys(tables, g)
    T = seq_ids.numel()
    q = torch.randn(T, H, D, generator=g)
    w = torch.randn(T, H, generator=g) * H ** -0.5
    meta = build_index_meta(tables, [c for c, _ in REQUESTS], seq_ids, positions, B, TOPK)
    k8, ks, kf = filled_caches(keys, rows)
    f8, fs = torch.zeros(NUM_BLOCKS, B, D, dtype=torch.float8_e4m3fn), torch.zeros(NUM_BLOCKS, B)
    write_index_keys(torch.cat(keys), torch.cat(rows), f8, fs, quantized=True, rotate=True)
    return dict(tables=tables, seq_ids=seq_ids, positions=positions, keys=keys, rows=rows, q=q, w=w,
                meta=meta, k8=k8, ks=ks, kf=kf, f8=f8, fs=fs)


def test_meta_contents(step):
    meta = step["meta"]
    assert torch.equal(meta.bounds, step["positions"] + 1)
    for b, (ctx, qlen) in enumerate(REQUESTS):
        assert torch.equal(meta.rows[b], step["rows"][b])
        assert meta.queries[b].numel() == qlen
        assert meta.ctx_lens[b] == ctx
    assert not meta.all_short
    short = build_index_meta(step["tables"][:3], [1, 5, 9], torch.tensor([0, 1, 2]), torch.tensor([0, 4, 7]), B, 8)
    assert short.all_short


def _check_selection(sel, meta, topk=TOPK):
    """Structure: valid first, -1 padded, rows of the query's own request, causal, no duplicates; rows with
    ≤ topk candidates select all of them in ascending position order."""
    inv = row_to_pos(meta)
    for t in range(sel.shape[0]):
        b, bound = int(meta.seq_ids[t]), int(meta.bounds[t])
        picked = sel[t].tolist()
        n = sum(1 for x in picked if x >= 0)
        assert all(x >= 0 for x in picked[:n]) and all(x == -1 for x in picked[n:])
        assert n == min(bound, topk)
        pos = []
        for x in picked[:n]:
            bb, p = inv[x]
            assert bb == b and p < bound          # own request, causal: never a future key
            pos.append(p)
        assert len(set(pos)) == n
        if bound <= topk:
            assert pos == list(range(bound))


def _assert_same_up_to_near_ties(sel_a, sel_b, ref_scores, meta, rel=1e-5):
    """sel_* [T, topk] rows; ref_scores: per request [n_q, ctx] scores of the precision the pair shares."""
    inv = row_to_pos(meta)
    compared = 0
    for b, qi in enumerate(meta.queries):
        if not qi.numel():
            continue
        sc = causal_scores(ref_scores[b], meta.bounds[qi])
        tol = rel * sc.masked_fill(~torch.isfinite(sc), 0).abs().amax().clamp_min(1e-30)
        gap = gap_at_cut(sc, TOPK)
        for j, t in enumerate(qi.tolist()):
            pa = [inv[x][1] for x in sel_a[t].tolist() if x >= 0]
            pb = [inv[x][1] for x in sel_b[t].tolist() if x >= 0]
            va = sorted(sc[j, pa].tolist(), reverse=True)
            vb = sorted(sc[j, pb].tolist(), reverse=True)
            assert max(abs(x - y) for x, y in zip(va, vb)) <= tol     # picked scores agree on every row
            if gap[j] > tol:
                assert sorted(pa) == sorted(pb)
                compared += 1
    return compared


@pytest.mark.parametrize("fmt", ["int8", "fp8", "none"])
def test_qli_fast_matches_ref(step, fmt):
    """Each key format against the twin: int8 (int32 dot products), the fp8 e4m3 variant (fp32 dot products of
    e4m3 values) and unquantised keys."""
    quantized = fmt != "none"
    pages, scales = {"int8": (step["k8"], step["ks"]), "fp8": (step["f8"], step["fs"]),
                     "none": (step["kf"], None)}[fmt]
    meta, q, w = step["meta"], step["q"], step["w"]
    fast = qli_topk(q, w, pages, scales, meta, quantized=quantized, key_block=16, query_block=5)
    ref = qli_topk_ref(q, w, pages, scales, meta, quantized=quantized)
    assert fast.dtype == torch.int64 and fast.shape == (q.shape[0], TOPK)
    _check_selection(fast, meta)
    _check_selection(ref, meta)
    # the shared-precision scores, as the reference computes them
    if quantized:
        q8, sq = quantize_index_queries(q, dtype=pages.dtype)
        q_used = q8.float() * sq.unsqueeze(-1)
        kflat = pages.view(-1, D).float() * scales.view(-1, 1)
    else:
        q_used, kflat = hadamard(q), step["kf"].view(-1, D)
    scores = [indexer_scores_ref(q_used[qi], kflat[meta.rows[b]], w[qi]) if qi.numel() else None
              for b, qi in enumerate(meta.queries)]
    compared = _assert_same_up_to_near_ties(fast, ref, scores, meta)
    assert compared >= 60


def test_qli_blocking_does_not_change_results(step):
    meta, q, w = step["meta"], step["q"], step["w"]
    base = qli_topk(q, w, step["k8"], step["ks"], meta)
    for kb, qb, lb in [(1, 1, 1 << 20), (3, 7, 1 << 20), (4, 1000, 1 << 20), (64, 2, 1 << 20), (8, 1000, 300)]:
        assert torch.equal(qli_topk(q, w, step["k8"], step["ks"], meta, key_block=kb, query_block=qb,
                                    max_logits_bytes=lb), base)


def test_qli_int8_vs_full_precision(step):
    """int8 (with Hadamard) against fp64 docs/model.md §9.4 scores of the unrotated inputs: error under the analytic
    bound, equal sets on rows whose cut gap exceeds twice the bound."""
    meta, q, w, keys = step["meta"], step["q"], step["w"], step["keys"]
    sel8 = qli_topk(q, w, step["k8"], step["ks"], meta, quantized=True)
    selfp = qli_topk(q, w, step["kf"], None, meta, quantized=False)
    fp = full_precision_scores(q, w, keys, meta)
    q8, sq = quantize_index_queries(q)
    qd = (q8.double() * sq.double().unsqueeze(-1))
    inv = row_to_pos(meta)
    worst_rel, compared, tie_rows = 0.0, 0, 0
    for b, qi in enumerate(meta.queries):
        if not qi.numel():
            continue
        rows = meta.rows[b]
        kd = step["k8"].view(-1, D)[rows].double() * step["ks"].view(-1)[rows].double().unsqueeze(1)
        # rotated exact keys/queries: exact dot products are rotation invariant
        qr, kr = hadamard(q[qi].double()), hadamard(keys[b].double())
        s8 = indexer_scores_ref(qd[qi], kd, w[qi].double())
        err = (s8 - fp[b]).abs()
        amax_q = qr.abs().amax(-1)                                  # [n, H]
        amax_k = kr.abs().amax(-1)                                  # [S]
        head = math.sqrt(D) * (amax_q.unsqueeze(-1) * kr.norm(dim=-1)
                               + qd[qi].norm(dim=-1).unsqueeze(-1) * amax_k) / 254   # [n, H, S]
        bound = (w[qi].double().abs().unsqueeze(-1) * head).sum(1) * D ** -0.5     # [n, S]
        assert (err <= bound * (1 + 1e-9) + 1e-12).all()
        worst_rel = max(worst_rel, float(err.max() / fp[b].abs().max()))
        sc = causal_scores(fp[b], meta.bounds[qi])
        gap = gap_at_cut(sc, TOPK)
        row_bound = causal_scores(bound, meta.bounds[qi]).amax(1)
        for j, t in enumerate(qi.tolist()):
            if gap[j] > 2 * row_bound[j]:
                p8 = sorted(inv[x][1] for x in sel8[t].tolist() if x >= 0)
                pf = sorted(inv[x][1] for x in selfp[t].tolist() if x >= 0)
                assert p8 == pf
                compared += 1
            else:
                tie_rows += 1
    # measured on this data: max |I8 - I| / max |I| ≈ 1e-2 (int8 step 1/127 over D = 32 values per head)
    assert worst_rel < 0.05
    assert compared >= 10       # at least the short rows (gap = inf) plus clear-cut long rows


def test_qli_tie_rule_on_exact_zeros():
    """All heads negative => every score is exactly 0 (ReLU), also in int8: ties broken by larger position."""
    tables, seq_ids, positions = make_step(2)
    g = torch.Generator().manual_seed(3)
    keys, rows = make_keys(tables, g)
    T = seq_ids.numel()
    # keys all positive, queries all negative: every head's dot product is < 0, so every score is exactly 0
    keys = [k.abs() + 0.1 for k in keys]
    q = -torch.rand(T, H, D, generator=g) - 0.1
    w = torch.ones(T, H) * H ** -0.5
    k8, ks, kf = filled_caches(keys, rows, rotate=False)
    meta = build_index_meta(tables, [c for c, _ in REQUESTS], seq_ids, positions, B, TOPK)
    inv = row_to_pos(meta)
    for quantized, pages, scales in [(True, k8, ks), (False, kf, None)]:
        for fn in (qli_topk, qli_topk_ref):
            sel = fn(q, w, pages, scales, meta, quantized=quantized, rotate=False, key_block=5)
            _check_selection(sel, meta)
            for t in range(T):
                bound = int(meta.bounds[t])
                if bound > TOPK:
                    assert [inv[x][1] for x in sel[t].tolist()] == list(range(bound - 1, bound - 1 - TOPK, -1))
    # -0.0 == +0.0: w = -0.0 on some heads turns a zero into -0.0, which must tie with +0.0
    w2 = w.clone()
    w2[::2] = -0.0
    a = qli_topk(q, w2, kf, None, meta, quantized=False, rotate=False)
    assert torch.equal(a, qli_topk_ref(q, w2, kf, None, meta, quantized=False, rotate=False))
    assert torch.equal(a, qli_topk(q, w, kf, None, meta, quantized=False, rotate=False))


def test_rank_rule_signed_zero_and_nan():
    """The merge step of the fast path: score desc, larger position first, -0.0 == +0.0, NaN below finite scores
    but above empty (pos -1) entries; agrees with `select_topk` on the same row."""
    from deltaserve.ops.indexer import select_topk
    scores = torch.tensor([[0.0, -0.0, 0.0, -0.0, 1.0, float("nan"), -0.0, 0.5]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, -1]])
    s, p = qli_mod._rank(scores, pos, 6)
    assert p.tolist() == [[4, 6, 3, 2, 1, 0]]
    s, p = qli_mod._rank(scores, pos, 8)
    assert p.tolist() == [[4, 6, 3, 2, 1, 0, 5, -1]]
    ref = select_topk(scores[:, :7], torch.tensor([6]), 6)
    assert ref.tolist() == [[4, 6, 3, 2, 1, 0]]


def test_qli_rotation_is_selection_invariant_in_fp64():
    tables, seq_ids, positions = make_step(4)
    g = torch.Generator().manual_seed(5)
    keys, rows = make_keys(tables, g)
    q = torch.randn(seq_ids.numel(), H, D, generator=g, dtype=torch.float64)
    w = torch.randn(seq_ids.numel(), H, generator=g, dtype=torch.float64)
    meta = build_index_meta(tables, [c for c, _ in REQUESTS], seq_ids, positions, B, TOPK)
    kd = torch.zeros(NUM_BLOCKS * B, D, dtype=torch.float64)
    kr = torch.zeros(NUM_BLOCKS * B, D, dtype=torch.float64)
    write_index_keys(torch.cat(keys).double(), torch.cat(rows), kd, None, quantized=False, rotate=False)
    write_index_keys(torch.cat(keys).double(), torch.cat(rows), kr, None, quantized=False, rotate=True)
    # (fp32 scoring inside; random data has no near-ties at 1e-7 relative in practice)
    assert torch.equal(qli_topk(q, w, kd, None, meta, quantized=False, rotate=False),
                       qli_topk(q, w, kr, None, meta, quantized=False, rotate=True))


def test_meta_built_once_per_step_shared_by_layers(step, monkeypatch):
    calls = []
    real = qli_mod.build_index_meta

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(qli_mod, "build_index_meta", counting)
    g = torch.Generator().manual_seed(7)
    meta = qli_mod.build_index_meta(step["tables"], [c for c, _ in REQUESTS], step["seq_ids"], step["positions"],
                                    B, TOPK)
    outs = []
    for _layer in range(2):        # two DSA layers with their own keys and queries, same metadata object
        keys, rows = make_keys(step["tables"], g)
        k8, ks, _ = filled_caches(keys, rows)
        q = torch.randn(step["q"].shape, generator=g)
        w = torch.randn(step["w"].shape, generator=g)
        outs.append(qli_topk(q, w, k8, ks, meta))
        assert torch.equal(outs[-1], qli_topk_ref(q, w, k8, ks, meta))
    assert len(calls) == 1
    assert not torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------------------------------
# QSFA
# ---------------------------------------------------------------------------------------------------------------

R, RHO = 64, 16
SCALE = (48 + RHO) ** -0.5


def make_qsfa_inputs(seed=0, n_rows=NUM_BLOCKS * B, T=12, k=TOPK * 2):
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n_rows, R + RHO, generator=g)
    q_lat = torch.randn(T, H, R, generator=g)
    q_pe = torch.randn(T, H, RHO, generator=g)
    sel = torch.full((T, k), -1, dtype=torch.int64)
    counts = [0, 1, k, 3, k - 1, 0, 5, 2, k, 7, 1, k // 2][:T]
    for t, n in enumerate(counts):
        sel[t, :n] = torch.randperm(n_rows, generator=g)[:n]
    return q_lat, q_pe, latent, sel, counts


QSFA_FORMS = [qsfa, qsfa_native]


@pytest.mark.parametrize("form", QSFA_FORMS)
def test_qsfa_fast_matches_dense_ref_fp32(form):
    q_lat, q_pe, latent, sel, counts = make_qsfa_inputs()
    out, lse = form(q_lat, q_pe, latent, sel, SCALE, query_block=5)
    out_r, lse_r = qsfa_ref(q_lat, q_pe, latent, sel, SCALE)
    assert out.shape == (12, H, R) and lse.shape == (12, H) and not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, out_r, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, lse_r, rtol=0, atol=1e-5)
    for t, n in enumerate(counts):
        if n == 0:
            assert (out[t] == 0).all() and (lse[t] == float("-inf")).all()
            assert (out_r[t] == 0).all() and (lse_r[t] == float("-inf")).all()
    # lse = log-sum-exp of the scores over the selected rows, computed independently
    for t, n in enumerate(counts):
        if n:
            c = latent[sel[t, :n]]
            s = (torch.einsum("hr,jr->hj", q_lat[t], c[:, :R]) + torch.einsum("hr,jr->hj", q_pe[t], c[:, R:])) * SCALE
            torch.testing.assert_close(lse[t], torch.logsumexp(s.double(), -1).float(), rtol=0, atol=1e-5)
    # order of the valid entries does not matter; entries after the first -1 are ignored
    perm = sel.clone()
    for t, n in enumerate(counts):
        perm[t, :n] = sel[t, torch.randperm(n)]
    for t, n in enumerate(counts):
        if n <= sel.shape[1] - 2:
            perm[t, -1] = 0                                    # junk after the first -1
    out_p, lse_p = form(q_lat, q_pe, latent, perm, SCALE)
    torch.testing.assert_close(out_p, out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse_p, lse, rtol=0, atol=1e-5)
    torch.testing.assert_close(qsfa_ref(q_lat, q_pe, latent, perm, SCALE)[0], out_r, rtol=0, atol=1e-5)


@pytest.mark.parametrize("form", QSFA_FORMS)
def test_qsfa_all_rows_empty_and_bf16_cache(form):
    q_lat, q_pe, latent, sel, _ = make_qsfa_inputs(1)
    empty = torch.full_like(sel, -1)
    for fn in (form, qsfa_ref):
        o, l = fn(q_lat, q_pe, latent, empty, SCALE)
        assert (o == 0).all() and (l == float("-inf")).all()
    lb = latent.to(torch.bfloat16)
    out, lse = form(q_lat.bfloat16(), q_pe.bfloat16(), lb, sel.int(), SCALE)
    out_r, lse_r = qsfa_ref(q_lat.bfloat16(), q_pe.bfloat16(), lb, sel.int(), SCALE)
    torch.testing.assert_close(out, out_r, rtol=0, atol=1e-4)
    torch.testing.assert_close(lse, lse_r, rtol=0, atol=1e-4)


@pytest.mark.parametrize("tile", [128, 16])
def test_qsfa_c8_cache(tile):
    q_lat, q_pe, latent, sel, counts = make_qsfa_inputs(2)
    c8 = C8Latent(torch.zeros(NUM_BLOCKS, B, R, dtype=torch.int8), torch.zeros(NUM_BLOCKS, B, R // min(tile, R)),
                  torch.zeros(NUM_BLOCKS, B, RHO))
    slots = torch.arange(NUM_BLOCKS * B)
    write_latent(latent, slots, c8)
    assert torch.equal(c8.values.view(-1, R), quantize_latent(latent, R, tile).values)
    deq = dequantize_latent(C8Latent(c8.values.view(-1, R), c8.scales.view(-1, R // min(tile, R)),
                                     c8.k_pe.view(-1, RHO)))
    per_elem = (deq[:, :R] - latent[:, :R]).abs()
    assert (per_elem <= latent[:, :R].abs().amax(1, keepdim=True) / 254 * (1 + 1e-6)).all()
    assert torch.equal(deq[:, R:], latent[:, R:])              # k_pe never quantised
    out, lse = qsfa(q_lat, q_pe, c8, sel, SCALE, query_block=4)
    out_r, lse_r = qsfa_ref(q_lat, q_pe, c8, sel, SCALE)
    torch.testing.assert_close(out, out_r, rtol=0, atol=1e-5)   # same dequantised values, fp32 order only
    torch.testing.assert_close(lse, lse_r, rtol=0, atol=1e-5)
    # C8 vs full precision: element error ≤ amax/254 (≈ 1e-2 for unit normals) -> measured ~1e-2 on outputs
    out_f, lse_f = qsfa(q_lat, q_pe, latent, sel, SCALE)
    assert (out - out_f).abs().max() < 3e-2
    fin = torch.isfinite(lse_f)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse - lse_f)[fin].abs().max() < 3e-2


def test_qli_feeds_qsfa_end_to_end(step):
    """Selected rows from QLI go straight into QSFA; equals dense attention over the same positions per request."""
    meta, q, w = step["meta"], step["q"], step["w"]
    g = torch.Generator().manual_seed(11)
    latent = torch.randn(NUM_BLOCKS * B, R + RHO, generator=g)
    T = q.shape[0]
    q_lat, q_pe = torch.randn(T, H, R, generator=g), torch.randn(T, H, RHO, generator=g)
    sel = qli_topk(q, w, step["k8"], step["ks"], meta)
    out, lse = qsfa(q_lat, q_pe, latent, sel, SCALE)
    inv = row_to_pos(meta)
    for t in range(T):
        b = int(meta.seq_ids[t])
        pos = [inv[x][1] for x in sel[t].tolist() if x >= 0]
        seq_lat = latent[meta.rows[b]]                      # the request's latent in position order
        s = (torch.einsum("hr,sr->hs", q_lat[t], seq_lat[:, :R])
             + torch.einsum("hr,sr->hs", q_pe[t], seq_lat[:, R:])) * SCALE
        allowed = torch.zeros(seq_lat.shape[0], dtype=torch.bool)
        allowed[pos] = True
        s = s.masked_fill(~allowed, float("-inf"))
        torch.testing.assert_close(lse[t], torch.logsumexp(s, -1), rtol=0, atol=1e-5)
        torch.testing.assert_close(out[t], torch.softmax(s, -1) @ seq_lat[:, :R], rtol=0, atol=1e-5)
