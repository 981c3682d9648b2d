"""Batched KDA ops over many sequences at once, reading and writing per-sequence state *slots* in place
(docs/ops.md §6.1, §6.3, §6.4; docs/model.md §8.2, §8.5, §8.6).

State pools are the per-layer views of :class:`deltaserve.cache.state_slots.StateSlots`:

* recurrent: ``recurrent_states [num_slots, H, K, V]`` fp32, key-major (``StateSlots.recurrent[:, layer]``);
* conv: ``conv_states [num_slots, C, W-1]`` (``StateSlots.conv[:, layer].view(num_slots, 3 * P, W - 1)`` -- the
  last three dims of the pool are contiguous, so that view exists and writes through; ``x`` is then the
  concatenation ``[q̂ | k̂ | v̂]`` of the pre-conv inputs, ``weight`` the three conv weights stacked the same way).

``slots`` is int64 ``[N]`` (one per sequence). Slots must be distinct among entries ``>= 0``; a slot ``< 0`` means
"padding": that sequence's outputs are zero and no state is read or written (docs/ops.md §6).

Every fast path has a ``*_ref`` twin with the same signature that loops over sequences and calls the one-sequence
reference ops of :mod:`deltaserve.ops.kda` / :mod:`deltaserve.ops.conv`; the tests keep them in agreement.
``q`` and ``k`` must already be L2-normalised; ``scale`` (None ⇒ ``K**-0.5``) is applied to ``q`` inside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .conv import short_conv_ref
from .kda import _decay, _segsum, _tail_sum, kda_chunk_ref, kda_recurrent_ref

__all__ = [
    "kda_decode_batched_ref",
    "kda_decode_batched",
    "short_conv_decode_batched_ref",
    "short_conv_decode_batched",
    "kda_prefill_varlen_ref",
    "kda_prefill_varlen",
]


def _slot_list(slots: Tensor | list[int]) -> list[int]:
    return [int(s) for s in (slots.tolist() if isinstance(slots, Tensor) else slots)]


def _check_distinct(slots: list[int]) -> None:
    valid = [s for s in slots if s >= 0]
    if len(set(valid)) != len(valid):
        raise ValueError(f"slots must be distinct (padding < 0 excepted), got {slots}")


# --------------------------------------------------------------------------------------------------------------
# Decode: one token per sequence
# --------------------------------------------------------------------------------------------------------------


def kda_decode_batched_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
                           recurrent_states: Tensor, slots: Tensor) -> Tensor:
    """One decode token for each of N sequences: ``q, k [N, H, K]``, ``v [N, H, V]``, ``g [N, H, K]``,
    ``beta [N, H]``. Updates ``recurrent_states[slots]`` in place; returns ``o [N, H, V]`` fp32.

    Reference: one :func:`kda_recurrent_ref` call (T = 1) per sequence.
    """
    N, H, _ = q.shape
    o = torch.zeros(N, H, v.shape[-1], dtype=torch.float32, device=q.device)
    sl = _slot_list(slots)
    _check_distinct(sl)
    for i, s in enumerate(sl):
        if s < 0:
            continue
        o_i, S = kda_recurrent_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], scale,
                                   recurrent_states[s])
        o[i] = o_i[0]
        recurrent_states[s] = S
    return o


_CPU_GROUP_BYTES = 4 << 20      # state bytes per vectorised group on CPU (≈ L2/L3-resident)


def _decode_group(qf: Tensor, kf: Tensor, vf: Tensor, gf: Tensor, bf: Tensor, idx: Tensor,
                  recurrent_states: Tensor) -> Tensor:
    """One vectorised decode step for sequences whose states live at ``idx`` (q already scaled)."""
    n, H, K = qf.shape
    V = vf.shape[-1]
    S = torch.empty(n * H, K, V, dtype=torch.float32, device=qf.device)
    if recurrent_states.dtype == torch.float32 and recurrent_states.device == S.device:
        torch.index_select(recurrent_states, 0, idx, out=S.view(n, H, K, V))
    else:
        S.view(n, H, K, V).copy_(recurrent_states[idx])
    decay = gf.exp()
    rows2 = torch.stack([decay * kf, decay * qf], dim=2).view(n * H, 2, K)       # [e^g ⊙ k ; e^g ⊙ q̃]
    pr = torch.bmm(rows2, S).view(n, H, 2, V)                                     # old-state matvecs
    delta = (vf - pr[:, :, 0]) * bf.unsqueeze(-1)                                 # β (v - Sᵀ(e^g ⊙ k))
    out = pr[:, :, 1] + (kf * qf).sum(-1, keepdim=True) * delta                   # S'ᵀ q̃
    S.mul_(decay.view(n * H, K, 1))
    S.baddbmm_(kf.reshape(n * H, K, 1), delta.reshape(n * H, 1, V))               # + k δᵀ
    recurrent_states.index_copy_(0, idx, S.view(n, H, K, V).to(recurrent_states.dtype))
    return out


def kda_decode_batched(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
                       recurrent_states: Tensor, slots: Tensor) -> Tensor:
    """Fast twin of :func:`kda_decode_batched_ref`: gather the N states into a buffer, update all
    sequences and heads with batched ops, scatter back. No Python loop over sequences (on CPU, over
    cache-sized groups of them: ``_CPU_GROUP_BYTES``). Slots must be distinct (checked only by the ref).

    With D = diag(e^g) and S the old state: S' = D S + k δᵀ, δ = β (v - Sᵀ(e^g ⊙ k)) and the read
    o = S'ᵀ q̃ = Sᵀ(e^g ⊙ q̃) + (k·q̃) δ, so both matvecs are one bmm over the *old* state ([2, K] rows per head)
    and the state is touched by one decay pass and one in-place rank-1 ``baddbmm_``.
    """
    N, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(N, H, V, dtype=torch.float32, device=q.device)
    if N == 0:
        return o
    scale = K ** -0.5 if scale is None else scale
    slots = torch.as_tensor(slots, dtype=torch.long, device=recurrent_states.device)
    valid = slots >= 0
    all_valid = bool(valid.all())
    rows = None if all_valid else valid.nonzero().squeeze(1)
    idx = slots if all_valid else slots[rows]
    n = idx.numel()
    if n == 0:
        return o

    def pick(t: Tensor) -> Tensor:
        t = t.float()
        return t if rows is None else t[rows]

    qf, kf, vf, gf, bf = pick(q), pick(k), pick(v), pick(g), pick(beta)
    qf = qf * scale
    # CPU: update the states in cache-sized groups of sequences (a gather/update/scatter sweep over all N states
    # at once is memory-bound and slower than per-sequence work that stays in cache); accelerators: one group.
    group = n if q.device.type != "cpu" else max(1, _CPU_GROUP_BYTES // (H * K * V * 4))
    out = qf.new_empty(n, H, V)
    for a in range(0, n, group):
        e = min(n, a + group)
        out[a:e] = _decode_group(qf[a:e], kf[a:e], vf[a:e], gf[a:e], bf[a:e], idx[a:e], recurrent_states)
    if rows is None:
        return out
    o[rows] = out
    return o


def short_conv_decode_batched_ref(x: Tensor, weight: Tensor, conv_states: Tensor, slots: Tensor) -> Tensor:
    """One decode token for each of N sequences: ``x [N, C]``, ``weight [C, W]``, ``conv_states [num_slots, C,
    W-1]`` updated in place at ``slots``. Returns ``y [N, C]`` in ``x.dtype`` (SiLU applied, docs/model.md §8.2).

    Reference: one :func:`short_conv_ref` call per sequence.
    """
    y = torch.zeros_like(x)
    sl = _slot_list(slots)
    _check_distinct(sl)
    for i, s in enumerate(sl):
        if s < 0:
            continue
        y_i, new_state = short_conv_ref(x[i:i + 1], weight, conv_states[s])
        y[i] = y_i[0]
        conv_states[s] = new_state
    return y


def short_conv_decode_batched(x: Tensor, weight: Tensor, conv_states: Tensor, slots: Tensor) -> Tensor:
    """Fast twin of :func:`short_conv_decode_batched_ref`: gather windows, one multiply-reduce, scatter back."""
    N, C = x.shape
    W = weight.shape[1]
    y = torch.zeros_like(x)
    if N == 0:
        return y
    slots = torch.as_tensor(slots, dtype=torch.long, device=conv_states.device)
    valid = slots >= 0
    all_valid = bool(valid.all())
    rows = None if all_valid else valid.nonzero().squeeze(1)
    idx = slots if all_valid else slots[rows]
    if idx.numel() == 0:
        return y
    xv = (x if rows is None else x[rows]).float()
    w = weight.float()
    st = conv_states[idx].float()                                                   # [n, C, W-1] oldest first
    acc = xv * w[:, W - 1]                                                          # current token: last tap
    for j in range(W - 1):                                                          # loop over taps only
        acc = acc.addcmul_(st[..., j], w[:, j])
    out = F.silu(acc).to(x.dtype)
    if W > 1:
        conv_states.index_copy_(0, idx, torch.cat([st[..., 1:], xv.unsqueeze(-1)], dim=-1).to(conv_states.dtype))
    if rows is None:
        return out
    y[rows] = out
    return y


# --------------------------------------------------------------------------------------------------------------
# Varlen chunked prefill
# --------------------------------------------------------------------------------------------------------------


def _bounds(cu_seqlens: Tensor | list[int]) -> list[int]:
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
    return cu


def kda_prefill_varlen_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
                           cu_seqlens: Tensor, recurrent_states: Tensor, slots: Tensor,
                           chunk_size: int = 64) -> Tensor:
    """Chunked KDA prefill of B sequences packed token-major: ``q, k [T, H, K]``, ``v [T, H, V]``, ``g [T, H, K]``,
    ``beta [T, H]``, sequence b owning rows ``cu_seqlens[b]:cu_seqlens[b+1]``. Each sequence starts from
    ``recurrent_states[slots[b]]`` and its final state is written back there in place. Returns ``o [T, H, V]``
    fp32 (zeros for sequences with a slot < 0).

    Reference: one :func:`kda_chunk_ref` call per sequence.
    """
    cu = _bounds(cu_seqlens)
    sl = _slot_list(slots)
    if len(sl) != len(cu) - 1:
        raise ValueError(f"{len(sl)} slots for {len(cu) - 1} sequences")
    _check_distinct(sl)
    o = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
    for b, s in enumerate(sl):
        a, e = cu[b], cu[b + 1]
        if s < 0 or e == a:
            continue
        o[a:e], S = kda_chunk_ref(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], scale, recurrent_states[s],
                                  chunk_size=chunk_size)
        recurrent_states[s] = S
    return o


_SUB_CHUNK = 8          # sub-chunk size of the factorised intra-chunk decays (as in kda.kda_chunk)
_CHUNK_GROUP_FLOATS = 1 << 20   # CPU: floats of the largest intra-chunk temporary per batch of chunks (≈ 4 MiB)


def _intra_chunk(qc: Tensor, kc: Tensor, vc: Tensor, gc: Tensor, bc: Tensor, sub: int
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Everything of docs/model.md §8.6 that does not depend on the carried state, for a batch of chunks.

    ``qc, kc, gc [N, H, C, K]`` (q pre-scaled), ``vc [N, H, C, V]``, ``bc [N, H, C]``. Returns ``W_, U`` (the
    solved ``T·(e^Γ ⊙ k)`` and ``T·v``), ``A`` (causal q·k pair decays), ``q e^Γ``, ``(k e^{Γ_C-Γ})ᵀ`` and
    ``e^{Γ_C}`` as ``[N, H, K, 1]``.

    Pair decays e^{Γ_i-Γ_j} are factorised through sub-chunk starts (both factors ≤ 1, each summed directly from
    g) for j before i's sub-chunk; only the sub×sub diagonal blocks use the pairwise form.
    """
    N, H, C, K = qc.shape
    B = sub
    nb = C // B
    G = gc.cumsum(dim=2)                                                  # Γ from chunk start
    gb = gc.reshape(N, H, nb, B, K)
    row_f = _decay(gb.cumsum(dim=3))                                      # e^{Σ_{t=s_a}^{i} g}
    tail_in_b = _tail_sum(gb)                                             # Σ_{t=j+1}^{end_b} g
    seg_tot = _segsum(gb.sum(dim=3))                                      # [N, H, nb, nb, K], b < c ≤ a'
    between = torch.cat([torch.full_like(seg_tot[:, :, :1], float("-inf")), seg_tot[:, :, :-1]], dim=2)
    col_f = _decay(tail_in_b[:, :, None] + between[:, :, :, :, None]).reshape(N, H, nb, C, K)
    diag_dec = _decay(_segsum(gb))                                        # [N, H, nb, B, B, K]
    idx = torch.arange(nb, device=qc.device)
    strict = torch.ones(B, B, dtype=torch.bool, device=qc.device).tril(-1)
    k_col = kc[:, :, None] * col_f                                        # [N, H, nb, C, K]
    kb = kc.reshape(N, H, nb, B, K)

    def pairwise(x: Tensor, inclusive: bool) -> Tensor:
        xb = x.reshape(N, H, nb, B, K)
        out = torch.matmul(xb * row_f, k_col.transpose(-1, -2))           # [N, H, nb, B, C]
        diag = (xb[:, :, :, :, None, :] * kb[:, :, :, None, :, :] * diag_dec).sum(-1)
        if not inclusive:
            diag = diag * strict
        out = out.reshape(N, H, nb, B, nb, B)
        out[:, :, idx, :, idx, :] += diag.movedim(2, 0)                   # col_f zeroed these blocks
        return out.reshape(N, H, C, C)

    L = bc.unsqueeze(-1) * pairwise(kc, inclusive=False)
    A = pairwise(qc, inclusive=True)
    dG = _decay(G)
    rhs = bc.unsqueeze(-1) * torch.cat([dG * kc, vc], dim=-1)
    X = torch.linalg.solve_triangular(L + torch.eye(C, device=qc.device), rhs, upper=False, unitriangular=True)
    k_dec_t = (kc * _decay(_tail_sum(gc))).transpose(-1, -2)
    return X[..., :K], X[..., K:], A, qc * dG, k_dec_t, _decay(G[:, :, -1, :]).unsqueeze(-1)


