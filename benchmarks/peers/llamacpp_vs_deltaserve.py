"""deltaserve beside llama.cpp (llama-cpp-python) on one checkpoint, pair by pair in one run.

    python benchmarks/peers/llamacpp_vs_deltaserve.py CHECKPOINT --gguf CHECKPOINT.gguf
        [--llama-python /work/llamavenv/bin/python] [--batch-sizes 1 8 32] [--input-len 128] [--output-len 128]
        [--prefill-len 2048] [--runs 3] [--dtype bfloat16] [--threads 2] [--with-transformers] [--json PATH]

The GGUF is the same checkpoint converted by `convert_gguf.py` (bf16). llama.cpp runs in a worker process
(`llamacpp_worker.py`, started with --llama-python, the interpreter that has llama-cpp-python; it needs no torch), so
llama-cpp-python stays out of the project's venv; the driver sends it the prompts and waits, so the two engines never
run at the same time. Both get --threads threads.

Per run and batch size B: the same B random prompts (ids clear of special tokens, seeded per (B, run) exactly as
hf_vs_deltaserve.py seeds them), greedy, exactly --output-len new tokens, llama.cpp first, then deltaserve
(then transformers with --with-transformers). Time to first token = until every sequence has its first token;
decode tokens/s = B (O - 1) / (total - TTFT); output tokens/s = B O / total. Ratios deltaserve / llama.cpp per pair,
then median [min, max] over runs. Token agreement as in hf_vs_deltaserve.py (ids compared directly: both engines get
and return token ids, so the tokenizers do not enter). Prefill: one --prefill-len prompt per run, llama.cpp's
llama_decode of the whole prompt vs deltaserve's time to first token of the same prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_vs_deltaserve as hfp  # noqa: E402

from deltaserve.engine.config import EngineArgs  # noqa: E402
from deltaserve.engine.llm_engine import LLMEngine  # noqa: E402
from deltaserve.tools.bench_report import format_table, machine_info, summarize, write_json  # noqa: E402


class LlamaCpp:
    """The worker process; one JSON request / answer per line."""

    def __init__(self, python: str, gguf: str, threads: int, n_seq_max: int, n_ctx: int, n_batch: int,
                 log: str | None = None):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.log = open(log, "w") if log else subprocess.DEVNULL  # llama.cpp's loader and context messages
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve().parent / "llamacpp_worker.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        self.info = self.ask(op="init", gguf=gguf, threads=threads, n_seq_max=n_seq_max, n_ctx=n_ctx,
                             n_batch=n_batch)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited (rc {self.proc.wait()})")
        ans = json.loads(line)
        if "error" in ans:
            raise RuntimeError("llama.cpp worker: " + ans["error"])
        return ans

    def generate(self, ids: torch.Tensor, output_len: int) -> tuple[dict, list[list[int]]]:
        a = self.ask(op="generate", prompts=ids.tolist(), output_len=output_len)
        return hfp._rates(ids.shape[0], output_len, a["ttft_s"], a["total_s"]), a["tokens"]

    def close(self) -> None:
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--gguf", required=True)
    p.add_argument("--llama-python", default=os.environ.get("LLAMA_PYTHON", "/work/llamavenv/bin/python"))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=2048, help="0: skip the prefill workload")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", choices=list(hfp.DTYPES), default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-log", default=None, help="file for llama.cpp's own log (default: discarded)")
    p.add_argument("--with-transformers", action="store_true", help="a third column: transformers generate()")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    max_b = max(args.batch_sizes)
    n_batch = max(max_b * args.input_len, args.prefill_len, 512)
    n_ctx = max(max_b * (args.input_len + args.output_len), args.prefill_len + 16)
    llama = LlamaCpp(args.llama_python, args.gguf, args.threads, max_b, n_ctx, n_batch, args.llama_log)
    engine = LLMEngine(EngineArgs(model=args.checkpoint, dtype=args.dtype, max_num_seqs=max_b,
                                  enable_prefix_caching=False))
    hf = hfp.load_hf(args.checkpoint, args.dtype) if args.with_transformers else None
    vocab, special = engine.config.vocab_size, 256
    warm = hfp.prompts_for(vocab, special, 1, 16, 12345)
    llama.generate(warm, 2)
    hfp.run_deltaserve(engine, warm, 2, "warmup")
    if hf is not None:
        hfp.run_hf(hf, warm, 2)

    points = []
    for B in args.batch_sizes:
        pairs = []
        for r in range(args.runs):
            ids = hfp.prompts_for(vocab, special, B, args.input_len, 1000 * B + r)
            lc, lc_tokens = llama.generate(ids, args.output_len)
            d, d_tokens = hfp.run_deltaserve(engine, ids, args.output_len, f"b{B}-r{r}")
            pair = {"llamacpp": lc, "deltaserve": d,
                    "ratio": {"ttft_speedup": lc["ttft_s"] / d["ttft_s"],
                              "decode_ratio": d["decode_tokens_per_s"] / lc["decode_tokens_per_s"],
                              "output_ratio": d["output_tokens_per_s"] / lc["output_tokens_per_s"]},
                    **hfp.agreement(d_tokens, lc_tokens)}
            if hf is not None:
                h, h_tokens = hfp.run_hf(hf, ids, args.output_len)
                pair["transformers"] = h
                pair["ratio"]["decode_ratio_vs_hf"] = d["decode_tokens_per_s"] / h["decode_tokens_per_s"]
                pair["agree_hf"] = hfp.agreement(d_tokens, h_tokens)["agree"]
            pairs.append(pair)
            print(f"batch {B} run {r}: " + json.dumps(pair), file=sys.stderr, flush=True)
        sides = [s for s in ("llamacpp", "deltaserve", "transformers", "ratio") if s in pairs[0]]
        summary = {side: {k: summarize([q[side][k] for q in pairs]) for k in pairs[0][side]} for side in sides}
        for k in ("agree", "prefix", "agree_hf"):
            if k in pairs[0]:
                summary[k] = summarize([q[k] for q in pairs])
        points.append({"batch": B, "pairs": pairs, "summary": summary})

    prefill = None
    if args.prefill_len:
        runs = []
        for r in range(args.runs):
            ids = hfp.prompts_for(vocab, special, 1, args.prefill_len, 77 + r)
            lc = llama.ask(op="prefill", prompt=ids[0].tolist())["prefill_s"]
            d, _ = hfp.run_deltaserve(engine, ids, 1, f"prefill-r{r}")
            runs.append({"llamacpp_tokens_per_s": args.prefill_len / lc,
                         "deltaserve_tokens_per_s": args.prefill_len / d["ttft_s"], "ratio": lc / d["ttft_s"]})
            print(f"prefill run {r}: " + json.dumps(runs[-1]), file=sys.stderr, flush=True)
        prefill = {"runs": runs, "summary": {k: summarize([q[k] for q in runs]) for k in runs[0]}}
    llama.close()

    def cell(s: dict) -> str:
        return f"{s['median']:.3g} [{s['min']:.3g}, {s['max']:.3g}]"

    rows = [[pt["batch"], cell(pt["summary"]["llamacpp"]["decode_tokens_per_s"]),
             cell(pt["summary"]["deltaserve"]["decode_tokens_per_s"]), cell(pt["summary"]["ratio"]["decode_ratio"]),
             cell(pt["summary"]["ratio"]["output_ratio"]), cell(pt["summary"]["llamacpp"]["ttft_s"]),
             cell(pt["summary"]["deltaserve"]["ttft_s"]), f"{pt['summary']['agree']['median']:.2f}",
             f"{pt['summary']['prefix']['median']:.1f}"] for pt in points]
    print(f"checkpoint={args.checkpoint} gguf={args.gguf} llama-cpp-python={llama.info['version']} "
          f"dtype={args.dtype} threads={args.threads} input_len={args.input_len} output_len={args.output_len} "
          f"runs={args.runs}")
    print(format_table(["batch", "llama.cpp decode tok/s", "DS decode tok/s", "DS/llama.cpp decode",
                        "DS/llama.cpp output", "llama.cpp TTFT s", "DS TTFT s", "agree", "prefix"], rows))
    if hf is not None:
        print(format_table(["batch", "HF decode tok/s", "DS/HF decode", "agree DS-HF"],
                           [[pt["batch"], cell(pt["summary"]["transformers"]["decode_tokens_per_s"]),
                             cell(pt["summary"]["ratio"]["decode_ratio_vs_hf"]),
                             f"{pt['summary']['agree_hf']['median']:.2f}"] for pt in points]))
    if prefill:
        s = prefill["summary"]
        print(f"prefill {args.prefill_len} tokens: llama.cpp {cell(s['llamacpp_tokens_per_s'])} tok/s, deltaserve "
              f"{cell(s['deltaserve_tokens_per_s'])} tok/s, DS/llama.cpp {cell(s['ratio'])}")
    if args.json:
        write_json(args.json, {"bench": "peers-llamacpp", "config": vars(args), "machine": machine_info(),
                               "llama_cpp_python": llama.info["version"], "checkpoint": Path(args.checkpoint).name,
                               "points": points, "prefill": prefill})
    return 0


if __name__ == "__main__":
    sys.exit(main())
