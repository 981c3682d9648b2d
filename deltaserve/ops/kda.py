"""KDA (Kimi Delta Attention) core ops, plain PyTorch, one sequence at a time (docs/model.md §8.3-§8.6).

Shapes (no batch dimension): ``q, k [T, H, K]``, ``v [T, H, V]``, ``g [T, H, K]`` (log-space decay, <= 0),
``beta [T, H]``, recurrent state ``S [H, K, V]`` key-major, everything fp32. ``q`` and ``k`` must already be
L2-normalised (:func:`l2_normalize`); ``scale`` (default ``K**-0.5``) is applied to ``q`` inside.

Every fast path has a readable ``*_ref`` twin that transcribes the spec; tests keep them in agreement.
No function modifies its inputs (in particular ``initial_state``) in place.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "kda_gate",
    "l2_normalize",
    "kda_recurrent_ref",
    "kda_recurrent",
    "kda_chunk_ref",
    "kda_chunk",
]


def kda_gate(u: Tensor, A_log: Tensor, lower_bound: float | None) -> Tensor:
    """Per-channel log-space forget gate ``g [T, H, K]`` fp32 from ``u [T, H, K]`` and ``A_log [H]``.

    ``u`` is ``f_b_proj(f_a_proj(x)) + dt_bias`` viewed per head; ``A_log`` is already narrowed to the first H
    entries by the caller. ``lower_bound=None``: Kimi-Linear gate ``-exp(A_log) * softplus(u)`` (softplus is
    the identity above 20, like HF/FLA). ``lower_bound=λ``: K3 "safe" gate ``λ * sigmoid(exp(A_log) * u)`` in
    (λ, 0) -- a different activation, not a clamp of the first one.
    """
    u = u.float()
    a = A_log.float().exp().view(1, -1, 1)  # broadcast over T and K
    if lower_bound is None:
        return -a * F.softplus(u, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(a * u)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x * rsqrt(sum(x**2) + eps)`` over the last dim in fp32 (eps inside the sqrt, unlike F.normalize)."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
             initial_state: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Cast to fp32, scale q, and build a fresh state (never aliasing ``initial_state``)."""
    T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if initial_state is None:
        S = q.new_zeros(H, K, V)
    else:
        S = initial_state.to(device=q.device, dtype=torch.float32, copy=True)
    return q * scale, k, v, g, beta, S


# --------------------------------------------------------------------------------------------------------------
# Recurrent form (decode, spec verification, short chunks)
# --------------------------------------------------------------------------------------------------------------


def kda_recurrent_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                      initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token-by-token KDA recurrence (docs/model.md §8.5). Returns ``(o [T, H, V], final_state [H, K, V])`` fp32."""
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state)
    T = q.shape[0]
    o = v.new_zeros(v.shape)
    for t in range(T):
        # 1) decay every key row of S by its own channel gate
        S = S * g[t].exp()[:, :, None]
        # 2) delta rule on the already decayed state: S += k ⊗ β (v - Sᵀk)
        predicted = (S * k[t][:, :, None]).sum(dim=1)                    # [H, V]
        delta = beta[t][:, None] * (v[t] - predicted)                    # [H, V]
        S = S + k[t][:, :, None] * delta[:, None, :]
        # 3) read after the update
        o[t] = (S * q[t][:, :, None]).sum(dim=1)
    return o, S


def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                  initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Fast twin of :func:`kda_recurrent_ref` (same contract): batched matvecs and in-place updates on a private
    copy of the state; for T=1 this is a handful of tensor ops."""
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state)
    T = q.shape[0]
    decay = g.exp()                                # [T, H, K], computed for all tokens at once
    kb = k.unsqueeze(-2)                           # [T, H, 1, K]: row vectors for bmm
    qb = q.unsqueeze(-2)
    o = v.new_empty(v.shape)
    for t in range(T):
        S.mul_(decay[t].unsqueeze(-1))
        delta = (v[t] - torch.bmm(kb[t], S).squeeze(1)) * beta[t].unsqueeze(-1)   # [H, V]
        S.baddbmm_(k[t].unsqueeze(-1), delta.unsqueeze(1))                          # rank-1 update per head
        o[t] = torch.bmm(qb[t], S).squeeze(1)
    return o, S


# --------------------------------------------------------------------------------------------------------------
# Chunked form (prefill), exact
# --------------------------------------------------------------------------------------------------------------


def _pad_to_chunks(T: int, chunk_size: int, *xs: Tensor) -> list[Tensor]:
    """Zero-pad dim 0 to a multiple of ``chunk_size``. Zero g and zero β make the padded steps the identity on
    the state (decay exp(0)=1, update β·…=0): the final state is unaffected; padded outputs are discarded."""
    pad = (-T) % chunk_size
    if pad == 0:
        return list(xs)
    return [torch.cat([x, x.new_zeros((pad, *x.shape[1:]))], dim=0) for x in xs]


