"""Prompt logprobs (SamplingParams.prompt_logprobs; `prompt_logprobs` and `echo` + `logprobs` on the API) against the
model's own cacheless forward (`reference_logits`): every prompt token after the first gets the log-softmax of the
logits before it, its rank and the top alternatives; the first gets None. Offline under chunked prefill, a warm
prefix cache (which such a request must not read), n > 1 and preemption; then through a real server in the shapes
lm-evaluation-harness and vLLM clients read."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.models.loader import load_model
from engine_utils import assert_pools_free, drive, make_llm, pool_bytes, random_prompts
from server_utils import assert_all_free, iter_sse, run_server

TOL = 1e-4  # fp32: the engine's chunked, batched forward against one cacheless forward
SCORED_CAP = 200  # the server's --max-prompt-logprobs-tokens


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("k31-tiny")


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = load_model(checkpoint, dtype="float32")

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model.reference_logits(torch.tensor(ids)).float().log_softmax(-1)
    return logprobs


def assert_matches_reference(reports, prompt: list[int], ref: torch.Tensor, num_top: int) -> None:
    assert len(reports) == len(prompt) and reports[0] is None
    for j in range(1, len(prompt)):
        r, row, target = reports[j], ref[j - 1], prompt[j]
        assert r.token_id == target
        assert abs(r.logprob - row[target].item()) < TOL, (j, r.logprob, row[target].item())
        # the rank counts the tokens above it (ties within the tolerance may fall either way)
        assert int((row > row[target] + TOL).sum()) + 1 <= r.rank <= int((row > row[target] - TOL).sum()) + 1
        assert len(r.top) == num_top
        if num_top:
            assert torch.allclose(torch.tensor([v for _, v in r.top]), row.topk(num_top).values, atol=TOL)
        assert all(abs(row[t].item() - v) < TOL for t, v in r.top)


def test_offline_prompt_logprobs_equal_the_cacheless_forward(checkpoint, reference):
    prompts = random_prompts([37, 70, 9], seed=3, high=900)
    llm = make_llm(checkpoint, max_num_batched_tokens=16)  # chunked: every prompt spans several steps
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3, logprobs=1, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_matches_reference(out.prompt_logprobs, prompt, reference(prompt), 3)
        # the first generated token's logprob continues the prompt's: the same forward, one position on
        assert abs(out.outputs[0].logprobs[0].logprob - reference(prompt + out.outputs[0].token_ids[:1])[
            len(prompt) - 1, out.outputs[0].token_ids[0]].item()) < TOL
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outs]
    assert all(o.prompt_logprobs is None for o in plain)
    assert_pools_free(llm.engine)


def test_a_warm_prefix_cache_is_not_read_for_prompt_logprobs(checkpoint, reference):
    prompt = random_prompts([80], seed=5, high=900)[0]
    llm = make_llm(checkpoint, max_num_batched_tokens=64)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    warm = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert warm.num_cached_tokens > 0  # the cache holds this prompt
    scored = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0),
                          use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0
    assert_matches_reference(scored.prompt_logprobs, prompt, reference(prompt), 0)
    assert scored.outputs[0].token_ids == warm.outputs[0].token_ids
    assert_pools_free(llm.engine)


def test_prompt_logprobs_survive_n_and_preemption(checkpoint, reference):
    prompts = random_prompts([40, 33, 47, 29], seed=11, high=900)
    config = make_llm(checkpoint).engine.config
    # 3 state slots and 9 pages of 16 tokens for 4 requests of up to 4 pages each: some are preempted mid-prompt
    memory = pool_bytes(config, num_slots=3, num_blocks=9, block_size=16, num_checkpoints=2)
    llm = make_llm(checkpoint, max_num_seqs=3, kv_cache_memory=memory, max_num_batched_tokens=24,
                   max_state_checkpoints=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2, ignore_eos=True, n=2)
    done = drive(llm.engine, [(i, f"r{i}", p, params) for i, p in enumerate(prompts)])
    assert llm.engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        out = done[f"r{i}"]
        assert len(out.outputs) == 2
        assert_matches_reference(out.prompt_logprobs, prompt, reference(prompt), 2)


def test_prompt_logprobs_are_validated():
    from deltaserve import InvalidRequestError
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(prompt_logprobs=21)
    assert err.value.field == "prompt_logprobs"
    with pytest.raises(InvalidRequestError):
        SamplingParams(prompt_logprobs=-1)


# --------------------------------------------------------------------------------------------------- the API
@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(checkpoint, "--served-model-name", "tiny", "--kv-cache-memory", "64MiB",
                    "--max-num-batched-tokens", "32", "--dtype", "float32", "--max-prompt-logprobs-tokens",
                    str(SCORED_CAP)) as s:
        yield s


def test_echo_with_logprobs_reports_the_prompt_as_lm_eval_reads_it(server, reference):
    # text, so that token strings are whole characters (byte pieces of one character all decode to U+FFFD and
    # collide as keys of top_logprobs)
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    prompt = tokenize(server, text)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    # lm-evaluation-harness `local-completions` loglikelihood payload
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, logprobs=1, echo=True,
                                    temperature=0, seed=1234)
    lp = out.choices[0].logprobs
    ref = reference(prompt)
    assert len(lp.tokens) == len(prompt) + 1 and len(lp.token_logprobs) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(prompt)):
        assert abs(lp.token_logprobs[j] - ref[j - 1, prompt[j]].item()) < TOL
        # the prompt token is among its position's alternatives, as lm-eval's greedy check needs
        assert lp.top_logprobs[j][lp.tokens[j]] == pytest.approx(lp.token_logprobs[j], abs=1e-6)
        if abs(ref[j - 1].max() - ref[j - 1, prompt[j]]) > TOL:  # not a near-tie: lm-eval's is_greedy is exact
            assert lp.token_logprobs[j] < max(lp.top_logprobs[j].values())
    # the generated (greedy) token follows, with its own logprob
    assert abs(lp.token_logprobs[-1] - ref[-1].max().item()) < TOL
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert out.choices[0].text.startswith(server_text(server, prompt))
    assert_all_free(server)


def tokenize(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def server_text(server, ids: list[int]) -> str:
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_prompt_logprobs_in_vllm_shape_streamed_or_not(server, reference):
    prompt = random_prompts([30], seed=9, high=900)[0]
    ref = reference(prompt)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert plain.status_code == 200, plain.text
    got = plain.json()["choices"][0]["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        entry = got[j][str(prompt[j])]
        assert abs(entry["logprob"] - ref[j - 1, prompt[j]].item()) < TOL and entry["rank"] >= 1
        assert len(got[j]) in (2, 3)  # the prompt token and the top 2 (it may be one of them)
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True, "echo": True,
                                                                    "logprobs": 0}, timeout=60) as r:
        events = [e for e in iter_sse(r) if e != "[DONE]"]
    first = events[0]["choices"][0]
    assert first["prompt_logprobs"] == got
    assert first["logprobs"]["token_logprobs"][0] is None
    assert first["logprobs"]["token_logprobs"][1:] == [got[j][str(prompt[j])]["logprob"] for j in range(1, len(prompt))]
    streamed = "".join(e["choices"][0]["text"] for e in events[1:] if e["choices"])
    assert streamed == plain.json()["choices"][0]["text"]


def test_chat_prompt_logprobs(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi there"}],
                                         max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1})
    scored = out.model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == out.usage.prompt_tokens
    assert all(len(entry) in (1, 2) for entry in scored[1:])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       stream=True, extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"


def test_prompt_logprobs_are_capped_per_request(server):
    long_prompt = random_prompts([SCORED_CAP + 1], seed=2, high=900)[0]
    for extra, param in (({"prompt_logprobs": 0}, "prompt_logprobs"), ({"echo": True, "logprobs": 0}, "echo")):
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": long_prompt, "max_tokens": 1,
                                                             **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "--max-prompt-logprobs-tokens" in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": long_prompt[:SCORED_CAP],
                                                          "max_tokens": 1, "prompt_logprobs": 0}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert_all_free(server)
