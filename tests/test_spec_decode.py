"""Speculative decoding (docs/serving.md §9): the config, the suffix proposer on its own, and the engine with drafts,
whose outputs must be the ones it gives without them: greedy tokens checked against the plain reference forward
(`engine_utils.assert_same_greedy`) and against a run without speculation, under chunked prefill, prefix hits,
preemption, n > 1, logprobs and stop strings, on both execution backends, with the pools checked after every step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.state_slots import StateSlots
from deltaserve.errors import ConfigError
from deltaserve.layers.batch import StepBatch
from deltaserve.spec_decode import DraftRequest, Proposal, Proposer, SpeculativeConfig, SuffixProposer
from engine_utils import (assert_pools_free, assert_same_greedy, assert_same_prefix, greedy, make_llm, new_stats,
                          pool_bytes, random_prompts)
from server_utils import metric, run_server

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
MTP = {"method": "mtp", "num_speculative_tokens": 3}
CHI2_7DOF_P001 = 24.322  # the chi-square distribution with 7 degrees of freedom exceeds this with probability 0.001


class Seq:
    """A token sequence as the proposer reads a request."""

    def __init__(self, tokens):
        self.tokens = list(tokens)

    @property
    def num_tokens(self):
        return len(self.tokens)

    def token_slice(self, start, end):
        return self.tokens[start:end]


# ------------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("value, needle", [
    ('{"method": "suffix"', "not valid JSON"),
    ("[1]", "JSON object"),
    ({"num_speculative_tokens": 2}, "'method'"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "suffix", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "suffix", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "suffix", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown keys"),
    ({"method": "suffix", "num_speculative_tokens": 2, "model": "/x"}, "model"),
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 2}, "min_token_prob"),
    ({"method": "dspark", "num_speculative_tokens": 2, "dspark_max_skip": -1}, "dspark_max_skip"),
])
def test_config_errors_name_the_key(value, needle):
    with pytest.raises(ConfigError, match=needle):
        SpeculativeConfig.parse(value)


def test_dspark_without_a_drafter_folder_names_where_it_looked(make_checkpoint):
    """Without `model`, the drafter shipped beside the target (MODEL/dspark) is taken; a model without one is
    refused at start naming that folder."""
    path = make_checkpoint("k31-tiny")
    with pytest.raises(ConfigError, match=f"no drafter at {path / 'dspark'}"):
        make_llm(path, speculative_config={"method": "dspark", "num_speculative_tokens": 2})


def test_config_from_json_and_dict():
    text = '{"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 8}'
    config = SpeculativeConfig.parse(text)
    assert config == SpeculativeConfig.parse(config.to_dict())
    assert (config.method, config.num_speculative_tokens, config.suffix_decoding_max_tree_depth) == ("suffix", 3, 8)
    assert SpeculativeConfig.parse(None) is None


# ---------------------------------------------------------------------------------------------- suffix proposer
def test_suffix_proposer_continues_what_followed_the_longest_match():
    p = SuffixProposer(max_tree_depth=8, max_spec_factor=4.0, min_token_prob=0.1)
    seq = Seq([1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 6, 7, 1, 2, 3])
    # the last pair (2, 3) occurs twice before: its longest match is [1, 2, 3] (ending at index 2), followed by 4, 5
    assert p.draft(seq, 4) == [4, 5, 9, 9]
    assert p.draft(seq, 2) == [4, 5]
    # max_spec_factor bounds the draft by the match length (3 tokens matched)
    assert SuffixProposer(max_tree_depth=8, max_spec_factor=1.0).draft(Seq(seq.tokens), 8) == [4, 5, 9]
    # no earlier occurrence of the last pair: no draft
    assert p.draft(Seq([1, 2, 3, 4]), 4) == []
    assert p.draft(Seq([7]), 4) == []


def test_suffix_proposer_takes_the_majority_and_stops_under_min_token_prob():
    tokens = [5, 6, 1, 0, 5, 6, 1, 0, 5, 6, 2, 0, 5, 6]  # (5, 6) was followed by 1 twice and by 2 once
    assert SuffixProposer(max_tree_depth=2, max_spec_factor=4.0, min_token_prob=0.5).draft(Seq(tokens), 4) == \
        [1, 0, 5, 6]
    # 2/3 < 0.7: no draft at all
    assert SuffixProposer(max_tree_depth=2, max_spec_factor=4.0, min_token_prob=0.7).draft(Seq(tokens), 4) == []


def test_suffix_proposer_grows_with_the_request_and_shares_finished_outputs():
    p = SuffixProposer(max_tree_depth=8, max_spec_factor=2.0, max_cached_requests=2)
    a = Seq([1, 2, 3])
    assert p.draft(a, 4) == []
    a.tokens += [7, 8, 9, 1, 2, 3]
    assert p.draft(a, 4) == [7, 8, 9, 1]  # the index caught up with the new tokens
    p.finish(a, [10, 11, 12, 13, 14])
    # a new request ending in (11, 12) drafts from the finished output
    assert p.draft(Seq([4, 10, 11, 12]), 3) == [13, 14]
    p.finish(Seq([]), [20, 21, 22, 23])
    p.finish(Seq([]), [30, 31, 32, 33])
    assert p.num_cached_responses == 2  # the first output was evicted, with its pairs
    assert p.draft(Seq([4, 10, 11, 12]), 3) == []
    assert p.draft(Seq([5, 30, 31]), 2) == [32, 33]


# ------------------------------------------------------------------------------------------- engine: greedy
class ScriptedProposer(Proposer):
    """Drafts each request's true greedy continuation (from a run without drafts), with one token made wrong at a
    position that rotates from step to step (or none): verify steps then keep every number of drafts from 0 to k,
    so both ways of settling one (the state the step ended with, a rolled-back snapshot) run many times. The random
    test models do not repeat themselves, so no real proposer's drafts would be kept on them."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int):
        self.continuations, self.vocab, self.calls = continuations, vocab, 0

    def propose(self, requests):
        out = []
        for seq, room in requests:
            done = len(seq.output_ids)
            drafts = list(self.continuations[tuple(seq.prompt_ids)][done:done + room])
            self.calls += 1
            wrong = self.calls % (room + 1)
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % self.vocab
            out.append(Proposal(drafts))
        return out

    def finish(self, seq, output):
        pass


