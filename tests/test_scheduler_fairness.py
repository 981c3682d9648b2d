"""Fair admission: one client key's huge request cannot starve the others.

Unit tests drive the real `Scheduler` over real `PagePool` / `StateSlots` (and a `PrefixCache`) without a model:
each step applies the plan as the engine would (computed tokens advance, a request whose tokens are all computed
gets one new token, `max_tokens` finishes it) and checks the pools' integrity. Then the engine (greedy outputs
equal running each request alone) and one real server (a small request completes while a large one is far from
done).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import pytest
import torch

from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.prefix_cache import PrefixCache
from deltaserve.cache.state_slots import StateSlots
from deltaserve.config import ModelConfig
from deltaserve.engine.request import Request, RequestStatus
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.scheduler import Scheduler
from deltaserve.tools.presets import get_preset
from engine_utils import assert_pools_free, assert_same_greedy, assert_same_prefix, greedy, make_llm, new_stats, \
    random_prompts
from server_utils import iter_sse, run_server, wait_until

CONFIG = ModelConfig.from_dict(get_preset("k31-tiny").config)
BLOCK = 16


def make_scheduler(max_num_seqs: int = 16, budget: int = 64, num_blocks: int = 512, num_checkpoints: int = 0,
                   chunked: bool = True) -> Scheduler:
    pages = PagePool(CONFIG, num_blocks, BLOCK, torch.float32)
    states = StateSlots(CONFIG, max_num_seqs)
    prefix = (PrefixCache(pages, states, StateSlots(CONFIG, num_checkpoints), BLOCK, "fairness-test")
              if num_checkpoints else None)
    return Scheduler(pages, states, max_num_seqs, budget, chunked, prefix)


class Sim:
    """Steps a scheduler as the engine core does, minus the model: records when each request was first scheduled
    and when it finished, checks every plan's bounds and the pools after every step."""

    def __init__(self, scheduler: Scheduler):
        self.s = scheduler
        self.step_no = 0
        self.requests: dict[str, Request] = {}
        self.first_scheduled: dict[str, int] = {}
        self.finished_at: dict[str, int] = {}
        self.admission_order: list[str] = []

    def add(self, rid: str, client: str, prompt: list[int], max_tokens: int) -> Request:
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens, sampling=None,
                      client=client)
        self.requests[rid] = req
        self.s.add(req)
        return req

    def step(self):
        s = self.s
        running_before = set(map(id, s.running))
        plan = s.schedule()
        assert plan.chunks, "a step with work scheduled nothing"
        assert plan.num_tokens <= s.token_budget
        assert len(s.running) <= s.max_num_seqs
        assert len({id(c.request) for c in plan.chunks}) == len(plan.chunks)
        for req, n in plan.chunks:
            assert req.status is RequestStatus.RUNNING and 0 < n <= req.num_tokens - req.num_computed_tokens
            self.first_scheduled.setdefault(req.request_id, self.step_no)
            if id(req) not in running_before:
                self.admission_order.append(req.request_id)
        for req, n in plan.chunks:
            req.num_computed_tokens += n
        if s.prefix is not None:
            s.prefix.commit([c.request for c in plan.chunks])
        for req, _ in plan.chunks:
            if req.num_computed_tokens == req.num_tokens:
                req.output_ids.append(1 + len(req.output_ids) % 97)
                if len(req.output_ids) >= req.max_tokens:
                    s.finish(req, RequestStatus.FINISHED_LENGTH)
                    self.finished_at[req.request_id] = self.step_no
        s.check_integrity()
        self.step_no += 1
        return plan

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.step()

    def run(self, max_steps: int, until=None) -> None:
        """Step until `until()` holds (or, without it, no work is left), failing after `max_steps` steps."""
        done = until if until is not None else lambda: not self.s.has_work()
        for _ in range(max_steps):
            if done():
                return
            self.step()
        assert done(), f"not done after {max_steps} steps"

    def assert_all_done(self) -> None:
        assert set(self.finished_at) == set(self.requests)
        assert all(len(r.output_ids) == r.max_tokens for r in self.requests.values())
        s = self.s
        s.check_integrity()
        assert not s.running and not s.waiting
        assert s.pages.num_free == s.pages.num_blocks and s.states.num_free == s.states.num_slots


def counts_by_client(s: Scheduler) -> Counter:
    return Counter(r.client for r in s.running)


