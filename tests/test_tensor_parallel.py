"""Tensor and expert parallelism of the model's math (docs/parallel.md): 2 and 4 gloo ranks, each holding its
shard (heads, widths, vocabulary slices; experts split in width or placed whole), give the logits of one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from deltaserve import LLM
from deltaserve.cli import main
from deltaserve.default_model import default_model_path
from deltaserve.distributed import Shard
from deltaserve.engine.config import EngineArgs
from deltaserve.engine.core import EngineBrokenError
from deltaserve.errors import ConfigError
from deltaserve.models.loader import load_model
from deltaserve.tools.corpus import VALIDATION_PATH
from block_utils import count_programs
from engine_utils import assert_pools_free, greedy, make_llm, pool_bytes, random_prompts, with_mtp_copies
from parallel_utils import LAYOUTS, sharded_logits
from server_utils import cmdline, descendants, free_port, iter_sse, metric, pid_alive, run_server, wait_until


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


_ONE_PROCESS: dict = {}


_LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "tp2-ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
            "tp4": dict(tensor_parallel_size=4), "tp4-ep": dict(tensor_parallel_size=4, enable_expert_parallel=True)}


@pytest.mark.parametrize("preset, layout", [
    *(("k31-tiny", layout) for layout in _LAYOUTS),
    *((preset, layout) for preset in ("kimi-linear-tiny", "deepseek-v32-tiny")
      for layout in ("tp2", "tp2-ep", "tp4-ep"))])
def test_engine_over_ranks_gives_one_process_tokens(make_checkpoint, preset, layout):
    """The engine's steps over 2 or 4 ranks, experts split in width or placed whole (the workers replaying rank 0's
    slot and page copies): the same greedy tokens as one process through chunked prefill, prefix hits, preemption
    and a fork, and its logprobs to fp32 rounding. Four ranks with experts split in width only on k31-tiny: four
    ranks on two cores are slow, and the other presets' four-way attention splits run in the tp4-ep case."""
    parallel = _LAYOUTS[layout]
    path = make_checkpoint(preset)
    if preset not in _ONE_PROCESS:
        _ONE_PROCESS[preset] = _engine_scenario(path)
    want_tokens, want_logprobs = _ONE_PROCESS[preset]
    got_tokens, got_logprobs = _engine_scenario(path, **parallel)
    assert got_tokens == want_tokens
    for got, want in zip(got_logprobs[0], want_logprobs[0]):
        assert abs(got[0] - want[0]) < 1e-4 and [t for t, _ in got[1]] == [t for t, _ in want[1]]


def _speculation_scenario(path, speculative_config=None, **parallel):
    """Greedy tokens of windows of Python source (the trained model's drafts are then both kept and rejected), two of
    them sharing a prefix (prefix hits), with n = 2 (a fork) and a small token budget (chunked prefill, verify steps
    cut short); and the speculative decoding counters (drafts made, kept, kept per position)."""
    with make_llm(path, max_num_seqs=4, max_num_batched_tokens=24, kv_cache_memory="64MiB",
                  speculative_config=speculative_config, **parallel) as llm:
        ids = llm.tokenizer.encode(VALIDATION_PATH.read_text()[:40_000])
        prompts = [ids[i:i + n] for i, n in ((0, 40), (3000, 90), (7000, 70), (7000, 100), (9000, 20))]
        params = [greedy(24) for _ in prompts]
        params[1] = greedy(24, n=2)
        runs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
        engine = llm.engine
        assert engine.prefix.num_hit_tokens > 0
        assert_pools_free(engine)
        stats = engine.core.spec_stats
        counts = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.accepted_per_pos))
    return [[c.token_ids for c in o.outputs] for run in runs for o in run], counts


@pytest.mark.parametrize("method, mtp_layers, parallel", [
    ("suffix", 1, dict(tensor_parallel_size=2)),
    ("mtp", 1, dict(tensor_parallel_size=2)),
    ("mtp", 3, dict(tensor_parallel_size=2, enable_expert_parallel=True))],
    ids=["suffix-tp2", "mtp-tp2", "mtp3-tp2-ep"])
