"""Smoke tests of `deltaserve bench`: every subcommand at a tiny size writes JSON whose fields are present and sane
(positive rates, min <= median <= max, p50 <= p90 <= p99), and a PNG with --plot. Figures are never asserted."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics

import pytest
from server_utils import run_server

from deltaserve.cli import main
from deltaserve.tools.bench_report import percentiles, summarize

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None  # --plot is an optional extra


@pytest.fixture(scope="module")
def k31_tiny(make_checkpoint):
    return str(make_checkpoint("k31-tiny"))


def _bench(tmp_path, name: str, *argv: str) -> dict:
    out, png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    plot = ["--plot", str(png)] if HAVE_MPL else []
    assert main(["bench", name, *argv, "--json", str(out), *plot]) == 0
    if HAVE_MPL and name not in ("shared-prefix", "vision"):  # those two draw nothing
        assert png.stat().st_size > 1000
    payload = json.loads(out.read_text())
    assert payload["bench"] == name and payload["machine"]["torch_threads"] >= 1
    assert isinstance(payload["machine"]["amx_tiles"], bool)
    return payload


def _check_summary(summary: dict, positive: tuple[str, ...]) -> None:
    for key, s in summary.items():
        assert s["min"] <= s["median"] <= s["max"], key
    for key in positive:
        assert summary[key]["min"] > 0, key


def test_percentiles_and_summary():
    p = percentiles([5.0, 1.0, 3.0, 2.0, 4.0])
    assert p["p50"] == 3.0 and p["p50"] <= p["p90"] <= p["p99"] <= 5.0 and p["mean"] == 3.0
    assert summarize([2.0, 1.0, 9.0]) == {"median": 2.0, "min": 1.0, "max": 9.0, "n": 3}


def test_throughput(tmp_path, k31_tiny):
    payload = _bench(tmp_path, "throughput", "--model", k31_tiny, "--num-prompts", "1", "3", "--input-len", "16",
                     "--output-len", "4", "--runs", "2")
    assert [p["num_prompts"] for p in payload["points"]] == [1, 3]
    for p in payload["points"]:
        assert len(p["runs"]) == 2
        _check_summary(p["summary"], ("requests_per_s", "prompt_tokens_per_s", "output_tokens_per_s",
                                      "decode_tokens_per_s", "mean_ttft_s"))


def test_shared_prefix(tmp_path, k31_tiny):
    payload = _bench(tmp_path, "shared-prefix", "--model", k31_tiny, "--prefix-len", "128", "--question-len", "8",
                     "--num-requests", "3")
    assert payload["caching_on"]["hit_rate"] > 0 and payload["later_ttft_speedup"] > 0


def test_latency_on_the_default_model(tmp_path):
    payload = _bench(tmp_path, "latency", "--batch-size", "2", "--input-len", "16", "--output-len", "4",
                     "--runs", "2")
    assert payload["config"]["batch_size"] == 2 and len(payload["decode_steps_s"]) >= 1
    _check_summary(payload["summary"], ("prefill_s", "prefill_tokens_per_s", "decode_step_s", "decode_tokens_per_s"))


def test_spec_on_the_default_model(tmp_path):
    """Two proposer settings at two batch sizes: every figure present and positive, and the greedy outputs those
    of the run without speculation."""
    payload = _bench(tmp_path, "spec", "--batch-sizes", "1", "2", "--input-len", "32", "--output-len", "12",
                     "--speculative-configs", '{"method": "suffix", "num_speculative_tokens": 2}',
                     '{"method": "suffix", "num_speculative_tokens": 4}')
    assert [(r["proposer"]["num_speculative_tokens"], r["batch_size"]) for r in payload["results"]] == [
        (2, 1), (2, 2), (4, 1), (4, 2)]
    for r in payload["results"]:
        assert r["base_decode_tokens_per_s"] > 0 and r["spec_decode_tokens_per_s"] > 0 and r["speedup"] > 0
        assert r["mean_acceptance_length"] >= 1 and 0 <= r["acceptance_rate"] <= 1
        assert r["drafts_per_verify"] <= r["proposer"]["num_speculative_tokens"]
        assert r["identical"] == 1.0


def test_spec_prompts_are_never_reused():
    """Every batch of every round gets windows of its own (the suffix proposer would otherwise draft a prompt's
    answer from its earlier run), the warm-up one too, all of the asked length."""
    from deltaserve.engine.config import EngineArgs
    from deltaserve.engine.llm_engine import LLMEngine
    from deltaserve.tools.bench_spec import spec_prompts

    warm, batches = spec_prompts(LLMEngine(EngineArgs(kv_cache_memory="64MiB")), [1, 8, 32], 3, 128)
    assert sorted(batches) == [(b, r) for b in (1, 8, 32) for r in range(3)]
    prompts = warm + [p for batch in batches.values() for p in batch]
    assert len(prompts) == 1 + 3 * 41 and all(len(p) == 128 for p in prompts)
    assert len({tuple(p) for p in prompts}) == len(prompts)
    assert all(len(batches[b, r]) == b for b, r in batches)


def test_long_context_beyond_the_checkpoint_limit(tmp_path, k31_tiny):
    """k31-tiny allows 4096 positions; 4608 runs through the stretched view. KDA state bytes stay constant while
    latent and indexer bytes grow with the context."""
    payload = _bench(tmp_path, "long-context", "--model", k31_tiny, "--contexts", "256", "4608", "--output-len", "3")
    short, long = payload["points"]
    assert short["kda_state_bytes"] == long["kda_state_bytes"] > 0
    assert long["latent_cache_bytes"] > short["latent_cache_bytes"] > 0
    assert long["index_cache_bytes"] > short["index_cache_bytes"] > 0
    for p in payload["points"]:
        _check_summary(p["summary"], ("prefill_s", "prefill_tokens_per_s", "decode_token_s"))


def test_roofline(tmp_path, k31_tiny):
    payload = _bench(tmp_path, "roofline", "--model", k31_tiny, "--triad-mb", "8", "--matmul-size", "128",
                     "--input-len", "16", "--output-len", "4", "--runs", "1")
    s = payload["summary"]
    _check_summary({k: v for k, v in s.items() if not math.isnan(v["median"])},
                   ("triad_gb_per_s", "matmul_fp32_gflops", "decode_tokens_per_s", "ceiling_tokens_per_s"))
    assert 0 < s["fraction_of_ceiling"]["median"] < 1
    assert payload["bytes_per_step"] > payload["weight_bytes_touched"] > 0


def test_serve_against_our_server(tmp_path, k31_tiny):
    with run_server(k31_tiny) as server:
        fixed = _bench(tmp_path, "serve", "--base-url", server.url + "/v1", "--concurrency", "1", "2",
                       "--num-prompts", "4", "--input-len", "8", "--output-len", "5")
        chat = _bench(tmp_path, "serve", "--base-url", server.url + "/v1", "--workload", "multi-turn", "--turns", "2",
                      "--request-rate", "20", "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                      "--api", "completions")
    assert [p["concurrency"] for p in fixed["points"]] == [1, 2]
    for p in fixed["points"] + chat["points"]:
        (run,) = p["runs"]
        assert run["errors"] == 0 and run["completed"] == 4, fixed.get("sample_errors")
        assert run["request_throughput"] > 0 and run["output_throughput"] > 0
        for m in ("ttft", "tpot", "itl", "e2e"):
            assert 0 < run[f"{m}_p50_s"] <= run[f"{m}_p90_s"] <= run[f"{m}_p99_s"], m


def test_quant(tmp_path, k31_tiny):
    payload = _bench(tmp_path, "quant", "--model", k31_tiny, "--dtype", "bfloat16", "--batch-sizes", "1", "2",
                     "--input-len", "24", "--output-len", "3", "--prefill-len", "40", "--num-quality-prompts", "2",
                     "--quality-len", "32", "--kv-cache-memory", "64MiB", "--rounds", "2")
    assert payload["config"]["quality_len"] == 32 and payload["config"]["rounds"] == 2
    by_name = {r["variant"]: r for r in payload["results"]}
    assert set(by_name) == {"unquantised", "w8a8-mxfp8", "w4a8-mxfp4", "mxfp", "c8-int8", "c8-fp8"}
    base = by_name["unquantised"]
    assert base["allowed_speedup"] == 1 and base["speedup"] == {"1": 1, "2": 1} and base["share_of_allowed_b1"] == 1
    assert len(base["rounds"]) == 2 * (len(by_name) - 1)
    assert base["teacher_forced"]["top1_agreement"] == 1 and base["teacher_forced"]["perplexity_change"] == 0
    assert base["teacher_forced"]["mean_kl"] == pytest.approx(0, abs=1e-6)
    assert base["greedy_agreement"] == 1 and base["greedy_mean_kl"] == pytest.approx(0, abs=1e-6)
    for r in payload["results"]:
        assert sum(r["weight_bytes_by_format"].values()) == r["weight_bytes"]
        assert r["rss_bytes"] > r["weight_bytes"] > r["weight_bytes_per_token"] > 0
        assert all(v > 0 for v in r["decode_tokens_per_s"].values()) and r["prefill_tokens_per_s"] > 0
        # each speed-up is the median (of two rounds: their mean) of the ratios to the baseline's twin figures, timed
        # back to back with the variant's; the baseline's figures are all its twins
        if r is not base:
            assert len(r["rounds"]) == len(r["baseline_rounds"]) == 2
            assert r["speedup"]["1"] == pytest.approx(statistics.mean(
                x["decode"]["1"] / b["decode"]["1"] for x, b in zip(r["rounds"], r["baseline_rounds"])))
            assert all(b in base["rounds"] for b in r["baseline_rounds"])
        assert r["decode_tokens_per_s"]["1"] == pytest.approx(statistics.median(x["decode"]["1"] for x in r["rounds"]))
        assert r["share_of_allowed_b1"] == pytest.approx(r["speedup"]["1"] / r["allowed_speedup"])
        assert 0 <= r["greedy_agreement"] <= 1 and r["greedy_mean_kl"] >= -1e-6
        tf = r["teacher_forced"]
        if r["kv_cache_dtype"] != "auto":  # the cacheless forward reads no cache: nothing to compare
            assert tf is None and r["weight_bytes"] == base["weight_bytes"] and r["allowed_speedup"] == 1
            continue
        assert 0 <= tf["top1_agreement"] <= 1 and tf["mean_kl"] >= -1e-6
        assert 1 < tf["perplexity"] < math.inf
        assert tf["perplexity_change"] == pytest.approx(tf["perplexity"] / base["teacher_forced"]["perplexity"] - 1)
    for scheme, formats in (("w8a8-mxfp8", {"MXFP8"}), ("w4a8-mxfp4", {"MXFP4"}), ("mxfp", {"MXFP4", "MXFP8"})):
        r = by_name[scheme]
        assert set(r["weight_bytes_by_format"]) - {"bfloat16", "float32"} == formats
        assert r["weight_bytes_per_token"] < base["weight_bytes_per_token"] and r["allowed_speedup"] > 1
        assert r["teacher_forced"]["mean_kl"] > 0  # quantised weights change the distributions
    assert by_name["mxfp"]["weight_bytes"] < by_name["w8a8-mxfp8"]["weight_bytes"] < base["weight_bytes"]
    assert by_name["mxfp"]["allowed_speedup"] > max(by_name["w8a8-mxfp8"]["allowed_speedup"],
                                                    by_name["w4a8-mxfp4"]["allowed_speedup"])
    assert by_name["c8-int8"]["cache_bytes_per_token"] < base["cache_bytes_per_token"]


@pytest.mark.parametrize("flag", ["--num-quality-prompts", "--rounds", "--batch-sizes"])
def test_quant_refuses_counts_below_one(capsys, flag):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "quant", flag, "0"])
    assert exit_info.value.code == 2 and f"argument {flag}: must be an integer >= 1" in capsys.readouterr().err


def test_soak_small(tmp_path, k31_tiny):
    payload = _bench(tmp_path, "soak", "--model", k31_tiny, "--clients", "8", "--duration", "8", "--warmup", "2",
                     # a pool of about two sequences for eight clients: the scheduler must preempt
                     "--kv-cache-memory", "640KiB", "--max-num-seqs", "8", "--server-arg=--max-model-len",
                     "--server-arg=300")
    res = payload["result"]
    assert res["errors"] == 0, res["sample_errors"]
    assert res["requests"] >= 8 and set(res["by_kind"]) <= {"chat_stream", "completion", "completion_n2",
                                                             "stop_string", "dropped_stream", "bad_request"}
    assert res["integrity_ok"] and res["all_free_after"] and res["server_alive"]
    assert res["tracebacks_in_log"] == 0
    assert res["preemptions"] > 0, "the small cache did not force a preemption"
    assert res["rss_baseline_mb"] > 0 and len(payload["rss_samples"]) >= 2


def test_backends_native_vs_torch(tmp_path, k31_tiny, capsys):
    """Both backends run on one checkpoint (bf16 by default); the table has its rows and the agreement is a
    percentage."""
    payload = _bench(tmp_path, "backends", "--model", k31_tiny, "--num-prompts", "2", "--output-len", "8")
    table = capsys.readouterr().out
    for row in ("prompts", "teacher-forced argmax agreement (%)", "mean |dlogprob|", "max |dlogprob|",
                "free-running identical prefix (mean/min)", "wall time native", "wall time torch"):
        assert row in table, row
    assert payload["config"]["dtype"] == "bfloat16"
    backends = payload["backends"]
    assert backends["native"]["backend"] == "native" and backends["native"]["ops"] == "native"
    assert backends["torch"]["backend"] == "torch" and backends["torch"]["ops"] == "fast"
    assert backends["native"]["reason"] != backends["torch"]["reason"]
    assert f"native: {backends['native']['reason']}" in table and f"torch: {backends['torch']['reason']}" in table
    s = payload["summary"]
    assert s["prompts"] == 2 and s["tokens"] == 16
    assert 0 <= s["teacher_forced_agreement_pct"] <= 100 and 0 <= s["native_self_agreement_pct"] <= 100
    assert 0 <= s["mean_abs_dlogprob"] <= s["max_abs_dlogprob"]
    assert 0 <= s["free_identical_prefix_min"] <= s["free_identical_prefix_mean"] <= 8
    assert s["native_generate_s"] > 0 and s["torch_generate_s"] > 0
    assert all(len(p["native_tokens"]) == len(p["torch_tokens"]) == 8 for p in payload["prompts"])


def test_vision(tmp_path, make_checkpoint):
    payload = _bench(tmp_path, "vision", "--model", str(make_checkpoint("k3-tiny-vision")), "--sizes", "56", "300",
                     "--runs", "1")
    # 56 px: 4 x 4 patches, 4 positions; 300 px shrinks to 228 (the preset's 256-patch limit), padded to 252: 18 x 18
    assert [(e["side"], e["positions"]) for e in payload["encode"]] == [(56, 4), (300, 81)]
    assert all(e["preprocess_s"] > 0 and e["encode_s"] > 0 for e in payload["encode"])
    assert [t["images"] for t in payload["ttft"]] == [0, 1, 4] and all(t["ttft_s"] > 0 for t in payload["ttft"])

