"""Suffix decoding (arXiv 2411.04975; docs/serving.md §9.7), model-free: a request's next tokens are guessed from
what followed earlier occurrences of its latest tokens, in its own prompt and output and in recent responses.

Instead of the paper's suffix trees this keeps, per token sequence, the end positions of each token pair (a bigram
index): the occurrences of the request's last two tokens are the candidate matches, each extended backwards to its
match length (at most `max_tree_depth`). The candidates of the longest match are the node of the paper's tree: the
draft follows them token by token, taking the continuation most of them share, with probability estimate = its share
(the tree's child count over the node count), and stops when that falls under `min_token_prob`, when the candidates
run out, or at `max_spec_factor` x the match length. Drafts carry no probabilities: verification treats them as
one-hot (docs/serving.md §9.2). Between the request's own sequence and the response cache, the draft with the larger
expected accepted length (the sum over its tokens of the product of their estimates so far) wins.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import NamedTuple
from weakref import WeakKeyDictionary

from .proposer import DraftRequest, Proposal, Proposer, TokenSource

MAX_CANDIDATES = 64  # most recent occurrences examined per source and step: bounds the work per request
GLOBAL_OCCURRENCES = 256  # occurrences kept per token pair over all cached responses


class Draft(NamedTuple):
    tokens: list[int]
    score: float  # expected accepted tokens under the probability estimates


class TokenIndex:
    """A growing token sequence and, for every adjacent pair, the positions where it ends (ascending)."""

    def __init__(self, tokens: list[int] | None = None):
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, int], list[int]] = {}
        if tokens:
            self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            n = len(self.tokens)
            if n >= 2:
                self.ends.setdefault((self.tokens[-2], t), []).append(n - 1)


def match_length(tokens: list[int], end: int, suffix: list[int], limit: int) -> int:
    """How many of the last tokens of `suffix` equal the tokens of `tokens` ending at index `end` (at most `limit`)."""
    n = 0
    while n < limit and n <= end and n < len(suffix) and tokens[end - n] == suffix[-1 - n]:
        n += 1
    return n


def follow(candidates: list[tuple[list[int], int]], match: int, max_tokens: int, max_spec_factor: float,
           min_token_prob: float) -> Draft:
    """The greedy draft from candidates (token list, index of the matched suffix's last token) that all matched
    `match` tokens."""
    limit = min(max_tokens, max(1, int(max_spec_factor * match)))
    tokens: list[int] = []
    score, prob = 0.0, 1.0
    alive = candidates
    while len(tokens) < limit:
        counts: dict[int, int] = {}
        step = len(tokens) + 1
        for seq, end in alive:
            if end + step < len(seq):
                t = seq[end + step]
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        token, count = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))
        share = count / len(alive)
        if share < min_token_prob:
            break
        prob *= share
        score += prob
        tokens.append(token)
        alive = [(seq, end) for seq, end in alive if end + step < len(seq) and seq[end + step] == token]
    return Draft(tokens, score)


def best_match(occurrences, suffix: list[int], depth: int) -> tuple[int, list[tuple[list[int], int]]]:
    """(longest match length, the candidates reaching it) over (tokens, end index) occurrences of the suffix's last
    pair."""
    best, chosen = 0, []
    for seq, end in occurrences:
        n = match_length(seq, end, suffix, depth)
        if n > best:
            best, chosen = n, [(seq, end)]
        elif n == best:
            chosen.append((seq, end))
    return best, chosen


class SuffixProposer(Proposer):
    """Drafts for each request from its own tokens and from the outputs of up to `max_cached_requests` finished
    requests (docs/serving.md §9.7)."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 1000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1):
        self.depth, self.max_cached = max_tree_depth, max_cached_requests
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self._own: WeakKeyDictionary = WeakKeyDictionary()  # request -> TokenIndex of its tokens so far
        self._responses: OrderedDict[int, list[int]] = OrderedDict()  # response id -> tokens, oldest first
        self._pairs: dict[tuple[int, int], deque[tuple[int, int]]] = {}  # pair -> (response id, end index)
        self._next_id = 0

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal(self.draft(seq, room)) for seq, room in requests]

    def draft(self, seq: TokenSource, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens to follow `seq`'s tokens (its index catches up with them first)."""
        index = self._own.get(seq)
        if index is None:
            index = self._own[seq] = TokenIndex()
        index.extend(seq.token_slice(len(index.tokens), seq.num_tokens))
        tokens = index.tokens
        if max_tokens < 1 or len(tokens) < 2:
            return []
        suffix = tokens[-self.depth:]
        pair = (tokens[-2], tokens[-1])
        own_ends = [e for e in index.ends.get(pair, ())[-MAX_CANDIDATES - 1:] if e < len(tokens) - 1]
        drafts = [self._draft([(tokens, e) for e in own_ends], suffix, max_tokens)]
        shared = [(self._responses[r], e) for r, e in reversed(self._pairs.get(pair, ())) if r in self._responses]
        drafts.append(self._draft(shared[:MAX_CANDIDATES], suffix, max_tokens))
        return max(drafts, key=lambda d: d.score).tokens

    def _draft(self, occurrences: list[tuple[list[int], int]], suffix: list[int], max_tokens: int) -> Draft:
        if not occurrences:
            return Draft([], 0.0)
        match, candidates = best_match(occurrences, suffix, self.depth)
        return follow(candidates, match, max_tokens, self.max_spec_factor, self.min_token_prob)

    def finish(self, seq: TokenSource, output: list[int]) -> None:
        """Forget the request's index; keep its output (if any) for later requests' matches."""
        self._own.pop(seq, None)
        if self.max_cached == 0 or len(output) < 2:
            return
        rid, self._next_id = self._next_id, self._next_id + 1
        self._responses[rid] = list(output)
        for end in range(1, len(output)):
            pair = (output[end - 1], output[end])
            occ = self._pairs.get(pair)
            if occ is None:
                occ = self._pairs[pair] = deque(maxlen=GLOBAL_OCCURRENCES)
            occ.append((rid, end))
        while len(self._responses) > self.max_cached:
            old, tokens = self._responses.popitem(last=False)
            for pair in set(zip(tokens, tokens[1:])):
                occ = self._pairs.get(pair)
                if occ is None:
                    continue
                kept = [x for x in occ if x[0] != old]
                if kept:
                    self._pairs[pair] = deque(kept, maxlen=GLOBAL_OCCURRENCES)
                else:
                    del self._pairs[pair]

    @property
    def num_cached_responses(self) -> int:
        return len(self._responses)