def kda_prefill_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
                       cu_seqlens: Tensor, recurrent_states: Tensor, slots: Tensor,
                       chunk_size: int = 64) -> Tensor:
    """Fast twin of :func:`kda_prefill_varlen_ref` (same contract).

    Each sequence is zero-padded to whole chunks (zero g and β: the identity on the state). Chunks are laid out
    by (chunk index j, sequence rank) with sequences ranked by chunk count, longest first, so the sequences that
    still have a chunk j form a prefix and step j of the state hand-off is one contiguous slice. All intra-chunk
    work (pair decays, triangular solve) runs batched over every chunk of every sequence; the only Python loop
    is over j (the longest sequence's chunk count), batched across sequences.
    """
    cu = _bounds(cu_seqlens)
    sl = _slot_list(slots)
    Bn = len(cu) - 1
    if len(sl) != Bn:
        raise ValueError(f"{len(sl)} slots for {Bn} sequences")
    _check_distinct(sl)
    T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    sub = _SUB_CHUNK if C % _SUB_CHUNK == 0 else C
    dev = q.device
    o_out = torch.zeros(T, H, V, dtype=torch.float32, device=dev)
    lens = [cu[b + 1] - cu[b] for b in range(Bn)]
    n_chunks = [-(-n // C) for n in lens]
    # sequences that do any work: non-empty and with a real slot
    work = [b for b in range(Bn) if lens[b] > 0 and sl[b] >= 0]
    if not work:
        return o_out
    order = sorted(work, key=lambda b: -n_chunks[b])                  # stable: ties keep batch order
    nb_sorted = [n_chunks[b] for b in order]
    max_n = nb_sorted[0]
    active = [sum(1 for n in nb_sorted if n > j) for j in range(max_n)]   # sequences with a chunk j (a prefix)
    base = [0] * (max_n + 1)
    for j in range(max_n):
        base[j + 1] = base[j] + active[j]
    NC = base[max_n]

    # token -> padded row (chunk id · C + offset in chunk), chunk id = base[j] + rank
    base_t = torch.tensor(base[:max_n], dtype=torch.long, device=dev)
    src_parts, dst_parts = [], []
    for rank, b in enumerate(order):
        p = torch.arange(lens[b], device=dev)
        src_parts.append(p + cu[b])
        dst_parts.append((base_t[p // C] + rank) * C + p % C)
    src = torch.cat(src_parts)
    dst = torch.cat(dst_parts)
    scale = K ** -0.5 if scale is None else scale

    def pack(x: Tensor, mul: float | None = None) -> Tensor:
        """[T, H, ...] -> [NC, H, C, ...] zero-padded chunks."""
        xs = x.float()[src]
        if mul is not None:
            xs = xs * mul
        buf = xs.new_zeros(NC * C, *x.shape[1:])
        buf.index_copy_(0, dst, xs)
        return buf.view(NC, C, *x.shape[1:]).movedim(1, 2).contiguous()

    qc, kc, vc, gc, bc = pack(q, scale), pack(k), pack(v), pack(g), pack(beta)

    W_ = torch.empty(NC, H, C, K, device=dev)
    U = torch.empty(NC, H, C, V, device=dev)
    A = torch.empty(NC, H, C, C, device=dev)
    q_dec = torch.empty(NC, H, C, K, device=dev)
    k_dec_t = torch.empty(NC, H, K, C, device=dev)
    last_dec = torch.empty(NC, H, K, 1, device=dev)
    # batches of chunks for the intra-chunk work: the [.., C, sub, K] decay temporaries stay cache-sized on CPU
    per_chunk = H * C * sub * max(K, V)
    group = NC if dev.type != "cpu" else max(1, _CHUNK_GROUP_FLOATS // per_chunk)
    for c0 in range(0, NC, group):
        s_ = slice(c0, min(NC, c0 + group))
        res = _intra_chunk(qc[s_], kc[s_], vc[s_], gc[s_], bc[s_], sub)
        for dst_t, r in zip((W_, U, A, q_dec, k_dec_t, last_dec), res):
            dst_t[s_] = r

    slot_idx = torch.tensor([sl[b] for b in order], dtype=torch.long, device=recurrent_states.device)
    S = recurrent_states[slot_idx].to(device=dev, dtype=torch.float32)     # [nB, H, K, V], a private copy
    o_c = torch.empty(NC, H, C, V, device=dev)
    for j in range(max_n):
        m, c0 = active[j], base[j]
        cs = slice(c0, c0 + m)
        Sm = S[:m]
        v_new = U[cs] - torch.matmul(W_[cs], Sm)
        o_c[cs] = torch.matmul(A[cs], v_new) + torch.matmul(q_dec[cs], Sm)
        S[:m] = last_dec[cs] * Sm + torch.matmul(k_dec_t[cs], v_new)
    recurrent_states.index_copy_(0, slot_idx, S.to(recurrent_states.dtype))
    o_out.index_copy_(0, src, o_c.movedim(2, 1).reshape(NC * C, H, V)[dst])
    return o_out
