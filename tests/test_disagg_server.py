"""Prefill/decode disaggregation served (docs/disaggregation.md): a prefill and a decode server on loopback behind
`deltaserve router`, driven by the openai client with 32 concurrent streams: one instance's tokens, every pool free
on both sides after, and the transfer metrics; a decode server whose prefill instance is gone answers that request
with an error within its timeout and goes on serving."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine_utils import greedy, make_llm, random_prompts
from server_utils import REPO, assert_all_free, free_port, metric, pid_alive, run_server, wait_until

PRODUCER = json.dumps({"kv_role": "kv_producer"})
CONSUMER = json.dumps({"kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"handshake_timeout_s": 3, "transfer_timeout_s": 3}})
ARGS = ("--dtype", "float32", "--served-model-name", "m", "--kv-cache-memory", "32MiB")


@contextlib.contextmanager
def run_router(prefill: str, decode: str):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "deltaserve.cli", "router", "--prefill", prefill, "--decode",
                             decode, "--port", str(port)], cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url + "/health", timeout=5).status_code == 200
        assert wait_until(healthy, 60, 0.2), "the router did not become healthy"
        yield url
    finally:
        proc.terminate()
        proc.wait(15)


def _stream(client: openai.OpenAI, prompt: list[int]) -> str:
    stream = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny"])
def test_router_over_a_prefill_and_a_decode_instance(make_checkpoint, preset):
    path = make_checkpoint(preset)
    prompts = random_prompts([3 + 5 * i for i in range(32)], seed=12, high=1000)
    single = make_llm(path, kv_cache_memory="32MiB")
    want = [o.outputs[0].text for o in single.generate(prompts, greedy(12), use_tqdm=False)]
    with run_server(path, *ARGS, "--kv-transfer-config", PRODUCER) as prefill, \
            run_server(path, *ARGS, "--kv-transfer-config", CONSUMER) as decode, \
            run_router(prefill.url, decode.url) as router:
        with openai.OpenAI(base_url=router + "/v1", api_key="x", max_retries=0, timeout=120) as client:
            with ThreadPoolExecutor(32) as pool:
                got = list(pool.map(lambda p: _stream(client, p), prompts))
            assert got == want
            chat = [{"role": "user", "content": "hello there"}]
            routed = client.chat.completions.create(model="m", messages=chat, max_tokens=8, temperature=0)
        with openai.OpenAI(base_url=decode.url + "/v1", api_key="x", max_retries=0, timeout=120) as direct:
            local = direct.chat.completions.create(model="m", messages=chat, max_tokens=8, temperature=0)
        assert routed.choices[0].message.content == local.choices[0].message.content
        for server in (prefill, decode):
            assert_all_free(server)
        assert metric(decode, "deltaserve:kv_transfer_bytes_total") == metric(prefill,
                                                                              "deltaserve:kv_transfer_bytes_total") > 0
        assert metric(decode, "deltaserve:kv_transfer_seconds_count") == len(prompts) + 1
        assert metric(decode, "deltaserve:kv_transfers_in_flight") == 0


def test_a_decode_server_whose_prefill_instance_is_killed(make_checkpoint):
    """The prefill server answers, then is killed (SIGKILL, its engine process too) before the decode server pulls:
    that request fails within the handshake timeout naming the stage and the peer; the decode server serves the
    next request and its pools are intact and free."""
    path = make_checkpoint("k31-tiny")
    prompt = random_prompts([30], seed=2, high=1000)[0]
    with run_server(path, *ARGS, "--kv-transfer-config", PRODUCER) as prefill:
        first = httpx.post(prefill.url + "/v1/completions", timeout=60,
                           json={"model": "m", "prompt": prompt, "max_tokens": 1,
                                 "kv_transfer_params": {"do_remote_decode": True}})
        kv = first.json()["kv_transfer_params"]
        assert kv["num_tokens"] == len(prompt) - 1
        engine = prefill.engine_pid()
        os.kill(engine, signal.SIGKILL)
        prefill.proc.kill()
        assert wait_until(lambda: not pid_alive(engine) and prefill.proc.poll() is not None, 10, 0.1)
    with run_server(path, *ARGS, "--kv-transfer-config", CONSUMER) as decode:
        started = time.monotonic()
        answer = httpx.post(decode.url + "/v1/completions", timeout=60,
                            json={"model": "m", "prompt": prompt, "max_tokens": 4, "kv_transfer_params": kv})
        assert time.monotonic() - started < 3 + 5
        assert answer.status_code >= 500, answer.text
        assert "handshake: the prefill instance at" in answer.json()["error"]["message"]
        assert "did not answer within 3 s" in answer.json()["error"]["message"]
        plain = httpx.post(decode.url + "/v1/completions", timeout=60,
                           json={"model": "m", "prompt": prompt, "max_tokens": 4})
        assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "length"
        # its first contact with that peer: the handshake is the stage that gets no answer
        assert metric(decode, 'deltaserve:kv_transfer_failures_total{stage="handshake"}') == 1
        assert_all_free(decode)


def test_router_guards_and_errors_without_instances():
    """The router alone (its instances down): the API key on all but /health, 413 for an oversized body, 400 for
    one that is not a JSON object, 502 naming an unreachable instance, 503 health."""
    from fastapi.testclient import TestClient

    from deltaserve.disagg.router import MAX_BODY_BYTES, build_router_app

    dead = f"http://127.0.0.1:{free_port()}"
    with TestClient(build_router_app([dead], [dead], api_key="k")) as client:
        key = {"Authorization": "Bearer k"}
        assert client.get("/health").status_code == 503
        assert client.post("/v1/completions", json={"prompt": "a"}).status_code == 401
        assert client.post("/v1/completions", headers={**key, "content-length": str(MAX_BODY_BYTES + 1)},
                           content=b"{}").status_code == 413
        bad = client.post("/v1/completions", headers=key, content=b"[1, 2]")
        assert bad.status_code == 400 and "JSON object" in bad.json()["error"]["message"]
        gone = client.post("/v1/chat/completions", headers=key, json={"messages": []})
        assert gone.status_code == 502 and f"prefill instance {dead}" in gone.json()["error"]["message"]
