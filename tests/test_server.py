"""Acceptance tests of `deltaserve serve` as a real subprocess, driven with the `openai` client and raw httpx.

Servers (each start costs a few seconds, so they are module-scoped and shared where the test allows):
* `server`: the main one (openai client, greedy vs offline LLM, concurrency, disconnects, metrics, tokenize);
* `strict`: --api-key, --max-queue-len 1, --max-request-bytes, a small --max-model-len (bad input, queue full);
* one dedicated server each for killing the engine core and for SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.ops.native import native_choice

from server_utils import (all_free, assert_all_free, integrity, iter_sse, metric, pid_alive, run_server,
                          wait_until)

MODEL = "tiny-test"
KEY = "sk-test-key"
STRICT_MAX_LEN = 256
STRICT_MAX_BYTES = 8192
COMMON = ("--served-model-name", MODEL, "--kv-cache-memory", "64MiB", "--shutdown-timeout", "5")
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "def main():\n    print("]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


# --------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("k31-tiny")


@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(checkpoint, *COMMON) as srv:
        yield srv


@pytest.fixture(scope="module")
def strict(checkpoint):
    with run_server(checkpoint, *COMMON, "--max-queue-len", "1", "--max-request-bytes", str(STRICT_MAX_BYTES),
                    "--max-model-len", str(STRICT_MAX_LEN), api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint), kv_cache_memory="64MiB")


def tokenize(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, headers=server.headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def ascii_stop(text: str) -> tuple[int, str]:
    """A 3-letter stop string inside `text` (first occurrence at k > 0), as (k, stop)."""
    for m in re.finditer(r"[A-Za-z]{3}", text):
        k, stop = m.start(), m.group()
        if k > 0 and text.find(stop) == k:
            return k, stop
    raise AssertionError(f"no ASCII stop string candidate in {text!r}")


# ----------------------------------------------------------------------------------------- small endpoints
def test_models_version_tokenize_roundtrip(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == 4096 and card["object"] == "model"
    version = httpx.get(server.url + "/version").json()
    assert version["version"] and version["reason"]
    assert version["backend"] == ("native" if native_choice()[0] else "torch")  # --backend auto
    assert version["ops"] == ("native" if version["backend"] == "native" else "fast")
    assert httpx.get(server.url + "/health").status_code == 200
    for text in PROMPTS + ["héllo wörld — 中文 ✓"]:
        r = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()
        assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 4096
        back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]})
        assert back.status_code == 200 and back.json()["prompt"] == text
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    usage = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens == len(chat["tokens"])


def test_metrics_counter_grows(server, client):
    text = httpx.get(server.url + "/metrics").text
    assert "deltaserve:generation_tokens_total" in text and "deltaserve:prompt_tokens_total" in text
    gen0 = metric(server, "deltaserve:generation_tokens_total")
    prompt0 = metric(server, "deltaserve:prompt_tokens_total")
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    assert metric(server, "deltaserve:generation_tokens_total") == gen0 + 5
    assert metric(server, "deltaserve:prompt_tokens_total") == prompt0 + out.usage.prompt_tokens


# ------------------------------------------------------------------------------------ greedy vs offline LLM
def test_greedy_matches_offline_llm(server, client, llm):
    n_tokens = 24
    prompts = [tokenize(server, p) for p in PROMPTS] + [[5, 17, 300, 42, 9, 600, 77]]
    for ids in prompts:
        ref = llm.generate(ids, SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True, logprobs=2),
                           use_tqdm=False)[0].outputs[0]
        assert len(ref.token_ids) == n_tokens
        ref_tokens = [llm.tokenizer.decode([t]) for t in ref.token_ids]
        out = client.completions.create(model=MODEL, prompt=ids, max_tokens=n_tokens, temperature=0, logprobs=2,
                                        extra_body={"ignore_eos": True})
        c = out.choices[0]
        assert c.logprobs.tokens == ref_tokens, f"prompt {ids}: server tokens differ from the offline LLM"
        assert c.text == ref.text
        assert c.finish_reason == "length" and out.usage.completion_tokens == n_tokens
        assert out.usage.prompt_tokens == len(ids)
        assert c.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)
        for lp, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs):
            # greedy: the chosen token is the best alternative; 2 alternatives (1 when both decode alike)
            assert 1 <= len(top) <= 2 and lp == pytest.approx(max(top.values()), abs=1e-6)

        # the same request streamed reassembles to the same text and tokens
        text, tokens, finish = "", [], None
        for chunk in client.completions.create(model=MODEL, prompt=ids, max_tokens=n_tokens, temperature=0,
                                               logprobs=2, stream=True, extra_body={"ignore_eos": True}):
            for ch in chunk.choices:
                text += ch.text
                tokens += ch.logprobs.tokens if ch.logprobs else []
                finish = ch.finish_reason or finish
        assert (text, tokens, finish) == (ref.text, ref_tokens, "length")


# ---------------------------------------------------------------------------------------------- completions
def test_completions_n3_stream_and_seed(client):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0.8, seed=1234, n=3,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in a.choices)
    assert a.usage.completion_tokens == 24 and a.usage.total_tokens == 24 + a.usage.prompt_tokens
    assert isinstance(a.usage.prompt_tokens_details.cached_tokens, int)
    assert 0 <= a.usage.prompt_tokens_details.cached_tokens <= a.usage.prompt_tokens
    b = client.completions.create(**kw)
    assert [c.text for c in b.choices] == [c.text for c in a.choices], "same seed, different samples"
    other = client.completions.create(**{**kw, "seed": 4321})
    assert [c.text for c in other.choices] != [c.text for c in a.choices], "the seed has no effect"

    texts, finishes, usage = {}, {}, []
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            assert chunk.choices == []
            usage.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [c.text for c in a.choices], "streamed samples differ (same seed)"
    assert len(usage) == 1 and usage[0].completion_tokens == 24
    assert usage[0].prompt_tokens_details.cached_tokens is not None


def test_completions_stop_strings(client):
    ids_prompt = PROMPTS[2]
    base = client.completions.create(model=MODEL, prompt=ids_prompt, max_tokens=32, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    k, stop = ascii_stop(base)
    out = client.completions.create(model=MODEL, prompt=ids_prompt, max_tokens=32, temperature=0,
                                    stop=[stop, "\x00never"], extra_body={"ignore_eos": True})
    c = out.choices[0]
    assert c.text == base[:k] and c.finish_reason == "stop"
    assert c.model_extra.get("stop_reason") == stop
    kept = client.completions.create(model=MODEL, prompt=ids_prompt, max_tokens=32, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == base[:k + len(stop)]
    streamed = "".join(ch.text for chunk in client.completions.create(
        model=MODEL, prompt=ids_prompt, max_tokens=32, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) for ch in chunk.choices)
    assert streamed == base[:k]


# ------------------------------------------------------------------------------------------------------ chat
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_chat_stream_reassembles(client, thinking):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": thinking}})
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    msg = choice.message
    reasoning = getattr(msg, "reasoning_content", None) or ""
    content = msg.content or ""
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 24
    assert content or reasoning, "empty message"
    if thinking:  # generation starts inside the reasoning block
        assert reasoning
    else:
        assert reasoning == "" and content
    assert isinstance(full.usage.prompt_tokens_details.cached_tokens, int)
    assert 0 <= full.usage.prompt_tokens_details.cached_tokens <= full.usage.prompt_tokens
    lps = choice.logprobs.content
    assert len(lps) == 24
    for lp in lps:
        assert len(lp.top_logprobs) == 2 and lp.logprob == pytest.approx(lp.top_logprobs[0].logprob, abs=1e-6)
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob

    got = {"content": "", "reasoning": "", "tokens": [], "finish": None, "usage": [], "role": None}
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            assert chunk.choices == []
            got["usage"].append(chunk.usage)
        for ch in chunk.choices:
            d = ch.delta
            got["role"] = got["role"] or d.role
            got["content"] += d.content or ""
            got["reasoning"] += getattr(d, "reasoning_content", None) or ""
            got["tokens"] += [lp.token for lp in ch.logprobs.content] if ch.logprobs and ch.logprobs.content else []
            got["finish"] = ch.finish_reason or got["finish"]
    assert got["role"] == "assistant"
    assert got["content"] == content and got["reasoning"] == reasoning
    assert got["tokens"] == [lp.token for lp in lps]
    assert got["finish"] == "length"
    assert len(got["usage"]) == 1
    u = got["usage"][0]
    assert (u.prompt_tokens, u.completion_tokens) == (full.usage.prompt_tokens, 24)
    # (the streamed run may hit the prefix cache the first run filled: only the range is fixed)
    assert u.prompt_tokens_details is not None and isinstance(u.prompt_tokens_details.cached_tokens, int)
    assert 0 <= u.prompt_tokens_details.cached_tokens <= u.prompt_tokens


def test_chat_seed_and_n3(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0.8, seed=99, n=3,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in a.choices)
    assert a.usage.completion_tokens == 24

    def dump(resp):
        return [(c.message.content, getattr(c.message, "reasoning_content", None)) for c in resp.choices]
    assert dump(a) == dump(b)


# ----------------------------------------------------------------------------------------------------- async
def test_async_client_and_32_concurrent_streams(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as ac:
            # async non-streamed, both endpoints, n=3
            comp = await ac.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, n=3, temperature=0.8,
                                               seed=5, extra_body={"ignore_eos": True})
            assert sorted(c.index for c in comp.choices) == [0, 1, 2] and comp.usage.completion_tokens == 18
            chat = await ac.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=3,
                                                    extra_body={"ignore_eos": True})
            assert sorted(c.index for c in chat.choices) == [0, 1, 2] and chat.usage.completion_tokens == 18

            async def completion_stream(i: int):
                want = 4 + i % 9
                texts, finish, tokens, usage = "", None, 0, None
                stream = await ac.completions.create(
                    model=MODEL, prompt=PROMPTS[i % 3], max_tokens=want, temperature=0.7, seed=i, logprobs=1,
                    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    usage = chunk.usage or usage
                    for c in chunk.choices:
                        texts += c.text
                        tokens += len(c.logprobs.tokens) if c.logprobs else 0
                        finish = c.finish_reason or finish
                return want, finish, tokens, usage.completion_tokens

            async def chat_stream(i: int):
                want = 4 + i % 7
                finish, n_lp, usage = None, 0, None
                stream = await ac.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=want,
                    logprobs=True, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True})
                async for chunk in stream:
                    usage = chunk.usage or usage
                    for c in chunk.choices:
                        n_lp += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
                        finish = c.finish_reason or finish
                return want, finish, n_lp, usage.completion_tokens

            jobs = [completion_stream(i) if i % 2 else chat_stream(i) for i in range(32)]
            return await asyncio.gather(*jobs)

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert len(results) == 32
    for want, finish, n_tokens, usage_tokens in results:
        assert finish == "length"
        assert n_tokens == want == usage_tokens
    assert elapsed < 120
    assert_all_free(server)


# ------------------------------------------------------------------------------------------------ disconnects
def test_disconnect_mid_stream_frees_resources(server):
    assert_all_free(server)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as hc:
        with hc.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = iter_sse(r)
            first = [next(events) for _ in range(4)]
            assert all(isinstance(e, dict) and e["choices"][0]["finish_reason"] is None for e in first)
            busy = integrity(server)
            assert busy["ok"] and busy["free_pages"] < busy["total_pages"]
            assert busy["free_slots"] < busy["total_slots"]
        # leaving the block closes the connection mid-stream
    t0 = time.monotonic()
    assert_all_free(server, timeout=5)
    assert time.monotonic() - t0 < 5

    # a non-streamed request whose client gives up is aborted too
    outcome = []

    def give_up():
        try:
            r = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
            outcome.append(f"answered {r.status_code} within one second")
        except httpx.TimeoutException:
            outcome.append("gave up")

    t = threading.Thread(target=give_up)
    t.start()
    assert wait_until(lambda: not all_free(server), 5, 0.05), "the request never took resources"
    t.join(10)
    assert outcome == ["gave up"]
    assert_all_free(server, timeout=5)
    # and the server still serves
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] is not None


# ------------------------------------------------------------------------------------------------- bad input
def _chunked(data: bytes):
    for i in range(0, len(data), 1000):
        yield data[i:i + 1000]


def _bad_cases():
    P, C = "/v1/completions", "/v1/chat/completions"
    msg = [{"role": "user", "content": "hi"}]
    auth = {"Authorization": f"Bearer {KEY}"}
    long_ids = list(range(1, STRICT_MAX_LEN + 1))
    big = json.dumps({"model": MODEL, "prompt": "x" * (STRICT_MAX_BYTES + 10)}).encode()
    # (id, method, path, kwargs for httpx.request, expected status, expected param)
    return [
        ("malformed-json", "POST", P, {"content": b'{"prompt": "a",', "headers": {"content-type": "application/json"}},
         400, None),
        ("body-not-object", "POST", P, {"json": ["a", "b"]}, 400, None),
        ("body-is-string", "POST", C, {"json": "hello"}, 400, None),
        ("missing-prompt", "POST", P, {"json": {"model": MODEL}}, 400, "prompt"),
        ("temperature-hot", "POST", P, {"json": {"prompt": "a", "temperature": "hot"}}, 400, "temperature"),
        ("temperature-negative", "POST", P, {"json": {"prompt": "a", "temperature": -1}}, 400, "temperature"),
        ("top_p-zero", "POST", P, {"json": {"prompt": "a", "top_p": 0}}, 400, "top_p"),
        ("n-zero", "POST", P, {"json": {"prompt": "a", "n": 0}}, 400, "n"),
        ("max_tokens-zero", "POST", P, {"json": {"prompt": "a", "max_tokens": 0}}, 400, "max_tokens"),
        ("logprobs-21", "POST", P, {"json": {"prompt": "a", "logprobs": 21}}, 400, "logprobs"),
        ("stream-not-bool", "POST", P, {"json": {"prompt": "a", "stream": "yes"}}, 400, "stream"),
        ("empty-stop-string", "POST", P, {"json": {"prompt": "a", "stop": [""]}}, 400, "stop"),
        ("prompt-too-long-ids", "POST", P, {"json": {"prompt": long_ids}}, 400, "prompt"),
        ("prompt-too-long-text", "POST", P, {"json": {"prompt": "word " * (2 * STRICT_MAX_LEN)}}, 400, "prompt"),
        ("chat-too-long", "POST", C, {"json": {"messages": [{"role": "user", "content": "word " * 300}]}},
         400, "messages"),
        ("prompt-plus-max-tokens-too-long", "POST", P, {"json": {"prompt": "a", "max_tokens": STRICT_MAX_LEN}},
         400, "max_tokens"),
        ("empty-prompt", "POST", P, {"json": {"prompt": ""}}, 400, "prompt"),
        ("empty-prompt-list", "POST", P, {"json": {"prompt": []}}, 400, "prompt"),
        ("token-outside-vocab", "POST", P, {"json": {"prompt": [1, 2, 1 << 20]}}, 400, "prompt"),
        ("negative-token", "POST", P, {"json": {"prompt": [1, -2]}}, 400, "prompt"),
        ("detokenize-outside-vocab", "POST", "/detokenize", {"json": {"tokens": [1, 1 << 20]}}, 400, "tokens"),
        ("unknown-model", "POST", P, {"json": {"model": "gpt-17", "prompt": "a"}}, 404, "model"),
        ("unknown-model-chat", "POST", C, {"json": {"model": "gpt-17", "messages": msg}}, 404, "model"),
        ("missing-api-key", "POST", P, {"json": {"prompt": "a"}, "headers": {"Authorization": ""}}, 401, None),
        ("wrong-api-key", "POST", P, {"json": {"prompt": "a"}, "headers": {"Authorization": "Bearer nope"}},
         401, None),
        ("models-without-key", "GET", "/v1/models", {"headers": {"Authorization": ""}}, 401, None),
        ("too-large", "POST", P, {"content": big, "headers": {"content-type": "application/json"}}, 413, None),
        ("too-large-chunked", "POST", P, {"content": _chunked(big), "headers": {"content-type": "application/json"}},
         413, None),
        ("unknown-role", "POST", C, {"json": {"messages": [{"role": "wizard", "content": "hi"}]}},
         400, "messages.0.role"),
        ("no-messages", "POST", C, {"json": {"messages": []}}, 400, "messages"),
        ("bad-tool_choice", "POST", C, {"json": {"messages": msg, "tool_choice": "sometimes"}}, 400, "tool_choice"),
        ("tool_choice-without-tools", "POST", C, {"json": {"messages": msg, "tool_choice": "required"}},
         400, "tool_choice"),
        ("stream_options-without-stream", "POST", C, {"json": {"messages": msg, "stream_options":
                                                               {"include_usage": True}}}, 400, "stream_options"),
        ("top_logprobs-without-logprobs", "POST", C, {"json": {"messages": msg, "top_logprobs": 2}},
         400, "top_logprobs"),
        ("chat-top_logprobs-21", "POST", C, {"json": {"messages": msg, "logprobs": True, "top_logprobs": 21}},
         400, "top_logprobs"),
        ("GET-on-POST-route", "GET", P, {}, 405, None),
        ("unknown-route", "POST", "/v1/nothing", {"json": {}}, 404, None),
    ], auth


def test_bad_inputs_get_openai_errors(strict):
    cases, auth = _bad_cases()
    assert len(cases) >= 20
    assert httpx.get(strict.url + "/health").status_code == 200, "/health must not need the API key"
    failures = []
    with httpx.Client(base_url=strict.url, timeout=30) as hc:
        for name, method, path, kwargs, status, param in cases:
            headers = {**auth, **kwargs.pop("headers", {})}
            headers = {k: v for k, v in headers.items() if v}
            r = hc.request(method, path, headers=headers, **kwargs)
            try:
                body = r.json()
            except ValueError:
                failures.append(f"{name}: {r.status_code} body is not JSON: {r.text[:200]!r}")
                continue
            err = body.get("error") if isinstance(body, dict) else None
            if r.status_code != status:
                failures.append(f"{name}: status {r.status_code} != {status}: {r.text[:300]}")
            elif not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
                failures.append(f"{name}: not an OpenAI error body: {body}")
            elif not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
                      and err["code"] == status and err["param"] == param):
                failures.append(f"{name}: unexpected error fields (param {param!r}, code {status}): {err}")
        assert not failures, "\n".join(failures)

        # the openai client maps these to its exception types
        with openai.OpenAI(base_url=strict.url + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with openai.OpenAI(base_url=strict.url + "/v1", api_key=KEY, max_retries=0) as good:
            with pytest.raises(openai.BadRequestError) as exc:
                good.completions.create(model=MODEL, prompt="a", temperature=-1)
            assert exc.value.status_code == 400 and exc.value.body["param"] == "temperature"
            with pytest.raises(openai.NotFoundError):
                good.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
            # after all that, a good request still succeeds
            out = good.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
            assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
            chat = good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3)
            assert chat.choices[0].finish_reason is not None
    assert_all_free(strict)


def test_queue_full_gets_503_with_retry_after(strict):
    body = {"model": MODEL, "prompt": "Hold the line", "max_tokens": STRICT_MAX_LEN - 16, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=strict.url, headers=strict.headers, timeout=30) as hc:
        with hc.stream("POST", "/v1/completions", json=body) as held:
            assert held.status_code == 200
            events = iter_sse(held)
            first = next(events)
            assert first["choices"][0]["finish_reason"] is None
            r = hc.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 503, r.text
            assert r.headers.get("retry-after") == "1"
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == 503
            assert "queue" in err["message"]
            assert hc.get("/health").status_code == 200  # full, not unhealthy
        # the held stream is closed; once it is aborted a request is admitted again

        def admitted():
            r = hc.post("/v1/completions", json={"model": MODEL, "prompt": "again", "max_tokens": 2})
            return r if r.status_code == 200 else None
        r = wait_until(admitted, 5, 0.1)
        assert r, "still refused after the held request was closed"
        assert r.json()["usage"]["completion_tokens"] >= 1
    assert_all_free(strict)


# ---------------------------------------------------------------------------------------- engine death, SIGTERM
@pytest.mark.slow
def test_engine_death_fails_in_flight_then_restarts(checkpoint):
    with run_server(checkpoint, *COMMON, "--max-engine-restarts", "1") as srv:
        engine = srv.engine_pid()
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3000, "ignore_eos": True}
        blocking: dict = {}

        def non_streamed():
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            blocking.update(status=r.status_code, body=r.json(), t=time.monotonic())

        with httpx.Client(timeout=30) as hc, hc.stream("POST", srv.url + "/v1/completions",
                                                       json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = iter_sse(r)
            assert next(events)["choices"][0]["finish_reason"] is None
            t = threading.Thread(target=non_streamed)
            t.start()
            assert wait_until(lambda: integrity(srv)["stats"]["num_running"] == 2, 10, 0.05), integrity(srv)
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            rest = list(events)  # must end: an error event then [DONE]
            ended = time.monotonic() - killed
            # the restart is still under way (a fresh process loads the model): /health says so
            health = httpx.get(srv.url + "/health", timeout=5)
        assert ended < 5, f"the stream took {ended:.1f} s to end after the engine died"
        assert rest[-1] == "[DONE]", rest[-3:]
        assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"] == "length"
                       for e in rest), "the request claims to have completed"
        errors = [e["error"] for e in rest if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == 503 and errors[0]["type"] == "ServiceUnavailableError"
        t.join(10)
        assert not t.is_alive(), "the non-streamed request hangs"
        assert blocking["status"] == 503 and blocking["t"] - killed < 5
        assert set(blocking["body"]["error"]) == {"message", "type", "param", "code"}
        assert health.status_code == 503 and health.json()["error"]["type"] == "ServiceUnavailableError"

        # a fresh engine core serves again within 10 s of the kill; the API process never stopped
        back = wait_until(lambda: httpx.get(srv.url + "/health", timeout=5).status_code == 200,
                          killed + 10 - time.monotonic(), 0.1)
        assert back, f"not healthy 10 s after the engine died:\n{srv.log()}"
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert srv.proc.poll() is None and not pid_alive(engine) and srv.engine_pid() != engine
        assert metric(srv, "deltaserve:engine_restarts_total") == 1
        assert_all_free(srv)
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30) as c:
            out = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
            assert out.choices[0].finish_reason in ("stop", "length")

        # the one restart allowed is used up: the next death stops the server with a failure status, so a
        # supervisor restarts it (never a server that answers 503 for ever)
        os.kill(srv.engine_pid(), signal.SIGKILL)
        killed = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            srv.proc.wait(10)
        assert srv.proc.returncode not in (None, 0), f"still running {time.monotonic() - killed:.1f} s after"
        assert time.monotonic() - killed < 10
        assert "restarts within" in srv.log()


@pytest.mark.slow
def test_sigterm_drains_then_exits(checkpoint):
    drain = 8.0
    with run_server(checkpoint, "--served-model-name", MODEL, "--kv-cache-memory", "64MiB",
                    "--shutdown-timeout", str(drain)) as srv:
        engine = srv.engine_pid()
        results: dict = {}

        def stream(name: str, max_tokens: int):
            events = []
            try:
                with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                                  json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": max_tokens,
                                        "ignore_eos": True, "stream": True}) as r:
                    for e in iter_sse(r):
                        events.append(e)
            except httpx.HTTPError as exc:
                events.append(exc)
            results[name] = events
            results[f"{name}-ended"] = time.monotonic()

        def non_streamed():
            try:
                r = httpx.post(srv.url + "/v1/completions", timeout=60,
                               json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4000, "ignore_eos": True})
                results["blocking"] = (r.status_code, r.headers.get("content-type"), r.text)
            except httpx.HTTPError as exc:
                results["blocking"] = exc

        # long enough to be seen running beside the long ones (12 tokens could finish between two polls)
        short = threading.Thread(target=stream, args=("short", 100))
        long = threading.Thread(target=stream, args=("long", 4000))
        blocking = threading.Thread(target=non_streamed)
        long.start()
        blocking.start()
        short.start()
        assert wait_until(lambda: integrity(srv)["stats"]["num_running"] == 3, 10, 0.05), integrity(srv)
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code = srv.proc.wait(drain + 20)
        took = time.monotonic() - t0
        short.join(10)
        long.join(10)
        blocking.join(10)
        # uvicorn re-raises the captured SIGTERM once it has shut down cleanly
        assert code in (0, -signal.SIGTERM), srv.log()
        print(f"SIGTERM: exit code {code} after {took:.1f} s (drain timeout {drain} s)")
        assert took < drain + 5, f"exit took {took:.1f} s with a drain timeout of {drain} s"
        assert not pid_alive(engine), "the engine core outlived the server"
        assert not short.is_alive() and not long.is_alive() and not blocking.is_alive()
        # the short request drained to completion
        assert results["short-ended"] > t0, "the short request ended before SIGTERM: nothing was drained"
        short_events = results["short"]
        assert short_events[-1] == "[DONE]", short_events[-3:]
        finishes = [e["choices"][0]["finish_reason"] for e in short_events if isinstance(e, dict) and e.get("choices")]
        assert finishes[-1] == "length"
        # the long ones were ended at the drain timeout with OpenAI-shaped 503s: an error event then [DONE] ...
        long_events = results["long"]
        assert long_events[-1] == "[DONE]", long_events[-3:]
        errors = [e["error"] for e in long_events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == 503 and errors[0]["type"] == "ServiceUnavailableError"
        assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]
                       for e in long_events), "the cut stream claims to have finished"
        # ... and a JSON error body, not a plain-text 500
        status, content_type, text = results["blocking"]
        assert status == 503 and content_type == "application/json", (status, content_type, text)
        assert json.loads(text)["error"]["type"] == "ServiceUnavailableError"
        assert took >= drain - 1, "the long requests were not given the drain time"