def test_speculative_decoding_over_ranks(tmp_path_factory, method, mtp_layers, parallel):
    """The default model over 2 ranks with suffix drafts (rank 0 alone drafts; the verify steps' rows and KDA
    snapshots run on every rank) and MTP drafts (every run of an MTP layer, catch-up and chained, runs on every
    rank's shard of it; with its MTP layer copied into three, each layer's runs on that layer): the greedy tokens of
    one process without drafts, and the drafts one process makes and keeps with them, some kept and some
    rejected."""
    path = default_model_path()
    if mtp_layers > 1:
        path = with_mtp_copies(path, tmp_path_factory.mktemp("mtp_copies"), mtp_layers)
    config = {"method": method, "num_speculative_tokens": 3}
    key = ("speculation", method, mtp_layers)
    if key not in _ONE_PROCESS:
        _ONE_PROCESS[key] = (_speculation_scenario(path)[0], _speculation_scenario(path, config)[1])
    want_tokens, want_counts = _ONE_PROCESS[key]
    tokens, counts = _speculation_scenario(path, config, **parallel)
    assert tokens == want_tokens
    assert counts == want_counts and 0 < counts[2] < counts[1], (counts, want_counts)


def test_dspark_drafting_over_ranks_is_refused_naming_why():
    with pytest.raises(ConfigError, match="'dspark' does not run with tensor_parallel_size > 1"):
        EngineArgs(tensor_parallel_size=2, speculative_config={"method": "dspark", "model": "drafter",
                                                                 "num_speculative_tokens": 3})


