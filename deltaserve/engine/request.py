"""Request: the one object the scheduler, the caches and the runner all speak (nano-vllm's `Sequence`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """A sequence being generated. Invariant: 0 <= num_computed_tokens <= num_tokens; every computed token has a
    page row in `block_ids`; a RUNNING request holds exactly one state slot; drafts (`spec_token_ids`) only follow a
    request whose every token but the newest is computed."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    sampling: Any  # sampler.SamplingState: generator, penalty counts, min_tokens masking
    index: int = 0  # which of the n completions of its prompt
    client: str | None = None  # fairness key of the scheduler; None: the request's own id
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    finish_reason: str | None = None
    cache_salt: str | None = None  # requests with different salts never share cached pages
    block_hashes: list = field(default_factory=list)  # prefix-chain hash of each full page of known tokens
    num_registered_blocks: int = 0  # leading pages already registered in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    prefix_match: int = 0  # cached pages found at admission (interval-aligned): a branch point worth a checkpoint
    siblings_pending: int = 0  # n - 1 completions still to fork from this request once its prompt is computed
    num_preemptions: int = 0
    # Speculative decoding: tokens drafted to follow the newest one, verified by the next step that computes it
    # (docs/serving.md §9); empty when not decoding or when the proposer had none.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_token_probs: Any = None  # [drafts, vocab] the distribution each draft was drawn from; None: one-hot drafts
    # A drafter with its own cache (MTP): its rows computed so far (positions 0..num_drafter_tokens - 1), and the
    # target's state at one position it will need that no step of this request computes (a fork's parent's), as
    # (position, [d] tensor) or None.
    num_drafter_tokens: int = 0
    drafter_hidden: Any = None
    # Prefill/decode disaggregation, on a prefill instance: the tokens whose cache a decode instance pulls once this
    # request finishes (its prompt is the client's less the last token, which the decode instance computes); None
    # for a request of its own.
    remote_decode_tokens: int | None = None
    # Images in the prompt, in order: (first pad position, pad count, the processed image); each image's features
    # take its pad positions (docs/vision.md)
    images: list = field(default_factory=list)
    # With params.prompt_logprobs (first completion only): the report of each prompt token computed so far, None
    # for the first token; filled chunk by chunk and sent with the first output token.
    prompt_logprobs: list | None = None

    def __post_init__(self) -> None:
        if self.client is None:
            self.client = self.request_id
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None]

    @property
    def scores_prompt(self) -> bool:
        """Prompt logprobs are still owed: its prompt rows need logits, and the prefix cache must not skip them."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens the next step may compute for it: the known ones not yet computed, then its drafts."""
        return self.num_tokens - self.num_computed_tokens + len(self.spec_token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, without concatenating the whole sequence (hot path)."""
        P = len(self.prompt_ids)
        if end <= P:
            return self.prompt_ids[start:end]
        if start >= P:
            return self.output_ids[start - P:end - P]
        return self.prompt_ids[start:] + self.output_ids[:end - P]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
