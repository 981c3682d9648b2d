"""Batched next-token sampling over fp32 logits [B, V] with per-row SamplingParams.

Order of operations for every step (vLLM's):
  0. structured outputs: rows with a grammar matcher get -inf on every token it does not allow (engine/grammar.py).
  1. min_tokens: while a row has fewer than `min_tokens` outputs, its eos and stop_token_ids get -inf.
  2. penalties on the (masked) logits:
       repetition (prompt + output tokens): positive logits / r, negative logits * r;
       frequency/presence (output tokens only): logit -= freq * count + presence * (count > 0).
  3. logprobs (rows that asked): log_softmax of the logits after step 2 ("penalized" mode, the
     default) or of the logits as passed in ("raw" mode, vLLM V1's default raw_logprobs). Neither
     mode sees temperature/top-k/top-p/min_p, so a token's logprob does not depend on them.
  4. greedy rows (temperature 0 or top_k 1): argmax, ties going to the lowest token id.
  5. random rows: temperature, top-k, top-p, min-p, then an exponential race
     argmax(p / q), q ~ Exp(1) drawn from the row's generator, which samples exactly from p.

Determinism contract: a row with a seed draws only from its own `torch.Generator`, one vector of
V exponentials per random step, so its token stream depends only on its seed and its logits; never
on which other rows share the batch. Unseeded rows draw from the Sampler's shared generator.
"""

from __future__ import annotations

from typing import Iterable, Literal, NamedTuple

import torch
from torch import Tensor

from ..ops.native import argmax_rows
from .grammar import Grammars
from .sampling_params import SamplingParams

LogprobsMode = Literal["penalized", "raw"]


class TokenLogprobs(NamedTuple):
    """Logprob report for one sampled token.

    `rank` is 1 + the number of tokens with a strictly larger logprob (1 = the most likely).
    `top` holds the request's top-N (token_id, logprob) pairs, sorted by logprob descending;
    empty when the request asked for logprobs=0.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


class SampleOutput(NamedTuple):
    """One step's result: a token per row, and per row a TokenLogprobs or None (not requested)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class SamplingState:
    """What the sampler needs to know about one request across steps.

    `output_token_ids` is held by reference: pass the engine's own list (or call `append`) so the
    penalties and min_tokens see every generated token. The sampler itself never mutates state
    other than advancing `generator`.
    `generator` is created once, from `params.seed`, and reused every step; None when unseeded.
    `grammar` is the completion's llguidance matcher when it has structured outputs (the core advances it with each
    appended token), else None.
    `stop_ids_for_min_tokens` = eos ids + stop_token_ids. As in vLLM, eos is included even with
    ignore_eos, because min_tokens is about *blocking* those tokens, not about stopping.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Iterable[int] = (),
        output_token_ids: list[int] | None = None,
        eos_token_id: int | Iterable[int] | None = None,
        generator_device: str | torch.device = "cpu",
    ) -> None:
        self.params = params
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = output_token_ids if output_token_ids is not None else []
        eos: set[int] = set()
        if isinstance(eos_token_id, int):
            eos.add(eos_token_id)
        elif eos_token_id is not None:
            eos.update(eos_token_id)
        self.stop_ids_for_min_tokens: set[int] = eos | set(params.stop_token_ids)
        self.generator: torch.Generator | None = None
        self.grammar = None
        if params.seed is not None:
            self.generator = torch.Generator(device=generator_device).manual_seed(params.seed)

    @property
    def edits_logits(self) -> bool:
        """min_tokens still masks stop ids, or a penalty applies: the row's logits depend on the tokens so far."""
        p = self.params
        return (len(self.output_token_ids) < p.min_tokens or p.repetition_penalty != 1.0
                or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)

    @property
    def reads_history(self) -> bool:
        """Sampling the next row reads the tokens so far (a grammar, min_tokens, a penalty)."""
        return self.grammar is not None or self.edits_logits

    def append(self, token_id: int) -> None:
        """Record a generated token (for penalties and min_tokens)."""
        self.output_token_ids.append(token_id)


