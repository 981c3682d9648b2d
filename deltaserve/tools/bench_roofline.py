"""`deltaserve bench roofline`: this machine's limits measured with torch, and decode as a fraction of them.

Machine (per run, at the current torch thread count):
- triad bandwidth: a = b + s*c over fp32 arrays of --triad-mb each; 3 arrays' bytes moved per pass (two reads,
  one write; write-allocate traffic not counted, as in STREAM).
- matmul throughput: N x N x N products, 2N^3 flops, in fp32, bf16 and int8 (torch._int_mm, int32 accumulate);
  a dtype this torch build cannot multiply is reported as NaN.
Model (the engine on --model): B prompts of I tokens decoded for O tokens; decode_tokens_per_s = B / median step.
Bytes one decode step must read (BENCHMARKS.md): the weights the batch's tokens touch (every dense weight, MX layers
as stored; routed experts in the share E[distinct experts hit by B tokens routing top-k of E uniformly] / E; one
embedding row per token unless tied to the LM head; MTP heads excluded, decode does not run them), plus per
sequence the KDA state read and written back (2 x one state slot) and the cache rows at the mean context of the
decode phase (every page byte per token).
ceiling_tokens_per_s = B x bandwidth / bytes_per_step, with the same run's triad bandwidth;
fraction = decode_tokens_per_s / ceiling_tokens_per_s.
JSON: {"bench", "config", "machine", "runs": [...], "summary", "bytes_per_step", "weight_bytes_touched"}.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from ..cache.state_slots import StateSlots
from ..engine.config import EngineArgs
from ..engine.llm_engine import LLMEngine
from ..layers.moe import Experts
from ..layers.quantized import MXExperts, MXLinear
from ..models.loader import DTYPES
from .bench import random_prompts
from .bench_latency import latency_run
from .bench_long_context import page_bytes
from .bench_report import emit, format_summary, machine_info, new_figure, save_figure, summarize_runs


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page faults, oneDNN primitive creation
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def triad_bandwidth(size_mb: int, repeats: int = 5) -> float:
    """Bytes/s of a = b + 3c over fp32 arrays of `size_mb` MiB each (best of `repeats`)."""
    n = size_mb * (1 << 20) // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    return 3 * a.nbytes / _best_time(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)


def matmul_flops(n: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """flop/s of an n x n x n product in `dtype` (int8: torch._int_mm); NaN when the build cannot run it."""
    gen = torch.Generator().manual_seed(0)
    try:
        if dtype == torch.int8:
            a = torch.randint(-64, 64, (n, n), dtype=torch.int8, generator=gen)
            b = torch.randint(-64, 64, (n, n), dtype=torch.int8, generator=gen)
            return 2 * n ** 3 / _best_time(lambda: torch._int_mm(a, b), repeats)
        a, b = torch.randn(n, n, generator=gen).to(dtype), torch.randn(n, n, generator=gen).to(dtype)
        return 2 * n ** 3 / _best_time(lambda: a @ b, repeats)
    except RuntimeError:
        return float("nan")


def weight_bytes_touched(model: torch.nn.Module, batch: int) -> int:
    """Weight bytes a decode step of `batch` tokens reads: every stored weight once (an MX layer's elements and
    scales, whatever its buffers are named), except the routed experts (Experts, MXExperts), read in the share
    E[distinct experts hit by `batch` tokens routing top-k of E uniformly] / E (k/E at batch 1), and the embedding
    table, one row per token, unless the LM head is the same tensor (tied: read in full). MTP heads are left out
    (decode does not run them), and so are the buffers of other modules: tables read in part (rotary
    frequencies), not weights. Each tensor counts once, at the largest share any module reads of it."""
    cfg = model.config
    share = 1 - (1 - cfg.num_experts_per_token / cfg.num_experts) ** batch if cfg.num_experts else 1.0
    sizes: dict[int, int] = {}
    read: dict[int, float] = {}  # data_ptr -> share of the tensor read
    for path, m in model.named_modules():
        if path.split(".")[0] == "mtp":
            continue
        tensors = [*m.parameters(recurse=False)]
        if isinstance(m, (MXLinear, MXExperts)):
            tensors += m.buffers()
        if isinstance(m, (Experts, MXExperts)):
            part = share
        elif isinstance(m, torch.nn.Embedding):
            part = min(1.0, batch / m.num_embeddings)
        else:
            part = 1.0
        for t in tensors:
            sizes[t.data_ptr()] = t.numel() * t.element_size()
            read[t.data_ptr()] = max(read.get(t.data_ptr(), 0.0), part)
    return int(sum(n * read[ptr] for ptr, n in sizes.items()))


def run_roofline(args: argparse.Namespace) -> str:
    engine = LLMEngine(EngineArgs.from_cli(args, args.model))
    cfg = engine.config
    page_row = sum(page_bytes(engine.pages)) / engine.pages.block_size
    mean_context = args.input_len + args.output_len / 2
    weights = weight_bytes_touched(engine.model, args.batch_size)
    per_seq = 2 * StateSlots.bytes_per_slot(cfg) + mean_context * page_row
    bytes_per_step = weights + args.batch_size * per_seq
    vocab = cfg.vocab_size
    latency_run(engine, random_prompts(vocab, args.batch_size, args.input_len, args.seed + 10_000), 2, "warmup")
    runs = []
    for r in range(args.runs):
        bw = triad_bandwidth(args.triad_mb)
        flops = {d: matmul_flops(args.matmul_size, dt) for d, dt in
                 (("fp32", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.int8))}
        run, _ = latency_run(engine, random_prompts(vocab, args.batch_size, args.input_len, args.seed + r),
                              args.output_len, f"run{r}")
        ceiling = args.batch_size * bw / bytes_per_step
        runs.append({"triad_gb_per_s": bw / 1e9, **{f"matmul_{d}_gflops": f / 1e9 for d, f in flops.items()},
                     "decode_tokens_per_s": run["decode_tokens_per_s"], "ceiling_tokens_per_s": ceiling,
                     "fraction_of_ceiling": run["decode_tokens_per_s"] / ceiling})
    summary = summarize_runs(runs)
    config = {"model": str(engine.model_path), "dtype": engine.dtype, "batch_size": args.batch_size,
              "input_len": args.input_len, "output_len": args.output_len, "runs": args.runs,
              "triad_mb": args.triad_mb, "matmul_size": args.matmul_size, "ops": args.ops}
    payload = {"bench": "roofline", "config": config, "machine": machine_info(), "runs": runs, "summary": summary,
               "bytes_per_step": bytes_per_step, "weight_bytes_touched": weights}
    table = ("roofline  " + " ".join(f"{k}={v}" for k, v in config.items())
             + f"\nbytes per decode step: {bytes_per_step / 1e6:.2f} MB (weights {weights / 1e6:.2f} MB)\n"
             + format_summary(summary))

    def plot(path: str) -> None:
        fig, (ax,) = new_figure()
        bw = summary["triad_gb_per_s"]["median"] * 1e9
        peak = max(summary[f"matmul_{d}_gflops"]["median"] for d in ("fp32", "bf16")) * 1e9
        xs = [2 ** (i / 4) for i in range(-24, 48)]  # arithmetic intensity, flop/byte
        ax.plot(xs, [min(peak, bw * x) / 1e9 for x in xs], label="roof (triad, best float matmul)")
        # decode does one multiply-add per weight element touched per token: 2 flops per element per token
        itemsize = torch.empty((), dtype=DTYPES[engine.dtype]).element_size()
        flops_per_token = 2 * weight_bytes_touched(engine.model, 1) / itemsize
        intensity = args.batch_size * flops_per_token / bytes_per_step
        achieved = flops_per_token * summary["decode_tokens_per_s"]["median"] / 1e9
        ax.plot([intensity], [achieved], "o", label=f"decode batch {args.batch_size}")
        ax.set(xscale="log", yscale="log", xlabel="flop / byte", ylabel="GFLOP/s", title="roofline")
        ax.legend()
        save_figure(fig, path)

    return emit(args, payload, table, plot)