def prompt(length: int, seed: int) -> list[int]:
    return [(seed * 131 + 7 * i) % 1000 + 1 for i in range(length)]


# ---------------------------------------------------------------------------------------------- starvation
def _flood_then_small(small_client: str) -> Sim:
    """Key A queues 200 sequences and fills every slot; then one small request arrives under `small_client`."""
    sim = Sim(make_scheduler(max_num_seqs=16, budget=64))
    for i in range(200):
        sim.add(f"a{i}", "A", prompt(12, i), max_tokens=40)
    sim.steps(5)
    assert len(sim.s.running) == 16 and set(counts_by_client(sim.s)) == {"A"}
    sim.add("b", small_client, prompt(12, 999), max_tokens=4)
    return sim


def test_a_small_request_is_admitted_at_once_beside_a_huge_one():
    sim = _flood_then_small("B")
    arrival = sim.step_no
    sim.step()
    # A held every slot: its newest sequence gave one up, the rest of A kept running (nothing else was idle).
    assert counts_by_client(sim.s) == {"A": 15, "B": 1}
    assert sim.first_scheduled["b"] == arrival and sim.s.num_preemptions == 1
    sim.run(10, until=lambda: "b" in sim.finished_at)
    assert sim.finished_at["b"] == arrival + 3  # prompt in one step, then three decodes
    sim.step()
    assert counts_by_client(sim.s) == {"A": 16}  # alone again, A takes every slot back
    sim.run(2000)
    sim.assert_all_done()
    assert sim.finished_at["b"] < min(t for rid, t in sim.finished_at.items() if rid != "b")
    assert sim.s.num_preemptions == 1


def test_two_floods_split_the_slots_evenly_without_churn():
    sim = Sim(make_scheduler(max_num_seqs=16, budget=64))
    for i in range(60):
        sim.add(f"a{i}", "A", prompt(12, i), max_tokens=30)
    sim.steps(5)
    for i in range(60):
        sim.add(f"b{i}", "B", prompt(12, 100 + i), max_tokens=30)
    # B takes half the slots as fast as the token budget admits its prompts: A's eight newest give way, once.
    sim.run(3, until=lambda: counts_by_client(sim.s) == {"A": 8, "B": 8})
    assert sim.s.num_preemptions == 8
    for _ in range(200):
        sim.step()
        if {r.client for r in sim.s.waiting} == {"A", "B"}:  # both still want more: neither holds over half
            assert max(counts_by_client(sim.s).values()) <= 8, counts_by_client(sim.s)
    assert sim.s.num_preemptions == 8  # equal shares are stable: no preemption back and forth
    sim.run(1000)
    sim.assert_all_done()


def test_one_key_stays_fcfs_and_the_small_request_waits_its_turn():
    sim = _flood_then_small("A")  # the same arrival under the flooding key: plain FCFS
    sim.run(2000)
    sim.assert_all_done()
    assert sim.s.num_preemptions == 0
    assert sim.admission_order == [f"a{i}" for i in range(200)] + ["b"]
    assert sum(t < sim.finished_at["b"] for rid, t in sim.finished_at.items() if rid != "b") >= 180


def test_single_key_plans_are_greedy_fcfs():
    """With one key every step's plan is the FCFS rule: running requests in admission order, then waiting
    requests in arrival order, each taking min(remaining, budget left), admission stopping at the first that has
    no slot."""
    s = make_scheduler(max_num_seqs=6, budget=32)
    sim = Sim(s)
    lengths = [5, 40, 9, 70, 3, 17, 33, 8, 51, 2, 26, 12]
    arrivals = {0: [0, 1, 2], 2: [3, 4], 3: [5, 6, 7], 6: [8], 9: [9, 10, 11]}
    while s.has_work() or sim.step_no <= max(arrivals):
        for i in arrivals.get(sim.step_no, []):
            sim.add(f"r{i}", "only", prompt(lengths[i], i), max_tokens=6 + i % 4)
        left, slots, expected = s.token_budget, s.max_num_seqs - len(s.running), []
        for r in s.running:
            if left:
                expected.append((r.request_id, min(r.num_tokens - r.num_computed_tokens, left)))
                left -= expected[-1][1]
        for r in s.waiting:
            if not left or not slots:
                break
            expected.append((r.request_id, min(r.num_tokens, left)))
            left, slots = left - expected[-1][1], slots - 1
        plan = sim.step()
        assert [(c.request.request_id, c.num_new_tokens) for c in plan.chunks] == expected
        assert sim.step_no < 300
    sim.assert_all_done()
    assert sim.admission_order == [f"r{i}" for i in range(len(lengths))]


