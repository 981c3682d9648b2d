"""Running one model over several processes: the parallel layout (`ParallelConfig`), how weights split over its
ranks (sharding.py) and a process's place among them (`Shard`); docs/parallel.md."""

from .shard import CommClock, Shard
from .sharding import ParallelConfig, component, local_shape, shard, split_dim

__all__ = ["CommClock", "ParallelConfig", "Shard", "component", "local_shape", "shard", "split_dim"]
