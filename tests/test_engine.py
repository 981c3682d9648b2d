"""The engine end to end (fp32, CPU): batch invariance under staggered arrivals, chunked prefill budgets, recompute
preemption, seeded sampling across batch compositions, stop conditions with vLLM's semantics, n > 1, request
errors and aborts, logprobs and chat. Greedy outputs are checked against an argmax loop over `reference_logits`
(the plain no-cache forward) with `engine_utils.assert_same_greedy`; every engine checks both cache pools'
integrity after every step (`engine_utils.make_llm`) and must end with both pools completely free.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve import InvalidRequestError, SamplingParams
from deltaserve.chat import render_chat
from engine_utils import (ALL_STATS, NEAR_TIE, assert_pools_free, assert_same_greedy, assert_same_prefix, drive,
                          greedy, make_llm, new_stats, pool_bytes, random_prompts)

TWO_FAMILIES = ["k31-tiny", "kimi-linear-tiny"]

# 16 prompts of mixed lengths (block_size 16: 16/17 straddle a page boundary; 60 > index_topk 16 of k31-tiny).
LENGTHS = [1, 2, 3, 5, 7, 9, 12, 16, 17, 23, 29, 33, 40, 47, 55, 60]
ARRIVAL_STEPS = [0, 0, 0, 1, 1, 2, 3, 3, 4, 6, 7, 9, 10, 12, 15, 18]
MAX_TOKENS = [8 + i % 5 for i in range(len(LENGTHS))]  # 8..12


@pytest.fixture(scope="module", autouse=True)
def _report_near_ties(request):
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    lines = [s.summary() for s in ALL_STATS]
    total = sum(s.sequences for s in ALL_STATS)
    ties = sum(len(s.near_ties) for s in ALL_STATS)
    gap = min((s.min_gap for s in ALL_STATS), default=float("inf"))
    lines.append(f"total: {ties} near-tie divergences (gap < {NEAR_TIE}) in {total} greedy sequences checked; "
                 f"smallest top-2 gap {gap:.2g}")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown even when the tests pass
        if reporter is not None:
            reporter.write_line("")
        for line in lines:
            (reporter.write_line if reporter is not None else print)(f"[test_engine near-ties] {line}")


def _bpe(llm) -> int:
    return llm.tokenizer.num_bpe_ranks


_ALONE: dict = {}


def _alone(path, prompt: list[int], max_tokens: int) -> list[int]:
    """Tokens of `prompt` generated alone (no other request, whole prompt in one step), cached per checkpoint."""
    key = (str(path), tuple(prompt), max_tokens)
    if key not in _ALONE:
        llm = _ALONE.setdefault(("llm", str(path)), make_llm(path, max_num_batched_tokens=100_000))
        out = llm.generate([prompt], greedy(max_tokens), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
        assert llm.engine.max_step_requests == 1
        assert_pools_free(llm.engine)
        _ALONE[key] = list(out.token_ids)
    return _ALONE[key]


@torch.inference_mode()
def _assert_logprobs(c, prompt: list[int], model, num_top: int) -> None:
    """Each token's logprob entry is the log_softmax of the reference row that predicted it (within 1e-4): the
    sampled token's value and rank, and the top-`num_top` alternatives."""
    ref = torch.log_softmax(model.reference_logits(torch.tensor(prompt + c.token_ids)).float(), dim=-1)
    assert len(c.logprobs) == len(c.token_ids)
    for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert entry.token_id == tok
        assert abs(entry.logprob - row[tok].item()) < 1e-4, (i, entry.logprob, row[tok].item())
        assert int((row > row[tok] + 1e-4).sum()) + 1 <= entry.rank <= int((row > row[tok] - 1e-4).sum()) + 1
        assert len(entry.top) == num_top
        for (tid, lp), want in zip(entry.top, row.topk(max(num_top, 1)).values.tolist()):
            assert abs(lp - row[tid].item()) < 1e-4
            assert abs(lp - want) < 1e-4


