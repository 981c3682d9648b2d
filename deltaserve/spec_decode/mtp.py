"""MTP drafting (docs/serving.md §9.4, docs/model.md §13): the checkpoint's MTP layers propose the tokens after the
newest one, layer j drafting the (j + 1)-th; past the last layer, the last is chained on its own output.

Layer j (0-based; MTP layer j + 1 of the checkpoint) attends over its own latent cache (pages of layer
`num_layers + j`, beside the target's layers in the page pool), so its row at every position of a request must be
computed, in order, as training aligned it: row p of layer j reads token p and, one position back, the target's
pre-norm state (j = 0) or layer j - 1's output (zero at p = 0). Each step, after the target's tokens are settled,
the proposer catches every scheduled request up from `num_drafter_tokens` (the rows every layer has computed) to its
newest token, layer by layer; layer 0's output at the newest row gives draft 1. For draft d + 1 (d >= 1) each layer
from d on computes its row one position further (reading draft d and its predecessor's output one position back,
from the step before): layer d's output gives the draft, and the rows of the layers after it are the ones those
layers attend over when their turn comes. Past the last layer it runs again one position on, on draft d and its
own output. Rows written at draft positions are speculative and are computed again once their tokens are known. A
row whose input one position back is not at hand (the first row after a prefix hit or a fork) reads zero there: a
draft may then differ, never an output.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple
from weakref import WeakKeyDictionary

import torch

from ..layers.batch import StepBatch, StepLayout
from .proposer import DraftRequest, Proposal, Proposer, TargetStep


class _Rows(NamedTuple):
    seq: Any
    start: int  # first drafter row (position) computed this step
    tokens: list[int]  # token at each row's position


class MTPProposer(Proposer):
    """Greedy MTP drafts over `cache` (the engine's PagedCache, whose page pool holds each MTP layer's latent), the
    layers' blocks run by the engine's `backend` (on the native backend, a program like the stack's).

    Every run of a layer is one `StepLayout` (the rows' tokens, positions and pages; `sample_rows`: each sequence's
    last row, whose draft may be taken) and the states it reads one position back, computed by `run_layout`. Over a
    tensor-parallel group `send_draft` (engine/workers.py) first sends the layer, the layout and the states to the
    other ranks, which run the same `run_layout` on their shard of the layer and their pools: only rank 0 holds
    requests."""

    reads_hidden = True

    def __init__(self, model, cache, backend,
                 send_draft: Callable[[StepLayout, torch.Tensor, int], None] | None = None):
        self.model, self.cache, self.backend = model, cache, backend
        self.layers = list(model.mtp)  # layer j's latent cache: layer num_layers + j of the page pool (engine/pools.py)
        self.send_draft = send_draft
        # id(seq) -> (its newest position, every layer's output there [layers, d], the draft layer 0's gives)
        self._last: dict[int, tuple[int, torch.Tensor, int]] = {}
        # request -> (its newest position at the last catch-up, layers 0 .. n-2's outputs there): what the next
        # catch-up's first row of layers 1 .. n-1 reads one position back
        self._carried: WeakKeyDictionary = WeakKeyDictionary()

    @torch.inference_mode()
    def catch_up(self, step: TargetStep) -> None:
        """Compute every scheduled request's rows of every layer up to its newest token, layer by layer; keep each
        one's outputs at its newest row and the draft layer 0's gives (what `propose` starts from)."""
        self._last = {}
        picked = [p for p in (self._rows(c, step) for c in step.chunks) if p is not None]
        if not picked:
            return
        catch_up = [rows for rows, _ in picked]
        ends = torch.tensor([len(r.tokens) for r in catch_up]).cumsum(0)
        back, outs = torch.cat([target for _, target in picked]), []  # layer 0 reads the target's states
        first_drafts = None  # layer 0's, at each request's newest row
        for j in range(len(self.layers)):
            out, tokens = self._run(catch_up, back, j)
            outs.append(out[ends - 1])
            if j == 0:
                first_drafts = tokens
            if j + 1 < len(self.layers):
                back = self._one_back(catch_up, out, ends, j)
        newest_outs = torch.stack(outs, dim=1)  # [requests, layers, d]
        for i, rows in enumerate(catch_up):
            newest = rows.start + len(rows.tokens) - 1
            rows.seq.num_drafter_tokens = newest + 1
            self._last[id(rows.seq)] = (newest, newest_outs[i], int(first_drafts[i]))
            if len(self.layers) > 1:
                self._carried[rows.seq] = (newest, newest_outs[i, :-1])

    def _one_back(self, catch_up: list[_Rows], out: torch.Tensor, ends: torch.Tensor, j: int) -> torch.Tensor:
        """What layer j + 1's catch-up rows read one position back: layer j's output there, from this catch-up
        (`out`, rows ending at `ends`) or, for a request's first row, kept from its last one (zero at position 0
        or when not at hand)."""
        back = torch.zeros_like(out)
        for rows, end in zip(catch_up, ends.tolist()):
            first = end - len(rows.tokens)
            back[first + 1:end] = out[first:end - 1]
            carried = self._carried.get(rows.seq)
            if carried is not None and carried[0] == rows.start - 1:
                back[first] = carried[1][j]
        return back

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        last, self._last = self._last, {}
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests) if r.room > 0 and id(r.seq) in last]
        if live:
            self._chain(requests, live, last, drafts)
        return [Proposal(tokens) for tokens in drafts]

    def _chain(self, requests: list[DraftRequest], live: list[int], last: dict, drafts: list[list[int]]) -> None:
        """Greedy drafts for requests `live`: draft 1 from layer 0 at each one's newest row; draft d + 1 from layer
        d one position further, on draft d and layer d - 1's output one position back, the layers after d computing
        their rows there too; past the last layer, the last one on its own output."""
        n = len(self.layers)
        position = [last[id(requests[i].seq)][0] for i in live]  # aligned with `live`
        outs = torch.stack([last[id(requests[i].seq)][1] for i in live])  # [live, layers, d] one position back
        token = [last[id(requests[i].seq)][2] for i in live]
        for depth in range(1, max(requests[i].room for i in live) + 1):
            for j, i in enumerate(live):
                drafts[i].append(token[j])
            keep = [j for j, i in enumerate(live) if requests[i].room > depth]
            if not keep:
                break
            live, position, outs = [live[j] for j in keep], [position[j] + 1 for j in keep], outs[keep]
            here = outs.clone()
            for layer in range(min(depth, n - 1), n):
                reads = outs[:, layer - 1] if depth < n else outs[:, n - 1]
                rows = [_Rows(requests[i].seq, p, [drafts[i][-1]]) for i, p in zip(live, position)]
                here[:, layer], tokens = self._run(rows, reads, layer)
                if layer == min(depth, n - 1):
                    token = tokens.tolist()
            outs = here

    def finish(self, seq, output: list[int]) -> None:
        """Its drafter rows live in its pages; what it carried to the next catch-up is dropped."""
        self._carried.pop(seq, None)

    def _rows(self, chunk, step: TargetStep) -> tuple[_Rows, torch.Tensor] | None:
        """The drafter rows a scheduled request catches up this step (from `num_drafter_tokens` to its newest token)
        and the target's state one position back of each [rows, d] (this step's row, the state carried from a fork,
        or zero)."""
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
        return _Rows(seq, lo, seq.token_slice(lo, hi + 1)), hidden

    def _run(self, rows: list[_Rows], hidden: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer `layer` over each sequence's rows (positions start .. start + len - 1, after `start` cached
        ones), reading `hidden` [rows, d] one position back, writing their latent rows; returns every row's pre-norm
        output and each sequence's last row's draft."""
        ids, positions, query_start, contexts = [], [], [0], []
        for r in rows:
            n = len(r.tokens)
            ids += r.tokens
            positions += range(r.start, r.start + n)
            query_start.append(query_start[-1] + n)
            contexts.append(r.start)
        layout = StepLayout(ids, positions, query_start, contexts, [r.seq.state_slot for r in rows],
                            [r.seq.block_ids for r in rows], [[] for _ in rows], [q - 1 for q in query_start[1:]], [])
        if self.send_draft is not None:
            self.send_draft(layout, hidden, layer)
        return self.run_layout(layout, hidden, layer)

    @torch.inference_mode()
    def run_layout(self, layout: StepLayout, hidden: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer `layer` over `layout`'s rows, reading `hidden` [rows, d] one position back: every row's output
        and the greedy drafts of rows `layout.sample_rows` (the head's logits are gathered over ranks)."""
        mtp = self.layers[layer]
        q, contexts = layout.query_start, layout.context_lens
        handles = [self.cache.handle(table, slot, ctx + q[i + 1] - q[i])
                   for i, (table, slot, ctx) in enumerate(zip(layout.tables, layout.slots, contexts))]
        pos = torch.tensor(layout.positions, dtype=torch.long)
        write_rows = torch.cat([h.rows[c:] for h, c in zip(handles, contexts)])
        batch = StepBatch(pos, q, contexts, self.cache, handles, [], self.backend.ops, None, write_rows,
                          decode_form=True)
        embeds = self.model.embed_tokens(torch.tensor(layout.ids, dtype=torch.long))
        out = self.backend.run_block(mtp.block, mtp.block_input(embeds, hidden.to(embeds.dtype), pos), batch)
        return out, mtp.logits(out[layout.sample_rows]).argmax(-1)
