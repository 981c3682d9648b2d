"""Multi-head latent attention over one sequence's cached latents (docs/model.md §9.2–9.3, 9.5).

Both functions take the same arguments and return the same [T, H, v] output:
  q_nope [T, H, n], q_pe [T, H, rho]   queries (q_pe already rotated for RoPE models)
  latent [S, r], k_pe [S, rho]         the cached normalised latent and shared rope key of keys 0..S-1
  w_kv_b [H*(n+v), r]                  kv_b_proj.weight
  allowed [T, S] bool                  which keys each query may attend (causal bound or the DSA selection)
`mla_attention_ref` expands keys/values per head (the transformers form); `mla_attention_absorbed` folds
W_UK into the query and W_UV into the output so attention runs over the 576-wide latent directly (decode form);
`mla_attention_expanded` is the fast prefill form of the reference: the same expansion, attention by torch's fused
scaled_dot_product_attention (fp32 softmax statistics, no [T, H, S] score tensor).
Softmax is fp32; the output is cast to q's dtype.
"""

import torch


def _split_kv_b(w_kv_b: torch.Tensor, heads: int, n: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = w_kv_b.view(heads, n + v, -1)
    return w[:, :n], w[:, n:]  # W_UK [H, n, r], W_UV [H, v, r]


def _masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    scores = scores.float().masked_fill(~allowed.unsqueeze(1), float("-inf"))
    return torch.softmax(scores, dim=-1)


def mla_attention_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                      w_kv_b: torch.Tensor, v_head_dim: int, scale: float, allowed: torch.Tensor) -> torch.Tensor:
    T, H, n = q_nope.shape
    kv = torch.nn.functional.linear(latent, w_kv_b).view(latent.shape[0], H, n + v_head_dim)
    k_nope, value = kv[..., :n], kv[..., n:]
    scores = torch.einsum("thn,shn->ths", q_nope, k_nope) + torch.einsum("thr,sr->ths", q_pe, k_pe)
    p = _masked_softmax(scores * scale, allowed).to(value.dtype)
    return torch.einsum("ths,shv->thv", p, value).to(q_nope.dtype)


def mla_attention_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                           w_kv_b: torch.Tensor, v_head_dim: int, scale: float, allowed: torch.Tensor) -> torch.Tensor:
    T, H, n = q_nope.shape
    w_uk, w_uv = _split_kv_b(w_kv_b, H, n, v_head_dim)
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    scores = torch.einsum("thr,sr->ths", q_lat, latent) + torch.einsum("thr,sr->ths", q_pe, k_pe)
    p = _masked_softmax(scores * scale, allowed).to(latent.dtype)
    o_lat = torch.einsum("ths,sr->thr", p, latent)
    return torch.einsum("thr,hvr->thv", o_lat, w_uv).to(q_nope.dtype)


def mla_attention_expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                           w_kv_b: torch.Tensor, v_head_dim: int, scale: float,
                           allowed: torch.Tensor) -> torch.Tensor:
    """Fast twin of `mla_attention_ref` for chunks: expanded keys/values, fused attention over the `allowed` mask.
    Every query row must allow at least one key (a causal bound always does). Values are zero-padded to the
    query/key head size and the batch is 4-D: torch's CPU flash kernel takes only that form, and runs long
    prefills faster than the math fallback it picks otherwise."""
    T, H, n = q_nope.shape
    S = latent.shape[0]
    kv = torch.nn.functional.linear(latent, w_kv_b).view(S, H, n + v_head_dim)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)                                   # [H, T, n + rho]
    k = torch.cat([kv[..., :n], k_pe.to(kv.dtype).unsqueeze(1).expand(S, H, -1)], dim=-1).transpose(0, 1)
    v = torch.nn.functional.pad(kv[..., n:], (0, max(0, q.shape[-1] - v_head_dim))).transpose(0, 1)
    # a chunk with no cached prefix under the plain causal bound: the kernel's own causal form skips the blocks
    # above the diagonal, about half the work of the masked form (and bit for bit its result)
    causal = T == S and torch.equal(allowed, torch.ones_like(allowed).tril())
    out = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None],
                                                           attn_mask=None if causal else allowed, is_causal=causal,
                                                           scale=scale)[0, ..., :v_head_dim]
    return out.transpose(0, 1).to(q_nope.dtype)
