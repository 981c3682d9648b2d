"""A process's place in a tensor-parallel group: what a layer reads to build its part of the model and to combine
the ranks' partial results (docs/parallel.md §3). One process is `Shard()`: every part is the whole and every
collective returns its input, so the single-process path runs no extra code."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .sharding import ParallelConfig


@dataclass
class CommClock:
    """Wall time this rank spent in collectives, and how many: tensor parallelism's communication time."""

    seconds: float = 0.0
    calls: int = 0

    def add(self, started: float) -> None:
        self.seconds += time.perf_counter() - started
        self.calls += 1


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` in torch.distributed group `group` (None: the default group); with `expert_parallel`
    the routed experts are placed whole, a contiguous range a rank, instead of split in width. `clock` (when set)
    adds up the time of every collective."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    group: Any = None
    clock: CommClock | None = field(default=None, compare=False)

    @property
    def layout(self) -> ParallelConfig:
        return ParallelConfig(self.size, self.expert_parallel)

    def part(self, n: int) -> int:
        """This rank's share of n heads, columns or experts (the layout was checked to divide: sharding.py)."""
        return n // self.size

    def span(self, n: int) -> range:
        """The indices of this rank's contiguous part of n."""
        k = n // self.size
        return range(self.rank * k, (self.rank + 1) * k)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of each one's partial x, summed in fp32 and returned in x's dtype."""
        if self.size == 1:
            return x
        total = x.float().contiguous()
        started = time.perf_counter()
        dist.all_reduce(total, group=self.group)
        if self.clock is not None:
            self.clock.add(started)
        return total.to(x.dtype)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x, concatenated along `dim` in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        started = time.perf_counter()
        dist.all_gather(parts, x, group=self.group)
        if self.clock is not None:
            self.clock.add(started)
        return torch.cat(parts, dim)
