"""DSA lightning-indexer scoring and top-k selection (docs/model.md §9.4–9.5).

Selection is engine-canonical: score descending, then larger position first; -0.0 == +0.0. Rows whose causal
range holds no more than `topk` keys select all of them. Output: absolute key positions, valid first, -1 padded.
"""

import torch


def indexer_scores_ref(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """I(t, s) = sum_h weights[t, h] * relu(q[t, h] . k[s] * D^-1/2), fp32. q [T, H, D], k [S, D], weights [T, H]
    (already scaled by H^-1/2). Returns [T, S] without any causal masking."""
    qf, kf = q.float(), k.float()
    per_head = torch.relu(torch.einsum("thd,sd->ths", qf, kf) * q.shape[-1] ** -0.5)
    return torch.einsum("th,ths->ts", weights.float(), per_head)


def select_topk(scores: torch.Tensor, query_positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Pick up to `topk` keys per row among positions 0..query_positions[t] of `scores` [T, S].

    Returns int64 [T, topk] positions (valid entries first, -1 padding). Ties keep the larger position.
    """
    T, S = scores.shape
    key_pos = torch.arange(S, device=scores.device)
    causal = key_pos.unsqueeze(0) <= query_positions.unsqueeze(1)
    # +0.0 so that -0.0 and 0.0 compare equal in the sort; NaN ranks below every finite score.
    s = torch.nan_to_num(scores.float() + 0.0, nan=float("-inf")).masked_fill(~causal, float("-inf"))
    # Order keys by position descending first, then a stable sort by score keeps that order among ties.
    s_rev = s.flip(-1)
    order = torch.sort(s_rev, dim=-1, descending=True, stable=True).indices
    # NaN (now -inf) and future keys (-inf) tie; a last stable pass on validity keeps every causally valid key,
    # NaN included, ahead of every future key (the position tie rule would otherwise rank future keys first).
    valid_sorted = causal.flip(-1).gather(1, order)
    order = order.gather(1, torch.sort(valid_sorted.to(torch.uint8), dim=-1, descending=True, stable=True).indices)
    picked = (S - 1 - order)[:, :topk]
    n_valid = causal.sum(-1).clamp(max=topk)
    slot = torch.arange(picked.shape[1], device=scores.device).unsqueeze(0)
    out = torch.where(slot < n_valid.unsqueeze(1), picked, torch.full_like(picked, -1))
    if out.shape[1] < topk:
        out = torch.cat([out, out.new_full((T, topk - out.shape[1]), -1)], dim=1)
    return out


def selection_mask(selected: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[T, topk] positions (-1 padded) -> bool [T, num_keys] mask of selected keys."""
    mask = torch.zeros(selected.shape[0], num_keys + 1, dtype=torch.bool, device=selected.device)
    mask.scatter_(1, torch.where(selected < 0, num_keys, selected), True)
    return mask[:, :num_keys]
