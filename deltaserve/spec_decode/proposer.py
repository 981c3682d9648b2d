"""The proposer interface: what every drafting method implements (docs/serving.md §9)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple, Protocol

import torch


class TokenSource(Protocol):
    """What a proposer reads of a request (the engine's `Request` is one): its known tokens, prompt then output."""

    @property
    def num_tokens(self) -> int: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


class DraftRequest(NamedTuple):
    """A request to draft for: the request (read through TokenSource) and the most drafts it may take."""

    seq: Any
    room: int


class Proposal(NamedTuple):
    """A request's drafts, and the distribution [len(tokens), vocab] each was drawn from (None: one-hot, as for
    drafts taken by argmax or without a model): verification keeps a draft with probability min(1, p / q)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class TargetStep(NamedTuple):
    """What the target computed in the step just settled, for proposers that read its states (`reads_hidden`):
    every row's pre-norm final state [N, d], and per scheduled chunk (request, its first position, its row count,
    its first row), in row order. A chunk's request has already had its tokens appended and its accepted drafts
    counted."""

    hidden: torch.Tensor | None
    chunks: list[tuple[Any, int, int, int]]


class Proposer(ABC):
    """Drafts for running requests, once per step after its tokens are settled: first `catch_up` (a proposer with its
    own cache rows brings them up to every scheduled request's newest token; the engine then copies the pages of
    requests forked this step), then `propose`. Contract: `propose` returns, per DraftRequest, a Proposal of at most
    `room` token ids to follow the newest of the request's tokens; a proposer may keep per-request state keyed by
    the request object (held weakly) or in the request's pages; `finish` is told a finished request's output and
    frees what the proposer keeps for it. `reads_hidden`: the engine keeps the target's states for `catch_up`."""

    reads_hidden = False

    def catch_up(self, step: TargetStep) -> None:
        """Bring the proposer's own rows up to date with the step just settled (nothing for a model-free one)."""

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]: ...

    @abstractmethod
    def finish(self, seq: TokenSource, output: list[int]) -> None: ...
