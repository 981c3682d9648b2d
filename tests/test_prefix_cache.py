"""Hybrid prefix caching: shared pages plus KDA state checkpoints give the same tokens as a cold run, hit the shared
prefix, survive preemption and checkpoint eviction, respect cache_salt, and keep every pool consistent."""

import pytest
import torch

from deltaserve import SamplingParams
from engine_utils import assert_pools_free, assert_same_greedy, make_llm, new_stats, pool_bytes


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _tokens(n: int, seed: int, high: int = 700) -> list[int]:
    return torch.randint(5, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine, prompt, params, rid, salt=None):
    engine.add_request(rid, prompt, params, cache_salt=salt)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


def test_multi_turn_chat_hits_and_matches_the_cold_run(make_checkpoint):
    path = make_checkpoint("k31-tiny")
    warm = make_llm(path).engine
    cold = make_llm(path, enable_prefix_caching=False).engine
    stats = new_stats("multi-turn")
    conversation = _tokens(40, 1)
    previous_len = 0
    for turn in range(4):
        a = _run(warm, conversation, _greedy(10), f"w{turn}")
        b = _run(cold, conversation, _greedy(10), f"c{turn}")
        assert_same_greedy(a.outputs[0].token_ids, conversation, warm.model, stats)
        assert_same_greedy(b.outputs[0].token_ids, conversation, cold.model, stats)
        if turn:
            # everything up to the last full page before the newest message is served from cache
            assert a.num_cached_tokens >= (previous_len // 16) * 16 - 16, (turn, a.num_cached_tokens)
            assert a.num_cached_tokens > 0
        assert b.num_cached_tokens == 0
        previous_len = len(conversation) + 10
        conversation = conversation + a.outputs[0].token_ids + _tokens(13, 100 + turn)
    stats.assert_rare()
    assert_pools_free(warm)
    assert warm.prefix.num_hit_tokens > 0 and warm.pages.num_cached > 0


def test_shared_system_prompt_is_served_from_cache_with_the_default_block_size(make_checkpoint):
    path = make_checkpoint("k31-tiny")
    system = _tokens(640, 2)  # ten default-size (64-token) pages
    questions = [_tokens(20 + i, 50 + i) for i in range(20)]
    warm = make_llm(path, block_size=64, max_num_batched_tokens=1024, kv_cache_memory="32MiB").engine
    cached = []
    for i, q in enumerate(questions):  # arriving one after another, as a served system prompt does
        out = _run(warm, system + q, _greedy(4), f"q{i}")
        cached.append(out.num_cached_tokens)
    assert cached[0] == 0
    served = sum(cached[1:]) / (len(system) * (len(questions) - 1))
    assert served >= 0.9, cached
    assert_pools_free(warm)

    # token identity with caching on and off, all 20 submitted together
    prompts = [system + q for q in questions]
    on = make_llm(path, block_size=64, max_num_batched_tokens=1024, kv_cache_memory="32MiB")
    off = make_llm(path, block_size=64, max_num_batched_tokens=1024, kv_cache_memory="32MiB",
                   enable_prefix_caching=False)
    outs_on = on.generate(prompts, _greedy(6), use_tqdm=False)
    outs_off = off.generate(prompts, _greedy(6), use_tqdm=False)
    stats = new_stats("shared system prompt")
    for i, (p, a, b) in enumerate(zip(prompts, outs_on, outs_off)):
        if i < 3 or a.outputs[0].token_ids != b.outputs[0].token_ids:  # equal, or both right at a near-tie
            assert_same_greedy(a.outputs[0].token_ids, p, on.engine.model, stats)
            assert_same_greedy(b.outputs[0].token_ids, p, off.engine.model, stats)
    stats.assert_rare()
    assert sum(o.num_cached_tokens for o in outs_on) > 0
    assert_pools_free(on.engine)


def test_prompts_diverging_inside_a_page(make_checkpoint):
    path = make_checkpoint("k3-tiny")
    engine = make_llm(path).engine
    base = _tokens(50, 3)
    stats = new_stats("diverging inside a page")
    first = _run(engine, base, _greedy(8), "base")
    assert_same_greedy(first.outputs[0].token_ids, base, engine.model, stats)
    for cut in (33, 40, 47):  # 16-token pages: 33..47 fall inside the third page
        prompt = base[:cut] + _tokens(9, cut)
        out = _run(engine, prompt, _greedy(8), f"cut{cut}")
        assert out.num_cached_tokens == 32  # the two full pages before the divergence (checkpointed at the tail)
        assert_same_greedy(out.outputs[0].token_ids, prompt, engine.model, stats)
    stats.assert_rare()
    assert_pools_free(engine)


def test_hit_after_preemption_and_after_checkpoint_eviction(make_checkpoint):
    path = make_checkpoint("k31-tiny")
    stats = new_stats("preemption / eviction")
    # Few pages: the long request is preempted by recompute; on resume the prefix cache restores its pages.
    config = make_llm(path).engine.config
    memory = pool_bytes(config, num_slots=4, num_blocks=8, block_size=16, num_checkpoints=2)
    engine = make_llm(path, max_num_seqs=4, kv_cache_memory=memory, max_state_checkpoints=2,
                      max_num_batched_tokens=32).engine
    long_prompt, other = _tokens(60, 4), _tokens(50, 5)
    engine.add_request("long", long_prompt, _greedy(40))
    engine.add_request("other", other, _greedy(40))
    total_pages = engine.pages.num_blocks
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert total_pages == 8  # 128 tokens for 190: someone must be preempted
    assert engine.preempted_ids, "the scenario must preempt"
    for rid, prompt in (("long", long_prompt), ("other", other)):
        assert_same_greedy(done[rid].outputs[0].token_ids, prompt, engine.model, stats)
    assert_pools_free(engine)

    # Only one checkpoint: a second prefix evicts the first; the first prefix then hits only what is left
    # (its pages may survive the checkpoint) and still gives the same tokens.
    engine = make_llm(path, max_state_checkpoints=1).engine
    a, b = _tokens(70, 6), _tokens(70, 7)
    ref_a = _run(engine, a, _greedy(6), "a1")
    _run(engine, b, _greedy(6), "b1")
    again = _run(engine, a, _greedy(6), "a2")
    assert_same_greedy(ref_a.outputs[0].token_ids, a, engine.model, stats)
    assert_same_greedy(again.outputs[0].token_ids, a, engine.model, stats)
    assert engine.prefix.checkpoints.num_slots == 1
    stats.assert_rare()
    assert_pools_free(engine)


def test_different_cache_salts_never_share_pages(make_checkpoint):
    engine = make_llm(make_checkpoint("kimi-linear-tiny")).engine
    prompt = _tokens(70, 8)
    assert _run(engine, prompt, _greedy(3), "s1", salt="tenant-a").num_cached_tokens == 0
    assert _run(engine, prompt, _greedy(3), "s2", salt="tenant-b").num_cached_tokens == 0
    assert _run(engine, prompt, _greedy(3), "s3", salt=None).num_cached_tokens == 0
    assert _run(engine, prompt, _greedy(3), "s4", salt="tenant-a").num_cached_tokens == 64
    assert _run(engine, prompt, _greedy(3), "s5", salt=None).num_cached_tokens == 64
    assert_pools_free(engine)


@pytest.mark.slow
def test_integrity_under_eviction_pressure(make_checkpoint):
    """Many distinct and overlapping prefixes through a small pool: pages and checkpoints are evicted constantly;
    integrity is checked after every step and every output matches the reference."""
    path = make_checkpoint("k31-tiny")
    config = make_llm(path).engine.config
    memory = pool_bytes(config, num_slots=3, num_blocks=20, block_size=16, num_checkpoints=8)
    llm = make_llm(path, max_num_seqs=3, kv_cache_memory=memory, max_state_checkpoints=8, max_num_batched_tokens=48)
    stems = [_tokens(40, 20 + i) for i in range(3)]
    prompts = [stems[i % 3] + _tokens(5 + i, 40 + i) for i in range(16)]
    outs = llm.generate(prompts, _greedy(6), use_tqdm=False)
    stats = new_stats("eviction pressure")
    for p, o in zip(prompts, outs):
        assert_same_greedy(o.outputs[0].token_ids, p, llm.engine.model, stats)
    stats.assert_rare()
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert llm.engine.pages.num_blocks == 20 and llm.engine.prefix.checkpoints.num_slots == 8
    assert llm.engine.pages.num_evicted > 0 and llm.engine.prefix.num_checkpoints_evicted > 0
    assert_pools_free(llm.engine)