class Sampler:
    """Stateless apart from the shared generator that unseeded rows draw from.

    `seed` seeds that shared generator (None: seeded from OS entropy), which makes unseeded rows
    reproducible for a fixed batch composition only. `grammars` computes the masks of rows with a grammar.
    """

    def __init__(self, seed: int | None = None, logprobs_mode: LogprobsMode = "penalized",
                 grammars: Grammars | None = None) -> None:
        if logprobs_mode not in ("penalized", "raw"):
            raise ValueError(f"logprobs_mode must be 'penalized' or 'raw', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.grammars = grammars
        self._seed = seed
        self._default_generators: dict[torch.device, torch.Generator] = {}

    def default_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The generator rows without a seed draw from."""
        return self._default_generator(torch.device(device))

    def _default_generator(self, device: torch.device) -> torch.Generator:
        gen = self._default_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._default_generators[device] = gen
        return gen

    @torch.no_grad()
    def sample(self, logits: Tensor, states: list[SamplingState]) -> SampleOutput:
        """Pick one token per row of `logits` [B, V] (any float dtype; computed in fp32).

        `states[i]` describes row i. The input tensor is not modified.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [B, V] with B == len(states) ({len(states)}), "
                             f"got {tuple(logits.shape)}")
        batch, vocab = logits.shape
        raw = logits.float()
        work = self._masked(raw, states)

        want_lp = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        lp_rows: Tensor | None = None
        if want_lp:
            src = work if self.logprobs_mode == "penalized" else raw
            lp_rows = torch.log_softmax(src[want_lp], dim=-1)

        greedy = [i for i, s in enumerate(states) if s.params.greedy]
        rand = [i for i, s in enumerate(states) if not s.params.greedy]
        # argmax_rows (torch.argmax's native twin) returns the first maximal index, i.e. ties go to the lowest id
        tokens = argmax_rows(work) if len(greedy) == batch else torch.empty(batch, dtype=torch.long,
                                                                             device=work.device)
        if greedy and rand:
            tokens[greedy] = argmax_rows(work[greedy])
        if rand:
            probs = _filtered_probs(work[rand], [states[i].params for i in rand])
            tokens[rand] = self._race(probs, [states[i] for i in rand])

        token_list = tokens.tolist()
        reports: list[TokenLogprobs | None] = [None] * batch
        if lp_rows is not None:
            for j, i in enumerate(want_lp):
                reports[i] = _report(lp_rows[j], token_list[i], states[i].params.logprobs or 0)
        return SampleOutput(token_list, reports)

    def _masked(self, raw: Tensor, states: list[SamplingState]) -> Tensor:
        """Steps 0-2: the fp32 logits after grammar masks, min_tokens and penalties (a copy when any applies)."""
        constrained = [i for i, st in enumerate(states) if st.grammar is not None]
        edits = any(st.edits_logits for st in states)
        work = raw.clone() if edits or constrained else raw  # never write into the caller's tensor
        if constrained:
            if self.grammars is None:
                raise ValueError("a row has a grammar but the sampler was built without Grammars")
            allowed = self.grammars.allowed([states[i].grammar for i in constrained]).to(work.device)
            work[constrained] = work[constrained].masked_fill(~allowed, float("-inf"))
        if edits:
            _mask_min_tokens(work, states)
            _apply_penalties(work, states)
        return work

    @torch.no_grad()
    def verify_draft(self, logits: Tensor, state: SamplingState, draft: int,
                     draft_probs: Tensor) -> tuple[int, TokenLogprobs | None]:
        """Speculative verification of one draft that came with its probabilities `draft_probs` [V] (a random row;
        docs/serving.md §9.2): keep `draft` with probability min(1, p(draft) / q(draft)), p the distribution this
        row samples from (`logits` [1, V] through every step of `sample`), else draw from norm(max(p - q, 0)).
        Either way the token is distributed as p. Returns (token, its logprob report or None)."""
        work = self._masked(logits.float(), [state])
        probs = _filtered_probs(work, [state.params])[0]
        q = draft_probs.to(probs.device, torch.float32)
        gen = state.generator or self._default_generator(probs.device)
        u = torch.rand((), generator=gen, device=gen.device).item()
        if u * q[draft].item() < probs[draft].item():
            token = draft
        else:
            residual = (probs - q).clamp(min=0)
            if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is a draw from the residual
                residual = probs
            token = int(self._race((residual / residual.sum()).unsqueeze(0), [state])[0])
        report = None
        if state.params.logprobs is not None:
            src = work if self.logprobs_mode == "penalized" else logits.float()
            report = _report(torch.log_softmax(src[0], dim=-1), token, state.params.logprobs or 0)
        return token, report

    def _race(self, probs: Tensor, states: list[SamplingState]) -> Tensor:
        """Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p.

        Each row's q comes from its own generator (or the shared one), so a seeded row's draw is
        independent of its batch neighbours. q is drawn on the generator's device and moved, which
        also makes seeded CPU-generated streams match across logits devices.
        """
        n, vocab = probs.shape
        q = torch.empty_like(probs)
        for j, state in enumerate(states):
            gen = state.generator or self._default_generator(probs.device)
            q[j] = torch.empty(vocab, device=gen.device).exponential_(generator=gen).to(probs.device)
        # exponential_ may return exactly 0; p / 0 would be inf (or NaN for p == 0), so floor q.
        q.clamp_(min=torch.finfo(torch.float32).tiny)
        return (probs / q).argmax(dim=-1)


