"""Fault isolation: a failure injected into one step phase (engine/faults.py) fails only the request it belongs to;
the others produce exactly the greedy tokens they produce without it, and the pools end intact and free. A failure
inside the batched model call fails its whole batch and the engine goes on."""

from __future__ import annotations

import contextlib
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.engine.config import EngineArgs
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.errors import ConfigError, RequestFailedError

from engine_utils import assert_pools_free
from server_utils import all_free, integrity, iter_sse, metric, run_server, wait_until

TRIGGER = 1000  # a token id only the failing request's prompt holds
PROMPTS = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [12, 13, TRIGGER, 14, 15], "c": [16, 17, 18, 19]}
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
GREEDY_N2 = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, n=2)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("k31-tiny")


def engine(checkpoint, fault: str | None = None) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(checkpoint), kv_cache_memory="64MiB", fault_injection=fault))


def run(eng: LLMEngine, prompts: dict[str, list[int]], max_steps: int = 200) -> dict:
    """Drive the engine to the end; {request id: final RequestOutput}. Pools are checked after every step."""
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, GREEDY_N2 if rid == "b" else GREEDY)
    done = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.check_integrity()
    assert not eng.has_unfinished_requests(), "the engine did not finish in a bounded number of steps"
    return done


def tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def assert_goes_on(eng, baseline) -> None:
    """The pools are free and the engine goes on: the prompts without the trigger run again to the same tokens."""
    assert_pools_free(eng)
    again = run(eng, {"a2": PROMPTS["a"], "c2": PROMPTS["c"]})
    assert tokens(again["a2"]) == baseline["a"] and tokens(again["c2"]) == baseline["c"]
    assert_pools_free(eng)


@pytest.fixture(scope="module")
def baseline(checkpoint) -> dict:
    eng = engine(checkpoint)
    done = run(eng, PROMPTS)
    assert all(out.error is None for out in done.values())
    assert_pools_free(eng)
    return {rid: tokens(out) for rid, out in done.items()}


@pytest.mark.parametrize("phase", ["schedule", "forward", "sample", "output", "detokenize"])
def test_one_request_fails_the_others_are_untouched(checkpoint, baseline, phase):
    eng = engine(checkpoint, f"{phase}:{TRIGGER}")
    done = run(eng, PROMPTS)
    assert set(done) == set(PROMPTS)
    failed = done["b"]
    assert failed.error is not None and phase in failed.error and "InjectedFault" in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error", "error"]
    for rid in ("a", "c"):
        assert done[rid].error is None
        assert tokens(done[rid]) == baseline[rid], f"{rid} changed when b failed in {phase}"
        assert [c.finish_reason for c in done[rid].outputs] == ["length"]
    assert_goes_on(eng, baseline)



def test_failure_inside_the_batched_model_fails_the_batch_and_the_engine_goes_on(checkpoint, baseline):
    eng = engine(checkpoint, f"model:{TRIGGER}")
    done = run(eng, PROMPTS)
    # all three were scheduled in the same first step: the model call that failed held every row
    assert all(out.error is not None and "model" in out.error for out in done.values()), done
    assert_goes_on(eng, baseline)


def test_a_request_failing_mid_decode_frees_what_it_held(checkpoint, baseline):
    """b joins while a is decoding and fails at its first output: a keeps its tokens, pools end free."""
    eng = engine(checkpoint, f"output:{TRIGGER}")
    eng.add_request("a", PROMPTS["a"], GREEDY)
    outs = {}
    for _ in range(3):
        for out in eng.step():
            outs[out.request_id] = out
    eng.add_request("b", PROMPTS["b"], GREEDY_N2)
    for _ in range(50):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            outs[out.request_id] = out
        eng.check_integrity()
    assert outs["b"].finished and outs["b"].error is not None
    assert tokens(outs["a"]) == baseline["a"]
    assert_pools_free(eng)


def test_offline_generate_raises_typed_error_with_every_output(checkpoint, baseline):
    llm = LLM(str(checkpoint), kv_cache_memory="64MiB", fault_injection=f"sample:{TRIGGER}")
    with pytest.raises(RequestFailedError) as info:
        llm.generate([PROMPTS["a"], PROMPTS["b"], PROMPTS["c"]], GREEDY, use_tqdm=False)
    outs = info.value.outputs
    assert [o.error is not None for o in outs] == [False, True, False]
    assert outs[0].outputs[0].token_ids == baseline["a"][0] and outs[2].outputs[0].token_ids == baseline["c"][0]
    assert_pools_free(llm.engine)


