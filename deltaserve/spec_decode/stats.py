"""Counters of speculative decoding, reported in the engine's stats and as `spec_decode_*` metrics (vLLM's names)."""

from __future__ import annotations


class SpecDecodeStats:
    """Cumulative: verify steps of a request that carried drafts (`num_drafts`), drafted and accepted tokens, and
    accepted tokens per draft position (position j counts the verify steps that kept at least j + 1 drafts)."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step emits on average: its accepted drafts plus the one the sampler adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}