# --------------------------------------------------------------------------------------------- token budget
@pytest.mark.parametrize("b_len, b_tokens", [(10, [10, 1, 1]), (400, [32, 32, 32])])
def test_a_key_takes_at_most_its_share_of_the_budget_while_another_has_work(b_len, b_tokens):
    """A's four 400-token prompts fill the 64-token budget; once B has work each key's running requests get at
    most half of it before admission, and what B leaves goes back to A."""
    def flooded(b_client: str) -> Sim:
        sim = Sim(make_scheduler(max_num_seqs=16, budget=64))
        for i in range(4):
            sim.add(f"a{i}", "A", prompt(400, i), max_tokens=4)
        sim.steps(2)
        sim.add("b", b_client, prompt(b_len, 99), max_tokens=4)
        return sim

    sim = flooded("B")
    for want in b_tokens:
        plan = sim.step()
        by_key = Counter()
        for req, n in plan.chunks:
            by_key[req.client] += n
        assert plan.num_tokens == 64 and by_key["B"] == want, by_key  # work-conserving
    sim.run(500)
    sim.assert_all_done()
    # The same arrival under key A waits behind A's prefills (FCFS): the oldest takes the whole budget.
    sim = flooded("A")
    assert [(c.request.request_id, c.num_new_tokens) for c in sim.step().chunks] == [("a0", 64)]


# ------------------------------------------------------------------------------------------------ preemption
def test_preemption_under_page_pressure_takes_from_the_biggest_key_and_keeps_integrity():
    # 14 pages of 16 tokens for three keys' requests of 20..45 + 24 tokens: pages run short again and again.
    s = make_scheduler(max_num_seqs=8, budget=48, num_blocks=14, num_checkpoints=4)
    sim = Sim(s)
    victims = []
    preempt = s.preempt

    def checked_preempt(req):
        counts = counts_by_client(s)
        newest_of_key = [r for r in s.running if r.client == req.client][-1]
        victims.append((req.client, counts[req.client] == max(counts.values()), newest_of_key is req))
        preempt(req)

    s.preempt = checked_preempt
    shared = prompt(32, 5)  # two full pages shared by A's requests: prefix-cache hits after a preemption
    arrivals = {0: [("a", "A", 6)], 1: [("b", "B", 3)], 4: [("c", "C", 1)], 9: [("d", "A", 2)]}
    while s.has_work() or sim.step_no <= max(arrivals):
        for name, client, count in arrivals.get(sim.step_no, []):
            for i in range(count):
                body = shared + prompt(4 + 3 * i, i) if client == "A" else prompt(20 + 5 * i, 50 + i)
                sim.add(f"{name}{i}", client, body, max_tokens=24)
        sim.step()
        assert sim.step_no < 1000
    sim.assert_all_done()
    assert s.num_preemptions == len(victims) > 0
    assert all(most and newest for _, most, newest in victims), victims
    assert {c for c, _, _ in victims} >= {"A"}
    assert s.prefix.num_hit_tokens > 0


def test_fork_keeps_a_slot_for_a_waiting_key():
    s = make_scheduler(max_num_seqs=4, budget=64)
    sim = Sim(s)
    parents = [sim.add(f"a{i}", "A", prompt(10, i), max_tokens=4) for i in range(3)]
    sim.step()
    assert s.can_fork(parents[0])  # alone: every slot
    b = sim.add("b", "B", prompt(10, 9), max_tokens=4)
    assert not s.can_fork(parents[0])  # the last slot is B's: admission would take B first
    assert s.can_fork(b)  # a completion of B's own may take it
    sim.run(50)
    sim.assert_all_done()


