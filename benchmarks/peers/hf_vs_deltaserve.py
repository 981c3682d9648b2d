"""deltaserve beside transformers `generate()` on one checkpoint, pair by pair in one process.

    python benchmarks/peers/hf_vs_deltaserve.py CHECKPOINT [--batch-sizes 1 8 32] [--input-len 128]
        [--output-len 128] [--runs 3] [--dtype bfloat16] [--threads 2] [--json PATH]

For every run and batch size B the two engines get the same B random prompts (ids clear of special tokens, seeded
per (B, run)), greedy, exactly --output-len new tokens (transformers with its eos disabled, deltaserve with
ignore_eos), back to back on the same torch threads. Per engine: time to first token (transformers: a separate
generate() of one token, so its prefill is timed the same way), decode tokens/s = B (O - 1) / (total - TTFT) and
whole-request output tokens/s = B O / total. Ratios deltaserve / transformers are taken within each pair, then
summarised over runs (median [min, max]). The generated ids are compared sequence by sequence: `agree` is the share of
sequences whose O tokens are identical, `prefix` the mean length of the common prefix (random weights in bf16 can
flip near-tie argmaxes between two correct implementations; fp32 should agree fully).
Warm-up generations (one token, batch 1) are not counted. Checkpoints: `deltaserve make-model` of a family that
transformers implements (kimi_linear: kimi-linear-tiny, kimi-linear-small; deepseek_v32: deepseek-v32-tiny,
deepseek-v32-small). llama.cpp as a further column: llamacpp_vs_deltaserve.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from deltaserve.engine.config import EngineArgs
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.tools.bench import drive
from deltaserve.tools.bench_report import format_table, machine_info, summarize, write_json

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def prompts_for(vocab: int, num_special: int, batch: int, length: int, seed: int) -> torch.Tensor:
    """[batch, length] ids in [0, vocab - num_special) (the BPE range: no special token can appear)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - num_special, (batch, length), generator=gen)


def load_hf(path: str, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens like deltaserve's ignore_eos
    return model


@torch.inference_mode()
def run_hf(model, ids: torch.Tensor, output_len: int) -> tuple[dict, list[list[int]]]:
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
    total = time.perf_counter() - start
    return _rates(ids.shape[0], output_len, ttft, total), out[:, ids.shape[1]:].tolist()


def run_deltaserve(engine: LLMEngine, ids: torch.Tensor, output_len: int, tag: str) -> tuple[dict, list[list[int]]]:
    prompts = ids.tolist()
    t = drive(engine, prompts, output_len, tag)
    # same accounting as transformers: prefill = until every sequence has its first token
    ttft = max(t["first"].values()) - t["start"]
    return _rates(len(prompts), output_len, ttft, t["end"] - t["start"]), t["tokens"]


def _rates(batch: int, output_len: int, ttft: float, total: float) -> dict:
    return {"ttft_s": ttft, "decode_tokens_per_s": batch * (output_len - 1) / max(total - ttft, 1e-9),
            "output_tokens_per_s": batch * output_len / total}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefix.append(n)
    return {"agree": sum(x == y for x, y in zip(a, b)) / len(a), "prefix": statistics.fmean(prefix)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    hf = load_hf(args.checkpoint, args.dtype)
    engine = LLMEngine(EngineArgs(model=args.checkpoint, dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
                                  enable_prefix_caching=False))
    vocab, special = engine.config.vocab_size, 256
    warm = prompts_for(vocab, special, 1, 16, 12345)
    run_hf(hf, warm, 2)
    run_deltaserve(engine, warm, 2, "warmup")
    points = []
    for B in args.batch_sizes:
        pairs = []
        for r in range(args.runs):
            ids = prompts_for(vocab, special, B, args.input_len, 1000 * B + r)
            h, h_tokens = run_hf(hf, ids, args.output_len)
            d, d_tokens = run_deltaserve(engine, ids, args.output_len, f"b{B}-r{r}")
            ratio = {"ttft_speedup": h["ttft_s"] / d["ttft_s"],
                     "decode_ratio": d["decode_tokens_per_s"] / h["decode_tokens_per_s"],
                     "output_ratio": d["output_tokens_per_s"] / h["output_tokens_per_s"]}
            pairs.append({"transformers": h, "deltaserve": d, "ratio": ratio, **agreement(d_tokens, h_tokens)})
            print(f"batch {B} run {r}: " + json.dumps(pairs[-1]), file=sys.stderr, flush=True)
        summary = {side: {k: summarize([q[side][k] for q in pairs]) for k in pairs[0][side]}
                   for side in ("transformers", "deltaserve", "ratio")}
        summary["agree"] = summarize([q["agree"] for q in pairs])
        summary["prefix"] = summarize([q["prefix"] for q in pairs])
        points.append({"batch": B, "pairs": pairs, "summary": summary})

    def cell(s: dict) -> str:
        return f"{s['median']:.3g} [{s['min']:.3g}, {s['max']:.3g}]"

    rows = [[pt["batch"], cell(pt["summary"]["transformers"]["decode_tokens_per_s"]),
             cell(pt["summary"]["deltaserve"]["decode_tokens_per_s"]), cell(pt["summary"]["ratio"]["decode_ratio"]),
             cell(pt["summary"]["ratio"]["output_ratio"]), cell(pt["summary"]["ratio"]["ttft_speedup"]),
             f"{pt['summary']['agree']['median']:.2f}", f"{pt['summary']['prefix']['median']:.1f}"]
            for pt in points]
    print(f"checkpoint={args.checkpoint} dtype={args.dtype} threads={args.threads} input_len={args.input_len} "
          f"output_len={args.output_len} runs={args.runs}")
    print(format_table(["batch", "HF decode tok/s", "DS decode tok/s", "DS/HF decode", "DS/HF output",
                        "TTFT HF/DS", "agree", "prefix"], rows))
    if args.json:
        write_json(args.json, {"bench": "peers-transformers", "config": vars(args), "machine": machine_info(),
                               "checkpoint": Path(args.checkpoint).name, "points": points})
    return 0


if __name__ == "__main__":
    sys.exit(main())