def _segsum(g: Tensor) -> Tensor:
    """Segment sums along the time dim (-2): ``out[..., i, j, c] = Σ_{t=j+1}^{i} g[..., t, c]`` for j ≤ i, -inf for
    j > i. Summed directly rather than as Γ_i − Γ_j: g ≤ 0, so every partial sum adds terms of one sign and
    nothing cancels (Γ_i − Γ_j of two long cumsums loses ~|Γ|·eps absolute, visible with strong decay)."""
    C = g.shape[-2]
    keep = torch.ones(C, C, dtype=torch.bool, device=g.device).tril(-1)[:, :, None]     # t > j
    terms = g.unsqueeze(-2).expand(*g.shape[:-1], C, g.shape[-1]).masked_fill(~keep, 0.0)  # [..., t, j, K]
    seg = terms.cumsum(dim=-3)                                                            # [..., i, j, K]
    causal = torch.ones(C, C, dtype=torch.bool, device=g.device).tril(0)[:, :, None]
    return seg.masked_fill(~causal, float("-inf"))


def _tail_sum(g: Tensor) -> Tensor:
    """``out[..., j, c] = Σ_{t>j} g[..., t, c]`` along dim -2 (= Γ_C − Γ_j), summed without cancellation."""
    shifted = torch.cat([g[..., 1:, :], torch.zeros_like(g[..., :1, :])], dim=-2)
    return shifted.flip(-2).cumsum(dim=-2).flip(-2)


