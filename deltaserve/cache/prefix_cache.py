"""Hybrid prefix caching (docs/serving.md §4): shared pages plus KDA state checkpoints.

Full pages are named by a hash chained over the previous page's hash and the page's token ids, rooted in the
model and the request's `cache_salt`. A KDA checkpoint is an immutable copy of every KDA layer's state after the
first c tokens (c a multiple of the checkpoint interval), keyed by the hash of the page ending at c. A hit is the
longest prefix for which both the pages and a checkpoint exist; on a hit the pages are shared by reference and the
checkpoint is copied into the request's working slot. Checkpoints are capped and evicted LRU, before pages (pages
are only evicted when a fresh one is needed); a page whose checkpoint is gone still serves a shorter hit.

Where checkpoints are taken (so a chain does not flood the capped pool): at the last TAIL_CHECKPOINTS interval
boundaries each step's chunk crosses (a prompt's tail and just before it — a shared system prompt followed by a short
question ends there —, the end of a long prefill chunk, a decode crossing a boundary), and at a request's branch
point — the end of the pages it found cached when that is beyond its checkpoint hit — so the next request diverging
at the same place hits there.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Protocol

from .page_pool import PagePool
from .state_slots import StateSlots

TAIL_CHECKPOINTS = 3


class Request(Protocol):
    """What the prefix cache reads and writes on a sequence (the engine's `Request` is one): the cache sits below the
    engine and names only these fields."""

    cache_salt: str | None
    images: list  # (first pad position, pad count, image with a `digest`), in prompt order
    block_ids: list[int]
    block_hashes: list[bytes]
    state_slot: int | None
    num_computed_tokens: int
    num_drafter_tokens: int
    num_cached_tokens: int
    num_registered_blocks: int
    prefix_match: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def prompt_len(self) -> int: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


class PrefixCache:
    def __init__(self, pages: PagePool, states: StateSlots, checkpoints: StateSlots, interval: int, model_id: str):
        if interval % pages.block_size:
            raise ValueError(f"state checkpoint interval {interval} must be a multiple of the block size "
                             f"{pages.block_size}")
        self.pages, self.states, self.checkpoints = pages, states, checkpoints
        self.block_size, self.interval = pages.block_size, interval
        self.model_id = model_id
        self._ckpt: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> checkpoint slot, least recent first
        self._pending: dict[bytes, int] = {}  # checkpoints being written by the step in flight
        self.num_queries = self.num_hit_tokens = self.num_checkpoints_evicted = 0

    # ---- hashes ----
    def _root(self, salt: str | None) -> bytes:
        return hashlib.sha256(f"deltaserve|{self.model_id}|{salt or ''}".encode()).digest()

    def block_hashes(self, req: Request) -> list[bytes]:
        """Hashes of every full page of the request's known tokens, extended incrementally."""
        B = self.block_size
        hashes = req.block_hashes
        prev = hashes[-1] if hashes else self._root(req.cache_salt)
        for j in range(len(hashes), req.num_tokens // B):
            block = req.token_slice(j * B, (j + 1) * B)
            # a page holding an image's pad positions holds that image: equal pads of two images must not match
            seen = "".join(image.digest for start, n, image in req.images if start < (j + 1) * B and start + n > j * B)
            prev = hashlib.sha256(prev + b"".join(t.to_bytes(4, "little") for t in block) + seen.encode()).digest()
            hashes.append(prev)
        return hashes

    # ---- hits ----
    def find_hit(self, req: Request) -> tuple[int, list[int]]:
        """(c, pages): the longest cached prefix c < num_tokens with a live checkpoint at c (0 = no hit), and the
        pages holding positions 0..c-1. Records the request's branch point (end of all matched pages). Nothing is
        reserved."""
        B = self.block_size
        hashes = self.block_hashes(req)
        pages: list[int] = []
        for j, h in enumerate(hashes[: (req.num_tokens - 1) // B]):  # always leave >= 1 token to compute
            block = self.pages.lookup(h, tuple(req.token_slice(j * B, (j + 1) * B)))
            if block is None:
                break
            pages.append(block)
        req.prefix_match = len(pages) * B // self.interval * self.interval
        for n_pages in range(len(pages), 0, -1):
            if (n_pages * B) % self.interval == 0 and hashes[n_pages - 1] in self._ckpt:
                return n_pages * B, pages[:n_pages]
        return 0, []

    def cached_pages(self, req: Request, num_tokens: int) -> list[int]:
        """The cached pages holding the request's longest cached prefix of full pages within its first
        `num_tokens` tokens, whether or not a KDA checkpoint exists there (for a cache whose state comes from
        elsewhere: prefill/decode disaggregation). Nothing is reserved."""
        B = self.block_size
        pages: list[int] = []
        for j, h in enumerate(self.block_hashes(req)[:num_tokens // B]):
            block = self.pages.lookup(h, tuple(req.token_slice(j * B, (j + 1) * B)))
            if block is None:
                break
            pages.append(block)
        return pages

    def pages_to_revive(self, pages: list[int]) -> int:
        """How many of a hit's pages sit in the cached (allocatable) state and stop being allocatable once shared."""
        return sum(self.pages.is_cached(b) for b in pages)

    def take_hit(self, req: Request, c: int, pages: list[int]) -> None:
        """Share the hit's pages and copy its checkpoint into the request's working slot (already allocated)."""
        self.num_queries += 1
        self.num_hit_tokens += c
        if c == 0:
            return
        self.pages.share(pages)
        req.block_ids = list(pages)
        h = req.block_hashes[c // self.block_size - 1]
        self._ckpt.move_to_end(h)
        self.checkpoints.copy_to(self._ckpt[h], self.states, req.state_slot)
        req.num_computed_tokens = req.num_drafter_tokens = c  # a drafter's rows live in the shared pages too
        req.num_cached_tokens = min(c, req.prompt_len)

    # ---- checkpoints ----
    def plan_snapshots(self, req: Request, num_new: int) -> list[tuple[int, int]]:
        """Checkpoint slots to fill while computing tokens start..start+num_new-1 of the request: at the last
        TAIL_CHECKPOINTS interval boundaries the chunk crosses and at its branch point, unless that prefix already
        has one; never past the request's known tokens (a speculative draft is not part of any prefix yet). Returns
        (offset within the chunk, checkpoint slot), offsets ascending."""
        start, end = req.num_computed_tokens, min(req.num_computed_tokens + num_new, req.num_tokens)
        last = end // self.interval * self.interval
        wanted = {last - k * self.interval for k in range(TAIL_CHECKPOINTS)} | {req.prefix_match}
        hashes = self.block_hashes(req)
        plan = []
        for c in sorted(c for c in wanted if start < c <= end):
            h = hashes[c // self.block_size - 1]
            if h in self._ckpt:
                self._ckpt.move_to_end(h)
                continue
            if h in self._pending:
                continue
            slot = self._checkpoint_slot()
            if slot is None:
                break
            self._pending[h] = slot
            plan.append((c - start, slot))
        return plan

    def _checkpoint_slot(self) -> int | None:
        if self.checkpoints.can_allocate():
            return self.checkpoints.allocate()
        if not self._ckpt:
            return None  # every slot is being written this step
        _, slot = self._ckpt.popitem(last=False)
        self.num_checkpoints_evicted += 1
        return slot

    def drop_pending(self, slots: set[int] | None = None) -> None:
        """Forget checkpoints planned this step that will not be (fully) written because their requests failed:
        the given slots (all pending ones for None) go back to the pool unpublished."""
        for h, slot in list(self._pending.items()):
            if slots is None or slot in slots:
                del self._pending[h]
                self.checkpoints.free(slot)

    def commit(self, reqs: list[Request]) -> None:
        """After a step: the checkpoints it wrote become live, and newly full pages are registered by hash."""
        for h, slot in self._pending.items():
            self._ckpt[h] = slot
        self._pending.clear()
        B = self.block_size
        for req in reqs:
            hashes = self.block_hashes(req)
            full = min(req.num_computed_tokens // B, len(hashes))
            for j in range(req.num_registered_blocks, full):
                self.pages.register(req.block_ids[j], hashes[j], tuple(req.token_slice(j * B, (j + 1) * B)))
            req.num_registered_blocks = max(req.num_registered_blocks, full)

    def check_integrity(self) -> None:
        slots = list(self._ckpt.values())
        if len(set(slots)) != len(slots) or self._pending:
            raise AssertionError("prefix cache: checkpoint slots doubly used or left pending")
        self.checkpoints.check_integrity(set(slots))
