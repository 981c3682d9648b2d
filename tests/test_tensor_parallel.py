"""Tensor and expert parallelism of the model's math (docs/parallel.md): 2 and 4 gloo ranks, each holding its
shard (heads, widths, vocabulary slices; experts split in width or placed whole), give the logits of one process."""

from __future__ import annotations

import pytest
import torch

from deltaserve.distributed import Shard
from deltaserve.models.loader import load_model
from engine_utils import assert_pools_free, greedy, make_llm, pool_bytes, random_prompts
from parallel_utils import LAYOUTS, sharded_logits


@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny", "deepseek-v32-tiny"])
def test_sharded_forward_equals_one_process(make_checkpoint, tmp_path, preset):
    """A 40-token prompt (past the tiny DSA presets' indexer top-k of 16, so the indexers' summed scores choose)
    through every layout: the gathered logits are one process's to fp32 rounding, with the same argmax."""
    path = make_checkpoint(preset)
    prompt = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    want = load_model(path, "float32").reference_logits(torch.tensor(prompt))
    got = sharded_logits(path, prompt, tmp_path)
    assert sorted(got) == sorted(f"tp{n}-ep{int(ep)}-g{g}" for n, ep in LAYOUTS for g in range(4 // n))
    for name, logits in got.items():
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=5e-4, msg=name)
        assert torch.equal(logits.argmax(-1), want.argmax(-1)), name


def _engine_scenario(path, **parallel) -> tuple[list[list[int]], object]:
    """Greedy tokens of a batch through small pools (4 working slots, 10 pages: preemption), a small token budget
    (chunked prefill), prompts sharing a 32-token prefix (prefix-cache hits), n = 2 (a fork: pages and KDA state
    copied) and logprobs, then the same batch again (hits on every prompt); pools checked after every step on
    rank 0, free at the end."""
    config = load_model(path, "float32").config
    shard = Shard(0, parallel.get("tensor_parallel_size", 1), parallel.get("enable_expert_parallel", False))
    high = 1000
    shared = random_prompts([32], seed=4, high=high)[0]
    prompts = (random_prompts([3, 9, 17, 33, 40], seed=11, high=high)
               + [shared + p for p in random_prompts([3, 20], seed=6, high=high)])
    params = [greedy(24) for _ in prompts]
    params[1] = greedy(24, n=2)
    params[-1] = greedy(24, logprobs=2)
    llm = make_llm(path, max_num_seqs=4, block_size=16, max_num_batched_tokens=20, max_state_checkpoints=2,
                   kv_cache_memory=pool_bytes(config, num_slots=4, num_blocks=10, block_size=16, shard=shard),
                   **parallel)
    with llm:
        runs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
        engine = llm.engine
        assert (engine.pages.num_blocks, engine.states.num_slots) == (10, 4)
        assert engine.scheduler.num_preemptions > 0 and engine.prefix.num_hit_tokens > 0
        assert_pools_free(engine)
        tokens = [[c.token_ids for c in o.outputs] for run in runs for o in run]
        logprobs = [[(e.logprob, e.top) for e in o.outputs[0].logprobs] for run in runs for o in run[-1:]]
    return tokens, logprobs


@pytest.mark.parametrize("preset, parallel", [
    ("k31-tiny", dict(tensor_parallel_size=2)),
    ("k31-tiny", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("k31-tiny", dict(tensor_parallel_size=4, enable_expert_parallel=True)),
    ("kimi-linear-tiny", dict(tensor_parallel_size=2)),
    ("kimi-linear-tiny", dict(tensor_parallel_size=4)),
    ("deepseek-v32-tiny", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
])
def test_engine_over_ranks_gives_one_process_tokens(make_checkpoint, preset, parallel):
    """The engine's steps over 2 or 4 ranks (the workers replaying rank 0's slot and page copies): the same greedy
    tokens as one process through chunked prefill, prefix hits, preemption and a fork, and its logprobs to fp32
    rounding."""
    path = make_checkpoint(preset)
    want_tokens, want_logprobs = _engine_scenario(path)
    got_tokens, got_logprobs = _engine_scenario(path, **parallel)
    assert got_tokens == want_tokens
    for got, want in zip(got_logprobs[0], want_logprobs[0]):
        assert abs(got[0] - want[0]) < 1e-4 and [t for t, _ in got[1]] == [t for t, _ in want[1]]
