"""StepTimer: where a step's wall time goes — model math versus the engine's own per-step Python work.

Phases (seconds, summed over steps since the timer was made or reset):
  schedule    the scheduler's plan (admission, chunking, preemption, prefix-cache lookups)
  vision      the vision tower encoding the step's new images (0 without images)
  prepare     building the StepBatch: ids, positions, page rows, DSA metadata
  model       the model forward and the logits of the sampled rows
  sample      penalties, sampling, logprobs
  update      token bookkeeping, stop checks, prefix-cache commit, freeing finished requests
  propose     speculative decoding's proposer: its own cache rows and the next drafts (0 without one)
  detokenize  the OutputProcessor (incremental detokenisation, stop strings), when an LLMEngine drives the core

`overhead_share` is everything but `model` and `vision` over the total: the share of a step outside model math.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("schedule", "vision", "prepare", "model", "sample", "update", "propose", "detokenize")


@dataclass
class StepTimer:
    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def overhead_share(self) -> float:
        total = self.total_s
        return (total - self.seconds["model"] - self.seconds["vision"]) / total if total > 0 else 0.0

    def reset(self) -> None:
        self.steps = 0
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def report(self) -> dict[str, float]:
        """Per-phase seconds, total, steps and the overhead share (JSON-ready)."""
        return {**{f"{k}_s": v for k, v in self.seconds.items()}, "total_s": self.total_s, "steps": self.steps,
                "overhead_share": self.overhead_share}
