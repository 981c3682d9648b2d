"""Scheduler: one rule, no prefill/decode phases (serving.md §2.2).

Each request's `num_computed_tokens` chases its `num_tokens` under one per-step token budget. Running requests go
first (decodes and unfinished chunked prefills, in admission order), then waiting requests in FCFS order while a
state slot, pages and budget remain. When pages run out, the newest running request is preempted by recompute.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from ..cache.page_pool import PagePool
from ..cache.prefix_cache import PrefixCache
from ..cache.state_slots import StateSlots
from .request import Request, RequestStatus


class ScheduledChunk(NamedTuple):
    request: Request
    num_new_tokens: int  # tokens computed for this request this step, starting at its num_computed_tokens


class StepPlan(NamedTuple):
    chunks: list[ScheduledChunk]
    snapshots: list[list[tuple[int, int]]] = []  # per chunk: (offset, checkpoint slot) KDA snapshots to take

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, pages: PagePool, states: StateSlots, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, prefix: PrefixCache | None = None):
        self.pages, self.states, self.prefix = pages, states, prefix
        self.max_num_seqs, self.token_budget = max_num_seqs, max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue ----
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----
    def schedule(self) -> StepPlan:
        budget = self.token_budget
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._can_grow(req, n):
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self._grow(req, n)
            chunks.append(ScheduledChunk(req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            # A prefix hit (pages + KDA checkpoint) skips its tokens; nothing is reserved until admission.
            hit, hit_pages = self.prefix.find_hit(req) if self.prefix is not None else (0, [])
            remaining = req.num_tokens - hit
            if remaining > budget and not self.chunked_prefill:
                break
            n = min(remaining, budget)
            new_pages = self.pages.blocks_needed(hit + n) - len(hit_pages)
            revived = self.prefix.pages_to_revive(hit_pages) if self.prefix is not None else 0
            if not (self.states.can_allocate() and self.pages.can_allocate(new_pages + revived)):
                break
            self.waiting.popleft()
            req.state_slot = self.states.allocate()
            if self.prefix is not None:
                self.prefix.take_hit(req, hit, hit_pages)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._grow(req, n)
            chunks.append(ScheduledChunk(req, n))
            budget -= n
        snapshots = [self.prefix.plan_snapshots(c.request, c.num_new_tokens) if self.prefix is not None else []
                     for c in chunks]
        return StepPlan(chunks, snapshots)

    def _blocks_to_add(self, req: Request, n: int) -> int:
        return max(0, self.pages.blocks_needed(req.num_computed_tokens + n) - len(req.block_ids))

    def _can_grow(self, req: Request, n: int) -> bool:
        return self.pages.can_allocate(self._blocks_to_add(req, n))

    def _grow(self, req: Request, n: int) -> None:
        req.block_ids.extend(self.pages.allocate(self._blocks_to_add(req, n)))

    # ---- state changes ----
    def preempt(self, req: Request) -> None:
        """Recompute preemption: release pages and slot, forget computed tokens (outputs are kept and will be
        recomputed), and put the request at the front of the waiting queue."""
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark finished and free everything it holds, wherever it is (running, waiting or preempted)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = status

    def _release(self, req: Request) -> None:
        if req.block_ids:
            self.pages.free(req.block_ids[::-1])  # chain tails first: they are evicted first
            req.block_ids = []
            req.num_registered_blocks = 0
        if req.state_slot is not None:
            self.states.free(req.state_slot)
            req.state_slot = None

    def check_integrity(self) -> None:
        """Pools account for exactly what running requests hold."""
        refs: dict[int, int] = {}
        for r in self.running:
            for b in r.block_ids:
                refs[b] = refs.get(b, 0) + 1
        self.pages.check_integrity(refs)
        self.states.check_integrity({r.state_slot for r in self.running})
        if self.prefix is not None:
            self.prefix.check_integrity()
        for r in self.waiting:
            if r.block_ids or r.state_slot is not None:
                raise AssertionError(f"waiting request {r.request_id} holds cache resources")
        for r in self.running:
            if not 0 <= r.num_computed_tokens <= r.num_tokens:
                raise AssertionError(f"request {r.request_id}: num_computed_tokens out of range")