def _looping_prompts(high: int) -> list[list[int]]:
    """Random prompts of mixed lengths, two of them built from a repeated phrase (the suffix proposer drafts from
    those)."""
    g = torch.Generator().manual_seed(3)
    phrase = torch.randint(0, high, (7,), generator=g).tolist()
    return random_prompts([3, 9, 17, 33, 40], seed=11, high=high) + [phrase * 4, phrase * 2 + [1, 2]]


def _spec_pool_bytes(config, num_slots: int, num_blocks: int, k: int, drafter_layers: int = 0) -> int:
    """kv_cache_memory for `num_slots` working slots with k draft states each, two checkpoints and `num_blocks`
    pages of 16 tokens whose rows include `drafter_layers` drafter layers (fp32)."""
    layers = tuple(range(config.num_layers, config.num_layers + drafter_layers))
    return ((num_slots * (1 + k) + 2) * StateSlots.bytes_per_slot(config)
            + num_blocks * 16 * PagePool.bytes_per_token(config, torch.float32, drafter_layers=layers))


def _assert_greedy_as_without_speculation(path, prompts, params, stats, speculative_config=SUFFIX, scripted=False,
                                          spec_memory=None, **engine_kw):
    """Run `prompts` without and with speculation (with `scripted`: drafts from ScriptedProposer; `spec_memory`:
    the speculative engine's kv_cache_memory, which also holds its draft states); every greedy sequence of both runs
    checked against the plain forward and against each other; both pools free at the end. Returns the speculative
    engine and both runs' outputs."""
    base = make_llm(path, **engine_kw)
    spec_kw = dict(engine_kw, **({"kv_cache_memory": spec_memory} if spec_memory else {}))
    spec = make_llm(path, speculative_config=speculative_config, **spec_kw)
    outs = {"base": base.generate(prompts, params, use_tqdm=False)}
    if scripted:
        truth = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, outs["base"])}
        spec.engine.core.proposer = ScriptedProposer(truth, spec.engine.config.vocab_size)
    outs["spec"] = spec.generate(prompts, params, use_tqdm=False)
    model = spec.engine.model
    for prompt, a, b, p in zip(prompts, outs["base"], outs["spec"], params):
        assert len(a.outputs) == len(b.outputs) == p.n
        for ca, cb in zip(a.outputs, b.outputs):
            assert len(cb.token_ids) == p.max_tokens
            got_a = assert_same_greedy(ca.token_ids, prompt, model, stats)
            got_b = assert_same_greedy(cb.token_ids, prompt, model, stats)
            assert_same_prefix(ca.token_ids, cb.token_ids, got_a, got_b)
    for llm in (base, spec):
        assert_pools_free(llm.engine)
    return spec.engine, outs


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny"])
def test_verify_steps_keep_and_roll_back_drafts(make_checkpoint, preset, backend):
    """Drafts right up to a rotating position: the tokens are those without drafts, and every count of kept drafts
    (0 to k) occurred, so the KDA state was both kept and rolled back to each snapshot position."""
    path = make_checkpoint(preset)
    probe = make_llm(path)
    prompts = _looping_prompts(probe.tokenizer.num_bpe_ranks)
    stats = new_stats(f"scripted drafts {preset} {backend}")
    engine, _ = _assert_greedy_as_without_speculation(path, prompts, [greedy(40)] * len(prompts), stats,
                                                      scripted=True, backend=backend, max_num_batched_tokens=48)
    spec = engine.core.spec_stats
    print(f"{preset} {backend}: {spec.num_drafts} verify steps, {spec.num_accepted_tokens}/{spec.num_draft_tokens} "
          f"drafts kept, per position {spec.accepted_per_pos}; {stats.summary()}")
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert all(n > 0 for n in spec.accepted_per_pos)  # some step kept all k
    assert spec.accepted_per_pos[0] < spec.num_drafts  # some step kept none
    assert engine.core.stats()["spec_decode_num_draft_tokens"] == spec.num_draft_tokens
    stats.assert_rare()


