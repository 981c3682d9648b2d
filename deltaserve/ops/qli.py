"""QLI: (quantized) lightning indexer over paged keys for a whole step's batch (docs/ops.md §3, docs/model.md §9.4–9.5).

Used by the engine's fast DSA path (layers/mla.py). Plain PyTorch, device-agnostic.

Storage (docs/ops.md §9.2, flattened): indexer keys of one DSA layer live in `key_pages [num_blocks * B, D]` — int8
values plus `key_scales fp32 [num_blocks * B]` for the 8-bit cache, or a float tensor (bf16/fp32) with
`key_scales=None` for the unquantised cache. A request's position `p` lives at flat row
`block_table[p // B] * B + p % B` (same block ids as the latent cache). `[num_blocks, B, D]` pages are accepted
too (viewed flat).

Precision variants: one set of functions, selected by `quantized: bool`:
  * `quantized=True`  keys are 8-bit + per-token fp32 scale (written by `write_index_keys(..., quantized=True)`):
    int8, or float8_e4m3fn (the fp8 variant) — the key pages' dtype says which. q is quantised per (token, head)
    to the same type (§3.2 step 2), scales are folded into the head weights and the dot products are accumulated
    exactly: int32 (`torch._int_mm`) for int8; fp32 for e4m3, whose products (4-bit significands) are exact in
    fp32 and whose sums differ from the reference only in summation order (§3.2 steps 3–4). Scoring fp8 on the CPU
    upcasts to fp32 (`torch._scaled_mm` is far slower there, docs/ops.md §10.2).
  * `quantized=False` keys are stored as floats and scored in fp32 (docs/model.md §9.4 exactly).
`rotate` (Hadamard, §3.2 step 1) must match how the keys were written; rotating is exact in real arithmetic
(orthonormal) and only spreads outliers before quantisation.

Selection (docs/model.md §9.5): candidates of a query at absolute position `pos` are its request's keys `0..pos`
(bound `pos + 1`, applied inside the op). Rows with `pos + 1 <= topk` candidates select all of them in ascending
position order without scoring; otherwise the `topk` best by score descending, then larger position first
(-0.0 == +0.0; NaN ranks below every finite score). Output: int64 `[T, topk]` flat page rows (physical slots),
valid first, -1 padded.

`StepIndexMeta` holds the per-step metadata (built once per step by `build_index_meta`, shared by all DSA layers).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch

from .indexer import indexer_scores_ref, select_topk

INT8_MAX = 127.0


# ---------------------------------------------------------------------------------------------------------------
# Hadamard rotation
# ---------------------------------------------------------------------------------------------------------------

def hadamard_matrix(d: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix H_d / sqrt(d) (symmetric, its own inverse)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(dtype)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x @ (H_D / sqrt(D)) over the last dim (D a power of two), by the fast Walsh–Hadamard butterfly, fp32 math
    for sub-fp32 inputs; returns x's dtype."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {d}")
    out_dtype = x.dtype
    y = x if x.dtype in (torch.float32, torch.float64) else x.float()
    lead = y.shape[:-1]
    y = y.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2)
        h *= 2
    return (y.reshape(*lead, d) * (1.0 / math.sqrt(d))).to(out_dtype)


# ---------------------------------------------------------------------------------------------------------------
# int8 quantisation and the key cache write
# ---------------------------------------------------------------------------------------------------------------

FP8_MAX = 448.0  # largest finite float8_e4m3fn
EIGHT_BIT = {torch.int8: INT8_MAX, torch.float8_e4m3fn: FP8_MAX}


def quantize_8bit(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit over the last dim (docs/ops.md §3.2 step 2): s = amax / Q_max (127 int8, 448 e4m3; zero vector
    => s = 1), q = round-to-nearest-even(x / s) clamped to ±Q_max (int8), or cast with round-to-nearest-even (fp8,
    clamped first so nothing saturates to NaN). Returns (q of `dtype` like x, fp32 scale x.shape[:-1])."""
    if dtype not in EIGHT_BIT:
        raise ValueError(f"8-bit cache values are int8 or float8_e4m3fn, got {dtype}")
    q_max = EIGHT_BIT[dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / q_max, torch.ones_like(amax))
    scaled = (xf / scale.unsqueeze(-1)).clamp_(-q_max, q_max)
    if dtype == torch.int8:
        return torch.round(scaled).to(torch.int8), scale
    return scaled.to(dtype), scale


