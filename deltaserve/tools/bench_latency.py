"""`deltaserve bench latency`: one batch end to end, prefill and decode timed separately (printed, never asserted).

A batch of B random prompts of I tokens is submitted at once and run to O new tokens (greedy, ignore_eos). The
prefill phase lasts from submission until every request has its first token (chunked prefill may take several
steps); the decode phase is every later step. Per run: prefill_s, prefill_tokens_per_s, decode_step_s (median step),
decode_tokens_per_s (B tokens per median step), end_to_end_s. Fresh prompts each run (no prefix-cache hits); one
warm-up batch is not counted.
JSON: {"bench", "config", "machine", "runs": [...], "summary": {metric: summary}, "decode_steps_s": [last run's]}.
"""

from __future__ import annotations

import argparse
import statistics

from ..engine.config import EngineArgs
from ..engine.llm_engine import LLMEngine
from .bench import drive, random_prompts
from .bench_report import (emit, format_summary, machine_info, new_figure, parallel_lines, save_figure,
                           summarize_runs)


def latency_run(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> tuple[dict, list[float]]:
    t = drive(engine, prompts, output_len, tag)
    prefill_end = max(t["first"].values())
    times = [t["start"]] + [at for at, _ in t["steps"]]
    decode_steps = [b - a for a, b in zip(times, times[1:]) if a >= prefill_end]
    prefill = prefill_end - t["start"]
    step = statistics.median(decode_steps) if decode_steps else float("nan")
    run = {"prefill_s": prefill, "prefill_tokens_per_s": sum(map(len, prompts)) / prefill,
           "decode_step_s": step, "decode_tokens_per_s": len(prompts) / step,
           "end_to_end_s": t["end"] - t["start"]}
    return run, decode_steps


def run_latency(args: argparse.Namespace) -> str:
    if args.output_len < 2:
        raise SystemExit("bench latency: --output-len must be >= 2 to time a decode step")
    engine = LLMEngine(EngineArgs.from_cli(args, args.model))
    vocab = engine.config.vocab_size
    latency_run(engine, random_prompts(vocab, args.batch_size, args.input_len, args.seed + 10_000), 2, "warmup")
    runs, steps = [], []
    for r in range(args.runs):
        prompts = random_prompts(vocab, args.batch_size, args.input_len, args.seed + r)
        run, steps = latency_run(engine, prompts, args.output_len, f"run{r}")
        runs.append(run)
    summary = summarize_runs(runs)
    config = {"model": str(engine.model_path), "dtype": engine.dtype, "batch_size": args.batch_size,
              "input_len": args.input_len, "output_len": args.output_len, "runs": args.runs, "ops": args.ops}
    parallel, parallel_text = parallel_lines(engine)
    payload = {"bench": "latency", "config": config, "machine": machine_info(), "runs": runs, "summary": summary,
               "decode_steps_s": steps, **parallel}
    table = ("latency  " + " ".join(f"{k}={v}" for k, v in config.items()) + "\n" + format_summary(summary)
             + parallel_text)

    def plot(path: str) -> None:
        fig, (ax1, ax2) = new_figure(2)
        ax1.bar(["prefill", "decode (all steps)"],
                [summary["prefill_s"]["median"], summary["end_to_end_s"]["median"] - summary["prefill_s"]["median"]])
        ax1.set(ylabel="seconds (median run)", title=f"batch {args.batch_size}: {args.input_len} in, "
                                                      f"{args.output_len} out")
        ax2.plot([s * 1e3 for s in steps], marker=".")
        ax2.set(xlabel="decode step (last run)", ylabel="ms", title="decode step latency")
        save_figure(fig, path)

    return emit(args, payload, table, plot)
