"""Shared by the fused-block and decode-stack tests: a bf16 model on the native kernels, two caches with the same
random states and pages, a pure decode step over them, and an engine's greedy tokens with the fused paths on and
off."""

from __future__ import annotations

import torch

from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.paged_cache import PagedCache, SeqHandle
from deltaserve.cache.state_slots import StateSlots
from deltaserve.layers.batch import StepBatch
from deltaserve.layers.native_path import enable_native_kernels
from deltaserve.models.loader import load_model
from deltaserve.ops.opset import get_ops
from deltaserve.ops.qli import build_index_meta
from engine_utils import assert_pools_free, greedy, make_llm


def native_model(path):
    model = load_model(path, dtype="bfloat16")
    assert enable_native_kernels(model) > 0
    return model


def twin_caches(model, seed: int, pages_per_sequence: int = 1, sequences: int = 4) -> list[PagedCache]:
    """Two caches with the same random KDA states, latent pages and index keys (room for `sequences` sequences of
    16 tokens a page)."""
    g = torch.Generator().manual_seed(seed)
    caches = [PagedCache(PagePool(model.config, sequences * pages_per_sequence, 16, torch.bfloat16),
                         StateSlots(model.config, sequences + 1)) for _ in "ab"]
    pools = [(c.states.conv, c.states.recurrent, *(c.pages.latent_rows(l) for l in c.pages.latent),
              *(c.pages.key_rows(l)[0] for l in c.pages.index_keys)) for c in caches]
    for first, second in zip(*pools):
        init = (torch.randn(first.shape, generator=g) * 0.1).to(first.dtype)
        first.copy_(init)
        second.copy_(init)
    return caches


def decode_batch(cache: PagedCache, slots: list[int], position: int, config, pages_per_sequence: int = 1) -> StepBatch:
    """Sequence i (state slot slots[i]) owns pages i * pages_per_sequence onwards (16 rows each) and decodes its
    token at position + i (contexts differ); DSA models get the step's indexer metadata. The step runs the native op
    set: the fused blocks and the decode stack compute what the modules compute on the native kernels, bit for bit,
    so the modules must take those kernels too."""
    N, span = len(slots), 16 * pages_per_sequence
    positions = [position + i for i in range(N)]
    handles = [SeqHandle(s, torch.arange(span * i, span * i + p + 1)) for i, (s, p) in enumerate(zip(slots, positions))]
    write_rows = torch.tensor([span * i + p for i, p in enumerate(positions)])
    tables = [torch.arange(pages_per_sequence * i, pages_per_sequence * (i + 1)) for i in range(N)]
    meta = (build_index_meta(tables, [p + 1 for p in positions], torch.arange(N), torch.tensor(positions), 16,
                             config.index_topk) if config.has_dsa else None)
    return StepBatch(torch.tensor(positions), list(range(N + 1)), positions, cache, handles, ops=get_ops("native"),
                     index_meta=meta, write_rows=write_rows)


def fused_and_module_tokens(path, prompts: list[list[int]], stack: bool) -> tuple[list, list]:
    """8 greedy tokens of each prompt from a bf16 engine with the fused blocks on (the decode stack on when `stack`)
    and from one with every fused path off; both engines' pools are checked free afterwards."""
    runs = []
    for fuse in (True, False):
        llm = make_llm(path, dtype="bfloat16")
        llm.engine.model.fuse_stack = fuse and stack
        for layer in llm.engine.model.layers:
            layer.fuse_blocks = fuse
        outs = llm.generate(prompts, greedy(8), use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        assert_pools_free(llm.engine)
    return runs[0], runs[1]