# -------------------------------------------------------------------------------------------------- engine
def test_fairness_changes_order_never_greedy_outputs(make_checkpoint):
    path = make_checkpoint("k31-tiny")
    llm = make_llm(path, max_num_seqs=4, max_num_batched_tokens=32)
    engine = llm.engine
    bpe = llm.tokenizer.num_bpe_ranks
    p_a, p_a2, p_b, p_c = random_prompts([20, 25, 9, 14], seed=3, high=bpe)
    arrivals = {0: [("a", p_a, greedy(10, n=4), "A"), ("a2", p_a2, greedy(8), "A")],
                3: [("b", p_b, greedy(5), "B")], 5: [("c", p_c, greedy(6), "C")]}
    done, finished_step, step = {}, {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, ids, params, client in arrivals.get(step, []):
            engine.add_request(rid, ids, params, client=client)
        for out in engine.step():
            if out.finished:
                done[out.request_id], finished_step[out.request_id] = out, step
        step += 1
        assert step < 500
    assert_pools_free(engine)
    # A's five sequences held every slot when B came: one gave way (recompute), and B finished long before A.
    assert engine.scheduler.num_preemptions > 0
    assert finished_step["b"] < finished_step["a"] and finished_step["c"] < finished_step["a"]

    stats = new_stats("fairness vs alone")
    for rid, ids, params, _ in [a for arr in arrivals.values() for a in arr]:
        alone = llm.generate([ids], greedy(params.max_tokens), use_tqdm=False)[0].outputs[0].token_ids
        assert len(done[rid].outputs) == params.n
        for c in done[rid].outputs:
            assert c.finish_reason == "length" and len(c.token_ids) == params.max_tokens
            stats.sequences += 1
            if c.token_ids != alone:  # only a genuine near-tie may flip a greedy choice (engine_utils.NEAR_TIE)
                assert_same_prefix(c.token_ids, alone, assert_same_greedy(c.token_ids, ids, engine.model, stats),
                                   assert_same_greedy(alone, ids, engine.model, stats))
    stats.assert_rare()


# -------------------------------------------------------------------------------------------------- server
BIG_PROMPTS, BIG_N, BIG_MAX_TOKENS, MAX_NUM_SEQS = 4, 4, 16, 4


def test_server_small_request_completes_while_a_large_one_runs(make_checkpoint):
    # float32: the bound below counts the large request's tokens streamed while the small one is in flight, so a step
    # must cost enough that the small request's fixed HTTP and tokenising time (long on a loaded CPU) stays a few
    # steps; the faster bf16 steps of the checkpoint's own dtype let that overhead stream a large share.
    with run_server(make_checkpoint("k31-tiny"), "--served-model-name", "tiny", "--kv-cache-memory", "64MiB",
                    "--max-num-seqs", str(MAX_NUM_SEQS), "--dtype", "float32") as srv:
        progress = {"events": 0, "done": False, "error": None}

        def big():
            body = {"model": "tiny", "prompt": [f"story number {i} begins" for i in range(BIG_PROMPTS)],
                    "n": BIG_N, "max_tokens": BIG_MAX_TOKENS, "ignore_eos": True, "temperature": 1.0, "seed": 1,
                    "stream": True, "user": "big-client"}
            try:
                with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=300) as r:
                    assert r.status_code == 200
                    for event in iter_sse(r):
                        if isinstance(event, dict) and event["choices"]:
                            progress["events"] += 1
                progress["done"] = True
            except Exception as e:  # noqa: BLE001 — reported by the main thread
                progress["error"] = e

        thread = threading.Thread(target=big)
        thread.start()
        try:
            # The large request holds every slot once its sequences stream.
            assert wait_until(lambda: progress["events"] >= 2 * MAX_NUM_SEQS or progress["error"], 120)
            start = time.monotonic()
            r = httpx.post(srv.url + "/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
            elapsed, seen = time.monotonic() - start, progress["events"]
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            assert not progress["done"]
        finally:
            thread.join(300)
        assert progress["error"] is None and progress["done"]
        total = progress["events"]
        assert total >= BIG_PROMPTS * BIG_N * BIG_MAX_TOKENS * 0.9
        # FCFS would have queued the small request behind three of the large one's four waves of sequences.
        assert seen < 0.25 * total, (seen, total)
        assert elapsed < 30

        def all_free() -> dict | None:
            rep = httpx.get(srv.url + "/debug/integrity", timeout=30).json()
            return rep if rep["ok"] and rep["free_pages"] == rep["total_pages"] and \
                rep["free_slots"] == rep["total_slots"] else None

        assert wait_until(all_free, 10), httpx.get(srv.url + "/debug/integrity", timeout=30).json()
