"""Generation results in vLLM's shape: RequestOutput with one CompletionOutput per sample (n)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[Any] | None  # per token: TokenLogprobs (sampled token + top-N alternatives), when asked for
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""  # text new since the previous output of this completion (for streaming)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed this request (its completions end with "error")
    # With SamplingParams.prompt_logprobs: per prompt token a TokenLogprobs (None for the first), once known
    prompt_logprobs: list[Any] | None = None
    # On a prefill instance (kv_transfer_params do_remote_decode), once finished: what the decode instance's request
    # carries to pull this request's cache (docs/disaggregation.md)
    kv_transfer_params: dict | None = None
