"""Each backend is exact against itself across schedules: on every preset, requests that arrive staggered (batched
with others, prefilled in chunks under a small token budget, resumed from prefix-cache hits, preempted and
recomputed) against the same backend running each request alone with its whole prompt in one step.

The torch backend runs in fp32 and must give identical greedy tokens. The native backend runs in bf16, the dtype its
kernels are for, and is not batch-invariant there: its products pick their kernel by a step's row count (dot tiles
up to LINEAR_MAX_ROWS rows, column packs or tiles above), so a row batched with others sums in another order than
the same row alone and its bf16 activations round differently. On the tiny random models, whose top logprobs sit
within a few hundredths of each other and whose DSA indexers pick keys by rank, such a rounding difference can grow
over a few tokens into another token. So for the native backend the test bounds the first place where the two runs
differ at all: up to it, tokens and top-5 logprobs are identical; there, the top-5 logprobs agree within
ROUNDING and a token that differs must be one the difference could carry over the alone run's token (a logprob gap
under NEAR_TIE plus twice the largest move); later tokens may part. A rounding difference usually moves the first
differing logprobs by hundredths, but where it flips a near-tie in a router's or a DSA indexer's top-k within that
step, the step's logits move by a discrete step (0.50 nats on k3-tiny when the batched rows run on the AMX tile
unit: the same at the commit before the tile unit took MX products a group at a time). A scheduling fault (a wrong
position, page, state slot or snapshot) shows as a difference of whole nats at the first token it touches.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.ops import native
from engine_utils import assert_pools_free, drive, make_llm, pool_bytes, random_prompts

PRESETS = ["kimi-linear-tiny", "k31-tiny", "k3-tiny", "deepseek-v32-tiny"]
BACKENDS = [("torch", "float32"),
            pytest.param("native", "bfloat16", marks=pytest.mark.skipif(native.native_library() is None,
                                                                        reason="no C compiler to build the kernels"))]
NEAR_TIE = 0.05  # logprob gap under which a bf16 argmax may flip with the summation order
ROUNDING = 1.0  # nats: a rounding moves the first differing logprobs by hundredths to half a nat, a fault by nats
MAX_TOKENS = 8


def _prompts() -> list[list[int]]:
    """Sixteen prompts: eight random ones of mixed lengths, and each of those extended, so the second half of the
    arrivals hits the prefix cache on the first half's pages and state checkpoints."""
    base = random_prompts([5, 9, 17, 23, 33, 40, 18, 47], seed=21, high=700)
    return base + [p + random_prompts([6], seed=i, high=700)[0] for i, p in enumerate(base)]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("backend, dtype", BACKENDS)
@pytest.mark.parametrize("preset", PRESETS)
def test_schedules_give_the_tokens_of_each_request_alone(make_checkpoint, backend, dtype, preset):
    path = make_checkpoint(preset)
    prompts = _prompts()
    config = make_llm(path, dtype=dtype, backend="torch").engine.config
    # 6 state slots, 14 pages of 16 tokens and 16 state checkpoints for 16 requests of up to 4 pages: preemption.
    memory = pool_bytes(config, num_slots=6, num_blocks=14, block_size=16, dtype=getattr(torch, dtype),
                        num_checkpoints=16)
    llm = make_llm(path, dtype=dtype, backend=backend, max_num_seqs=6, block_size=16, kv_cache_memory=memory,
                   max_num_batched_tokens=24, max_state_checkpoints=16)
    engine = llm.engine
    assert engine.core.backend.name == backend
    # the first eight staggered over four steps; their extensions once most of them have finished
    arrivals = [(i // 2 if i < 8 else 12 + i, f"r{i}", p, _params()) for i, p in enumerate(prompts)]
    done = drive(engine, arrivals)
    assert engine.max_step_requests >= 3 and engine.max_step_tokens == 24
    assert engine.scheduler.num_preemptions > 0
    assert engine.core.prefix.num_hit_tokens > 0

    alone_llm = make_llm(path, dtype=dtype, backend=backend, max_num_batched_tokens=100_000)
    parted = []
    for i, prompt in enumerate(prompts):
        got = done[f"r{i}"].outputs[0]
        alone = alone_llm.generate([prompt], _params(), use_tqdm=False)[0].outputs[0]
        assert alone_llm.engine.max_step_requests == 1
        if backend == "torch":
            assert list(got.token_ids) == list(alone.token_ids), (preset, i)
            continue
        first = _first_difference(got, alone)
        if first is None:
            continue
        k, delta, flipped = first
        assert delta < ROUNDING, f"{preset} prompt {i}: token {k} differs from alone by {delta:.3g} nats"
        if flipped:
            top = dict(alone.logprobs[k].top)
            gap = top[alone.token_ids[k]] - top.get(got.token_ids[k], float("-inf"))
            assert gap < NEAR_TIE + 2 * delta, (f"{preset} prompt {i}: token {k} flipped with a logprob gap of "
                                                f"{gap:.3g} alone, logprobs moved by {delta:.3g}")
        if list(got.token_ids) != list(alone.token_ids):
            parted.append((i, k))
    assert len(parted) <= len(prompts) // 2, f"{len(parted)} of {len(prompts)} requests parted from alone: {parted}"
    assert_pools_free(engine)
    assert_pools_free(alone_llm.engine)


def _first_difference(got, alone) -> tuple[int, float, bool] | None:
    """(position, largest |delta logprob| over the top-5 tokens both runs report there, whether the token differs)
    at the first position where the two outputs differ at all; None when they are identical."""
    for k, (a, b) in enumerate(zip(got.logprobs, alone.logprobs)):
        mine, theirs = dict(a.top), dict(b.top)
        common = mine.keys() & theirs.keys()
        delta = max((abs(mine[t] - theirs[t]) for t in common), default=float("inf"))
        if a.token_id != b.token_id or mine != theirs:
            return k, delta, a.token_id != b.token_id
    return None
