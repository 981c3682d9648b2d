"""Bounds on the work one request may ask for, and the server-wide count of sequences queued or in flight.

A request's cost is counted in sequences: every prompt of a completions list times `n` (a chat is one prompt).
Per-request limits (`RequestLimits`) reject a request that asks too much with a 400 naming the field; the
`SequenceQueue` admits a request only while the sequences of all admitted, unfinished requests plus its own stay
within `max_queue_len`, else the caller answers 503 with Retry-After. Both are owned by one `ServerState`; nothing
here is global.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.sampling_params import InvalidRequestError
from ..errors import DeltaserveError


class QueueFullError(DeltaserveError):
    """The server has no room for a request's sequences now; retrying later can succeed."""


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds (`--max-n`, `--max-prompts-per-request`, `--max-tokens-per-request`,
    `--max-prompt-logprobs-tokens`, `--max-images-per-request`)."""

    max_n: int = 16
    max_prompts_per_request: int = 64
    max_tokens_per_request: int = 1 << 20
    # prompt tokens one request may ask logprobs for: each keeps a report (with its alternatives) until the answer
    max_prompt_logprobs_tokens: int = 1 << 17
    max_images_per_request: int = 8

    def check_prompt_logprobs(self, prompt_lengths: list[int], param: str) -> None:
        """Raise InvalidRequestError when the prompts whose logprobs are asked for hold too many tokens."""
        total = sum(prompt_lengths)
        if total > self.max_prompt_logprobs_tokens:
            raise InvalidRequestError(param, f"prompt logprobs were asked for {total} prompt tokens, above this "
                                             f"server's limit of {self.max_prompt_logprobs_tokens} "
                                             f"(--max-prompt-logprobs-tokens)")

    def check_shape(self, n: int, num_prompts: int, prompt_param: str) -> None:
        """Raise InvalidRequestError when `n` or the number of prompts is above its limit."""
        if n > self.max_n:
            raise InvalidRequestError("n", f"n={n} is above this server's limit of {self.max_n} (--max-n)")
        if num_prompts > self.max_prompts_per_request:
            raise InvalidRequestError(prompt_param, f"the request has {num_prompts} prompts, above this server's "
                                                    f"limit of {self.max_prompts_per_request} "
                                                    "(--max-prompts-per-request)")

    def check_tokens(self, prompt_lengths: list[int], n: int, max_tokens: int | None, max_model_len: int,
                     param: str) -> None:
        """Raise InvalidRequestError when the request's token budget is above `max_tokens_per_request`.

        The budget sums, over every sequence (each prompt times `n`), the prompt's tokens plus the tokens it may
        generate: `max_tokens`, or the rest of the context when `max_tokens` is None (as the engine resolves it).
        """
        total = 0
        for length in prompt_lengths:
            room = max_model_len - length
            total += n * (length + (room if max_tokens is None else min(max_tokens, room)))
        if total > self.max_tokens_per_request:
            hint = "" if max_tokens is not None else f" (without {param}, each sequence may fill the context)"
            raise InvalidRequestError(param, f"the request may use {total} tokens (prompt plus {param}, over all "
                                             f"its sequences), above this server's limit of "
                                             f"{self.max_tokens_per_request} (--max-tokens-per-request){hint}")


@dataclass
class SequenceLease:
    """Sequences held in a `SequenceQueue` until `release()` (idempotent)."""

    queue: SequenceQueue
    sequences: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.queue.in_flight -= self.sequences


@dataclass
class SequenceQueue:
    """Counts the sequences of admitted, unfinished requests against `max_len` (`--max-queue-len`).

    `take` checks and reserves in one synchronous step, so concurrent requests on the event loop cannot both pass a
    check that only one of them fits.
    """

    max_len: int
    in_flight: int = field(default=0)

    def take(self, sequences: int, param: str) -> SequenceLease:
        """Reserve `sequences`; raises InvalidRequestError when they can never fit, QueueFullError when not now."""
        if sequences > self.max_len:
            raise InvalidRequestError(param, f"the request needs {sequences} sequences, more than this server "
                                             f"queues at once ({self.max_len}, --max-queue-len)")
        if self.in_flight + sequences > self.max_len:
            raise QueueFullError(f"the server is at its queue limit of {self.max_len} sequences "
                                 f"({self.in_flight} queued or running, this request needs {sequences})")
        self.in_flight += sequences
        return SequenceLease(self, sequences)