def kda_chunk_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                  initial_state: Tensor | None = None, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Exact chunked KDA (docs/model.md §8.6), one chunk and one head-batched step at a time.

    Same contract as :func:`kda_recurrent_ref`; T need not be a multiple of ``chunk_size``.
    """
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state)
    T = q.shape[0]
    C = chunk_size
    q, k, v, g, beta = _pad_to_chunks(T, C, q, k, v, g, beta)
    # heads first: [H, T', ...]
    q, k, v, g, beta = (x.transpose(0, 1) for x in (q, k, v, g, beta))
    o = torch.zeros_like(v)
    eye = torch.eye(C, device=q.device)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)   # j < i
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(0)    # j <= i
    for c0 in range(0, q.shape[1], C):
        sl = slice(c0, c0 + C)
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]
        G = g[:, sl].cumsum(dim=1)                                       # Γ [H, C, K]
        # pairwise e^{Γ_i-Γ_j} (j ≤ i), exponent -inf above the diagonal so nothing can overflow
        decay_causal = _segsum(g[:, sl]).exp()                           # [H, C(i), C(j), K]
        # L[i,j] = β_i Σ_c k_i k_j e^{Γ_i-Γ_j}, strictly lower
        L = bc[:, :, None] * (kc[:, :, None, :] * kc[:, None, :, :] * decay_causal).sum(-1)
        L = L * strict
        # Tm = (I + L)^{-1} diag(β) by forward substitution, one row at a time
        M = eye.expand_as(L).clone() + L
        Tm = torch.zeros_like(L)
        for i in range(C):
            rhs = torch.zeros_like(Tm[:, i])
            rhs[:, i] = bc[:, i]
            # row i of M·Tm = rhs  ⇒  Tm[i] = rhs - Σ_{j<i} M[i,j] Tm[j]   (M has a unit diagonal)
            Tm[:, i] = rhs - (M[:, i, :i, None] * Tm[:, :i]).sum(dim=1)
        W_ = Tm @ (G.exp() * kc)                                         # [H, C, K]
        U = Tm @ vc                                                      # [H, C, V]
        v_new = U - W_ @ S
        A = (qc[:, :, None, :] * kc[:, None, :, :] * decay_causal).sum(-1) * causal
        o[:, sl] = (qc * G.exp()) @ S + A @ v_new
        G_last = G[:, -1:, :]                                            # Γ_C [H, 1, K]
        S = G_last.transpose(1, 2).exp() * S + (kc * _tail_sum(g[:, sl]).exp()).transpose(1, 2) @ v_new
    return o.transpose(0, 1)[:T].contiguous(), S


# Decay factors below 2^-40 are flushed to exactly 0 in the fast chunked path. They change results by < 1e-12
# relative (five orders below fp32 resolution) but otherwise feed denormals into the triangular solve and the
# matmuls, which the CPU runs many times slower (strong decays give them: e^{Γ} of -100 and below).
_LOG_FLUSH = -40.0 * math.log(2.0)


def _decay(exponent: Tensor) -> Tensor:
    """``exp(exponent)`` for exponents ≤ 0, with factors below 2^-40 set to exactly 0."""
    return exponent.masked_fill(exponent < _LOG_FLUSH, float("-inf")).exp()


def kda_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
              initial_state: Tensor | None = None, chunk_size: int = 64, sub_chunk: int = 8
              ) -> tuple[Tensor, Tensor]:
    """Fast twin of :func:`kda_chunk_ref` (same contract; ``chunk_size`` must be a multiple of ``sub_chunk``).

    All intra-chunk work is vectorised over chunks; only the chunk-to-chunk state hand-off is a Python loop.
    The pairwise decays e^{Γ_i-Γ_j} are not materialised for whole chunks: rows are cut into sub-chunks of size
    B, and for j before the sub-chunk a of i the decay factorises through s_a (first position of sub-chunk a):
    e^{Σ_{t=s_a}^{i} g_t} · e^{Σ_{t=j+1}^{s_a-1} g_t}. Both factors are ≤ 1 (no overflow with any gate) and each
    exponent is summed directly from g (same-sign terms, no cancellation), so those blocks are plain matmuls;
    only the B×B diagonal blocks use the pairwise form. (I + L)^{-1} is a batched unit-triangular solve.
    """
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state)
    T, H, K = q.shape
    V = v.shape[-1]
    C, B = chunk_size, sub_chunk
    if C % B != 0:
        raise ValueError(f"chunk_size {C} must be a multiple of sub_chunk {B}")
    nb = C // B
    q, k, v, g, beta = _pad_to_chunks(T, C, q, k, v, g, beta)
    N = q.shape[0] // C

    def chunks(x: Tensor) -> Tensor:  # [T', H, ...] -> [H, N, C, ...]
        return x.reshape(N, C, H, *x.shape[2:]).movedim(2, 0)

    qc, kc, vc, bc, gc = chunks(q), chunks(k), chunks(v), chunks(beta), chunks(g)
    G = gc.cumsum(dim=2)                                                 # Γ from chunk start [H, N, C, K]
    gb = gc.reshape(H, N, nb, B, K)                                      # g per sub-chunk
    # row factor e^{Σ_{t=s_a}^{i} g_t}: cumsum local to the sub-chunk
    row_f = _decay(gb.cumsum(dim=3))                                     # [H, N, nb, B, K]
    # column exponent for j in sub-chunk b < a: Σ_{t=j+1}^{end_b} g_t  +  Σ_{sub-chunks c, b<c<a} total_c
    tail_in_b = _tail_sum(gb)                                            # [H, N, nb(b), B, K]
    seg_tot = _segsum(gb.sum(dim=3))                                     # [H, N, nb(a'), nb(b), K]: b < c ≤ a'
    between = torch.cat([torch.full_like(seg_tot[:, :, :1], float("-inf")), seg_tot[:, :, :-1]], dim=2)
    # between[a, b] = seg_tot[a-1, b]: finite only for b < a, so -inf masks j at or after s_a
    col_f = _decay(tail_in_b[:, :, None] + between[:, :, :, :, None]).reshape(H, N, nb, C, K)
    diag_dec = _decay(_segsum(gb))                                       # [H, N, nb, B(i), B(j), K], j ≤ i
    idx = torch.arange(nb, device=q.device)
    strict = torch.ones(B, B, dtype=torch.bool, device=q.device).tril(-1)

    def pairwise(x: Tensor, inclusive: bool) -> Tensor:
        """Σ_c x_i[c] k_j[c] e^{Γ_i[c]-Γ_j[c]} for j < i (or j ≤ i) -> [H, N, C, C]."""
        xb = x.reshape(H, N, nb, B, K)
        # blocks left of the diagonal: (x_i · row factor) · (k_j · column factor)ᵀ
        out = torch.einsum("hnaik,hnajk->hnaij", xb * row_f, kc[:, :, None] * col_f)   # [H, N, nb, B, C]
        diag = (xb[:, :, :, :, None, :] * kc.reshape(H, N, nb, B, K)[:, :, :, None, :, :] * diag_dec).sum(-1)
        if not inclusive:
            diag = diag * strict
        # the diagonal blocks of `out` are zero (col_f masks them); add the exact ones there
        out = out.reshape(H, N, nb, B, nb, B)
        out[:, :, idx, :, idx, :] += diag.movedim(2, 0)
        return out.reshape(H, N, C, C)

    L = bc[..., None] * pairwise(kc, inclusive=False)                    # strictly lower
    A = pairwise(qc, inclusive=True)                                     # causal
    # (I + L) X = diag(β) [e^Γ k | v]  ⇒  X = [W_ | U]
    rhs = bc[..., None] * torch.cat([_decay(G) * kc, vc], dim=-1)
    eye = torch.eye(C, device=q.device)
    X = torch.linalg.solve_triangular(L + eye, rhs, upper=False, unitriangular=True)
    W_, U = X[..., :K], X[..., K:]

    q_dec = qc * _decay(G)                                               # q e^{Γ}
    G_last = G[:, :, -1, :]                                              # Γ_C [H, N, K]
    k_dec_t = (kc * _decay(_tail_sum(gc))).transpose(-1, -2)             # (k e^{Γ_C-Γ})ᵀ [H, N, K, C]
    last_decay = _decay(G_last).unsqueeze(-1)                            # [H, N, K, 1]
    o = torch.empty(H, N, C, V, device=q.device)
    for n in range(N):
        v_new = U[:, n] - torch.bmm(W_[:, n], S)
        o[:, n] = torch.baddbmm(torch.bmm(A[:, n], v_new), q_dec[:, n], S)
        S = torch.baddbmm(last_decay[:, n] * S, k_dec_t[:, n], v_new)
    return o.reshape(H, N * C, V).transpose(0, 1)[:T].contiguous(), S
