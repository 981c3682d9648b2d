"""SpeculativeConfig: `--speculative-config` / `LLM(speculative_config=...)`, vLLM's JSON keys (docs/serving.md §9)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError
from ..json_flag import json_object

METHODS = ("suffix", "mtp", "dspark")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and how many a request may verify per step.

    `method`: "suffix" (model-free: the request's own prompt and output and recent responses), "mtp" (the
    checkpoint's MTP layers, layer j drafting the (j + 1)-th token, the last chained on its own output past them)
    or "dspark" (the DSpark drafter folder at `model`, by default the one shipped beside the target, its folder's
    `dspark/`; drafts at most its block size per step). `num_speculative_tokens`: the most drafts one request
    verifies in a step (the suffix proposer drafts fewer when its match is short). The
    `suffix_decoding_*` knobs are vLLM's names for the suffix proposer (max_tree_depth: the longest suffix matched;
    max_cached_requests: past responses kept for matching; max_spec_factor: drafts per matched token;
    min_token_prob: a draft stops at a token whose estimated probability is lower). `dspark_min_confidence`: a DSpark
    block stops before the draft at which the product of the drafter's probabilities of its drafts so far (its
    estimate that all of them survive verification) falls below it; 0 verifies the whole block.
    `dspark_max_skip`: a request whose block was cut to no drafts skips the drafter for the next 1, 2, 4, ... steps
    (doubling while its blocks stay empty, at most this many; reset by a block with drafts), so text the drafter
    cannot predict does not pay for its pass every step; 0 drafts every step."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    dspark_min_confidence: float = 0.15
    dspark_max_skip: int = 8

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config.method must be one of {list(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            raise ConfigError(f"speculative_config.num_speculative_tokens must be an integer in [1, 64], got "
                              f"{self.num_speculative_tokens!r}")
        if self.method != "dspark" and self.model is not None:
            raise ConfigError(f"speculative_config.model: method {self.method!r} takes no drafter checkpoint")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ConfigError("speculative_config: suffix_decoding_max_tree_depth must be >= 1 and "
                              "suffix_decoding_max_cached_requests >= 0")
        if not 0 <= self.dspark_min_confidence <= 1:
            raise ConfigError("speculative_config: dspark_min_confidence must be in [0, 1]")
        if not isinstance(self.dspark_max_skip, int) or self.dspark_max_skip < 0:
            raise ConfigError(f"speculative_config: dspark_max_skip must be an integer >= 0, got "
                              f"{self.dspark_max_skip!r}")
        if self.suffix_decoding_max_spec_factor <= 0 or not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ConfigError("speculative_config: suffix_decoding_max_spec_factor must be > 0 and "
                              "suffix_decoding_min_token_prob in [0, 1]")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A config from JSON text or a dict (None stays None); unknown keys and bad values raise ConfigError."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ConfigError(f"speculative_config needs {key!r}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
