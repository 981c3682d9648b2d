"""MTP drafting (docs/serving.md §9.4, docs/model.md §13): the checkpoint's first MTP layer proposes the token after
next from the target's pre-norm state one position back and the newest token, and is chained on its own output
for more drafts.

The MTP layer attends over its own latent cache (pages of layer `num_layers`, beside the target's layers in the page
pool), so its row at every position of a request must be computed, in order, as the target computes that position's
predecessor: row p reads token p and the target's state at p - 1 (zero at p = 0, as the layer was trained). Each step,
after the target's tokens are settled, the proposer catches every scheduled request up from `num_drafter_tokens`
(its rows computed so far) to its newest token; that last row's output gives draft 1, and each further draft feeds
the previous draft and the layer's own output back one position later (rows written there are speculative and are
computed again once their tokens are known). A row whose target state is not at hand (the first row after a prefix
hit starts a request past position 0) reads zero there: a draft may then differ, never an output.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from ..layers.batch import StepBatch, StepLayout
from .proposer import DraftRequest, Proposal, Proposer, TargetStep


class _Rows(NamedTuple):
    seq: Any
    start: int  # first drafter row (position) computed this step
    tokens: list[int]  # token at each row's position
    hidden: torch.Tensor  # [rows, d] the target's pre-norm state one position back of each row


class MTPProposer(Proposer):
    """Greedy MTP drafts over `cache` (the engine's PagedCache, whose page pool holds the MTP layer's latent), the
    layer's block run by the engine's `backend` (on the native backend, a program like the stack's).

    Every run of the layer is one `StepLayout` (the rows' tokens, positions and pages; `sample_rows`: each
    sequence's last row, whose draft is taken) and the target states it reads, computed by `run_layout`. Over a
    tensor-parallel group `send_draft` (engine/workers.py) first sends both to the other ranks, which run the same
    `run_layout` on their shard of the layer and their pools: only rank 0 holds requests."""

    reads_hidden = True

    def __init__(self, model, cache, backend, send_draft: Callable[[StepLayout, torch.Tensor], None] | None = None):
        self.model, self.cache, self.backend = model, cache, backend
        self.layer = model.mtp[0]  # its latent cache is layer num_layers of the page pool (engine/pools.py)
        self.send_draft = send_draft
        # id(seq) -> (output at its newest row, that position, the draft it gives)
        self._last: dict[int, tuple[torch.Tensor, int, int]] = {}

    @torch.inference_mode()
    def catch_up(self, step: TargetStep) -> None:
        """Compute every scheduled request's rows up to its newest token; keep each one's last output and the draft
        it gives (what `propose` starts from)."""
        self._last = {}
        catch_up = [rows for rows in (self._rows(c, step) for c in step.chunks) if rows is not None]
        if not catch_up:
            return
        last, tokens = self._run(catch_up)
        for j, rows in enumerate(catch_up):
            rows.seq.num_drafter_tokens = rows.start + len(rows.tokens)
            self._last[id(rows.seq)] = (last[j], rows.start + len(rows.tokens) - 1, int(tokens[j]))

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        last, self._last = self._last, {}
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests) if r.room > 0 and id(r.seq) in last]
        if live:
            self._chain(requests, live, last, drafts)
        return [Proposal(tokens) for tokens in drafts]

    def _chain(self, requests: list[DraftRequest], live: list[int], last: dict, drafts: list[list[int]]) -> None:
        """Greedy drafts for requests `live`: draft 1 from each one's newest row, then the layer chained on the
        previous draft and its own output one position later."""
        h = torch.stack([last[id(requests[i].seq)][0] for i in live])  # aligned with `live`
        positions = [last[id(requests[i].seq)][1] for i in live]
        token = [last[id(requests[i].seq)][2] for i in live]
        for depth in range(1, max(requests[i].room for i in live) + 1):
            for j, i in enumerate(live):
                drafts[i].append(token[j])
            keep = [j for j, i in enumerate(live) if requests[i].room > depth]
            if not keep:
                break
            chained = [_Rows(requests[live[j]].seq, positions[j] + 1, [drafts[live[j]][-1]], h[j:j + 1])
                       for j in keep]
            live, positions = [live[j] for j in keep], [positions[j] + 1 for j in keep]
            h, token = self._run(chained)
            token = token.tolist()

    def finish(self, seq, output: list[int]) -> None:
        """Nothing is kept per request: its drafter rows live in its pages."""

    def _rows(self, chunk, step: TargetStep) -> _Rows | None:
        """The drafter rows a scheduled request catches up this step: from `num_drafter_tokens` to its newest token,
        each with the target's state one position back (this step's row, the state carried from a fork, or zero)."""
        seq, start, num_rows, first_row = chunk
        if seq.is_finished or seq.state_slot is None:
            return None
        lo, hi = seq.num_drafter_tokens, seq.num_computed_tokens  # hi: the newest token's position
        if lo > hi:
            return None
        hidden = step.hidden.new_zeros(hi - lo + 1, step.hidden.shape[-1])
        a, b = max(lo, start + 1), min(hi, start + num_rows)  # rows whose state one back this step computed
        if a <= b:
            hidden[a - lo:b - lo + 1] = step.hidden[first_row + a - 1 - start:first_row + b - start]
        carried = seq.drafter_hidden
        if carried is not None and lo <= carried[0] + 1 <= hi and not a <= carried[0] + 1 <= b:
            hidden[carried[0] + 1 - lo] = carried[1]
        seq.drafter_hidden = None
        return _Rows(seq, lo, seq.token_slice(lo, hi + 1), hidden)

    def _run(self, rows: list[_Rows]) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over each sequence's rows (positions start .. start + len - 1, after `start` cached ones),
        writing their latent rows; returns each sequence's last row's pre-norm output [len(rows), d] and draft."""
        ids, positions, query_start, contexts = [], [], [0], []
        for r in rows:
            n = len(r.tokens)
            ids += r.tokens
            positions += range(r.start, r.start + n)
            query_start.append(query_start[-1] + n)
            contexts.append(r.start)
        layout = StepLayout(ids, positions, query_start, contexts, [r.seq.state_slot for r in rows],
                            [r.seq.block_ids for r in rows], [[] for _ in rows], [q - 1 for q in query_start[1:]], [])
        hidden = torch.cat([r.hidden for r in rows])
        if self.send_draft is not None:
            self.send_draft(layout, hidden)
        return self.run_layout(layout, hidden)

    @torch.inference_mode()
    def run_layout(self, layout: StepLayout, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over `layout`'s rows, reading `hidden` [rows, d] (the target's states one position back): the
        outputs of rows `layout.sample_rows` and their greedy drafts (the head's logits are gathered over ranks)."""
        q, contexts = layout.query_start, layout.context_lens
        handles = [self.cache.handle(table, slot, ctx + q[i + 1] - q[i])
                   for i, (table, slot, ctx) in enumerate(zip(layout.tables, layout.slots, contexts))]
        pos = torch.tensor(layout.positions, dtype=torch.long)
        write_rows = torch.cat([h.rows[c:] for h, c in zip(handles, contexts)])
        batch = StepBatch(pos, q, contexts, self.cache, handles, [], self.backend.ops, None, write_rows,
                          decode_form=True)
        embeds = self.model.embed_tokens(torch.tensor(layout.ids, dtype=torch.long))
        out = self.backend.run_block(self.layer.block, self.layer.block_input(embeds, hidden.to(embeds.dtype), pos),
                                     batch)
        last = out[layout.sample_rows]
        return last, self.layer.logits(last).argmax(-1)