# ------------------------------------------------------------------------------------------- batch invariance
@pytest.mark.slow
@pytest.mark.parametrize("preset", TWO_FAMILIES)
def test_batch_invariance_staggered_arrivals(make_checkpoint, preset):
    path = make_checkpoint(preset)
    llm = make_llm(path, max_num_batched_tokens=48)
    engine, model = llm.engine, llm.engine.model
    prompts = random_prompts(LENGTHS, seed=11, high=_bpe(llm))
    arrivals = [(ARRIVAL_STEPS[i], f"r{i}", prompts[i], greedy(MAX_TOKENS[i])) for i in range(len(prompts))]
    done = drive(engine, arrivals)
    # The run really mixed requests: many in one step, and steps filled to the token budget (chunked prefill).
    assert engine.max_step_requests >= 6
    assert engine.max_step_tokens == 48

    stats = new_stats(f"batch invariance {preset}")
    for i, prompt in enumerate(prompts):
        out = done[f"r{i}"].outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS[i]
        alone = _alone(path, prompt, MAX_TOKENS[i])
        got_batch = assert_same_greedy(out.token_ids, prompt, model, stats)
        got_alone = assert_same_greedy(alone, prompt, model, stats)
        assert_same_prefix(out.token_ids, alone, got_batch, got_alone)
    print(stats.summary())
    stats.assert_rare()


# --------------------------------------------------------------------------------------------- chunked prefill
@pytest.mark.parametrize("budget", [pytest.param(1, marks=pytest.mark.slow), 7, 64, 100_000])
@pytest.mark.parametrize("preset", TWO_FAMILIES)
def test_chunked_prefill_budgets_give_the_same_tokens(make_checkpoint, preset, budget):
    path = make_checkpoint(preset)
    llm = make_llm(path, max_num_batched_tokens=budget, max_model_len=128)
    prompts = random_prompts(LENGTHS, seed=11, high=_bpe(llm))
    if budget == 1:  # one token per step: keep it short
        prompts = prompts[::2]
    outs = llm.generate(prompts, greedy(8), use_tqdm=False)
    engine = llm.engine
    if budget < 100_000:
        assert engine.max_step_tokens == budget  # every step's budget is respected (and filled at the start)
    else:
        assert engine.max_step_tokens == sum(len(p) for p in prompts)  # everything prefilled in one step
    assert_pools_free(engine)

    stats = new_stats(f"chunked prefill {preset} budget={budget}")
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 8
        assert_same_greedy(tokens, prompt, engine.model, stats)
    stats.assert_rare()


# -------------------------------------------------------------------------------------------------- preemption
@pytest.mark.slow
@pytest.mark.parametrize("preset, budget", [("k31-tiny", 64), ("kimi-linear-tiny", 24)])
def test_preemption_by_recompute_gives_the_same_tokens(make_checkpoint, preset, budget):
    path = make_checkpoint(preset)
    probe = make_llm(path)
    # 8 state slots and 10 pages of 16 tokens (160 tokens) for 12 requests that need up to 4 pages each.
    memory = pool_bytes(probe.engine.config, num_slots=8, num_blocks=10, block_size=16)
    llm = make_llm(path, max_num_seqs=8, block_size=16, kv_cache_memory=memory, max_num_batched_tokens=budget,
                   max_state_checkpoints=2)
    engine = llm.engine
    assert (engine.pages.num_blocks, engine.states.num_slots) == (10, 8)
    lengths = [18, 21, 24, 32, 30, 33, 36, 39, 42, 45, 20, 31]
    prompts = random_prompts(lengths, seed=5, high=_bpe(llm))
    params = [greedy(12) for _ in prompts]
    params[3] = greedy(12, n=2)  # two completions sharing the prompt's two full pages, both preemptible
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    assert len(engine.preempted_ids) == engine.scheduler.num_preemptions
    assert_pools_free(engine)

    stats = new_stats(f"preemption {preset}")
    for prompt, out, p in zip(prompts, outs, params):
        assert len(out.outputs) == p.n
        for c in out.outputs:
            assert c.finish_reason == "length" and len(c.token_ids) == 12
            assert_same_greedy(c.token_ids, prompt, engine.model, stats)
    assert outs[3].outputs[0].token_ids == outs[3].outputs[1].token_ids
    print(f"{preset}: {engine.scheduler.num_preemptions} preemptions of {sorted(set(engine.preempted_ids))}")
    stats.assert_rare()


