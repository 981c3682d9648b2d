"""DSpark drafting (docs/serving.md §9.6) with a drafter folder (deltaserve/models/dspark.py).

Each step, after the target's tokens are settled:
* context injection: every scheduled request's positions the target has now computed, from `num_drafter_tokens` up
  to its newest token (exclusive), get the drafter's latent rows from the target's pre-norm states of this step —
  one row per drafter layer, in that layer's pages (layers `first_layer ...` of the page pool). A row depends only
  on its position's state, so rows in pages shared by a prefix hit are already right;
* block drafting, for each request that wants drafts: the anchor (its newest token, at position P) and mask tokens
  after it run through the drafter over the context rows before P; the Markov head then takes the drafts left to
  right. A greedy request takes the argmax of each corrected distribution (one-hot drafts); any other draws from it
  at its temperature with its own generator and keeps the distribution, q, for verification (the sampler's
  `verify_draft`).
"""

from __future__ import annotations

import torch

from ..models.dspark import DSparkDrafter
from .proposer import DraftRequest, Proposal, Proposer, TargetStep


class DSparkProposer(Proposer):
    reads_hidden = True

    def __init__(self, model, drafter: DSparkDrafter, cache, first_layer: int, default_generator,
                 min_confidence: float = 0.0):
        self.model, self.drafter, self.cache = model, drafter, cache
        self.layers = [first_layer + i for i in range(drafter.config.num_hidden_layers)]
        self.default_generator = default_generator  # the generator of requests without a seed
        self.min_confidence = min_confidence  # see _markov

    @torch.inference_mode()
    def catch_up(self, step: TargetStep) -> None:
        for chunk in step.chunks:
            self._inject(chunk, step.hidden)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        c = self.drafter.config
        live = [i for i, (seq, room) in enumerate(requests)
                if room > 0 and seq.num_drafter_tokens >= seq.num_computed_tokens]  # else: context rows missing
        out = [Proposal([]) for _ in requests]
        if not live:
            return out
        base = self._blocks([requests[i].seq for i in live]).view(len(live), c.block_size, -1)
        for j, i in enumerate(live):
            seq, room = requests[i]
            out[i] = self._markov(seq, base[j, :min(room, c.block_size)])
        return out

    def finish(self, seq, output: list[int]) -> None:
        """Nothing is kept per request: its context rows live in its pages."""

    def _inject(self, chunk, hidden: torch.Tensor) -> None:
        seq, start, num_rows, first_row = chunk
        if seq.is_finished or seq.state_slot is None:
            return
        lo, hi = max(seq.num_drafter_tokens, start), seq.num_computed_tokens  # positions before the newest token
        if lo >= hi:
            seq.num_drafter_tokens = max(seq.num_drafter_tokens, hi)
            return
        states = hidden[first_row + lo - start:first_row + hi - start]
        rows = self.cache.handle(seq.block_ids, seq.state_slot, hi).rows[lo:hi]
        for layer, latent in zip(self.layers, self.drafter.context_latents(states, torch.arange(lo, hi))):
            self.cache.write_mla_rows(layer, rows, latent, None)
        seq.num_drafter_tokens = hi

    def _blocks(self, seqs: list) -> torch.Tensor:
        """One drafter forward over every request's block (anchor = its newest token, at position P), each block
        seeing its own request's context rows (positions before P) and its own rows; returns the LM head's logits
        [len(seqs) * block_size, vocab]."""
        c = self.drafter.config
        G = c.block_size
        anchors = [seq.num_computed_tokens for seq in seqs]
        handles = [self.cache.handle(seq.block_ids, seq.state_slot, P) for seq, P in zip(seqs, anchors)]
        contexts = [torch.cat([self.cache.read_mla(layer, h, P)[0] for h, P in zip(handles, anchors)])
                    for layer in self.layers]
        ids = torch.full((len(seqs), G), c.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor([seq.token_slice(P, P + 1)[0] for seq, P in zip(seqs, anchors)])
        positions = torch.cat([torch.arange(P, P + G) for P in anchors])
        owner = torch.arange(len(seqs)).repeat_interleave(G)  # the request of each block row
        key_owner = torch.cat([torch.full((P,), b) for b, P in enumerate(anchors)] + [owner])
        visible = owner.unsqueeze(1) == key_owner.unsqueeze(0)
        states = self.drafter.block_states(self.model.embed_tokens(ids.reshape(-1)), positions, contexts, visible)
        return self.model.lm_head(states).float()

    def _markov(self, seq, base: torch.Tensor) -> Proposal:
        """The drafts of one request from its block's logits [G, vocab], left to right through the Markov head:
        argmax for a greedy request, else a draw at its temperature from its own generator (q kept). The block stops
        before the draft at which the product of the drafter's probabilities of its drafts falls below
        `min_confidence` (its estimate that every draft so far survives): rows unlikely to be kept are not verified
        (the spec's confidence-scheduled length, with the Markov head's own probabilities as the confidence)."""
        params = seq.params
        tokens, probs = [], []
        survival = 1.0
        previous = seq.token_slice(seq.num_computed_tokens, seq.num_computed_tokens + 1)[0]  # the anchor
        for k in range(base.shape[0]):
            logits = base[k] + self.drafter.markov_bias(torch.tensor(previous))
            q = torch.softmax(logits / (params.temperature if not params.greedy else 1.0), dim=-1)
            if params.greedy:
                token = int(logits.argmax())
            else:
                gen = seq.sampling.generator or self.default_generator
                token = int(torch.multinomial(q.to(gen.device), 1, generator=gen))
            survival *= float(q[token])
            if survival < self.min_confidence:
                break
            if not params.greedy:
                probs.append(q)
            tokens.append(token)
            previous = token
        return Proposal(tokens, torch.stack(probs) if probs else None)
