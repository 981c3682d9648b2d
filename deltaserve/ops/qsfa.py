"""QSFA: sparse absorbed MLA attention over selected latent rows of a paged cache (docs/ops.md §4.1–4.2, docs/model.md
§9.5).

Used by the engine's fast DSA path and dense MLA decode (layers/mla.py). Three forms, one contract: `qsfa_ref`
(dense, readable), `qsfa` (plain PyTorch, device-agnostic: gathers only the selected rows) and `qsfa_native`, which
takes a full-precision CPU cache through the native kernel (`native_src/attention.c`: one pass over each query's rows
with a running max, no gathered fp32 copy) and runs `qsfa` for any other input (C8 caches included).

Latent cache of one layer, flattened to rows (row = block_id · B + offset, as in `qli`):
  * full precision: a float tensor `[num_rows, r + rho]` (bf16/fp32) holding `[c | k_pe]`;
  * 8-bit ("C8", docs/ops.md §9.1): a `C8Latent(values [num_rows, r], scales fp32 [num_rows, r // tile],
    k_pe [num_rows, rho])` — symmetric int8 or float8_e4m3fn (the values' dtype) per `tile` latent values (128 in
    the spec; `tile = r` gives one scale per row), round-half-even, zero tile => scale 1; k_pe is never quantised.
    The three may be strided views of one byte page (PagePool's fused 656-byte layout).
`[num_blocks, B, ...]` tensors are accepted too (viewed flat).

`selected_rows [T, k]` int64/int32: flat rows, valid entries first, -1 padded; the op stops at the first -1 of a
row (anything after it is ignored). Entries of a row must be distinct. Order does not matter.
Output: `(out_lat [T, H, r], lse [T, H])`, both fp32, natural-log LSE; a row with no valid entry gives zeros and
lse = -inf (never NaN).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import native
from .qli import quantize_8bit


class C8Latent(NamedTuple):
    values: torch.Tensor   # int8 or float8_e4m3fn [rows, r]
    scales: torch.Tensor   # fp32 [rows, r // tile]
    k_pe: torch.Tensor     # [rows, rho], bf16/fp32, unquantised


def quantize_latent(x: torch.Tensor, r: int, tile: int = 128, dtype: torch.dtype = torch.int8) -> C8Latent:
    """[N, r + rho] -> C8Latent with int8 or float8_e4m3fn values (tile clamped to r; r must be a multiple of the
    tile)."""
    tile = min(tile, r)
    if r % tile:
        raise ValueError(f"latent rank {r} is not a multiple of the tile {tile}")
    n = x.shape[0]
    q, s = quantize_8bit(x[:, :r].float().reshape(n, r // tile, tile), dtype)
    return C8Latent(q.reshape(n, r), s, x[:, r:].clone())


def dequantize_latent(c8: C8Latent) -> torch.Tensor:
    """C8Latent (any leading shape) -> fp32 [..., r + rho]."""
    *lead, r = c8.values.shape
    nt = c8.scales.shape[-1]
    c = (c8.values.float().reshape(*lead, nt, r // nt) * c8.scales.unsqueeze(-1)).reshape(*lead, r)
    return torch.cat([c, c8.k_pe.float()], dim=-1)


def _flat_rows(t: torch.Tensor, trailing: int = 1) -> torch.Tensor:
    return t.view(-1, *t.shape[2:]) if t.dim() == trailing + 2 else t


def _flat_latent(latent):
    if isinstance(latent, C8Latent):
        return C8Latent(_flat_rows(latent.values), _flat_rows(latent.scales), _flat_rows(latent.k_pe))
    return _flat_rows(latent)


def write_latent(x: torch.Tensor, slots: torch.Tensor, latent) -> None:
    """Scatter this step's `[c | k_pe]` rows x [T, r + rho] into flat rows `slots [T]` (slot < 0 skipped),
    quantising per tile for a C8Latent cache."""
    keep = slots >= 0
    rows, xx = slots[keep], x[keep]
    latent = _flat_latent(latent)
    if isinstance(latent, C8Latent):
        r = latent.values.shape[-1]
        q = quantize_latent(xx, r, r // latent.scales.shape[-1], latent.values.dtype)
        latent.values[rows] = q.values
        latent.scales[rows] = q.scales
        latent.k_pe[rows] = q.k_pe.to(latent.k_pe.dtype)
    else:
        latent[rows] = xx.to(latent.dtype)


def _valid_prefix(selected_rows: torch.Tensor) -> torch.Tensor:
    """bool [T, k]: entries before the first -1 of each row."""
    return torch.cumprod((selected_rows >= 0).to(torch.int32), dim=1).bool()


def _gather_rows(latent, rows: torch.Tensor) -> torch.Tensor:
    """fp32 [n, r + rho] of the given flat rows only (dequantising only those for C8)."""
    if isinstance(latent, C8Latent):
        return dequantize_latent(C8Latent(latent.values[rows], latent.scales[rows], latent.k_pe[rows]))
    return latent[rows].float()


def qsfa(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_pages, selected_rows: torch.Tensor, scale: float,
         query_block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse absorbed MLA: per row t, softmax over its selected latent rows only. q_lat [T, H, r], q_pe [T, H, rho],
    latent_pages: float [rows, r + rho] or C8Latent, selected_rows [T, k] -> (out_lat fp32 [T, H, r], lse fp32
    [T, H]). Gathers (and dequantises) only the valid selected rows, `query_block` query rows at a time, each group
    trimmed to its longest valid prefix."""
    T, H, r = q_lat.shape
    latent = _flat_latent(latent_pages)
    out = torch.zeros(T, H, r, dtype=torch.float32, device=q_lat.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q_lat.device)
    valid = _valid_prefix(selected_rows)
    n_valid = valid.sum(1)
    for t0 in range(0, T, query_block):
        t1 = min(T, t0 + query_block)
        kk = int(n_valid[t0:t1].max()) if t1 > t0 else 0
        if kk == 0:
            continue
        m = valid[t0:t1, :kk]
        idx = selected_rows[t0:t1, :kk].long()
        if bool(m.all()):
            kv = _gather_rows(latent, idx.reshape(-1)).view(t1 - t0, kk, -1)
        else:
            kv = torch.zeros(t1 - t0, kk, latent_width(latent), dtype=torch.float32, device=q_lat.device)
            kv[m] = _gather_rows(latent, idx[m])
        c = kv[..., :r]
        s = (torch.einsum("thr,tjr->thj", q_lat[t0:t1].float(), c)
             + torch.einsum("thr,tjr->thj", q_pe[t0:t1].float(), kv[..., r:])) * scale
        s = s.masked_fill(~m.unsqueeze(1), float("-inf"))
        mx = s.amax(-1, keepdim=True)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        p = torch.exp(s - mx)
        z = p.sum(-1, keepdim=True)
        lse[t0:t1] = (mx + torch.log(z)).squeeze(-1)
        o = torch.einsum("thj,tjr->thr", p, c) / z.clamp_min(torch.finfo(torch.float32).tiny)
        out[t0:t1] = torch.where(z > 0, o, torch.zeros_like(o))
    return out, lse