# ---------------------------------------------------------------------------------------------- seeded sampling
def _seeded(seed: int = 1234, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=10, ignore_eos=True, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("preset", TWO_FAMILIES)
def test_seeded_sampling_is_reproducible_across_runs_and_batches(make_checkpoint, preset):
    path = make_checkpoint(preset)
    first = make_llm(path)
    bpe = _bpe(first)
    prompt, *others = random_prompts([30, 33, 7, 50, 12, 26], seed=21, high=bpe)

    def alone(llm):
        out = llm.generate([prompt], _seeded(), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 10
        return out.token_ids

    want = alone(first)
    assert alone(first) == want  # same engine again
    assert alone(make_llm(path, seed=99)) == want  # a fresh engine with another engine seed
    assert alone(make_llm(path, max_num_batched_tokens=5)) == want  # prompt split into 6 chunks

    # Teeth: the seed matters, and the draw is not the greedy path.
    assert first.generate([prompt], _seeded(seed=1235), use_tqdm=False)[0].outputs[0].token_ids != want
    assert first.generate([prompt], greedy(10), use_tqdm=False)[0].outputs[0].token_ids != want

    # With unseeded, other-seeded and greedy neighbours, arriving before and after it, at two budgets.
    for budget in (64, 9):
        llm = make_llm(path, max_num_batched_tokens=budget)
        arrivals = [(0, "a", others[0], SamplingParams(temperature=1.0, max_tokens=12)),
                    (0, "b", others[1], _seeded(seed=7)),
                    (2, "target", prompt, _seeded()),
                    (3, "c", others[2], greedy(6)),
                    (5, "d", others[3], SamplingParams(temperature=0.5, top_p=0.5, max_tokens=9)),
                    (5, "e", others[4], _seeded(seed=1234, n=2))]
        done = drive(llm.engine, arrivals)
        assert done["target"].outputs[0].token_ids == want, budget
        assert llm.engine.max_step_requests >= 4

    # Preempted and recomputed: 5 pages; once the target (admitted last, 30 + 10 tokens) needs its third page while
    # f0 holds three, the newest running request, the target, is the victim.
    # (Prefix caching off: cached pages would change who runs out of pages first; tests/test_prefix_cache.py covers
    # preemption with the cache.)
    memory = pool_bytes(first.engine.config, num_slots=4, num_blocks=5, block_size=16, num_checkpoints=0)
    llm = make_llm(path, max_num_seqs=4, kv_cache_memory=memory, block_size=16, enable_prefix_caching=False)
    arrivals = [(0, "f0", others[0], SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)),
                (0, "f1", others[2], SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)),
                (1, "target", prompt, _seeded())]
    done = drive(llm.engine, arrivals)
    assert "target" in llm.engine.preempted_ids
    assert done["target"].outputs[0].token_ids == want


# ----------------------------------------------------------------------------------------------- stop conditions
def _printable(tok, token_id: int) -> str:
    """The token's text if it is a plain printable-ASCII BPE token, else ''."""
    if tok.is_special(token_id):
        return ""
    raw = tok.id_to_bytes(token_id)
    return raw.decode() if raw and all(32 <= b < 127 for b in raw) else ""


@pytest.fixture(scope="module")
def k31_greedy(make_checkpoint):
    """k31-tiny, a few prompts and their 16-token greedy completions (tokens, text)."""
    path = make_checkpoint("k31-tiny")
    llm = make_llm(path)
    prompts = random_prompts([9, 14, 22, 31, 40, 11, 27, 35], seed=31, high=_bpe(llm))
    outs = llm.generate(prompts, greedy(16), use_tqdm=False)
    stats = new_stats("stop-condition baselines k31-tiny")
    for p, o in zip(prompts, outs):
        assert_same_greedy(o.outputs[0].token_ids, p, llm.engine.model, stats)
    stats.assert_rare()
    return path, llm.tokenizer, [(p, list(o.outputs[0].token_ids), o.outputs[0].text) for p, o in zip(prompts, outs)]