@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny"])
def test_speculation_under_preemption_prefix_hits_n_and_logprobs(make_checkpoint, preset):
    """Small pools (preemption by recompute), prompts sharing pages (prefix hits), a small token budget (chunked
    prefill and verify steps cut short), n = 2 and logprobs, with scripted drafts: the same greedy tokens as without
    drafts, and the logprobs of the reference rows."""
    path = make_checkpoint(preset)
    probe = make_llm(path)
    high = probe.tokenizer.num_bpe_ranks
    shared = random_prompts([32], seed=4, high=high)[0]
    prompts = _looping_prompts(high) + [shared + p for p in random_prompts([3, 11, 20], seed=6, high=high)]
    memory = pool_bytes(probe.engine.config, num_slots=4, num_blocks=10, block_size=16)
    # the same 4 working slots and 10 pages, and each slot's 4 draft states
    spec_memory = _spec_pool_bytes(probe.engine.config, 4, 10, k=4)
    params = [greedy(24) for _ in prompts]
    params[1] = greedy(24, n=2)
    params[-1] = greedy(24, logprobs=2)
    stats = new_stats(f"scripted drafts under pressure {preset}")
    engine, outs = _assert_greedy_as_without_speculation(
        path, prompts, params, stats, scripted=True, spec_memory=spec_memory, max_num_seqs=4, block_size=16,
        kv_cache_memory=memory, max_num_batched_tokens=20, max_state_checkpoints=2)
    assert (engine.pages.num_blocks, engine.states.num_slots) == (10, 4)
    spec = engine.core.spec_stats
    assert engine.scheduler.num_preemptions > 0 and engine.prefix.num_hit_tokens > 0
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    last = outs["spec"][-1].outputs[0]
    ref = torch.log_softmax(engine.model.reference_logits(torch.tensor(prompts[-1] + last.token_ids)).float(), -1)
    for i, (tok, entry) in enumerate(zip(last.token_ids, last.logprobs)):
        row = ref[len(prompts[-1]) - 1 + i]
        assert abs(entry.logprob - row[tok].item()) < 1e-4
        assert [t for t, _ in entry.top] == row.topk(2).indices.tolist()
    stats.assert_rare()


@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny"])
def test_suffix_greedy_tokens_are_the_ones_without_speculation(make_checkpoint, preset):
    """The suffix proposer on the random models (it rarely finds a match there: the default-model test below
    measures its drafts being kept)."""
    path = make_checkpoint(preset)
    prompts = _looping_prompts(make_llm(path).tokenizer.num_bpe_ranks)
    stats = new_stats(f"suffix speculation {preset}")
    _assert_greedy_as_without_speculation(path, prompts, [greedy(40)] * len(prompts), stats,
                                          max_num_batched_tokens=48)
    stats.assert_rare()