@pytest.mark.parametrize("spec", ["forward", "nowhere:5", "sample:x", "sample:5,"])
def test_malformed_fault_spec_is_a_config_error(spec):
    with pytest.raises(ConfigError):
        EngineArgs(fault_injection=spec)


# ------------------------------------------------------------------------------------------------ through a server
DETOK_TRIGGER = 1001  # fails in the API process's OutputProcessor
SERVED = "tiny-test"
SERVER_ARGS = ("--served-model-name", SERVED, "--kv-cache-memory", "64MiB", "--shutdown-timeout", "5")


@pytest.fixture(scope="module")
def fault_server(checkpoint):
    with run_server(checkpoint, *SERVER_ARGS, "--fault-injection",
                    f"sample:{TRIGGER},detokenize:{DETOK_TRIGGER}") as srv:
        yield srv


def completion(srv, prompt: list[int], max_tokens: int = 12) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", timeout=60,
                      json={"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True})


def stream_events(srv, prompt: list[int], max_tokens: int = 12) -> list:
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json={"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        return list(iter_sse(r))


def stream_text(events: list) -> str:
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"])


def errors_counted(srv) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    m = re.search(r'^deltaserve:request_success_total\{finished_reason="error"\} ([0-9.eE+-]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_server_fails_only_the_faulty_requests(fault_server):
    srv = fault_server
    errors_before = errors_counted(srv)
    alone = {k: completion(srv, PROMPTS[k]) for k in ("a", "c")}
    assert all(r.status_code == 200 for r in alone.values())
    expected = {k: r.json()["choices"][0]["text"] for k, r in alone.items()}
    detok_prompt = [20, DETOK_TRIGGER, 21]
    jobs = {
        "a-stream": lambda: stream_events(srv, PROMPTS["a"]),
        "c": lambda: completion(srv, PROMPTS["c"]),
        "b": lambda: completion(srv, PROMPTS["b"]),
        "b-stream": lambda: stream_events(srv, PROMPTS["b"]),
        "d": lambda: completion(srv, detok_prompt),
        "d-stream": lambda: stream_events(srv, detok_prompt),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        results = {name: f.result(timeout=60) for name, f in futures.items()}
    assert stream_text(results["a-stream"]) == expected["a"]
    assert results["c"].status_code == 200 and results["c"].json()["choices"][0]["text"] == expected["c"]
    for name, phase in (("b", "sample"), ("d", "detokenize")):
        r = results[name]
        assert r.status_code == 500, (name, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "InternalServerError"
        assert phase in err["message"]
        events = results[f"{name}-stream"]
        assert events[-1] == "[DONE]", events
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == 500 and phase in errors[0]["message"], events
        assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]
                       for e in events), "a failed stream claims to have finished"
    assert wait_until(lambda: all_free(srv), 5, 0.1), integrity(srv)
    assert errors_counted(srv) - errors_before == 4, "each failed request is counted once, as finished by error"
    assert completion(srv, PROMPTS["a"]).json()["choices"][0]["text"] == expected["a"]


def test_disconnects_refresh_gauges_and_log_no_errors(fault_server):
    srv = fault_server
    log_start = srv.log_path.stat().st_size
    body = {"model": SERVED, "prompt": PROMPTS["a"], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
            "ignore_eos": True, "stream": True}
    readers = []  # held until the block ends: dropping an SSE reader closes its connection
    with httpx.Client(timeout=30) as hc, contextlib.ExitStack() as stack:
        for path, payload in (("/v1/completions", body), ("/v1/completions", {**body, "prompt": ["x", "y"]}),
                              ("/v1/chat/completions", chat)):
            r = stack.enter_context(hc.stream("POST", srv.url + path, json=payload))
            assert r.status_code == 200
            readers.append(iter_sse(r))
            assert isinstance(next(readers[-1]), dict) and isinstance(next(readers[-1]), dict)
        assert wait_until(lambda: metric(srv, "deltaserve:num_requests_running") == 4, 10, 0.05), \
            metric(srv, "deltaserve:num_requests_running")
    # every client is gone; with nothing left to step, the core still reports its idle stats
    assert wait_until(lambda: metric(srv, "deltaserve:num_requests_running") == 0, 5, 0.05), metric(srv, "deltaserve:num_requests_running")
    assert metric(srv, "deltaserve:kv_cache_usage_perc") == 0
    assert wait_until(lambda: all_free(srv), 5, 0.1), integrity(srv)
    log = srv.log_path.read_bytes()[log_start:].decode(errors="replace")
    assert "Traceback" not in log and "RuntimeError" not in log and "ERROR" not in log, log[-3000:]