def test_stop_string_spanning_two_tokens(k31_greedy):
    path, tok, runs = k31_greedy
    found = None
    for prompt, tokens, text in runs:
        for k in range(1, len(tokens) - 3):
            a, b = _printable(tok, tokens[k]), _printable(tok, tokens[k + 1])
            if not a or not b:
                continue
            head = tok.decode(tokens[:k + 1], skip_special_tokens=True)  # text through token k
            assert text.startswith(head)
            stop = a[-2:] + b[:2]
            pos = len(head) - len(a[-2:])
            if text.find(stop) == pos:  # first occurrence starts inside token k and ends inside token k + 1
                found = prompt, tokens, text, k, stop, pos
                break
        if found:
            break
    assert found, "no greedy completion has two adjacent printable tokens to build a stop string from"
    prompt, tokens, text, k, stop, pos = found
    llm = make_llm(path)

    out = llm.generate([prompt], greedy(16, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == tokens[:k + 2]  # every generated token is kept, through the one completing the stop
    assert out.text == text[:pos]  # the text is cut before the stop string

    out = llm.generate([prompt], greedy(16, stop=[stop], include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == tokens[:k + 2]
    assert out.text == text[:pos + len(stop)]

    # A stop string that never occurs changes nothing.
    out = llm.generate([prompt], greedy(16, stop=["\x00never\x00"]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.token_ids == tokens and out.text == text
    assert_pools_free(llm.engine)


def test_stop_token_ids_and_max_tokens(k31_greedy):
    path, tok, runs = k31_greedy
    found = None
    for prompt, tokens, text in runs:
        for j in range(2, len(tokens) - 2):
            if _printable(tok, tokens[j]) and tokens[j] not in tokens[:j]:
                found = prompt, tokens, text, j
                break
        if found:
            break
    assert found
    prompt, tokens, text, j = found
    stop_id = tokens[j]
    llm = make_llm(path)

    out = llm.generate([prompt], greedy(16, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == tokens[:j + 1]
    # vLLM leaves the stop token's own text out, unless include_stop_str_in_output.
    assert out.text == tok.decode(tokens[:j], skip_special_tokens=True)

    out = llm.generate([prompt], greedy(16, stop_token_ids=[stop_id], include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == tokens[:j + 1]
    assert out.text == tok.decode(tokens[:j + 1], skip_special_tokens=True)

    for m in (1, 5, 16):
        out = llm.generate([prompt], greedy(m), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "length" and out.stop_reason is None
        assert out.token_ids == tokens[:m]
    assert_pools_free(llm.engine)


def test_min_tokens_suppresses_stop_ids(k31_greedy):
    path, tok, runs = k31_greedy
    prompt, tokens, _ = next((p, t, x) for p, t, x in runs if t[1] not in t[:1])
    stop_id = tokens[1]
    llm = make_llm(path)
    model = llm.engine.model

    out = llm.generate([prompt], greedy(10, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:2] and out.finish_reason == "stop"  # without min_tokens it stops at step 1

    out = llm.generate([prompt], greedy(10, stop_token_ids=[stop_id], min_tokens=3), use_tqdm=False)[0].outputs[0]
    got = out.token_ids
    assert len(got) >= 4 or (out.finish_reason == "length" and len(got) == 10)
    assert stop_id not in got[:3]
    assert got[0] == tokens[0]
    if out.finish_reason == "stop":
        assert got[-1] == stop_id and stop_id not in got[:-1] and out.stop_reason == stop_id
    else:
        assert stop_id not in got
    # Until 3 tokens exist the stop id (and eos) is masked; the rest is plain greedy.
    banned = sorted(set(llm.engine.eos_ids) | {stop_id})
    stats = new_stats("min_tokens k31-tiny")
    assert assert_same_greedy(got, prompt, model, stats, banned=banned, min_tokens=3) == len(got)
    assert_pools_free(llm.engine)


def test_eos_ignore_eos_and_min_tokens(k31_greedy):
    """The random model never emits its real eos, so the test declares the greedy token at step 1 to be eos."""
    path, tok, runs = k31_greedy
    prompt, tokens, text = next((p, t, x) for p, t, x in runs if t[1] not in t[:1] and _printable(tok, t[1]))
    llm = make_llm(path)
    llm.engine.eos_ids = {tokens[1]}

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None  # vLLM: eos gives stop_reason None
    assert out.token_ids == tokens[:2]
    assert out.text == tok.decode(tokens[:1], skip_special_tokens=True)  # eos text left out

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == tokens[:10]

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    assert tokens[1] not in out.token_ids[:3] and len(out.token_ids) >= 4
    assert_pools_free(llm.engine)


# --------------------------------------------------------------------------------------------------------- n > 1
@pytest.mark.parametrize("preset", TWO_FAMILIES)
def test_n_completions_share_one_prompt_computation(make_checkpoint, preset):
    path = make_checkpoint(preset)
    P, M = 21, 7
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=M, ignore_eos=True, logprobs=0)

    def run(p, **engine_kw):
        llm = make_llm(path, **engine_kw)
        (prompt,) = random_prompts([P], seed=8, high=_bpe(llm))
        out = llm.generate([prompt], p, use_tqdm=False)
        assert len(out) == 1
        assert_pools_free(llm.engine)
        return prompt, out[0], llm.engine

    prompt, out, engine = run(params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == M and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent samples
    assert engine.forward_tokens == P + 3 * (M - 1)  # the prompt once, then each completion's own decodes
    for c in out.outputs:  # the forked completions read the parent's pages and state: all as in the reference
        _assert_logprobs(c, prompt, engine.model, num_top=0)
    _, again, _ = run(params, seed=5)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    # A budget that splits the prompt still computes it once and samples the same streams.
    _, chunked, engine = run(params, max_num_batched_tokens=8)
    assert [c.token_ids for c in chunked.outputs] == [c.token_ids for c in out.outputs]
    assert engine.forward_tokens == P + 3 * (M - 1)

    prompt, g3, engine = run(greedy(M, n=3, logprobs=0))
    _, g1, _ = run(greedy(M))
    assert [c.index for c in g3.outputs] == [0, 1, 2]
    assert all(c.token_ids == g1.outputs[0].token_ids for c in g3.outputs)
    for c in g3.outputs:
        _assert_logprobs(c, prompt, engine.model, num_top=0)
    assert engine.forward_tokens == P + 3 * (M - 1)
    stats = new_stats(f"n=3 greedy {preset}")
    assert_same_greedy(g1.outputs[0].token_ids, prompt, engine.model, stats)
    stats.assert_rare()

    # One sequence at a time: no room to fork, so the other two completions compute the prompt themselves
    # (without the prefix cache; with it they start from the cached full pages and state checkpoint).
    _, alone, engine = run(greedy(M, n=3), max_num_seqs=1, enable_prefix_caching=False)
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in g3.outputs]
    assert engine.forward_tokens == 3 * P + 3 * (M - 1)
    _, cached, engine = run(greedy(M, n=3), max_num_seqs=1)
    assert [c.token_ids for c in cached.outputs] == [c.token_ids for c in g3.outputs]
    hit = (P - 1) // 16 * 16
    assert engine.forward_tokens == P + 2 * (P - hit) + 3 * (M - 1)


# ----------------------------------------------------------------------------------------------- errors, abort
@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed=1.5), "seed"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field and field in str(err.value)


def test_request_errors_leave_the_engine_clean_and_serving(make_checkpoint):
    path = make_checkpoint("k31-tiny")
    llm = make_llm(path, max_model_len=32)
    engine = llm.engine
    vocab = engine.config.vocab_size
    (good,) = random_prompts([6], seed=3, high=_bpe(llm))
    want = llm.generate([good], greedy(4), use_tqdm=False)[0].outputs[0].token_ids

    def serves():
        assert_pools_free(engine)
        out = llm.generate([good], greedy(4), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == want
        assert_pools_free(engine)

    bad_prompts = [([1] * 32, "prompt"),  # == max_model_len: no room for one token
                   ([1] * 40, "prompt"),
                   ("", "prompt"),
                   ([], "prompt"),
                   ([5, vocab], "prompt"),
                   ([-1, 5], "prompt")]
    for prompt, field in bad_prompts:
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request("bad", prompt, greedy(4))
        assert err.value.field == field, prompt
        serves()
        # Through LLM.generate, behind a valid request of the same batch: nothing of the batch stays queued.
        with pytest.raises(InvalidRequestError) as err:
            llm.generate([good, prompt], greedy(4), use_tqdm=False)
        assert err.value.field == field
        serves()
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(temperature=-1.0)
    assert err.value.field == "temperature"
    serves()

    # The longest valid prompt gets exactly the one token that fits.
    out = llm.generate([[1] * 31], greedy(10), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    # max_tokens=None runs to max_model_len.
    out = llm.generate([good], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 32 - len(good) and out.finish_reason == "length"

    # A request id in use is refused and the first request is unaffected.
    engine.add_request("dup", good, greedy(4))
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("dup", good, greedy(4))
    assert err.value.field == "request_id"
    done = drive(engine, [])
    assert list(done) == ["dup"] and done["dup"].outputs[0].token_ids == want
    serves()


def test_abort_frees_pages_and_slots(make_checkpoint):
    path = make_checkpoint("k31-tiny")
    llm = make_llm(path, max_num_batched_tokens=16)
    engine, pages, states = llm.engine, llm.engine.pages, llm.engine.states
    a, b, c, d, e = random_prompts([40, 20, 20, 25, 60], seed=4, high=_bpe(llm))
    engine.add_request("a", a, greedy(50))
    engine.add_request("b", b, greedy(6))
    engine.add_request("n2", c, greedy(30, n=2))
    for _ in range(7):
        engine.step()

    def running():
        return {r.request_id: r for r in engine.scheduler.running if r.request_id != "n2"}

    assert set(running()) == {"a", "b"}
    n2 = [r for r in engine.scheduler.running if r.request_id == "n2"]
    assert len(n2) == 2 and n2[0].block_ids[0] == n2[1].block_ids[0]  # the prompt's full page is shared
    ra = running()["a"]
    assert ra.output_ids and len(ra.block_ids) == 3  # mid-decode: 40 prompt + a few tokens in pages of 16
    free_pages, free_slots = pages.num_free, states.num_free
    engine.abort_request("a")
    engine.check_integrity()
    assert (pages.num_free, states.num_free) == (free_pages + 3, free_slots + 1)
    assert ra.block_ids == [] and ra.state_slot is None and ra.finish_reason == "abort"

    free_pages, free_slots = pages.num_free, states.num_free
    engine.abort_request("n2")  # two completions: 1 shared page + 2 own pages, 2 slots
    engine.check_integrity()
    assert (pages.num_free, states.num_free) == (free_pages + 3, free_slots + 2)
    assert set(running()) == {"b"} and len(engine.scheduler.running) == 1

    engine.add_request("e", e, greedy(4))
    engine.step()  # b decodes, e takes the rest of the budget: a chunked prefill in progress
    re_ = running()["e"]
    assert 0 < re_.num_computed_tokens < len(e) and re_.block_ids
    free_pages, free_slots = pages.num_free, states.num_free
    held = len(re_.block_ids)
    engine.abort_request("e")
    engine.check_integrity()
    assert (pages.num_free, states.num_free) == (free_pages + held, free_slots + 1)

    engine.add_request("d", d, greedy(4))
    engine.abort_request("d")  # still waiting: holds nothing, leaves the queue
    assert not engine.scheduler.waiting
    engine.abort_request("nope")  # unknown ids are ignored
    engine.check_integrity()
    done = drive(engine, [])  # b, untouched by the aborts around it, finishes normally
    assert list(done) == ["b"]
    out = done["b"].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    stats = new_stats("abort k31-tiny")
    assert_same_greedy(out.token_ids, b, engine.model, stats)
    stats.assert_rare()
    assert_pools_free(engine)


# ---------------------------------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("preset", TWO_FAMILIES)
def test_logprobs_match_the_reference(make_checkpoint, preset):
    path = make_checkpoint(preset)
    llm = make_llm(path)
    model = llm.engine.model
    prompts = random_prompts([13, 37], seed=6, high=_bpe(llm))
    params = [greedy(6, logprobs=2), SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True,
                                                    logprobs=2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = new_stats(f"logprobs {preset}")
    for prompt, out, p in zip(prompts, outs, params):
        c = out.outputs[0]
        if p.greedy:
            assert assert_same_greedy(c.token_ids, prompt, model, stats) == len(c.token_ids)
        assert len(c.token_ids) == 6
        _assert_logprobs(c, prompt, model, num_top=2)
        if p.greedy:
            assert all(e.rank == 1 and e.top[0][0] == tok for tok, e in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob == pytest.approx(sum(e.logprob for e in c.logprobs), abs=1e-5)
    # Sampling did not just take the argmax every time (the logprobs ignore temperature, so ranks show it).
    assert any(e.rank > 1 for e in outs[1].outputs[0].logprobs)
    stats.assert_rare()


# -------------------------------------------------------------------------------------------------------- chat
def test_chat_k31_native_renderer(make_checkpoint):
    path = make_checkpoint("k31-tiny")
    llm = make_llm(path)
    tok = llm.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ids = render_chat(tok, llm.engine.config, messages)
    tail = ([tok.token_to_id("<|open|>")] + tok.encode('message role="assistant"') + [tok.token_to_id("<|sep|>")]
            + [tok.token_to_id("<|open|>")] + tok.encode("think") + [tok.token_to_id("<|sep|>")])
    assert None not in tail
    assert ids[-len(tail):] == tail
    (out,) = llm.chat(messages, greedy(5), use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert len(out.outputs[0].token_ids) == 5
    stats = new_stats("chat k31-tiny")
    assert_same_greedy(out.outputs[0].token_ids, ids, llm.engine.model, stats)
    stats.assert_rare()
    assert_pools_free(llm.engine)


def test_chat_kimi_linear_jinja_template(make_checkpoint):
    path = make_checkpoint("kimi-linear-tiny")
    llm = make_llm(path)
    tok = llm.tokenizer
    assert tok.chat_template
    messages = [{"role": "user", "content": "Hello there"}]
    ids = render_chat(tok, llm.engine.config, messages)
    assert "Hello there" in tok.decode(ids)
    outs = llm.chat([messages, messages + [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "?"}]],
                    greedy(5), use_tqdm=False)
    assert len(outs) == 2 and outs[0].prompt_token_ids == ids
    assert len(outs[1].prompt_token_ids) > len(ids)
    stats = new_stats("chat kimi-linear-tiny")
    for out in outs:
        assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
        assert_same_greedy(out.outputs[0].token_ids, out.prompt_token_ids, llm.engine.model, stats)
    stats.assert_rare()
    assert_pools_free(llm.engine)


def test_step_timer_accounts_for_every_phase(make_checkpoint):
    """The step timer sees every step, puts time in every phase, and its phases add up to (most of) the wall time of
    the steps; the overhead share is the non-model part."""
    import time

    llm = make_llm(make_checkpoint("k31-tiny"))
    engine = llm.engine
    timer = engine.core.timer
    timer.reset()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(random_prompts([12, 30, 5], seed=2, high=700)):
        engine.add_request(f"t{i}", p, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - start
    report = timer.report()
    assert timer.steps == engine.num_steps > 0
    assert all(report[f"{k}_s"] > 0 for k in ("schedule", "prepare", "model", "sample", "update", "detokenize"))
    assert 0.5 * wall < report["total_s"] <= wall
    assert report["overhead_share"] == pytest.approx(1 - report["model_s"] / report["total_s"])
