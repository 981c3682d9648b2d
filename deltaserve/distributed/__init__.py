"""Running one model over several processes: the parallel layout (`ParallelConfig`) and how weights split over
its ranks (sharding.py); docs/parallel.md."""

from .sharding import ParallelConfig, component, local_shape, shard, split_dim

__all__ = ["ParallelConfig", "component", "local_shape", "shard", "split_dim"]
