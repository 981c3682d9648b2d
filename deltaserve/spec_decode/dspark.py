"""DSpark drafting (docs/serving.md §9.4) with a drafter folder (deltaserve/models/dspark.py).

Each step, after the target's tokens are settled:
* context injection, one drafter pass for all scheduled requests: every request's positions the target has now
  computed, from `num_drafter_tokens` up to its newest token (exclusive), get the drafter's latent rows from the
  target's pre-norm states of this step — one row per drafter layer, in that layer's pages (layers
  `first_layer ...` of the page pool). A row depends only on its position's state, so rows in pages shared by a
  prefix hit are already right;
* block drafting, one drafter pass for every request that wants drafts: the anchor (its newest token, at position
  P) and mask tokens after it, over its context rows before P (read from its pages, padded to the longest); the
  Markov head then takes the drafts left to right, slot by slot for all requests. A greedy request takes the
  argmax of each corrected distribution (one-hot drafts); any other draws from it at its temperature with its own
  generator and keeps the distribution, q, for verification (the sampler's `verify_draft`). A block stops where
  the drafter's confidence falls below `min_confidence`; a request whose block is cut to nothing skips the
  drafting pass for a while (`_backoff`).
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import torch

from ..models.dspark import DSparkDrafter
from .proposer import DraftRequest, Proposal, Proposer, TargetStep


class DSparkProposer(Proposer):
    reads_hidden = True

    def __init__(self, model, drafter: DSparkDrafter, cache, first_layer: int, default_generator,
                 min_confidence: float = 0.0, max_skip: int = 0):
        self.model, self.drafter, self.cache = model, drafter, cache
        self.layers = [first_layer + i for i in range(drafter.config.num_hidden_layers)]
        self.default_generator = default_generator  # the generator of requests without a seed
        self.min_confidence = min_confidence  # see _markov
        self.max_skip = max_skip
        # request -> (steps it still skips, the skip its last empty block bought): see `_backoff`
        self._quiet: WeakKeyDictionary = WeakKeyDictionary()

    @torch.inference_mode()
    def catch_up(self, step: TargetStep) -> None:
        """One drafter pass over every scheduled chunk's new context positions."""
        picked = []  # (request, first new position, end, that position's row in step.hidden)
        for seq, start, _, first_row in step.chunks:
            if seq.is_finished or seq.state_slot is None:
                continue
            lo, hi = max(seq.num_drafter_tokens, start), seq.num_computed_tokens  # before the newest token
            if lo < hi:
                picked.append((seq, lo, hi, first_row + lo - start))
            seq.num_drafter_tokens = max(seq.num_drafter_tokens, hi)
        if not picked:
            return
        # index lists built in Python: a decode step brings a request a row or a few, and a torch op per request
        # would cost more than the pass itself
        B = self.cache.pages.block_size
        states = step.hidden[torch.tensor([r for _, lo, hi, row in picked for r in range(row, row + hi - lo)])]
        positions = torch.tensor([p for _, lo, hi, _ in picked for p in range(lo, hi)])
        rows = torch.tensor([seq.block_ids[p // B] * B + p % B for seq, lo, hi, _ in picked for p in range(lo, hi)])
        for layer, latent in zip(self.layers, self.drafter.context_latents(states, positions)):
            self.cache.write_mla_rows(layer, rows, latent, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        live = [i for i, (seq, room) in enumerate(requests)
                if room > 0 and seq.num_drafter_tokens >= seq.num_computed_tokens  # else: context rows missing
                and not self._skips(seq)]
        out = [Proposal([]) for _ in requests]
        if not live:
            return out
        seqs = [requests[i].seq for i in live]
        rooms = [min(requests[i].room, self.drafter.config.block_size) for i in live]
        for i, seq, proposal in zip(live, seqs, self._markov(seqs, rooms, self._blocks(seqs))):
            out[i] = proposal
            self._backoff(seq, bool(proposal.tokens))
        return out

    def finish(self, seq, output: list[int]) -> None:
        """Its context rows live in its pages; only its skip count is kept here."""
        self._quiet.pop(seq, None)

    def _skips(self, seq) -> bool:
        """Whether `seq` sits this step out (one of the steps its last empty block bought), counting the step."""
        left, skip = self._quiet.get(seq, (0, 0))
        if left:
            self._quiet[seq] = (left - 1, skip)
        return left > 0

    def _backoff(self, seq, drafted: bool) -> None:
        """After a block: one with drafts clears the request's skips; an empty one (cut by the confidence rule: the
        drafter expects its first draft to be rejected) makes it skip the next 1, 2, 4, ... steps (doubling while
        its blocks stay empty), at most `max_skip`."""
        if drafted or not self.max_skip:
            self._quiet.pop(seq, None)
            return
        last = self._quiet.get(seq, (0, 0))[1]
        skip = min(self.max_skip, 2 * last if last else 1)
        self._quiet[seq] = (skip, skip)

    def _blocks(self, seqs: list) -> torch.Tensor:
        """One drafter pass over every request's block (anchor = its newest token, at position P), each block
        seeing its own request's context rows (positions before P, read from its pages) and its own rows; returns
        the LM head's logits [len(seqs), block_size, vocab]."""
        c = self.drafter.config
        G, B = c.block_size, len(seqs)
        anchors = torch.tensor([seq.num_computed_tokens for seq in seqs])
        rows = self.cache.pages.padded_slots([seq.block_ids for seq in seqs], int(anchors.max()))
        contexts = [self.cache.read_mla_rows(layer, rows.flatten()).unflatten(0, rows.shape)
                    for layer in self.layers]
        ids = torch.full((B, G), c.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor([seq.token_slice(P, P + 1)[0] for seq, P in zip(seqs, anchors.tolist())])
        positions = anchors.unsqueeze(1) + torch.arange(G)
        states = self.drafter.block_states_batched(self.model.embed_tokens(ids), positions, contexts, anchors)
        return self.model.lm_head(states).float()

    def _markov(self, seqs: list, rooms: list[int], base: torch.Tensor) -> list[Proposal]:
        """The drafts of each request from its block's logits `base` [B, G, vocab] (at most `rooms[b]`), slot by
        slot for all requests at once through the Markov head: argmax for a greedy request, else a draw at its
        temperature from its own generator (q kept). A request's block stops before the draft at which the product
        of the drafter's probabilities of its drafts falls below `min_confidence` (its estimate that every draft so
        far survives): rows unlikely to be kept are not verified (the spec's confidence-scheduled length, with the
        Markov head's own probabilities as the confidence)."""
        B = len(seqs)
        greedy = [seq.params.greedy for seq in seqs]
        sampled = [b for b in range(B) if not greedy[b]]
        temperature = torch.tensor([1.0 if g else seq.params.temperature for seq, g in zip(seqs, greedy)])
        previous = torch.tensor([seq.token_slice(seq.num_computed_tokens, seq.num_computed_tokens + 1)[0]
                                 for seq in seqs])  # the anchors
        survival = torch.ones(B, dtype=torch.float64)
        room = torch.tensor(rooms)
        length = room.clone()  # drafts kept per request, cut below
        open_ = torch.ones(B, dtype=torch.bool)
        tokens, probs = [], []
        for k in range(max(rooms)):
            open_ &= room > k
            if not bool(open_.any()):
                break
            logits = base[:, k] + self.drafter.markov_bias(previous)
            q = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
            token = logits.argmax(-1)  # a greedy request's draft
            for b in sampled:
                if open_[b]:
                    gen = seqs[b].sampling.generator or self.default_generator
                    token[b] = int(torch.multinomial(q[b].to(gen.device), 1, generator=gen))
            survival *= q.gather(1, token.unsqueeze(1)).squeeze(1).double()
            cut = open_ & (survival < self.min_confidence)
            length[cut] = k
            open_ &= ~cut
            tokens.append(token)
            probs.append(q)
            previous = token
        drafts, length = torch.stack(tokens, dim=1).tolist(), length.tolist()
        return [Proposal(drafts[b][:length[b]], None if greedy[b] or not length[b] else
                         torch.stack([p[b] for p in probs[:length[b]]])) for b in range(B)]
