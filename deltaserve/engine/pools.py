"""The engine's cache pools, sized once from the memory budget (docs/serving.md §3): how many of each (`size_pools`,
rank 0's decision, which tensor-parallel workers receive) and the pools themselves (`build_pools`, every rank)."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from ..cache.page_pool import PagePool
from ..cache.state_slots import StateSlots
from ..distributed import Shard
from ..errors import ConfigError
from .config import EngineArgs

log = logging.getLogger(__name__)


class PoolSizes(NamedTuple):
    num_blocks: int
    num_slots: int
    num_checkpoints: int  # 0: no prefix caching
    num_drafts: int  # draft states (num_slots x num_speculative_tokens); 0: no speculative decoding


def size_pools(config, args: EngineArgs, dtype: torch.dtype, drafter_layers: tuple[int, ...],
               shard: Shard = Shard()) -> PoolSizes:
    """Split the budget: KDA working slots for max_num_seqs first (with speculative decoding each with its
    num_speculative_tokens draft states), then (with prefix caching) the state checkpoints, then pages with the
    rest. On a rank of a tensor-parallel group a slot holds the rank's heads, so the budget is each rank's."""
    budget = args.kv_cache_memory_bytes
    slot_bytes = StateSlots.bytes_per_slot(config, shard)
    latent_8bit, keys_8bit = args.latent_cache_8bit(), args.index_cache_8bit() if config.has_dsa else None
    block_bytes = PagePool.bytes_per_token(config, dtype, latent_8bit, keys_8bit, drafter_layers) * args.block_size
    k = args.speculative.num_speculative_tokens if args.speculative is not None and slot_bytes else 0
    seq_bytes = slot_bytes * (1 + k)
    num_slots = args.max_num_seqs if slot_bytes == 0 else min(args.max_num_seqs, budget // seq_bytes)
    num_ckpt = 0
    if args.enable_prefix_caching:
        room = (budget - num_slots * seq_bytes) // slot_bytes if slot_bytes else 4 * args.max_num_seqs
        if args.max_state_checkpoints is not None and args.max_state_checkpoints > room:
            raise ConfigError(f"max_state_checkpoints {args.max_state_checkpoints} does not fit kv_cache_memory "
                              f"after {num_slots} working slots (room for {room})")
        default = min(4 * args.max_num_seqs, max(1, int(0.2 * budget) // max(slot_bytes, 1)), room)
        num_ckpt = args.max_state_checkpoints or default
        if num_ckpt == 0:
            log.warning("prefix caching is off: kv_cache_memory leaves no room for a KDA state checkpoint")
    num_blocks = (budget - num_slots * seq_bytes - num_ckpt * slot_bytes) // max(block_bytes, 1)
    if num_slots < 1 or num_blocks < 1:
        raise ConfigError(f"kv_cache_memory of {budget} bytes is too small: one sequence's KDA state slots need "
                          f"{seq_bytes} bytes ({num_ckpt} prefix-cache checkpoints need {slot_bytes} each) and one "
                          f"page of {args.block_size} tokens needs {block_bytes} bytes")
    log.info("cache memory: %d KDA working slots (+%d draft states each) + %d state checkpoints (%d B each), %d "
             "pages of %d tokens = %d tokens (%d B per token)", num_slots, k, num_ckpt, slot_bytes, num_blocks,
             args.block_size, num_blocks * args.block_size, block_bytes // args.block_size)
    return PoolSizes(num_blocks, num_slots, num_ckpt, num_slots * k)


def pool_bytes(*pools) -> int:
    """Bytes the given pools (PagePool, StateSlots; None skipped) hold."""
    tensors = [t for p in pools if p is not None
               for t in (p.storage() if isinstance(p, PagePool) else (p.conv, p.recurrent))]
    return sum(t.numel() * t.element_size() for t in tensors)


def build_pools(config, args: EngineArgs, dtype: torch.dtype, sizes: PoolSizes, drafter_layers: tuple[int, ...],
                shard: Shard = Shard()) -> tuple[PagePool, StateSlots, StateSlots | None, StateSlots | None]:
    """(pages, working slots, checkpoints or None, draft states or None); the state pools numbered 0, 1, 2 for the
    journal (cache/state_slots.py)."""
    latent_8bit, keys_8bit = args.latent_cache_8bit(), args.index_cache_8bit() if config.has_dsa else None
    checkpoints = StateSlots(config, sizes.num_checkpoints, shard=shard, pool_id=1) if sizes.num_checkpoints else None
    drafts = StateSlots(config, sizes.num_drafts, shard=shard, pool_id=2) if sizes.num_drafts else None
    return (PagePool(config, sizes.num_blocks, args.block_size, dtype, latent_8bit=latent_8bit, keys_8bit=keys_8bit,
                     drafter_layers=drafter_layers), StateSlots(config, sizes.num_slots, shard=shard), checkpoints,
            drafts)


def drafter_cache_layers(config, spec, drafter=None) -> tuple[int, ...]:
    """Latent-cache layers a drafter adds to the page pool, numbered from the target's num_layers: one per MTP
    layer, or one per layer of the DSpark `drafter`."""
    if spec is None or spec.method == "suffix":
        return ()
    count = config.num_nextn_predict_layers if spec.method == "mtp" else drafter.config.num_hidden_layers
    return tuple(range(config.num_layers, config.num_layers + count))
