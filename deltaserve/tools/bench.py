"""`deltaserve bench throughput`: offline throughput of the engine on random prompts (printed, never asserted).

Workload (BENCHMARKS.md): N prompts of I random tokens, O new tokens each, greedy, ignore_eos, all submitted at
once. Reports requests/s, prompt and output tokens/s, decode-phase output tokens/s (after the last prompt got its
first token) and mean time to first token. With --runs > 1 it prints every run and the median.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..engine.config import EngineArgs
from ..engine.llm_engine import LLMEngine
from ..engine.sampling_params import SamplingParams


def _one_run(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    first: dict[str, float] = {}
    produced_at: list[tuple[float, int]] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        produced_at.append((now, len(outs)))
        for out in outs:
            first.setdefault(out.request_id, now)
    end = time.perf_counter()
    elapsed = end - start
    last_first = max(first.values())
    decode_tokens = sum(n for t, n in produced_at if t > last_first)
    decode_time = end - last_first
    n_out = len(prompts) * output_len
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "prompt_tokens_per_s": sum(map(len, prompts)) / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 else float("nan"),
        "mean_ttft_s": statistics.mean(t - start for t in first.values()),
    }


def run_throughput(args: argparse.Namespace) -> str:
    engine = LLMEngine(EngineArgs.from_cli(args, args.model))
    vocab = engine.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.input_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
    _one_run(engine, prompts[:1], 2, "warmup")
    runs = [_one_run(engine, prompts, args.output_len, f"run{r}") for r in range(args.runs)]
    lines = [f"model={engine.model_path} dtype={args.dtype} threads={torch.get_num_threads()} "
             f"prompts={args.num_prompts} input_len={args.input_len} output_len={args.output_len}"]
    keys = list(runs[0])
    for i, r in enumerate(runs):
        lines.append(f"run {i}: " + "  ".join(f"{k}={r[k]:.3f}" for k in keys))
    if len(runs) > 1:
        lines.append("median: " + "  ".join(
            f"{k}={statistics.median(r[k] for r in runs):.3f} [min {min(r[k] for r in runs):.3f}, "
            f"max {max(r[k] for r in runs):.3f}]" for k in keys))
    return "\n".join(lines)


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
    """Shared-prefix workload (BENCHMARKS.md): a long system prompt and short questions, caching on vs off."""
    lines = []
    results = {}
    for caching in (True, False):
        args.enable_prefix_caching = caching
        engine = LLMEngine(EngineArgs.from_cli(args, args.model))
        gen = torch.Generator().manual_seed(0)
        vocab = engine.config.vocab_size
        system = torch.randint(0, vocab, (args.prefix_len,), generator=gen).tolist()
        questions = [torch.randint(0, vocab, (args.question_len,), generator=gen).tolist()
                     for _ in range(args.num_requests)]
        r = results[caching] = _shared_prefix_run(engine, system, questions, "on" if caching else "off")
        lines.append(f"prefix caching {'on ' if caching else 'off'}: " + "  ".join(f"{k}={v:.3f}" for k, v in r.items()))
    lines.insert(0, f"model={args.model} dtype={args.dtype} prefix_len={args.prefix_len} "
                    f"question_len={args.question_len} requests={args.num_requests}")
    lines.append(f"later-request TTFT off/on: {results[False]['later_mean_ttft_s'] / results[True]['later_mean_ttft_s']:.2f}x")
    return "\n".join(lines)
