"""`deltaserve bench spec`: what each speculative-decoding proposer buys, against no speculation, in one run (printed
and written with --json, never asserted).

Workload: at each --batch-sizes B, B windows of --input-len tokens of the shipped validation text (real Python: what
the default model completes), each continued for --output-len tokens (greedy, ignore_eos); no window serves twice
(batches, rounds and the warm-up all differ), so the suffix proposer's response cache never holds a prompt's answer. The engine without
speculation stays loaded; for every proposer (--speculative-configs, vLLM's JSON each) an engine is built and, in
each of --rounds rounds, every batch size runs on both engines back to back (which goes first alternates): the
machine's bandwidth moves from minute to minute, so each figure has its twin taken seconds from it. Per proposer and
batch size, medians over rounds of:
  * decode tokens/s: the tokens generated after every request has its first one, over that time, for both engines,
    and the speed-up (the ratio of each round's pair);
  * mean acceptance length (tokens a verify step emits: accepted drafts + 1), acceptance rate (accepted / drafted),
    drafts per verify step;
  * identical: the share of requests whose tokens equal the run without speculation (greedy: 100% expected, less
    only at a floating-point near-tie between the verify step's and the decode step's kernels).
JSON: {"bench", "machine", "model", "dtype", "config", "results": [one dict per proposer and batch size]}.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import fields, replace

from ..engine.config import EngineArgs
from ..engine.llm_engine import LLMEngine
from ..server.serve import positive_int
from ..spec_decode import SpeculativeConfig
from .bench import drive, validation_windows
from .bench_report import emit, format_table, machine_info, new_figure, save_figure


def decode_run(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    """Decode tokens/s of one batch, the tokens, and the proposer's counters over the run."""
    core = engine.core
    before = core.spec_stats.as_dict() if core.spec is not None else None
    t = drive(engine, prompts, output_len, tag)
    decode_time = t["end"] - max(t["first"].values())
    run = {"decode_tokens_per_s": len(prompts) * (output_len - 1) / decode_time, "tokens": t["tokens"]}
    if before is not None:
        after = core.spec_stats.as_dict()
        drafts, drafted, accepted = (after[k] - before[k] for k in (
            "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
        run.update(mean_acceptance_length=1 + accepted / drafts if drafts else 1.0,
                   acceptance_rate=accepted / drafted if drafted else 0.0,
                   drafts_per_verify=drafted / drafts if drafts else 0.0)
    return run


def spec_prompts(engine: LLMEngine, batch_sizes: list[int], rounds: int,
                 input_len: int) -> tuple[list[list[int]], dict[tuple[int, int], list[list[int]]]]:
    """The warm-up prompt and each (batch size, round)'s prompts, no window twice: the suffix proposer caches
    responses, and a prompt whose answer it has seen would be drafted from that answer."""
    windows = iter(validation_windows(engine, rounds * sum(batch_sizes) + 1, input_len))
    warm = [next(windows)]
    return warm, {(batch, r): [next(windows) for _ in range(batch)] for batch in batch_sizes for r in range(rounds)}


def run_spec(args: argparse.Namespace) -> str:
    if args.output_len < 2:
        raise SystemExit("bench spec: --output-len must be >= 2 to time decoding")
    configs = [SpeculativeConfig.parse(text) for text in args.speculative_configs]
    base = LLMEngine(replace(EngineArgs.from_cli(args, args.model), speculative_config=None))
    warm, batches = spec_prompts(base, args.batch_sizes, args.rounds, args.input_len)
    results = []
    for config in configs:
        engine = LLMEngine(replace(EngineArgs.from_cli(args, args.model), speculative_config=config.to_dict()))
        for e in (base, engine):
            decode_run(e, warm, 4, "warm")
        for batch in args.batch_sizes:
            rounds = []
            for r in range(args.rounds):
                prompts = batches[batch, r]
                order = [(base, "base"), (engine, "spec")]
                pair = {name: decode_run(e, prompts, args.output_len, f"{name}{batch}-{r}")
                        for e, name in (order if r % 2 == 0 else order[::-1])}
                rounds.append(pair)
            spec_runs = [p["spec"] for p in rounds]
            results.append({
                "proposer": config.to_dict(), "batch_size": batch,
                "base_decode_tokens_per_s": statistics.median(p["base"]["decode_tokens_per_s"] for p in rounds),
                "spec_decode_tokens_per_s": statistics.median(s["decode_tokens_per_s"] for s in spec_runs),
                "speedup": statistics.median(p["spec"]["decode_tokens_per_s"] / p["base"]["decode_tokens_per_s"]
                                             for p in rounds),
                **{k: statistics.median(s[k] for s in spec_runs)
                   for k in ("mean_acceptance_length", "acceptance_rate", "drafts_per_verify")},
                "identical": statistics.mean(a == b for p in rounds
                                             for a, b in zip(p["base"]["tokens"], p["spec"]["tokens"])),
            })
        del engine
    config = {"batch_sizes": args.batch_sizes, "input_len": args.input_len, "output_len": args.output_len,
              "rounds": args.rounds}
    payload = {"bench": "spec", "machine": machine_info(), "model": str(base.model_path), "dtype": base.dtype,
               "config": config, "results": results}
    table = format_table(
        ["proposer", "batch", "base tok/s", "spec tok/s", "speed-up", "accept length", "accept rate",
         "drafts/verify", "identical"],
        [[_name(r["proposer"]), r["batch_size"], r["base_decode_tokens_per_s"], r["spec_decode_tokens_per_s"],
          r["speedup"], r["mean_acceptance_length"], r["acceptance_rate"], r["drafts_per_verify"], r["identical"]]
         for r in results])
    header = (f"spec  model={base.model_path} dtype={base.dtype} " + " ".join(f"{k}={v}" for k, v in config.items())
              + "\ndecode tokens/s (tokens after every request's first, over that time), medians over rounds\n")

    def plot(path: str) -> None:
        fig, (speed_ax, length_ax) = new_figure(2)
        for name in dict.fromkeys(_name(r["proposer"]) for r in results):
            mine = [r for r in results if _name(r["proposer"]) == name]
            speed_ax.plot([r["batch_size"] for r in mine], [r["speedup"] for r in mine], marker="o", label=name)
            length_ax.plot([r["batch_size"] for r in mine], [r["mean_acceptance_length"] for r in mine], marker="o",
                           label=name)
        speed_ax.axhline(1.0, color="grey", lw=0.5)
        speed_ax.set(xscale="log", xlabel="batch", title="decode speed-up vs no speculation")
        length_ax.set(xscale="log", xlabel="batch", title="mean acceptance length")
        speed_ax.legend()
        save_figure(fig, path)

    return emit(args, payload, header + table, plot)


def _name(proposer: dict) -> str:
    """`method k=N`, then each knob set away from its default (two configs of one method differ by those)."""
    defaults = {f.name: f.default for f in fields(SpeculativeConfig)}
    knobs = [f"{k}={v}" for k, v in proposer.items()
             if k not in ("method", "num_speculative_tokens", "model") and k in defaults and v != defaults[k]]
    return " ".join([f"{proposer['method']} k={proposer['num_speculative_tokens']}", *knobs])


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative-configs", nargs="+",
                        default=['{"method": "suffix", "num_speculative_tokens": 4}'],
                        help="one vLLM-style JSON object per proposer measured")
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8, 32], help="batches timed")
    parser.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens (validation text)")
    parser.add_argument("--output-len", type=positive_int, default=256, help="generated tokens per prompt")
    parser.add_argument("--rounds", type=positive_int, default=1, help="paired rounds per batch size")