def quantize_index_keys(k: torch.Tensor, rotate: bool = True,
                        dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys [N, D] (post-LayerNorm) -> (8-bit [N, D], scale fp32 [N]); Hadamard-rotated first if `rotate`."""
    return quantize_8bit(hadamard(k.float()) if rotate else k.float(), dtype)


def quantize_index_queries(q: torch.Tensor, rotate: bool = True,
                           dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer queries [T, H, D] -> (8-bit [T, H, D], scale fp32 [T, H]), per token per head, same rule as keys."""
    return quantize_8bit(hadamard(q.float()) if rotate else q.float(), dtype)


def _flat(pages: torch.Tensor, trailing: int) -> torch.Tensor:
    """[num_blocks, B, ...] or [rows, ...] -> [rows, ...] view (no copy; writes go through)."""
    if pages.dim() == trailing + 2:
        return pages.view(-1, *pages.shape[2:])
    return pages


def write_index_keys(k: torch.Tensor, slots: torch.Tensor, key_pages: torch.Tensor,
                     key_scales: torch.Tensor | None, *, quantized: bool = True, rotate: bool = True) -> None:
    """Fused (rotate +) quantise + scatter of this step's indexer keys k [T, D] into flat rows `slots [T]`
    (docs/ops.md §3.3); slot < 0 is skipped. quantized: 8-bit values (int8 or float8_e4m3fn: key_pages' dtype) into
    key_pages, fp32 scales into key_scales [rows]; otherwise the (optionally rotated) key is stored in key_pages' dtype and key_scales must be None."""
    pages = _flat(key_pages, 1)
    keep = slots >= 0
    rows = slots[keep]
    kk = k[keep]
    if quantized:
        if key_scales is None:
            raise ValueError("the 8-bit key cache needs a scale store")
        q8, s = quantize_index_keys(kk, rotate, pages.dtype)
        pages[rows] = q8
        _flat(key_scales, 0).view(-1)[rows] = s
    else:
        if key_scales is not None:
            raise ValueError("the unquantised key cache has no scale store")
        pages[rows] = (hadamard(kk.float()) if rotate else kk.float()).to(pages.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Per-step metadata
# ---------------------------------------------------------------------------------------------------------------

class StepIndexMeta(NamedTuple):
    """Per-step DSA indexer metadata: built once per forward step, shared by every DSA layer (docs/ops.md §3.4).

    per query (T):     seq_ids [T] int64 (request index), bounds [T] int64 (= pos + 1: keys 0..bound-1 are valid)
    per request (B):   rows[b] int64 [ctx_len_b] flat page row of each position; queries[b] int64 index of its
                       query rows in the flattened batch; long_queries[b] the subset with bound > topk (scored)
    python-side:       ctx_lens, max_long_bound (per request, 0 if none), all_short, topk, block_size
    """
    seq_ids: torch.Tensor
    bounds: torch.Tensor
    rows: tuple[torch.Tensor, ...]
    queries: tuple[torch.Tensor, ...]
    long_queries: tuple[torch.Tensor, ...]
    ctx_lens: tuple[int, ...]
    max_long_bound: tuple[int, ...]
    all_short: bool
    topk: int
    block_size: int


def build_index_meta(block_tables: Sequence[torch.Tensor] | torch.Tensor, ctx_lens: Sequence[int],
                     seq_ids: torch.Tensor, query_positions: torch.Tensor, block_size: int,
                     topk: int) -> StepIndexMeta:
    """block_tables: per request a 1-D block-id tensor (or a padded [B, max_blocks] tensor); ctx_lens[b] = cached +
    new tokens (after this step's writes); seq_ids [T] / query_positions [T]: request index and absolute position
    of each flattened query row (any order). Positions must satisfy pos < ctx_len of their request."""
    device = query_positions.device
    seq_ids = seq_ids.to(device=device, dtype=torch.int64)
    bounds = query_positions.to(torch.int64) + 1
    ctx = tuple(int(c) for c in ctx_lens)
    rows, queries, long_q, max_long = [], [], [], []
    for b, n in enumerate(ctx):
        table = block_tables[b].to(device=device, dtype=torch.int64)
        pos = torch.arange(n, device=device, dtype=torch.int64)
        if n > table.numel() * block_size:
            raise ValueError(f"request {b}: {n} tokens do not fit its {table.numel()} blocks")
        rows.append(table[pos // block_size] * block_size + pos % block_size)
        qi = torch.nonzero(seq_ids == b).flatten()
        queries.append(qi)
        if qi.numel() and int(bounds[qi].max()) > n:
            raise ValueError(f"request {b}: a query position is beyond its context length {n}")
        li = qi[bounds[qi] > topk]
        long_q.append(li)
        max_long.append(int(bounds[li].max()) if li.numel() else 0)
    return StepIndexMeta(seq_ids, bounds, tuple(rows), tuple(queries), tuple(long_q), ctx, tuple(max_long),
                         all(m == 0 for m in max_long), int(topk), int(block_size))


# ---------------------------------------------------------------------------------------------------------------
# Selection helpers
# ---------------------------------------------------------------------------------------------------------------

def _rank(scores: torch.Tensor, pos: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best k per row of (scores, pos) [n, m] by score desc, then larger pos; pos < 0 marks an empty entry and
    ranks last. NaN ranks as -inf (still ahead of empty entries of equal score thanks to the pos order)."""
    s = torch.nan_to_num(scores.float() + 0.0, nan=float("-inf"))
    s = s.masked_fill(pos < 0, float("-inf"))
    o1 = torch.sort(pos, dim=1, descending=True, stable=True).indices
    s1 = s.gather(1, o1)
    o2 = torch.sort(s1, dim=1, descending=True, stable=True).indices[:, :k]
    idx = o1.gather(1, o2)
    return s.gather(1, idx), pos.gather(1, idx)


def _all_candidates(bounds: torch.Tensor, topk: int) -> torch.Tensor:
    """Rows with bound <= topk: positions 0..bound-1 ascending, -1 padded -> [n, topk]."""
    ar = torch.arange(topk, device=bounds.device, dtype=torch.int64).unsqueeze(0)
    return torch.where(ar < bounds.unsqueeze(1), ar, torch.full_like(ar, -1))


def _to_rows(positions: torch.Tensor, seq_rows: torch.Tensor) -> torch.Tensor:
    return torch.where(positions >= 0, seq_rows[positions.clamp(min=0)], positions)


def _int8_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact a [m, D] int8 . b [n, D]^T int8 -> fp32 [m, n]. torch._int_mm (int32 accumulation; on the CPU it takes
    any shape and the transposed view as is, faster than the fp32 matmul at decode shapes); where a build
    rejects the shape, an fp32 matmul of the integer values, also exact while D * 127^2 < 2^24 (D <= 1040)."""
    try:
        return torch._int_mm(a, b.t()).float()
    except (RuntimeError, NotImplementedError):
        pass
    if a.shape[1] * 127 * 127 >= 2 ** 24:
        return torch.matmul(a.double(), b.double().t()).float()
    return torch.matmul(a.float(), b.float().t())


# ---------------------------------------------------------------------------------------------------------------
# QLI
# ---------------------------------------------------------------------------------------------------------------

def _select_cut(s: torch.Tensor, k: int) -> torch.Tensor:
    """Positions [n, k] of the best k columns of s [n, m] (every row has > k entries above -inf) by the canonical
    rule, ordered score desc then larger position first. One `topk` for the k-th value, then ties at the cut are
    resolved by position (the largest positions among entries equal to the k-th value), then the k picked entries
    are ordered — no full sort of the m columns."""
    n = s.shape[0]
    kth = torch.topk(s, k, dim=1).values[:, -1:]
    gt, eq = s > kth, s == kth
    need = k - gt.sum(1, keepdim=True)
    from_right = eq.flip(1).cumsum(1).flip(1)            # rank among the tied entries, largest position = 1
    take = gt | (eq & (from_right <= need))
    pos = take.nonzero()[:, 1].view(n, k)                 # exactly k per row, ascending position
    return _rank(s.gather(1, pos), pos, k)[1]


def qli_topk(q: torch.Tensor, w: torch.Tensor, key_pages: torch.Tensor, key_scales: torch.Tensor | None,
             meta: StepIndexMeta, topk: int | None = None, *, quantized: bool = True, rotate: bool = True,
             key_block: int | None = None, query_block: int = 256, max_logits_bytes: int = 256 << 20,
             reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Top-k indexer selection for a step: q [T, H, D], w [T, H] (already × H^-1/2) -> int64 [T, topk] flat page
    rows, -1 padded. `reduce_scores` (tensor parallelism: q and w hold this rank's heads) turns each block of
    partial scores into the sum over the ranks before any top-k. Only rows with more than topk candidates are scored, per request, in groups of at most
    `query_block` query rows (fewer if the group's logits row buffer [rows, max bound] would exceed
    `max_logits_bytes`). Keys are gathered from the request's page rows `key_block` positions at a time (default:
    as many as keep the group's [rows x heads, block] dot products within 32 MiB, so a decode row takes its whole
    context in one GEMM), only up to the group's largest causal bound; the causal bound is applied per key block as the scores are written
    (no [T, S] mask). Scores: exact 8-bit dot products (int32 for int8, fp32 for e4m3), ReLU, head weights with the query
    scales folded in, × key scale (docs/ops.md §3.2). NaN scores rank below every finite score.
    """
    topk = meta.topk if topk is None else int(topk)
    if topk != meta.topk:
        raise ValueError("topk differs from the one the step metadata was built for")
    T, H, D = q.shape
    pages = _flat(key_pages, 1)
    out = torch.full((T, topk), -1, dtype=torch.int64, device=q.device)
    short = meta.bounds <= topk
    if bool(short.any()):
        out[short] = _all_candidates(meta.bounds[short], topk)  # positions for now, mapped to rows below
    if not meta.all_short:
        if quantized:
            q8, s_q = quantize_index_queries(q, rotate, pages.dtype)
            int8 = pages.dtype == torch.int8
            w_eff = w.float() * s_q * D ** -0.5
            scales = _flat(key_scales, 0).view(-1)
        else:
            qf = hadamard(q.float()) if rotate else q.float()
            w_eff = w.float() * D ** -0.5
        nan_rank = -torch.finfo(torch.float32).max
        for b, long_q in enumerate(meta.long_queries):
            if not long_q.numel():
                continue
            group = max(1, min(query_block, max_logits_bytes // (4 * meta.max_long_bound[b])))
            for g0 in range(0, long_q.numel(), group):
                qi = long_q[g0:g0 + group]
                n = qi.numel()
                bound = meta.bounds[qi].unsqueeze(1)
                kmax = int(bound.max())
                qg = (q8 if quantized else qf)[qi].reshape(n * H, D)
                wg = w_eff[qi].unsqueeze(-1)
                logits = torch.empty(n, kmax, dtype=torch.float32, device=q.device)
                kb = key_block or max(1024, (32 << 20) // (4 * n * H))
                for k0 in range(0, kmax, kb):
                    k1 = min(kmax, k0 + kb)
                    rows = meta.rows[b][k0:k1]
                    if quantized:
                        dots = _int8_dot(qg, pages[rows]) if int8 else torch.matmul(
                            qg.float(), pages[rows].float().t())
                    else:
                        dots = torch.matmul(qg, pages[rows].float().t())
                    sc = (torch.relu(dots).view(n, H, -1) * wg).sum(1)
                    if quantized:
                        sc = sc * scales[rows].unsqueeze(0)
                    sc = torch.nan_to_num(sc + 0.0, nan=nan_rank)       # +0.0: -0.0 == +0.0
                    kpos = torch.arange(k0, k1, device=q.device).unsqueeze(0)
                    logits[:, k0:k1] = sc.masked_fill(kpos >= bound, float("-inf"))
                if reduce_scores is not None:
                    logits = reduce_scores(logits)
                out[qi] = _select_cut(logits, topk)
    for b, qi in enumerate(meta.queries):
        if qi.numel():
            out[qi] = _to_rows(out[qi], meta.rows[b])
    return out


def qli_topk_ref(q: torch.Tensor, w: torch.Tensor, key_pages: torch.Tensor, key_scales: torch.Tensor | None,
                 meta: StepIndexMeta, topk: int | None = None, *, quantized: bool = True, rotate: bool = True,
                 key_block: int | None = None, query_block: int = 256, max_logits_bytes: int = 256 << 20,
                 reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Readable twin of `qli_topk` (same signature; the blocking arguments are ignored): per request, dequantise
    (q8·s_q, k8·s_k) or read the fp32 keys, score all keys with `indexer_scores_ref`, select with `select_topk`,
    then put rows with ≤ topk candidates in ascending position order and map positions to flat page rows."""
    topk = meta.topk if topk is None else int(topk)
    T, H, D = q.shape
    pages = _flat(key_pages, 1)
    out = torch.full((T, topk), -1, dtype=torch.int64, device=q.device)
    if quantized:
        q8, s_q = quantize_index_queries(q, rotate, pages.dtype)
        q_used = q8.float() * s_q.unsqueeze(-1)
        scales = _flat(key_scales, 0).view(-1)
    else:
        q_used = hadamard(q.float()) if rotate else q.float()
    for b, qi in enumerate(meta.queries):
        if not qi.numel():
            continue
        rows = meta.rows[b]
        keys = pages[rows].float()
        if quantized:
            keys = keys * scales[rows].unsqueeze(-1)
        scores = indexer_scores_ref(q_used[qi], keys, w[qi])
        if reduce_scores is not None:
            scores = reduce_scores(scores)
        sel = select_topk(scores, meta.bounds[qi] - 1, topk)
        short = meta.bounds[qi] <= topk
        sel[short] = torch.sort(torch.where(sel[short] < 0, rows.numel(), sel[short]), dim=1).values
        sel = torch.where(sel >= rows.numel(), -1, sel)
        out[qi] = _to_rows(sel, rows)
    return out
