"""Scheduler: one rule, no prefill/decode phases (docs/serving.md §2.2), shared fairly between clients.

Each request's `num_computed_tokens` chases its `num_tokens` under one per-step token budget. Running requests go
first (decodes and unfinished chunked prefills, in admission order), then waiting requests are admitted while a
running slot, a state slot, pages and budget remain. When pages run out, a running request is preempted by recompute.

Fairness. Every request carries a client key (`Request.client`: the OpenAI `user`, else the API request it belongs
to, so the n completions and all prompts of one HTTP request share one key). The keys that have work share the
engine max-min fairly; a key alone may use all of it (work-conserving):
  * admission takes the waiting request whose key holds the fewest running sequences (ties: queue order, i.e.
    arrival order with preempted requests in front); when it does not fit, admission stops for the step (no
    smaller request skips ahead of it);
  * running slots: when that request lacks a slot, a state slot or pages, a key holding at least two more running
    sequences than its key is over its share and gives up its newest sequence (recompute preemption) until it fits;
  * preemption under page pressure takes its victim by the same order: the newest sequence of the key holding the
    most running sequences (ties: the newest of them), so with one key it is the newest running request;
  * token budget: while K keys have running or waiting requests, each key's running requests get at most
    ceil(budget / K) tokens before admission; what admission leaves then goes to running requests in admission order.
With a single key this is plain FCFS.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import NamedTuple

from ..cache.page_pool import PagePool
from ..cache.prefix_cache import PrefixCache
from ..cache.state_slots import StateSlots
from ..layers.batch import DraftSlot
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
                 enable_chunked_prefill: bool = True, prefix: PrefixCache | None = None, draft_slots_per_seq: int = 0,
                 lookahead: int = 0, max_model_len: int | None = None):
        self.pages, self.states, self.prefix = pages, states, prefix
        # Positions a request holds pages for beyond the tokens it computes (never past max_model_len): a drafter
        # with its own cache (MTP) writes rows up to num_speculative_tokens positions past the newest token
        self.lookahead, self.max_model_len = lookahead, max_model_len
        # Speculative decoding over KDA layers: the state after each draft position of a verify step is kept in the
        # draft states, `draft_slots_per_seq` per working slot (DraftSlot.of); 0 = none kept
        self.draft_slots_per_seq = draft_slots_per_seq
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

    def can_fork(self, parent: Request) -> bool:
        """Whether one more completion of `parent` may start running now, sharing its prompt: a running slot stays
        free for each other key that waits holding no more running sequences than the parent's (admission would
        take those first, so a fork there would only be preempted again)."""
        counts = Counter(r.client for r in self.running)
        mine = counts[parent.client]
        ahead = {r.client for r in self.waiting if r.client != parent.client and counts[r.client] <= mine}
        return len(self.running) + len(ahead) < self.max_num_seqs

    # ---- one step ----
    def schedule(self) -> StepPlan:
        counts = Counter(r.client for r in self.running)  # running sequences per key, kept current below
        num_keys = len(set(counts) | {r.client for r in self.waiting})
        grants: dict[Request, int] = {}  # tokens granted this step per running request
        budget, preempted = self._schedule_running(grants, counts, -(-self.token_budget // max(num_keys, 1)))
        if not preempted:  # pages just ran short: admitting now would only preempt again
            budget = self._admit(grants, counts, budget)
        self._fill(grants, budget)
        chunks = [ScheduledChunk(r, grants[r]) for r in self.running if r in grants]
        snapshots = [self.prefix.plan_snapshots(c.request, c.num_new_tokens) if self.prefix is not None else []
                     for c in chunks]
        for chunk, snaps in zip(chunks, snapshots):
            self._plan_drafts(chunk, snaps)
        return StepPlan(chunks, snapshots)

    def _plan_drafts(self, chunk: ScheduledChunk, snapshots: list) -> None:
        """Keep the drafts the chunk's budget covers, and snapshot the KDA state after each of its rows but the last
        (the state after the last accepted token is then at hand, docs/serving.md §9.3)."""
        req, n = chunk
        drafts = max(0, req.num_computed_tokens + n - req.num_tokens)
        del req.spec_token_ids[drafts:]
        if req.spec_token_probs is not None:
            req.spec_token_probs = req.spec_token_probs[:drafts] if drafts else None
        if drafts and self.draft_slots_per_seq:
            snapshots += [(j, DraftSlot.of(req.state_slot, self.draft_slots_per_seq, j - 1))
                          for j in range(1, drafts + 1)]
            snapshots.sort(key=lambda s: s[0])

    def _schedule_running(self, grants: dict[Request, int], counts: Counter, cap: int) -> tuple[int, bool]:
        """Running requests in admission order, each key's at most `cap` tokens; preempts under page pressure.
        Returns the budget left and whether anything was preempted."""
        budget = self.token_budget
        used: Counter = Counter()  # tokens granted per key
        preempted = False
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_pending_tokens, budget, cap - used[req.client])
            if n <= 0:
                continue
            while not self._can_grow(req, n):
                victim = self._victim(counts)
                refund = grants.pop(victim, 0)
                budget += refund
                used[victim.client] -= refund
                self._preempt_counted(victim, counts)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self._grow(req, n)
            grants[req] = n
            used[req.client] += n
            budget -= n
        return budget, preempted

    def _admit(self, grants: dict[Request, int], counts: Counter, budget: int) -> int:
        """Admit waiting requests, the key with the fewest running sequences first, preempting the sequences of a
        key over its share when one does not fit. Returns the budget left."""
        while self.waiting and budget > 0:
            req = self._next_waiting(counts)
            hit, hit_pages = self._find_hit(req)
            if not self.chunked_prefill and req.num_tokens - hit > budget:
                break
            while not self._fits(req, hit, hit_pages, budget):
                victim = self._victim(counts)
                if victim is None or counts[victim.client] < counts[req.client] + 2:
                    return budget
                budget += grants.pop(victim, 0)
                self._preempt_counted(victim, counts)
                hit, hit_pages = self._find_hit(req)  # freed pages may have turned cached
            n = min(req.num_tokens - hit, budget)
            self.waiting.remove(req)
            req.state_slot = self.states.allocate()
            if self.prefix is not None:
                self.prefix.take_hit(req, hit, hit_pages)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            counts[req.client] += 1
            self._grow(req, n)
            grants[req] = n
            budget -= n
        return budget

    def _fill(self, grants: dict[Request, int], budget: int) -> None:
        """Give the budget left after admission to running requests in admission order (no preemption)."""
        for req in self.running:
            if budget == 0:
                break
            n = grants.get(req, 0)
            more = min(req.num_pending_tokens - n, budget)
            if more > 0 and self._can_grow(req, n + more):
                self._grow(req, n + more)
                grants[req] = n + more
                budget -= more

    def _next_waiting(self, counts: Counter) -> Request:
        """The first waiting request whose key holds the fewest running sequences."""
        best, fewest = self.waiting[0], counts[self.waiting[0].client]
        for r in self.waiting:
            if fewest == 0:
                break
            if counts[r.client] < fewest:
                best, fewest = r, counts[r.client]
        return best

    def _victim(self, counts: Counter) -> Request | None:
        """The newest running request of the key holding the most running sequences (ties: the newest of them)."""
        top = max(counts.values(), default=0)
        return next((r for r in reversed(self.running) if counts[r.client] == top), None)

    def _preempt_counted(self, req: Request, counts: Counter) -> None:
        self.preempt(req)
        counts[req.client] -= 1

    def _find_hit(self, req: Request) -> tuple[int, list[int]]:
        """A prefix hit (pages + KDA checkpoint) skips its tokens; nothing is reserved until admission. A request
        that still owes prompt logprobs computes every prompt token (a cached token has no logits)."""
        return self.prefix.find_hit(req) if self.prefix is not None and not req.scores_prompt else (0, [])

    def _fits(self, req: Request, hit: int, hit_pages: list[int], budget: int) -> bool:
        """Whether `req` can be admitted now: a running slot, a state slot, and pages for its first chunk (the
        cached pages of its hit revived)."""
        n = min(req.num_tokens - hit, budget)
        new_pages = self.pages.blocks_needed(self._held(hit + n)) - len(hit_pages)
        revived = self.prefix.pages_to_revive(hit_pages) if self.prefix is not None else 0
        return (len(self.running) < self.max_num_seqs and self.states.can_allocate()
                and self.pages.can_allocate(new_pages + revived))

    def _held(self, computed: int) -> int:
        """Positions a request computing up to `computed` tokens holds pages for (the drafter's lookahead added)."""
        held = computed + self.lookahead
        return held if self.max_model_len is None else min(held, self.max_model_len)

    def _blocks_to_add(self, req: Request, n: int) -> int:
        return max(0, self.pages.blocks_needed(self._held(req.num_computed_tokens + n)) - len(req.block_ids))

    def _can_grow(self, req: Request, n: int) -> bool:
        return self.pages.can_allocate(self._blocks_to_add(req, n))

    def _grow(self, req: Request, n: int) -> None:
        req.block_ids.extend(self.pages.allocate(self._blocks_to_add(req, n)))

    def admit_loaded(self, req: Request, num_tokens: int, cached: list[int]) -> bool:
        """Start a request whose first `num_tokens` tokens' cache was computed elsewhere and is to be loaded into
        its pages and slot (prefill/decode disaggregation), its first pages shared from the prefix cache (`cached`,
        pages this side already holds): a running slot, a state slot and pages for those tokens and the next,
        taken now; False, taking nothing, while they are not free."""
        blocks = self.pages.blocks_needed(self._held(num_tokens + 1)) - len(cached)
        revived = self.prefix.pages_to_revive(cached) if self.prefix is not None else 0
        if (len(self.running) >= self.max_num_seqs or not self.states.can_allocate()
                or not self.pages.can_allocate(blocks + revived)):
            return False
        req.state_slot = self.states.allocate()
        self.pages.share(cached)
        req.block_ids = list(cached) + self.pages.allocate(blocks)
        req.num_registered_blocks = len(cached)
        req.num_computed_tokens = num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    # ---- state changes ----
    def preempt(self, req: Request) -> None:
        """Recompute preemption: release pages and slot, forget computed tokens (outputs are kept and will be
        recomputed), and put the request at the front of the waiting queue."""
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = req.num_drafter_tokens = 0
        req.drafter_hidden = None
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
        req.spec_token_ids.clear()
        req.spec_token_probs = None
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
            if r.block_ids or r.state_slot is not None or r.spec_token_ids:
                raise AssertionError(f"waiting request {r.request_id} holds cache resources or drafts")
        for r in self.running:
            if not 0 <= r.num_computed_tokens <= r.num_tokens:
                raise AssertionError(f"request {r.request_id}: num_computed_tokens out of range")
            if r.spec_token_ids and r.num_computed_tokens != r.num_tokens - 1:
                raise AssertionError(f"request {r.request_id}: drafts while {r.num_tokens - r.num_computed_tokens} "
                                     f"known tokens are not computed")