@pytest.mark.slow
def test_server_over_two_ranks_and_a_rank_that_dies(make_checkpoint):
    """`serve --tensor-parallel-size 2` through the openai client gives one process's tokens (chunked prefill, then a
    prefix hit); when rank 1 is killed
    mid-stream the stream ends with an error within the distributed timeout, /health answers 503, the dead core's
    processes are all gone, and a fresh core (with a fresh rank 1) serves again."""
    path = make_checkpoint("k31-tiny")
    prompt = random_prompts([24], seed=8, high=1000)[0]
    with LLM(str(path), dtype="float32", kv_cache_memory="64MiB") as one:
        want = one.generate([prompt], greedy(12), use_tqdm=False)[0].outputs[0].text
    flags = ("--served-model-name", "tp", "--dtype", "float32", "--kv-cache-memory", "64MiB", "--block-size", "16",
             "--max-num-batched-tokens", "16", "--tensor-parallel-size", "2", "--distributed-timeout", "5",
             "--max-engine-restarts", "1")
    with run_server(path, *flags) as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            for _ in range(2):  # the prompt in chunks of 16, then again from the prefix cache
                out = client.completions.create(model="tp", prompt=prompt, max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True})
                assert out.choices[0].text == want
        assert metric(srv, "deltaserve:prefix_cache_hits_total") > 0
        engine = srv.engine_pid()
        tree = descendants(engine)
        (rank1,) = [p for p in tree if "deltaserve.engine.rank" in cmdline(p)]
        body = {"model": "tp", "prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as hc, hc.stream("POST", srv.url + "/v1/completions", json=body) as r:
            events = iter_sse(r)
            assert next(events)["choices"][0]["finish_reason"] is None
            os.kill(rank1, signal.SIGKILL)
            killed = time.monotonic()
            rest = list(events)
            ended = time.monotonic() - killed
            health = httpx.get(srv.url + "/health", timeout=5).status_code
        assert ended < 5 + 5, f"the stream took {ended:.1f} s to end after rank 1 died"
        errors = [e["error"] for e in rest if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == 503 and rest[-1] == "[DONE]"
        assert health == 503
        assert wait_until(lambda: not any(pid_alive(p) for p in [engine, *tree]), 10, 0.1), \
            [(p, cmdline(p)) for p in [engine, *tree] if pid_alive(p)]
        assert wait_until(lambda: httpx.get(srv.url + "/health", timeout=5).status_code == 200, 30, 0.2), srv.log()
        assert len([p for p in descendants(srv.engine_pid()) if "deltaserve.engine.rank" in cmdline(p)]) == 1
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            again = client.completions.create(model="tp", prompt=prompt, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert again.choices[0].text == want


def test_a_rank_that_hangs_fails_the_requests_within_the_timeout(make_checkpoint):
    """Rank 1 stopped (SIGSTOP) mid-run: rank 0's next collective times out after --distributed-timeout, every
    request in flight fails, the engine refuses to go on (EngineBrokenError) and closing it leaves no process."""
    path = make_checkpoint("kimi-linear-tiny")
    prompts = random_prompts([10, 20], seed=2, high=1000)
    llm = make_llm(path, tensor_parallel_size=2, distributed_timeout=3)
    (rank1,) = llm.engine.core.workers.processes
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"r{i}", p, greedy(200))
    llm.engine.step()
    os.kill(rank1.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(EngineBrokenError, match="tensor-parallel step failed"):
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert time.monotonic() - started < 3 + 5
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    llm.close()
    assert rank1.poll() is not None


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_two_nodes_over_loopback(make_checkpoint, command):
    """Two launches on one machine: `serve` or `generate` with `--nnodes 2 --node-rank 1` (rank 1, no API, no
    request of its own) and an engine with --node-rank 0 (rank 0), meeting at --master-addr/--master-port: one
    process's tokens; when node 0 closes, node 1's launch ends with status 0. An engine itself refuses node rank 1."""
    path = make_checkpoint("k31-tiny")
    prompts = random_prompts([7, 30], seed=9, high=1000)
    with LLM(str(path), dtype="float32", kv_cache_memory="16MiB") as one:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, greedy(10), use_tqdm=False)]
    port = free_port()
    with pytest.raises(ConfigError, match="an engine runs on node 0"):
        LLM(str(path), tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=port)
    node1 = subprocess.Popen([sys.executable, "-m", "deltaserve.cli", command, str(path), "--dtype", "float32",
                              "--kv-cache-memory", "16MiB", "--tensor-parallel-size", "2", "--nnodes", "2",
                              "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)])
    try:
        with LLM(str(path), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2, nnodes=2,
                 node_rank=0, master_port=port) as node0:
            assert node0.engine.core.workers.processes == []  # rank 1 is node 1's
            got = [o.outputs[0].token_ids for o in node0.generate(prompts, greedy(10), use_tqdm=False)]
        assert got == want
        assert node1.wait(30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()


def test_bench_latency_reports_each_rank(make_checkpoint, tmp_path, capsys):
    """`bench latency --tensor-parallel-size 2`: every rank's weight bytes (about half of one process's each, plus
    what every rank holds whole), its pool bytes and rank 0's time in collectives per step, in the JSON and the
    table."""
    path = make_checkpoint("k31-tiny")
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(path), "--batch-size", "2", "--input-len", "16", "--output-len",
                 "4", "--runs", "1", "--tensor-parallel-size", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())["parallel"]
    assert "tensor parallel 2: rank 0:" in capsys.readouterr().out
    one = load_model(path, "bfloat16")
    total = sum(p.numel() * p.element_size() for p in one.parameters())
    weights = report["rank_weight_bytes"]
    assert len(weights) == 2 and weights[0] == weights[1] and total / 2 < weights[0] < 0.75 * total
    assert report["rank_pool_bytes"][0] == report["rank_pool_bytes"][1] > 0
    assert report["comm_s_per_step"] > 0 and report["comm_calls_per_step"] > 2


@pytest.mark.parametrize("preset, parallel", [
    ("kimi-linear-tiny", dict(tensor_parallel_size=2)),
    ("deepseek-v32-tiny", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
])
def test_native_backend_on_each_rank(make_checkpoint, monkeypatch, preset, parallel):
    """bf16 over 2 ranks on the native backend: every rank runs its modules' native forms on its shard and its decode
    steps as programs whose blocks write the rank's partial output, all-reduced between native segments ("reduce"
    nodes; the blocks that need every rank inside the kernel — an indexer's top-k, experts across ranks — on the
    modules), and gives the greedy tokens of the same ranks on the torch backend but where the kernels' other
    summation order meets a near-tie (top-2 logprob gap under 0.05 nats at the first difference). Against one
    process the fp32 tests above hold: in bf16 each rank's partial sums are rounded before the all-reduce, which
    moves a router's or the output's near-ties."""
    taken = count_programs(monkeypatch)
    path = make_checkpoint(preset)
    prompts = random_prompts([5, 18, 33, 47], seed=12, high=1000)
    params = greedy(16, logprobs=2)
    kw = dict(dtype="bfloat16", kv_cache_memory="16MiB", max_num_batched_tokens=24, **parallel)
    with LLM(str(path), backend="torch", **kw) as modules:
        want = modules.generate(prompts, params, use_tqdm=False)
    with LLM(str(path), backend="native", **kw) as native:
        engine = native.engine
        assert engine.core.backend.name == "native"
        assert "native forms" in engine.core.backend_prepared and "(rank 0 of 2)" in engine.core.backend_prepared
        assert type(engine.model.layers[0].self_attn).__name__.startswith("Native")
        got = native.generate(prompts, params, use_tqdm=False)
        programs = [p for p in engine.core.backend.programs._by_kind.values() if p._value is not None]
        kinds = {k for p in programs for seg in p._value.segments for k in (seg.kinds or [seg.node.kind])}
    assert any(taken) and {"reduce", "kda" if preset == "kimi-linear-tiny" else "ffn"} <= kinds, kinds
    same = 0
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        if g.token_ids == w.token_ids:
            same += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b)
        (_, top1), (_, top2) = w.logprobs[i].top
        assert top1 - top2 < 0.05, (i, w.logprobs[i].top)
    assert same >= 3