def test_stop_string_inside_kept_drafts(make_checkpoint):
    """A stop string met inside the tokens one verify step emits ends the text there, as without drafts."""
    path = make_checkpoint("k31-tiny")
    base = make_llm(path)
    prompt = _looping_prompts(base.tokenizer.num_bpe_ranks)[3]
    full = base.generate([prompt], greedy(40), use_tqdm=False)[0].outputs[0]
    at = len(full.text) // 3
    stop = full.text[at:at + 2]
    assert stop.strip() and "\ufffd" not in stop, full.text
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    want = base.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    spec = make_llm(path, speculative_config=SUFFIX)
    spec.engine.core.proposer = ScriptedProposer({tuple(prompt): list(full.token_ids)}, spec.engine.config.vocab_size)
    got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, "stop", stop)
    assert spec.engine.core.spec_stats.num_accepted_tokens > 0
    assert_pools_free(spec.engine)


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.3), dict(min_tokens=30), dict(presence_penalty=0.5)])
def test_row_by_row_sampling_when_rows_read_the_tokens_before_them(make_checkpoint, kw):
    """Penalties and min_tokens read the tokens before each row: a verify step samples its rows one by one, each
    after the previous token is appended, and the tokens are those of the run without drafts."""
    path = make_checkpoint("k31-tiny")
    prompt = _looping_prompts(make_llm(path).tokenizer.num_bpe_ranks)[3]
    params = greedy(40, **kw)
    want = make_llm(path).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    spec = make_llm(path, speculative_config=SUFFIX)
    spec.engine.core.proposer = ScriptedProposer({tuple(prompt): list(want)}, spec.engine.config.vocab_size)
    assert spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert spec.engine.core.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("value, needle", [('{"method": "suffix"', "not valid JSON"),
                                           ('{"method": "mtp", "num_speculative_tokens": 2}', "no MTP layers")])