def qsfa_native(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_pages, selected_rows: torch.Tensor, scale: float,
                query_block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """`qsfa` on the native kernel for a bf16/fp32 cache on the CPU (`_native_ok`; `query_block` unused there: the
    kernel walks each query's rows itself), `qsfa` otherwise. A selected row outside the cache is an IndexError."""
    latent = _flat_latent(latent_pages)
    if not _native_ok(q_lat, latent):
        return qsfa(q_lat, q_pe, latent, selected_rows, scale, query_block)
    return _qsfa_native(q_lat, q_pe, latent, selected_rows, scale)


def _native_ok(q_lat: torch.Tensor, latent) -> bool:
    return (not isinstance(latent, C8Latent) and q_lat.device.type == "cpu" and latent.device.type == "cpu"
            and latent.dtype in (torch.bfloat16, torch.float32) and latent.stride(-1) == 1
            and native.native_library() is not None)


def _qsfa_native(q_lat, q_pe, latent: torch.Tensor, selected_rows: torch.Tensor, scale: float):
    T, H, r = q_lat.shape
    rho = q_pe.shape[-1]
    if latent.shape[-1] != r + rho:
        raise ValueError(f"latent rows have width {latent.shape[-1]}, queries need {r} + {rho}")
    sel = selected_rows.to(torch.int64).contiguous()
    out = torch.empty(T, H, r, dtype=torch.float32)
    lse = torch.empty(T, H, dtype=torch.float32)
    if T == 0:
        return out, lse
    ql, qp = q_lat.float().contiguous(), q_pe.float().contiguous()
    if native.native_library().ds_qsfa(T, H, r, rho, ql.data_ptr(), qp.data_ptr(), latent.data_ptr(),
                                       latent.stride(0), latent.shape[0], latent.dtype == torch.bfloat16, sel.data_ptr(),
                                       sel.shape[1], scale, out.data_ptr(), lse.data_ptr(), torch.get_num_threads()):
        raise IndexError(f"selected rows must lie in [0, {latent.shape[0]})")
    return out, lse


def latent_width(latent) -> int:
    if isinstance(latent, C8Latent):
        return latent.values.shape[-1] + latent.k_pe.shape[-1]
    return latent.shape[-1]


def qsfa_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_pages, selected_rows: torch.Tensor, scale: float,
             query_block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Readable twin of `qsfa` and `qsfa_native` (same signature; `query_block` ignored): dequantise the whole cache,
    score every row, mask everything but the selected rows (up to the first -1), dense softmax / logsumexp."""
    T, H, r = q_lat.shape
    latent = _flat_latent(latent_pages)
    full = dequantize_latent(latent) if isinstance(latent, C8Latent) else latent.float()
    n_rows = full.shape[0]
    sel = torch.where(_valid_prefix(selected_rows), selected_rows.long(), n_rows)
    allowed = torch.zeros(T, n_rows + 1, dtype=torch.bool, device=q_lat.device)
    allowed.scatter_(1, sel, True)
    allowed = allowed[:, :n_rows]
    scores = (torch.einsum("thr,sr->ths", q_lat.float(), full[:, :r])
              + torch.einsum("thr,sr->ths", q_pe.float(), full[:, r:])) * scale
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.nan_to_num(torch.exp(scores - lse.unsqueeze(-1)), nan=0.0)
    return torch.einsum("ths,sr->thr", p, full[:, :r]), lse
