"""`deltaserve bench throughput` and `bench shared-prefix`: offline engine benchmarks (printed, never asserted).

throughput (BENCHMARKS.md decode/throughput workload): for each N in --num-prompts, N prompts of I random tokens,
O new tokens each, greedy, ignore_eos, all submitted at once. Per run: requests/s, prompt and output tokens/s,
decode-phase output tokens/s (after the last prompt got its first token) and mean time to first token. Every run
draws fresh prompts (seed + run) so the prefix cache cannot serve a repeat; one warm-up run is not counted.
JSON: {"bench", "config", "machine", "points": [{"num_prompts", "runs": [...], "summary": {metric: summary}}]}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..engine.config import EngineArgs
from ..engine.llm_engine import LLMEngine
from ..engine.sampling_params import SamplingParams
from .bench_report import emit, format_table, machine_info, new_figure, parallel_lines, save_figure, summarize_runs
from .corpus import VALIDATION_PATH


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn uniformly from [0, vocab) by a generator seeded with `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def validation_windows(engine: LLMEngine, count: int, length: int, first: int = 0,
                       chars: int | None = None) -> list[list[int]]:
    """Windows `first` .. `first + count - 1` of `length` tokens of the shipped validation text (its first `chars`
    characters, or all of it), `first + count` windows spread evenly over it: real Python as prompts."""
    text = VALIDATION_PATH.read_text()
    ids = engine.tokenizer.encode(text if chars is None else text[:chars])
    stride = max(length, (len(ids) - length) // max(count + first, 1))
    return [ids[i * stride:i * stride + length] for i in range(first, first + count)]


def drive(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    """Submit all prompts at once (greedy, ignore_eos) and step to completion. Returns submit time `start`, `end`,
    per-request first-token times `first` and per-step (time, tokens produced) `steps`, all perf_counter seconds,
    and `tokens`: the generated ids of each prompt, in prompt order."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    steps: list[tuple[float, int]] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        steps.append((now, len(outs)))
        for out in outs:
            first.setdefault(out.request_id, now)
            tokens[out.request_id] = out.outputs[0].token_ids
    return {"start": start, "end": time.perf_counter(), "first": first, "steps": steps,
            "tokens": [list(tokens[f"{tag}-{i}"]) for i in range(len(prompts))]}


def _throughput_run(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    t = drive(engine, prompts, output_len, tag)
    elapsed = t["end"] - t["start"]
    last_first = max(t["first"].values())
    decode_tokens = sum(n for at, n in t["steps"] if at > last_first)
    decode_time = t["end"] - last_first
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "prompt_tokens_per_s": sum(map(len, prompts)) / elapsed,
        "output_tokens_per_s": len(prompts) * output_len / elapsed,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 else float("nan"),
        "mean_ttft_s": statistics.mean(f - t["start"] for f in t["first"].values()),
    }


def run_throughput(args: argparse.Namespace) -> str:
    engine = LLMEngine(EngineArgs.from_cli(args, args.model))
    vocab = engine.config.vocab_size
    _throughput_run(engine, random_prompts(vocab, 1, args.input_len, args.seed + 10_000), 2, "warmup")
    points = []
    for n in args.num_prompts:
        runs = [_throughput_run(engine, random_prompts(vocab, n, args.input_len, args.seed + 1000 * n + r),
                                args.output_len, f"n{n}-run{r}") for r in range(args.runs)]
        points.append({"num_prompts": n, "runs": runs, "summary": summarize_runs(runs)})
    config = {"model": str(engine.model_path), "dtype": engine.dtype, "input_len": args.input_len,
              "output_len": args.output_len, "runs": args.runs, "ops": args.ops}
    parallel, parallel_text = parallel_lines(engine)
    payload = {"bench": "throughput", "config": config, "machine": machine_info(), "points": points, **parallel}
    metrics = ["output_tokens_per_s", "decode_tokens_per_s", "prompt_tokens_per_s", "requests_per_s", "mean_ttft_s"]
    rows = [[p["num_prompts"], m, p["summary"][m]["median"], p["summary"][m]["min"], p["summary"][m]["max"]]
            for p in points for m in metrics]
    table = (f"throughput  model={engine.model_path} dtype={engine.dtype} threads={torch.get_num_threads()} "
             f"input_len={args.input_len} output_len={args.output_len} runs={args.runs}\n"
             + format_table(["prompts", "metric", "median", "min", "max"], rows) + parallel_text)

    def plot(path: str) -> None:
        fig, (ax,) = new_figure()
        xs = [p["num_prompts"] for p in points]
        for m in ("output_tokens_per_s", "decode_tokens_per_s"):
            med = [p["summary"][m]["median"] for p in points]
            err = [[md - p["summary"][m]["min"] for md, p in zip(med, points)],
                   [p["summary"][m]["max"] - md for md, p in zip(med, points)]]
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=m)
        ax.set(xlabel="concurrent prompts", ylabel="tokens/s", xscale="log", title="offline throughput")
        ax.legend()
        save_figure(fig, path)

    return emit(args, payload, table, plot)


def _shared_prefix_run(engine: LLMEngine, system: list[int], questions: list[list[int]], tag: str) -> dict:
    """The first request alone (it fills the cache), then the others together; TTFT of the later ones."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ttft, cached = [], []
    for group in ([questions[0]], questions[1:]):
        start = time.perf_counter()
        ids = [f"{tag}-{len(ttft) + i}" for i in range(len(group))]
        for rid, q in zip(ids, group):
            engine.add_request(rid, system + q, params)
        seen: set[str] = set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id not in seen:
                    seen.add(out.request_id)
                    ttft.append(time.perf_counter() - start)
                if out.finished:
                    cached.append(out.num_cached_tokens)
    later = ttft[1:]
    return {"first_ttft_s": ttft[0], "later_mean_ttft_s": statistics.mean(later),
            "hit_rate": sum(cached[1:]) / (len(system) * len(later))}


def run_shared_prefix(args: argparse.Namespace) -> str:
    """Shared-prefix workload (BENCHMARKS.md): a long system prompt and short questions, caching on vs off.
    JSON: {"bench", "config", "machine", "caching_on": {...}, "caching_off": {...}, "later_ttft_speedup"}."""
    results = {}
    for caching in (True, False):
        args.enable_prefix_caching = caching
        engine = LLMEngine(EngineArgs.from_cli(args, args.model))
        vocab = engine.config.vocab_size
        system, *questions = (random_prompts(vocab, 1, args.prefix_len, args.seed)
                              + random_prompts(vocab, args.num_requests, args.question_len, args.seed + 1))
        results[caching] = _shared_prefix_run(engine, system, questions, "on" if caching else "off")
    speedup = results[False]["later_mean_ttft_s"] / results[True]["later_mean_ttft_s"]
    config = {"model": args.model, "dtype": engine.dtype, "prefix_len": args.prefix_len,
              "question_len": args.question_len, "num_requests": args.num_requests}
    payload = {"bench": "shared-prefix", "config": config, "machine": machine_info(), "caching_on": results[True],
               "caching_off": results[False], "later_ttft_speedup": speedup}
    keys = list(results[True])
    table = ("shared-prefix  " + " ".join(f"{k}={v}" for k, v in config.items()) + "\n"
             + format_table(["prefix caching", *keys], [[name, *(results[c][k] for k in keys)]
                                                        for name, c in (("on", True), ("off", False))])
             + f"\nlater-request TTFT off/on: {speedup:.2f}x")
    return emit(args, payload, table, None)