def test_cli_reports_a_bad_speculative_config_in_one_line(make_checkpoint, capsys, value, needle):
    from deltaserve.cli import main

    path = make_checkpoint("kimi-linear-tiny")  # no MTP layers
    assert main(["generate", str(path), "--prompt", "x", "--max-tokens", "2", "--speculative-config", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("deltaserve generate: error: speculative_config") and needle in err[-1]
    assert not any("Traceback" in line for line in err)


def test_speculative_config_flag_reaches_the_engine(make_checkpoint):
    path = make_checkpoint("k31-tiny")
    llm = make_llm(path, speculative_config='{"method": "suffix", "num_speculative_tokens": 2}')
    assert llm.engine.core.spec.num_speculative_tokens == 2
    assert llm.engine.core.drafts.num_slots == 2 * llm.engine.core.states.num_slots
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        make_llm(path, speculative_config={"method": "suffix", "num_speculative_tokens": 99})


# ---------------------------------------------------------------------------------------------------- MTP
def _recorded_drafts(path, config: dict, params: list[SamplingParams]):
    """Run the first len(params) looping prompts with `config` (prefix caching off, chunks of 24 tokens); returns the
    engine core and every proposal made: (the request's tokens then, its drafts)."""
    llm = make_llm(path, speculative_config=config, enable_prefix_caching=False, max_num_batched_tokens=24)
    core = llm.engine.core
    seen = []
    propose = core.proposer.propose

    def recording(requests):
        proposals = propose(requests)
        seen.extend((r.seq.prompt_ids + r.seq.output_ids, p.tokens) for r, p in zip(requests, proposals))
        return proposals

    core.proposer.propose = recording
    llm.generate(_looping_prompts(llm.tokenizer.num_bpe_ranks)[:len(params)], params, use_tqdm=False)
    assert_pools_free(llm.engine)
    return core, seen


def _mtp_reference(model, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
    """The first MTP layer's greedy chain after `tokens` by plain forwards (no cache): row p reads token p and the
    target's state at p - 1 (zero at 0); each further draft reads the previous draft and the layer's own output
    one position back. Returns the drafts and each one's top-2 logit gap."""
    ids = torch.tensor(tokens)
    h = model(ids, StepBatch.single(len(tokens)))
    layer = model.mtp[0]
    back = torch.cat([h.new_zeros(1, h.shape[1]), h[:-1]])
    seq, drafts, gaps = list(tokens), [], []
    for _ in range(k):
        x = torch.tensor(seq)
        out = layer(model.embed_tokens(x), back, torch.arange(len(seq)), StepBatch.single(len(seq)))
        top = layer.logits(out[-1:])[0].topk(2)
        drafts.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        seq.append(drafts[-1])
        back = torch.cat([back, out[-1:]])
    return drafts, gaps


@torch.no_grad()
def test_mtp_drafts_are_the_layer_run_without_a_cache(make_checkpoint):
    """Every draft the engine proposes (its MTP rows caught up chunk by chunk and step by step in the paged cache,
    forks included) is the chain a plain forward of the request's tokens gives, but at a near-tie."""
    core, seen = _recorded_drafts(make_checkpoint("k31-tiny"), MTP, [greedy(12), greedy(12, n=2), greedy(12),
                                                                     greedy(12)])
    checked = near_ties = 0
    for tokens, drafts in seen:
        if not drafts:
            continue  # a fork's first decode step, or no room
        want, gaps = _mtp_reference(core.model, tokens, len(drafts))
        for got, ref, gap in zip(drafts, want, gaps):
            if got != ref:
                assert gap < 1e-3, (tokens, drafts, want, gaps)
                near_ties += 1
                break
            checked += 1
    assert checked > 40 and near_ties <= 2, (checked, near_ties)


def _mtp_cascade_reference(model, tokens: list[int], k: int) -> list[int]:
    """The greedy drafts of a checkpoint's MTP layers after `tokens` by plain forwards (no cache), aligned as in
    training: layer j's row p reads token p and, one position back, the target's state (j = 0) or layer j - 1's
    output (zero at p = 0); draft d comes from layer min(d, n) - 1 at the newest position + d - 1, and past
    position newest + n - 1 the last layer reads its own output one position back."""
    n, hi = len(model.mtp), len(tokens) - 1
    seq = list(tokens)
    main = model(torch.tensor(tokens[:hi]), StepBatch.single(hi))
    outs: list[torch.Tensor | None] = [None] * n  # layer j's outputs at positions 0 .. its last
    drafts = []
    for d in range(1, k + 1):
        j, p = min(d, n) - 1, hi + d - 1
        src = main if j == 0 else outs[j - 1][:hi + j]  # what rows 1 .. hi + j read one position back
        if p > hi + j:
            src = torch.cat([src, outs[j][hi + j:p]])
        back = torch.cat([src.new_zeros(1, src.shape[1]), src])
        out = model.mtp[j](model.embed_tokens(torch.tensor(seq[:p + 1])), back, torch.arange(p + 1),
                           StepBatch.single(p + 1))
        outs[j] = out
        drafts.append(int(model.mtp[j].logits(out[-1:])[0].argmax()))
        seq.append(drafts[-1])
    return drafts


@torch.no_grad()
def test_mtp_drafts_of_several_layers_are_the_layers_run_without_a_cache(make_checkpoint, tmp_path):
    """A checkpoint with three MTP layers (k31-tiny's config, num_nextn_predict_layers 3), 4 drafts a step: every
    draft the engine proposes (each layer's rows caught up layer by layer, chunk by chunk and step by step, the
    layers after the drafting one computing their rows at the draft positions) is the plain cascade's, all but at
    most two (rounding between the paged and the plain forms at a near-tie); the greedy outputs are those without
    drafts."""
    import dataclasses

    from deltaserve.tools.make_model import write_checkpoint
    from deltaserve.tools.presets import get_preset

    preset = get_preset("k31-tiny")
    config = json.loads(json.dumps(preset.config))
    config["text_config"]["num_nextn_predict_layers"] = 3
    path = str(write_checkpoint(dataclasses.replace(preset, config=config), tmp_path / "mtp3", dtype="float32"))
    config4 = {"method": "mtp", "num_speculative_tokens": 4}
    core, seen = _recorded_drafts(path, config4, [greedy(12)] * 4)
    layers = core.model.config.num_layers
    assert {f"latent.{layers + j}" for j in range(3)} <= set(core.pages.named_storage(drafter=True))
    checked = near_ties = 0
    for tokens, drafts in seen:
        if not drafts:
            continue
        want = _mtp_cascade_reference(core.model, tokens, len(drafts))
        if drafts != want:
            near_ties += 1
            continue
        checked += 1
    print(f"three MTP layers: {checked} proposals as the plain cascade, {near_ties} not")
    assert checked > 10 and near_ties <= 2, (checked, near_ties)
    assert any(len(drafts) == 4 for _, drafts in seen)  # every layer drafted, and the last one past them
    prompts = _looping_prompts(preset.num_bpe_ranks)
    params = [greedy(20) for _ in prompts]
    params[1] = greedy(20, n=2)  # a fork: its first rows of layers 1 and 2 read zero one position back
    stats = new_stats("three MTP layers")
    engine, _ = _assert_greedy_as_without_speculation(path, prompts, params, stats, speculative_config=config4,
                                                      max_num_batched_tokens=20)
    assert engine.core.spec_stats.num_draft_tokens > 0
    stats.assert_rare()


def test_mtp_needs_mtp_layers(make_checkpoint):
    with pytest.raises(ConfigError, match="no MTP layers"):
        make_llm(make_checkpoint("kimi-linear-tiny"), speculative_config=MTP)


# ---------------------------------------------------------------------------------------------- stochastic
def _loop_prompt(llm) -> list[int]:
    """Python source and the model's greedy continuation of it, its last 24 tokens once more: the suffix proposer
    then drafts what followed them, the model's most likely tokens, so under sampling drafts are both kept and
    rejected."""
    from deltaserve.tools.corpus import VALIDATION_PATH

    start = llm.tokenizer.encode(VALIDATION_PATH.read_text()[:2000])[:48]
    out = llm.generate([start], greedy(64), use_tqdm=False)[0].outputs[0].token_ids
    return start + out + out[-24:]


@torch.inference_mode()
def _exact_distribution(model, prompt: list[int], depth: int, top_k: int) -> dict[tuple[int, ...], float]:
    """P(first `depth` tokens) under temperature 1 and top_k, by walking the tree of the top-k tokens with plain
    forwards."""
    probs = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, p in probs.items():
            row = model.reference_logits(torch.tensor(prompt + list(prefix))).float()[-1]
            top = row.topk(top_k)
            for tok, q in zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()):
                nxt[prefix + (tok,)] = p * q
        probs = nxt
    return probs


@pytest.fixture(scope="module")
def tiny_drafter(make_checkpoint, tmp_path_factory) -> str:
    """A DSpark drafter for k31-tiny, trained for a few steps on a repeated random phrase (its drafts are then
    sometimes right: both verification outcomes occur)."""
    from safetensors.torch import save_file

    from deltaserve.tools import train_dspark

    work = tmp_path_factory.mktemp("dspark")
    phrase = torch.randint(0, 200, (29,), generator=torch.Generator().manual_seed(1))
    save_file({"tokens": phrase.repeat(80).to(torch.int32)}, str(work / "tokens.safetensors"))
    train_dspark.main(["--target", str(make_checkpoint("k31-tiny")), "--tokens", str(work / "tokens.safetensors"),
                       "--out", str(work / "drafter"), "--work", str(work / "state"), "--steps", "30", "--batch",
                       "2", "--seq-len", "64", "--anchors", "8", "--lr", "3e-3", "--block-size", "3"])
    return str(work / "drafter")


def _config(method: str, drafter: str | None = None) -> dict:
    if method == "dspark":  # the whole block verified: the tiny drafter is too unsure for any confidence cut
        return {"method": "dspark", "num_speculative_tokens": 3, "model": drafter, "dspark_min_confidence": 0.0}
    return {"suffix": SUFFIX, "mtp": MTP}[method]


@torch.no_grad()
def test_dspark_blocks_stop_where_their_estimated_survival_falls_below_the_threshold(make_checkpoint, tiny_drafter):
    """A block's drafts are cut before the first one at which the product of the Markov head's probabilities of the
    drafts so far is below dspark_min_confidence; what is kept is the uncut block's prefix."""
    llm = make_llm(make_checkpoint("k31-tiny"), speculative_config=_config("dspark", tiny_drafter))
    proposer = llm.engine.core.proposer
    torch.manual_seed(0)
    base = torch.randn(3, llm.engine.config.vocab_size) * 4
    seq = SimpleNamespace(params=greedy(4), num_computed_tokens=0, token_slice=lambda a, b: [5][a:b])
    whole = proposer._markov([seq], [3], base.unsqueeze(0))[0].tokens
    survival, products, previous = 1.0, [], 5
    for k, token in enumerate(whole):
        q = torch.softmax(base[k] + proposer.drafter.markov_bias(torch.tensor(previous)), -1)
        survival *= float(q[token])
        products.append(survival)
        previous = token
    for threshold in (0.0, products[0] / 2, (products[0] + products[1]) / 2, 1.0):
        proposer.min_confidence = threshold
        kept = proposer._markov([seq], [3], base.unsqueeze(0))[0].tokens
        assert kept == whole[:sum(p >= threshold for p in products)], (threshold, products)


def test_dspark_requests_with_empty_blocks_skip_the_drafter_for_doubling_spells(make_checkpoint, tiny_drafter):
    """A request whose block is cut to no drafts sits out the next 1, 2, 4, ... propose calls (at most
    dspark_max_skip), is left out of the drafter pass meanwhile, and drafts every step again after a block with
    drafts; a finished request's count is dropped."""
    llm = make_llm(make_checkpoint("k31-tiny"),
                   speculative_config={**_config("dspark", tiny_drafter), "dspark_max_skip": 4})
    proposer = llm.engine.core.proposer

    class Seq:  # what propose reads of a request
        params = greedy(4)
        num_computed_tokens = num_drafter_tokens = 0

    quiet, other = Seq(), Seq()
    passes = []
    proposer._blocks = lambda seqs: passes.append(list(seqs)) or torch.zeros(len(seqs), 3, 8)
    proposer._markov = lambda seqs, rooms, base: [Proposal([] if seq is quiet else [1]) for seq in seqs]
    drafted = []
    for _ in range(16):
        proposer.propose([DraftRequest(quiet, 3), DraftRequest(other, 3)])
        drafted.append(quiet in passes[-1])
        assert other in passes[-1]
    # drafted at calls 0, 2, 5, 10, 15: skips of 1, 2, 4, 4 between them
    assert [i for i, d in enumerate(drafted) if d] == [0, 2, 5, 10, 15]
    proposer._markov = lambda seqs, rooms, base: [Proposal([1]) for _ in seqs]
    for _ in range(5):  # the 4 steps bought at call 15 run out; a block with drafts clears the count
        proposer.propose([DraftRequest(quiet, 3)])
    assert quiet in passes[-1] and quiet not in proposer._quiet
    proposer._markov = lambda seqs, rooms, base: [Proposal([]) for _ in seqs]
    proposer.propose([DraftRequest(quiet, 3)])
    assert quiet in proposer._quiet
    proposer.finish(quiet, [])
    assert quiet not in proposer._quiet


@pytest.mark.slow
@pytest.mark.parametrize("method", ["suffix", "mtp", "dspark"])
def test_sampled_tokens_keep_the_target_distribution(make_checkpoint, tiny_drafter, method):
    """2,000 seeded samples of 3 tokens (temperature 1, top_k 2) with drafts: the counts of the 8 possible
    continuations fit the model's exact distribution (chi-square, 7 degrees of freedom, p > 0.001)."""
    from deltaserve.default_model import default_model_path

    # the suffix proposer needs a model that repeats itself: the trained default model; the others k31-tiny
    path = default_model_path() if method == "suffix" else make_checkpoint("k31-tiny")
    llm = make_llm(path, speculative_config=_config(method, tiny_drafter), max_num_seqs=64,
                   max_num_batched_tokens=512, kv_cache_memory="512MiB")
    prompt = _loop_prompt(llm)
    want = _exact_distribution(llm.engine.model, prompt, 3, 2)
    params = [SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True, seed=i) for i in range(2000)]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    spec = llm.engine.core.spec_stats
    assert spec.num_draft_tokens > 0
    if method != "mtp":  # the random MTP layer's argmax is rarely in the top-2 support
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    counts = {k: 0 for k in want}
    for out in outs:
        counts[tuple(out.outputs[0].token_ids)] += 1  # a token outside the top-2 tree would raise here
    keys = sorted(want)
    observed = [counts[k] for k in keys]
    expected = [want[k] * len(outs) for k in keys]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    print(f"{method}: {spec.num_accepted_tokens}/{spec.num_draft_tokens} drafts kept; chi-square "
          f"{statistic:.2f}")
    assert statistic < CHI2_7DOF_P001, (observed, expected)
    assert_pools_free(llm.engine)


# ------------------------------------------------------------------------------------------------------ server
def test_server_speculates_and_reports_it_in_metrics():
    """`serve --speculative-config` on the default model: a streamed greedy completion is the offline one without
    drafts, and the spec_decode counters count drafts made and kept."""
    from deltaserve.default_model import default_model_path

    base = make_llm(default_model_path())
    prompt = _loop_prompt(base)
    want = base.generate([prompt], greedy(40), use_tqdm=False)[0].outputs[0].text
    with run_server(None, "--served-model-name", "default", "--dtype", "float32",
                    "--speculative-config", json.dumps(SUFFIX)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        stream = client.completions.create(model="default", prompt=prompt, max_tokens=40, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want
        drafted = metric(server, "deltaserve:spec_decode_num_draft_tokens_total")
        accepted = metric(server, "deltaserve:spec_decode_num_accepted_tokens_total")
        assert metric(server, "deltaserve:spec_decode_num_drafts_total") > 0
        assert 0 < accepted <= drafted


# ------------------------------------------------------------------------------------------- default model
def test_default_model_greedy_tokens_with_suffix_drafts():
    """The shipped model on Python source (validation windows), chunked prefill, shared prefixes and a pool small
    enough to preempt: the tokens of the run without speculation, drafts both kept and rejected."""
    from deltaserve.default_model import default_model_path
    from deltaserve.tools.corpus import VALIDATION_PATH

    path = default_model_path()
    probe = make_llm(path)
    ids = probe.tokenizer.encode(VALIDATION_PATH.read_text()[:60_000])
    prompts = [ids[i:i + n] for i, n in ((0, 40), (3000, 90), (7000, 64), (7000, 100), (12000, 33))]
    memory = pool_bytes(probe.engine.config, num_slots=3, num_blocks=14, block_size=16)
    stats = new_stats("default model suffix")
    engine, _ = _assert_greedy_as_without_speculation(
        path, prompts, [greedy(48)] * len(prompts), stats, speculative_config=SUFFIX, max_num_seqs=3,
        block_size=16, kv_cache_memory=memory, max_num_batched_tokens=64, max_state_checkpoints=2,
        spec_memory=_spec_pool_bytes(probe.engine.config, 3, 14, k=SUFFIX["num_speculative_tokens"]))
    spec = engine.core.spec_stats
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert engine.scheduler.num_preemptions > 0 and engine.prefix.num_hit_tokens > 0
    stats.assert_rare()


# ------------------------------------------------------------------------------------------------------- DSpark
@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_drafter_greedy_tokens_are_the_ones_without_speculation(make_checkpoint, tiny_drafter, method, backend):
    """k31-tiny's (random) MTP layer, or a DSpark drafter, drafts 3 tokens a step (its own rows caught up or
    injected chunk by chunk, in pages shared by prefix hits and forks) under small pools (preemption), shared
    prompts (prefix hits), a small budget (chunked prefill) and n = 2: the tokens are those without drafts."""
    path = make_checkpoint("k31-tiny")
    probe = make_llm(path)
    high = probe.tokenizer.num_bpe_ranks
    shared = random_prompts([32], seed=4, high=high)[0]
    prompts = _looping_prompts(high) + [shared + p for p in random_prompts([3, 11], seed=6, high=high)]
    memory = pool_bytes(probe.engine.config, num_slots=4, num_blocks=10, block_size=16)
    params = [greedy(20) for _ in prompts]
    params[1] = greedy(20, n=2)
    stats = new_stats(f"{method} speculation {backend}")
    engine, _ = _assert_greedy_as_without_speculation(
        path, prompts, params, stats, speculative_config=_config(method, tiny_drafter), backend=backend,
        max_num_seqs=4, block_size=16, kv_cache_memory=memory, max_num_batched_tokens=20, max_state_checkpoints=2,
        spec_memory=_spec_pool_bytes(probe.engine.config, 4, 10, k=3, drafter_layers=1))
    assert (engine.pages.num_blocks, engine.states.num_slots) == (10, 4)
    assert engine.scheduler.num_preemptions > 0 and engine.prefix.num_hit_tokens > 0
    assert engine.core.spec_stats.num_draft_tokens > 0
    stats.assert_rare()


@torch.no_grad()
def test_dspark_drafts_are_the_drafter_run_without_a_cache(make_checkpoint, tiny_drafter):
    """Every greedy block the engine drafts (context rows from its pages) is the drafter run over the request's
    tokens by a plain forward: the target's states, the block after the newest token, the Markov head left to
    right."""
    from deltaserve.models.dspark import block_visibility, load_drafter

    core, seen = _recorded_drafts(make_checkpoint("k31-tiny"), _config("dspark", tiny_drafter), [greedy(12)] * 4)
    model = core.model
    drafter = load_drafter(tiny_drafter, model.config, torch.float32)
    G = drafter.config.block_size
    checked = 0
    for tokens, drafts in seen:
        if not drafts:
            continue
        T = len(tokens) - 1  # the newest token is the anchor, at position T
        states = model(torch.tensor(tokens[:T]), StepBatch.single(T))
        ids = torch.full((G,), drafter.config.mask_token_id)
        ids[0] = tokens[T]
        out = drafter.block_states(model.embed_tokens(ids), torch.arange(T, T + G),
                                   drafter.context_latents(states, torch.arange(T)),
                                   block_visibility(torch.tensor([T]), T, G))
        base = model.lm_head(out).float()
        previous, want = tokens[T], []
        for k in range(len(drafts)):
            want.append(int((base[k] + drafter.markov_bias(torch.tensor(previous))).argmax()))
            previous = want[-1]
        assert drafts == want, (tokens, drafts, want)
        checked += 1
    assert checked > 10


def test_default_model_greedy_tokens_with_its_shipped_dspark_drafter():
    """The DSpark drafter shipped beside the default model (taken when speculative_config names no `model`), on
    Python source with chunked prefill: the tokens of the run without speculation, drafts both kept and rejected."""
    from deltaserve.default_model import default_model_path
    from deltaserve.tools.corpus import VALIDATION_PATH

    path = default_model_path()
    probe = make_llm(path)
    ids = probe.tokenizer.encode(VALIDATION_PATH.read_text()[:30_000])
    prompts = [ids[i:i + n] for i, n in ((0, 40), (3000, 90), (7000, 64))]
    stats = new_stats("default model dspark")
    engine, _ = _assert_greedy_as_without_speculation(
        path, prompts, [greedy(32)] * len(prompts), stats,
        speculative_config={"method": "dspark", "num_speculative_tokens": 3}, max_num_batched_tokens=64,
        kv_cache_memory="64MiB")
    spec = engine.core.spec_stats
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    stats.assert_rare()
