"""`deltaserve bench quant`: what each weight scheme and cache dtype costs and buys (issue 8's benchmark; printed and
written with --json, never asserted).

Variants: the unquantised model, each weight scheme (w8a8-mxfp8, w4a8-mxfp4, mxfp) with the model-dtype cache, and
the C8 cache (int8, fp8) with unquantised weights. Per variant:
  * weight bytes: what the layers store (MX bytes + scales, or parameters), not the dequantised copies an MXLinear
    caches for speed nor the prepacked copies;
  * cache bytes per token (every MLA/DSA layer's latent + indexer key);
  * decode tokens/s at batch 1 and 16 (random prompts, greedy, decode phase only);
  * quality against the unquantised engine on a fixed prompt set (slices of the shipped validation text): greedy
    agreement (share of generated positions with the same token) and the mean KL(unquantised || variant) of the
    next-token distributions at the positions both runs reached with the same tokens so far (so both distributions
    condition on the same context).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from ..engine.config import QUANTIZATIONS, EngineArgs
from ..engine.llm_engine import LLMEngine
from ..engine.summary import weight_bytes
from .bench import drive, random_prompts
from .bench_latency import latency_run
from .bench_report import emit, format_table, machine_info, new_figure, save_figure
from .corpus import VALIDATION_PATH

CACHE_DTYPES = ("int8", "fp8")


def variants() -> list[tuple[str, str | None, str]]:
    """(name, quantization, kv_cache_dtype) of every variant, the unquantised baseline first."""
    return ([("unquantised", None, "auto")] + [(q, q, "auto") for q in QUANTIZATIONS]
            + [(f"c8-{c}", None, c) for c in CACHE_DTYPES])


def quality_prompts(engine: LLMEngine, count: int, length: int) -> list[list[int]]:
    ids = engine.tokenizer.encode(VALIDATION_PATH.read_text()[:200_000])
    stride = max(length, (len(ids) - length) // max(count, 1))
    return [ids[i * stride:i * stride + length] for i in range(count)]


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


def compare(base: list[tuple[list, list]], other: list[tuple[list, list]]) -> tuple[float, float]:
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


def run_quant(args: argparse.Namespace) -> str:
    rows, results, baseline = [], [], None
    for name, quantization, kv in variants():
        engine_args = EngineArgs.from_cli(args, args.model)
        engine_args.quantization, engine_args.kv_cache_dtype = quantization, kv
        engine = LLMEngine(engine_args)
        dtype = engine.dtype  # every variant resolves --dtype alike
        config, pages = engine.config, engine.core.pages
        cache_bytes = pages.bytes_per_token(config, pages.dtype, pages.latent_8bit, pages.keys_8bit)
        prompts = quality_prompts(engine, args.num_quality_prompts, args.input_len)
        quality = greedy_with_logits(engine, prompts, args.output_len)
        baseline = baseline or quality
        agreement, kl = compare(baseline, quality)
        speed = {}
        for batch in args.batch_sizes:
            latency_run(engine, random_prompts(config.vocab_size, batch, args.input_len, 99), 2, f"warm{batch}")
            run, _ = latency_run(engine, random_prompts(config.vocab_size, batch, args.input_len, batch),
                                 args.output_len, f"speed{batch}")
            speed[batch] = run["decode_tokens_per_s"]
        result = {"variant": name, "quantization": quantization, "kv_cache_dtype": kv,
                  "weight_bytes": weight_bytes(engine.model), "cache_bytes_per_token": cache_bytes,
                  "decode_tokens_per_s": speed, "greedy_agreement": agreement, "mean_kl": kl}
        results.append(result)
        rows.append([name, result["weight_bytes"] / 1e6, cache_bytes,
                     *[speed[b] for b in args.batch_sizes], agreement, kl])
        del engine
    headers = ["variant", "weight MB", "cache B/token", *[f"tok/s b{b}" for b in args.batch_sizes],
               "greedy agree", "KL"]
    payload = {"bench": "quant", "machine": machine_info(), "model": args.model, "dtype": dtype,
               "results": results}

    def plot(path: str) -> None:
        fig, (speed_ax, bytes_ax) = new_figure(2)
        names = [r["variant"] for r in results]
        width = 0.8 / len(args.batch_sizes)
        for k, b in enumerate(args.batch_sizes):
            speed_ax.bar([i + k * width for i in range(len(names))], [r["decode_tokens_per_s"][b] for r in results],
                         width, label=f"batch {b}")
        speed_ax.set_title("decode tokens/s")
        speed_ax.legend()
        bytes_ax.bar(names, [r["weight_bytes"] / 1e6 for r in results])
        bytes_ax.set_title("weight MB")
        for ax in (speed_ax, bytes_ax):
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        save_figure(fig, path)

    return emit(args, payload, format_table(headers, rows), plot)


def add_quant_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="decode batches timed")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=32, help="generated tokens per prompt")
    parser.add_argument("--num-quality-prompts", type=int, default=8,
                        help="prompts compared with the unquantised model (agreement, KL)")
