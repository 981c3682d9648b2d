"""`deltaserve bench quant`: what each weight scheme and cache dtype costs and buys, all measured in one run (issue
8's benchmark; printed and written with --json, never asserted).

Variants: the unquantised model (the model dtype, e.g. bf16), each weight scheme (w8a8-mxfp8, w4a8-mxfp4, mxfp)
with the model-dtype cache, and the C8 cache (int8, fp8) with unquantised weights. Per variant:
  * weight bytes as stored (MX elements + scales, or parameters; not the dequantised copies an MXLinear caches for
    speed nor prepacked copies), in total and by format (engine/summary.py weight_bytes_by_format);
  * resident bytes (VmRSS) of a fresh process that built the variant's engine and decoded one short request: the
    measuring process keeps what earlier variants freed (engine/heap.py), so its own RSS would not tell variants
    apart;
  * cache bytes per token (every MLA/DSA layer's latent + indexer key);
  * weight bytes one batch-1 decode step reads (bench_roofline.weight_bytes_touched: every weight once, k/E of the
    routed experts, one embedding row unless tied to the LM head) and the speed-up that allows, unquantised bytes /
    variant bytes: what a decode bound by reading weights could gain;
  * decode tokens/s at each --batch-sizes (random prompts of --input-len, greedy, decode phase only, one warm-up
    batch), and prefill tokens/s: one random prompt of --prefill-len tokens over its time to first token (after one
    warm-up prompt of the same length). The unquantised engine stays loaded for the whole run, and each other
    variant takes --rounds rounds in which every workload runs on both engines back to back (which goes first
    alternates): the machine's bandwidth moves from minute to minute, often by more than a scheme gains, so each
    variant figure has an unquantised twin taken seconds from it, not minutes. A variant's figures are the medians
    over its rounds; the unquantised ones the medians over all of its rounds (`baseline_rounds` of each variant);
  * against the unquantised variant: the decode and prefill speed-ups, each the median over rounds of the variant's
    figure over its unquantised twin's, and at batch 1 the share of the allowed speed-up reached (measured /
    allowed);
  * quality against the unquantised engine, teacher-forced: --num-quality-prompts windows of --quality-len tokens
    of the shipped validation text, one cacheless forward per window on the variant's own model and backend (so its
    quantisation applies); at every position with a next token: top-1 agreement (same argmax), mean
    KL(unquantised || variant) of the next-token distributions, and each variant's perplexity (the unquantised one's
    too) with its relative change. The cacheless forward reads no cache, so the C8 variants have no teacher-forced
    figures (null);
  * greedy agreement through the engine (cache included, so the C8 variants are measured too): --num-quality-prompts
    windows of --input-len tokens continued for --output-len tokens, the share of generated positions with the
    unquantised run's token, and the mean KL over the positions both runs reached with the same tokens so far.
JSON: {"bench", "machine", "model", "dtype", "config", "results": [one dict per variant, the unquantised first]}.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from ..engine.config import QUANTIZATIONS, EngineArgs
from ..engine.llm_engine import LLMEngine
from ..engine.summary import weight_bytes, weight_bytes_by_format
from ..server.serve import positive_int
from .bench import drive, random_prompts, validation_windows
from .bench_backends import forward_logits
from .bench_latency import latency_run
from .bench_report import emit, format_table, machine_info, new_figure, save_figure
from .bench_roofline import weight_bytes_touched

CACHE_DTYPES = ("int8", "fp8")
QUALITY_TEXT_CHARS = 200_000  # the quality windows come from the validation text's first characters


def variants() -> list[tuple[str, str | None, str]]:
    """(name, quantization, kv_cache_dtype) of every variant, the unquantised baseline first."""
    return ([("unquantised", None, "auto")] + [(q, q, "auto") for q in QUANTIZATIONS]
            + [(f"c8-{c}", None, c) for c in CACHE_DTYPES])


def vm_rss() -> int:
    """This process's resident bytes (VmRSS of /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmRSS line")


def _built_and_warmed_rss(engine_args: EngineArgs, input_len: int) -> int:
    engine = LLMEngine(engine_args)
    latency_run(engine, random_prompts(engine.config.vocab_size, 1, input_len, 0), 2, "rss")
    return vm_rss()