def _mask_min_tokens(logits: Tensor, states: list[SamplingState]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for i, s in enumerate(states):
        if len(s.output_token_ids) < s.params.min_tokens:
            ids = [t for t in s.stop_ids_for_min_tokens if t < vocab]
            rows.extend([i] * len(ids))
            cols.extend(ids)
    if rows:
        logits[rows, cols] = float("-inf")


def _token_matrix(token_lists: list[list[int]], vocab: int, device: torch.device) -> Tensor:
    """[len(token_lists), vocab] counts of each token id, built with one scatter_add."""
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    # Ids outside the logits' vocab (e.g. a prompt's special tokens past a trimmed lm_head) are
    # skipped rather than raising: they cannot be penalised because they cannot be sampled.
    pairs = [(i, t) for i, toks in enumerate(token_lists) for t in toks if 0 <= t < vocab]
    if pairs:
        idx = torch.tensor(pairs, dtype=torch.long, device=device)
        counts.index_put_((idx[:, 0], idx[:, 1]), torch.ones(len(pairs), device=device), accumulate=True)
    return counts


def _apply_penalties(logits: Tensor, states: list[SamplingState]) -> None:
    """Repetition, then frequency/presence penalties, in place, on rows that set them."""
    vocab, device = logits.shape[1], logits.device
    rep = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if rep:
        seen = _token_matrix([states[i].prompt_token_ids + states[i].output_token_ids for i in rep],
                             vocab, device) > 0
        r = torch.tensor([states[i].params.repetition_penalty for i in rep], device=device).unsqueeze(1)
        sub = logits[rep]
        penalised = torch.where(sub > 0, sub / r, sub * r)
        logits[rep] = torch.where(seen, penalised, sub)
    fp = [i for i, s in enumerate(states)
          if s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0]
    if fp:
        counts = _token_matrix([states[i].output_token_ids for i in fp], vocab, device)
        freq = torch.tensor([states[i].params.frequency_penalty for i in fp], device=device).unsqueeze(1)
        pres = torch.tensor([states[i].params.presence_penalty for i in fp], device=device).unsqueeze(1)
        logits[fp] = logits[fp] - freq * counts - pres * (counts > 0).float()


def _filtered_probs(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """Temperature, top-k, top-p and min-p for the random rows; returns probabilities [n, V]."""
    n, vocab = logits.shape
    device = logits.device
    temp = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    # Subtracting the row max first keeps a tiny temperature from overflowing to +inf (NaN softmax).
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temp

    if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        keep = torch.ones_like(sorted_logits, dtype=torch.bool)
        ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        # Top-k: keep sorted positions < k. Equal logits straddling the cut are split by sort order.
        keep &= torch.arange(vocab, device=device).unsqueeze(0) < ks.unsqueeze(1)
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        # Top-p over the top-k survivors: keep a token while the mass strictly before it is
        # < top_p, i.e. the smallest prefix reaching top_p; position 0 always survives (top_p > 0).
        sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep &= (mass_before < top_p) | (top_p >= 1.0)
        keep[:, 0] = True
        mask = torch.zeros_like(keep).scatter_(1, order, keep)
        scaled = scaled.masked_fill(~mask, float("-inf"))

    probs = torch.softmax(scaled, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
    if bool((min_p > 0).any()):
        # The max-probability token always satisfies p >= min_p * p_max (min_p <= 1), so one survives.
        drop = probs < min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def score_tokens(logits: Tensor, targets: list[int], num_top: int) -> list[TokenLogprobs]:
    """Each row's report for a given token (prompt logprobs): from the log_softmax of the raw logits [R, V], what
    `_report` gives a sampled token (logprob, rank, the top `num_top` alternatives)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [_report(row, token, num_top) for row, token in zip(lp, targets)]


def _report(row_logprobs: Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    sampled = row_logprobs[token_id]
    rank = int((row_logprobs > sampled).sum().item()) + 1
    top: list[tuple[int, float]] = []
    if num_top > 0:
        values, ids = row_logprobs.topk(min(num_top, row_logprobs.shape[0]))
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token_id, float(sampled.item()), rank, top)