def resident_bytes(engine_args: EngineArgs, input_len: int) -> int:
    """VmRSS of a fresh (spawned) process after it built an engine with `engine_args` and decoded one request of
    `input_len` prompt tokens."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_built_and_warmed_rss, engine_args, input_len).result()


def teacher_forced(engine: LLMEngine, windows: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per window: (fp32 log-probabilities [len - 1, vocab] of the next token at every position that has one, the
    next tokens [len - 1])."""
    return [(forward_logits(engine, w)[:-1].log_softmax(-1), torch.tensor(w[1:])) for w in windows]


def compare_teacher_forced(base: list[tuple[torch.Tensor, torch.Tensor]],
                           other: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Top-1 agreement, mean KL(base || other) and the perplexity of `other`, over every position of every
    window of two teacher_forced results on the same windows."""
    same = kl = nll = positions = 0.0
    for (lp_base, _), (lp, targets) in zip(base, other):
        same += (lp.argmax(-1) == lp_base.argmax(-1)).sum().item()
        kl += torch.nn.functional.kl_div(lp, lp_base, log_target=True, reduction="sum").item()
        nll -= lp.gather(1, targets.unsqueeze(1)).sum().item()
        positions += len(targets)
    return {"top1_agreement": same / positions, "mean_kl": kl / positions, "perplexity": math.exp(nll / positions)}


def greedy_with_logits(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> list[tuple[list, list]]:
    """Per prompt: (generated ids, the fp32 logits each was sampled from), via the core's logits observer."""
    logits: dict[str, list[torch.Tensor]] = {}

    def observe(requests, rows):
        for req, row in zip(requests, rows):
            logits.setdefault(req.request_id, []).append(row.clone())

    engine.core.logits_observer = observe
    try:
        out = drive(engine, prompts, output_len, "quality")
    finally:
        engine.core.logits_observer = None
    return [(tokens, logits[f"quality-{i}"]) for i, tokens in enumerate(out["tokens"])]


def compare_greedy(base: list[tuple[list, list]], other: list[tuple[list, list]]) -> tuple[float, float]:
    """(greedy agreement, mean KL over positions with a common history) of two greedy_with_logits results."""
    same = total = 0
    kls = []
    for (tok_a, log_a), (tok_b, log_b) in zip(base, other):
        total += len(tok_a)
        same += sum(a == b for a, b in zip(tok_a, tok_b))
        for j, (la, lb) in enumerate(zip(log_a, log_b)):
            kls.append(torch.nn.functional.kl_div(lb.log_softmax(-1), la.log_softmax(-1), log_target=True,
                                                  reduction="sum").item())
            if tok_a[j] != tok_b[j]:
                break  # later positions condition on different tokens
    return same / max(total, 1), statistics.mean(kls) if kls else float("nan")


def prefill_tokens_per_s(engine: LLMEngine, length: int) -> float:
    """Tokens/s of one random prompt of `length` tokens over its time to first token, after a warm-up prompt."""
    vocab = engine.config.vocab_size
    drive(engine, random_prompts(vocab, 1, length, 98), 1, "prefill-warm")
    run = drive(engine, random_prompts(vocab, 1, length, 97), 1, "prefill")
    return length / (run["first"]["prefill-0"] - run["start"])


def decode_tokens_per_s(engine: LLMEngine, batch: int, args: argparse.Namespace) -> float:
    """Decode-phase tokens/s of `batch` random prompts, after one warm-up batch of the same size."""
    vocab = engine.config.vocab_size
    latency_run(engine, random_prompts(vocab, batch, args.input_len, 99), 2, f"warm{batch}")
    run, _ = latency_run(engine, random_prompts(vocab, batch, args.input_len, batch), args.output_len, f"speed{batch}")
    return run["decode_tokens_per_s"]


def paired_speed(base: LLMEngine, engine: LLMEngine, args: argparse.Namespace,
                 base_first: bool) -> tuple[dict, dict]:
    """One round's speed figures ({"decode": {batch: tok/s}, "prefill": tok/s}) of `engine` and of the unquantised
    `base`, every workload timed on both back to back, `base` first when `base_first`."""
    engines, figures = (engine, base), ({"decode": {}}, {"decode": {}})
    order = (1, 0) if base_first else (0, 1)
    for batch in args.batch_sizes:
        for k in order:
            figures[k]["decode"][batch] = decode_tokens_per_s(engines[k], batch, args)
    for k in order:
        figures[k]["prefill"] = prefill_tokens_per_s(engines[k], args.prefill_len)
    return figures


def measure(engine: LLMEngine) -> dict:
    """The variant's bytes (its speed and outputs are taken apart)."""
    config, pages = engine.config, engine.core.pages
    return {"weight_bytes": weight_bytes(engine.model), "weight_bytes_by_format": weight_bytes_by_format(engine.model),
            "cache_bytes_per_token": pages.bytes_per_token(config, pages.dtype, pages.latent_8bit, pages.keys_8bit),
            "weight_bytes_per_token": weight_bytes_touched(engine.model, 1)}


def _median_ratio(rounds: list[dict], base_rounds: list[dict], pick) -> float:
    return statistics.median(pick(r) / pick(b) for r, b in zip(rounds, base_rounds))


def engine_args_of(args: argparse.Namespace, quantization: str | None, kv: str) -> EngineArgs:
    engine_args = EngineArgs.from_cli(args, args.model)
    engine_args.quantization, engine_args.kv_cache_dtype = quantization, kv
    return engine_args


def _quality(engine: LLMEngine, args: argparse.Namespace, kv: str) -> tuple[list, list | None]:
    """(greedy runs, teacher-forced log-probabilities or None for a C8 cache) of an engine, on windows spread over
    the start of the validation text."""
    def windows(length: int) -> list[list[int]]:
        return validation_windows(engine, args.num_quality_prompts, length, chars=QUALITY_TEXT_CHARS)

    greedy = greedy_with_logits(engine, windows(args.input_len), args.output_len)
    tf = teacher_forced(engine, windows(args.quality_len)) if kv == "auto" else None
    return greedy, tf


def run_quant(args: argparse.Namespace) -> str:
    (base_name, _, base_kv), *others = variants()
    base_args = engine_args_of(args, None, base_kv)
    base_rss = resident_bytes(base_args, args.input_len)
    base_engine = LLMEngine(base_args)
    dtype = base_engine.dtype  # every variant resolves --dtype alike
    base_greedy, base_tf = _quality(base_engine, args, base_kv)
    base = {"variant": base_name, "quantization": None, "kv_cache_dtype": base_kv, "rss_bytes": base_rss,
            **measure(base_engine), "rounds": [], "teacher_forced": compare_teacher_forced(base_tf, base_tf)}
    base["greedy_agreement"], base["greedy_mean_kl"] = compare_greedy(base_greedy, base_greedy)
    results = [base]
    for name, quantization, kv in others:
        engine_args = engine_args_of(args, quantization, kv)
        r = {"variant": name, "quantization": quantization, "kv_cache_dtype": kv,
             "rss_bytes": resident_bytes(engine_args, args.input_len)}
        engine = LLMEngine(engine_args)
        r.update(measure(engine), rounds=[], baseline_rounds=[])
        for i in range(args.rounds):
            mine, twin = paired_speed(base_engine, engine, args, base_first=i % 2 == 0)
            r["rounds"].append(mine)
            r["baseline_rounds"].append(twin)
            base["rounds"].append(twin)
        greedy, tf = _quality(engine, args, kv)
        del engine
        r["teacher_forced"] = compare_teacher_forced(base_tf, tf) if tf is not None else None
        r["greedy_agreement"], r["greedy_mean_kl"] = compare_greedy(base_greedy, greedy)
        results.append(r)
    del base_engine
    base["baseline_rounds"] = base["rounds"]
    for r in results:
        r["decode_tokens_per_s"] = {b: statistics.median(x["decode"][b] for x in r["rounds"])
                                    for b in args.batch_sizes}
        r["prefill_tokens_per_s"] = statistics.median(x["prefill"] for x in r["rounds"])
        r["allowed_speedup"] = base["weight_bytes_per_token"] / r["weight_bytes_per_token"]
        r["speedup"] = {b: _median_ratio(r["rounds"], r["baseline_rounds"], lambda x, b=b: x["decode"][b])
                        for b in args.batch_sizes}
        r["prefill_speedup"] = _median_ratio(r["rounds"], r["baseline_rounds"], lambda x: x["prefill"])
        r["share_of_allowed_b1"] = r["speedup"][1] / r["allowed_speedup"] if 1 in r["speedup"] else float("nan")
        if r["teacher_forced"] is not None:
            tf = r["teacher_forced"]
            tf["perplexity_change"] = tf["perplexity"] / base["teacher_forced"]["perplexity"] - 1
    config = {"batch_sizes": args.batch_sizes, "input_len": args.input_len, "output_len": args.output_len,
              "prefill_len": args.prefill_len, "rounds": args.rounds, "num_quality_prompts": args.num_quality_prompts,
              "quality_len": args.quality_len}
    payload = {"bench": "quant", "machine": machine_info(), "model": args.model, "dtype": dtype, "config": config,
               "results": results}
    cost = format_table(
        ["variant", "weight MB", "by format (MB)", "RSS MB", "cache B/token", "read MB/token", "allowed x",
         *[f"tok/s b{b}" for b in args.batch_sizes], *[f"speed-up b{b}" for b in args.batch_sizes],
         "share of allowed b1", "prefill tok/s", "prefill speed-up"],
        [[r["variant"], r["weight_bytes"] / 1e6, _by_format_mb(r["weight_bytes_by_format"]), r["rss_bytes"] / 1e6,
          r["cache_bytes_per_token"], r["weight_bytes_per_token"] / 1e6, r["allowed_speedup"],
          *r["decode_tokens_per_s"].values(), *r["speedup"].values(), r["share_of_allowed_b1"],
          r["prefill_tokens_per_s"], r["prefill_speedup"]] for r in results])
    quality = format_table(
        ["variant", "top-1 agree", "KL", "perplexity", "ppl change", "greedy agree", "greedy KL"],
        [[r["variant"], *_tf_cells(r["teacher_forced"]), r["greedy_agreement"], r["greedy_mean_kl"]]
         for r in results])
    table = (f"quant  model={args.model} dtype={dtype} " + " ".join(f"{k}={v}" for k, v in config.items())
             + f"\n{cost}\n\nteacher-forced over {args.num_quality_prompts} x {args.quality_len} validation tokens "
             f"(top-1, KL(unquantised || variant), perplexity); greedy over {args.num_quality_prompts} x "
             f"{args.output_len} generated tokens\n{quality}")

    def plot(path: str) -> None:
        fig, (speed_ax, bytes_ax) = new_figure(2)
        names = [r["variant"] for r in results]
        width = 0.8 / len(args.batch_sizes)
        for k, b in enumerate(args.batch_sizes):
            speed_ax.bar([i + k * width for i in range(len(names))], [r["decode_tokens_per_s"][b] for r in results],
                         width, label=f"batch {b}")
        speed_ax.set_title("decode tokens/s")
        speed_ax.legend()
        bytes_ax.bar(names, [r["weight_bytes"] / 1e6 for r in results], label="stored")
        bytes_ax.bar(names, [r["weight_bytes_per_token"] / 1e6 for r in results], label="read per token")
        bytes_ax.set_title("weight MB")
        bytes_ax.legend()
        for ax in (speed_ax, bytes_ax):
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        save_figure(fig, path)

    return emit(args, payload, table, plot)


def _by_format_mb(by_format: dict[str, int]) -> str:
    return ", ".join(f"{fmt} {n / 1e6:.4g}" for fmt, n in sorted(by_format.items(), key=lambda kv: -kv[1]))


def _tf_cells(tf: dict | None) -> list:
    if tf is None:
        return ["-"] * 4
    return [tf["top1_agreement"], tf["mean_kl"], tf["perplexity"], f"{100 * tf['perplexity_change']:+.2f}%"]


def add_quant_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8, 32], help="decode batches timed")
    parser.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens of the decode runs")
    parser.add_argument("--output-len", type=positive_int, default=32, help="generated tokens per prompt")
    parser.add_argument("--prefill-len", type=positive_int, default=1024, help="tokens of the prompt whose prefill is timed")
    parser.add_argument("--rounds", type=positive_int, default=2,
                        help="speed rounds per variant, each timing it and the unquantised engine back to back; "
                             "figures are their medians")
    parser.add_argument("--num-quality-prompts", type=positive_int, default=8,
                        help="validation windows compared with the unquantised model")
    parser.add_argument("--quality-len", type=positive_int, default=256, help="tokens of each teacher-forced window")
