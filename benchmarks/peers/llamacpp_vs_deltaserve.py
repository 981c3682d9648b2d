"""deltaserve beside llama.cpp (llama-cpp-python) on one checkpoint, pair by pair in one run.

    python benchmarks/peers/llamacpp_vs_deltaserve.py CHECKPOINT --gguf [LABEL=]FILE.gguf [[LABEL=]FILE.gguf ...]
        [--quantization none w8a8-mxfp8 w4a8-mxfp4 mxfp] [--compare SCHEME=LABEL ...]
        [--llama-python /work/llamavenv/bin/python] [--llama-lib DIR] [--batch-sizes 1 8 32] [--input-len 128]
        [--output-len 128] [--prefill-len 2048] [--runs 3] [--dtype bfloat16] [--threads 2]
        [--kv-cache-memory 2GiB] [--with-transformers] [--json PATH]

Each GGUF is the same checkpoint converted by `convert_gguf.py` (bf16), or that file quantised by llama.cpp's
`llama-quantize` (e.g. `Q8_0`, `MXFP4_MOE`); LABEL names its column (default: the file's stem). Each deltaserve
variant is the checkpoint loaded with one `--quantization` scheme (`none`: as stored, in --dtype). Every variant is
loaded once, each llama.cpp file in its own worker process (`llamacpp_worker.py`, started with --llama-python, the
interpreter that has llama-cpp-python; it needs no torch; --llama-lib, default $LLAMA_CPP_LIB_PATH, points the
bindings at a separately built libllama), so llama-cpp-python stays out of the project's venv; the driver sends a
worker the prompts and waits, so no two engines ever run at the same time. All get --threads threads.

--compare names the pairs whose ratios are reported, deltaserve scheme = llama.cpp label. Default: those of
none=bf16, w8a8-mxfp8=Q8_0 and mxfp=MXFP4_MOE whose both sides are loaded (issue 25's pairs: MXFP4_MOE stores the
routed experts in MXFP4 and the rest in Q8_0, as `mxfp` stores experts MXFP4 and the rest MXFP8), or else the
n-th scheme with the n-th GGUF (one file and no --quantization: the bf16 pair this script always measured).

Per run and batch size B: the same B random prompts (ids clear of special tokens, seeded per (B, run) exactly as
hf_vs_deltaserve.py seeds them), greedy, exactly --output-len new tokens, pair by pair: each compared pair's
llama.cpp side, then its deltaserve side, then the variants in no pair (then transformers with
--with-transformers). Time to first token = until every sequence has its first token; decode tokens/s =
B (O - 1) / (total - TTFT); output tokens/s = B O / total. Ratios deltaserve / llama.cpp per pair within the run,
then median [min, max] over runs. Token agreement per pair as in hf_vs_deltaserve.py (ids compared directly: both
engines get and return token ids, so the tokenizers do not enter). Prefill: one --prefill-len prompt per run,
llama.cpp's llama_decode of the whole prompt vs deltaserve's time to first token of the same prompt. Sizes: each
GGUF's file bytes and tensor bytes (llama_model_size) beside each deltaserve variant's weight bytes as loaded
(engine/summary.py, by format).
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

from deltaserve.engine.config import QUANTIZATIONS, EngineArgs  # noqa: E402
from deltaserve.engine.llm_engine import LLMEngine  # noqa: E402
from deltaserve.engine.summary import weight_bytes, weight_bytes_by_format  # noqa: E402
from deltaserve.tools.bench_report import format_table, machine_info, summarize, write_json  # noqa: E402

# issue 25's pairs, deltaserve scheme -> llama.cpp type: the same layers quantised to elements of the same width
PEER_OF = {"none": "bf16", "w8a8-mxfp8": "Q8_0", "mxfp": "MXFP4_MOE"}


class LlamaCpp:
    """The worker process; one JSON request / answer per line."""

    def __init__(self, python: str, gguf: str, threads: int, n_seq_max: int, n_ctx: int, n_batch: int,
                 log: str | None = None, lib: str | None = None):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        if lib:
            env["LLAMA_CPP_LIB_PATH"] = lib
        self.log = open(log, "a") if log else subprocess.DEVNULL  # llama.cpp's loader and context messages
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


def labelled(items: list[str]) -> dict[str, str]:
    """LABEL=PATH (or PATH, labelled by its stem) -> {label: path}, in the given order."""
    out = {}
    for item in items:
        label, _, path = item.partition("=") if "=" in item else (Path(item).stem, "", item)
        if label in out:
            raise SystemExit(f"--gguf: label {label!r} given twice")
        out[label] = path
    return out


def pairs_to_compare(given: list[str] | None, schemes: list[str], labels: list[str]) -> list[tuple[str, str]]:
    """(deltaserve scheme, llama.cpp label) pairs: --compare SCHEME=LABEL, else PEER_OF's loaded pairs, else the
    n-th scheme with the n-th label."""
    if given:
        pairs = [tuple(g.split("=", 1)) for g in given]
        for d, lc in pairs:
            if d not in schemes or lc not in labels:
                raise SystemExit(f"--compare {d}={lc}: {d!r} not in --quantization or {lc!r} not a --gguf label")
        return pairs
    return [(d, PEER_OF[d]) for d in schemes if PEER_OF.get(d) in labels] or list(zip(schemes, labels))


def run_order(pairs: list[tuple[str, str]], schemes: list[str], labels: list[str]) -> list[tuple[str, str]]:
    """(side, name) in the order a round runs them: each pair's llama.cpp side then its deltaserve side, then the
    rest; every variant once."""
    order = [x for d, lc in pairs for x in (("llamacpp", lc), ("deltaserve", d))]
    order += [("llamacpp", lc) for lc in labels] + [("deltaserve", d) for d in schemes]
    return list(dict.fromkeys(order))


def summarize_tree(items: list[dict]) -> dict:
    """The nesting of the items (dicts of one shape), each number replaced by its summarize() over the items."""
    return {k: summarize([it[k] for it in items]) if isinstance(v, (int, float)) else
            summarize_tree([it[k] for it in items]) for k, v in items[0].items()}


def ratios(d: dict, lc: dict) -> dict:
    return {"ttft_speedup": lc["ttft_s"] / d["ttft_s"],
            "decode_ratio": d["decode_tokens_per_s"] / lc["decode_tokens_per_s"],
            "output_ratio": d["output_tokens_per_s"] / lc["output_tokens_per_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--gguf", nargs="+", required=True, metavar="[LABEL=]PATH")
    p.add_argument("--quantization", nargs="+", choices=["none", *QUANTIZATIONS], default=["none"],
                   help="deltaserve variants, one engine each (none: the checkpoint as stored, in --dtype)")
    p.add_argument("--compare", nargs="+", default=None, metavar="SCHEME=LABEL",
                   help="the deltaserve / llama.cpp pairs to report ratios for (default: see the module doc)")
    p.add_argument("--llama-python", default=os.environ.get("LLAMA_PYTHON", "/work/llamavenv/bin/python"))
    p.add_argument("--llama-lib", default=os.environ.get("LLAMA_CPP_LIB_PATH"),
                   help="folder with libllama.so for the bindings (default: $LLAMA_CPP_LIB_PATH, else their own)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=2048, help="0: skip the prefill workload")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", choices=list(hfp.DTYPES), default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-memory", default=EngineArgs.kv_cache_memory, help="per deltaserve engine")
    p.add_argument("--llama-log", default=None, help="file for llama.cpp's own log (default: discarded)")
    p.add_argument("--with-transformers", action="store_true", help="a further column: transformers generate()")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ggufs, schemes = labelled(args.gguf), list(dict.fromkeys(args.quantization))
    pairs = pairs_to_compare(args.compare, schemes, list(ggufs))
    order = run_order(pairs, schemes, list(ggufs))
    max_b = max(args.batch_sizes)
    n_batch = max(max_b * args.input_len, args.prefill_len, 512)
    n_ctx = max(max_b * (args.input_len + args.output_len), args.prefill_len + 16)
    if args.llama_log:
        open(args.llama_log, "w").close()  # the workers append
    llamas = {lc: LlamaCpp(args.llama_python, path, args.threads, max_b, n_ctx, n_batch, args.llama_log,
                           args.llama_lib) for lc, path in ggufs.items()}
    engines = {d: LLMEngine(EngineArgs(model=args.checkpoint, dtype=args.dtype, max_num_seqs=max_b,
                                       enable_prefix_caching=False, kv_cache_memory=args.kv_cache_memory,
                                       quantization=None if d == "none" else d)) for d in schemes}
    hf = hfp.load_hf(args.checkpoint, args.dtype) if args.with_transformers else None
    sizes = {"llamacpp": {lc: {"file_bytes": os.path.getsize(path), "weight_bytes": llamas[lc].info["model_bytes"],
                               "desc": llamas[lc].info["desc"]} for lc, path in ggufs.items()},
             "deltaserve": {d: {"weight_bytes": weight_bytes(e.model), "by_format": weight_bytes_by_format(e.model)}
                            for d, e in engines.items()}}
    vocab, special = next(iter(engines.values())).config.vocab_size, 256

    def generate(side: str, name: str, ids: torch.Tensor, output_len: int, tag: str):
        if side == "llamacpp":
            return llamas[name].generate(ids, output_len)
        return hfp.run_deltaserve(engines[name], ids, output_len, f"{name}-{tag}")

    def prefill_s(side: str, name: str, ids: torch.Tensor, tag: str) -> float:
        if side == "llamacpp":
            return llamas[name].ask(op="prefill", prompt=ids[0].tolist())["prefill_s"]
        return hfp.run_deltaserve(engines[name], ids, 1, f"{name}-{tag}")[0]["ttft_s"]

    warm = hfp.prompts_for(vocab, special, 1, 16, 12345)
    for side, name in order:
        generate(side, name, warm, 2, "warmup")
    if hf is not None:
        hfp.run_hf(hf, warm, 2)

    points = []
    for B in args.batch_sizes:
        runs = []
        for r in range(args.runs):
            ids = hfp.prompts_for(vocab, special, B, args.input_len, 1000 * B + r)
            run, tokens = {"llamacpp": {}, "deltaserve": {}}, {}
            for side, name in order:
                run[side][name], tokens[side, name] = generate(side, name, ids, args.output_len, f"b{B}-r{r}")
            run["ratio"] = {f"{d}/{lc}": ratios(run["deltaserve"][d], run["llamacpp"][lc]) for d, lc in pairs}
            run["agreement"] = {f"{d}/{lc}": hfp.agreement(tokens["deltaserve", d], tokens["llamacpp", lc])
                                for d, lc in pairs}
            if hf is not None:
                h, h_tokens = hfp.run_hf(hf, ids, args.output_len)
                run["transformers"] = h
                run["ratio_vs_hf"] = {d: run["deltaserve"][d]["decode_tokens_per_s"] / h["decode_tokens_per_s"]
                                      for d in schemes}
                run["agree_hf"] = {d: hfp.agreement(tokens["deltaserve", d], h_tokens)["agree"] for d in schemes}
            runs.append(run)
            print(f"batch {B} run {r}: " + json.dumps(run), file=sys.stderr, flush=True)
        points.append({"batch": B, "runs": runs, "summary": summarize_tree(runs)})

    prefill = None
    if args.prefill_len:
        runs = []
        for r in range(args.runs):
            ids = hfp.prompts_for(vocab, special, 1, args.prefill_len, 77 + r)
            run = {"llamacpp": {}, "deltaserve": {}}
            for side, name in order:
                run[side][name] = args.prefill_len / prefill_s(side, name, ids, f"prefill-r{r}")
            run["ratio"] = {f"{d}/{lc}": run["deltaserve"][d] / run["llamacpp"][lc] for d, lc in pairs}
            runs.append(run)
            print(f"prefill run {r}: " + json.dumps(run), file=sys.stderr, flush=True)
        prefill = {"runs": runs, "summary": summarize_tree(runs)}
    version = next(iter(llamas.values())).info["version"]
    for llama in llamas.values():
        llama.close()

    def cell(s: dict) -> str:
        return f"{s['median']:.3g} [{s['min']:.3g}, {s['max']:.3g}]"

    def ds_name(d: str) -> str:
        return f"DS {args.dtype if d == 'none' else d}"

    print(f"checkpoint={args.checkpoint} llama-cpp-python={version} dtype={args.dtype} threads={args.threads} "
          f"input_len={args.input_len} output_len={args.output_len} runs={args.runs}")
    print(format_table(["variant", "GGUF file MB", "weight MB", "by format (MB) / llama.cpp's description"],
                       [[f"llama.cpp {lc}", s["file_bytes"] / 1e6, s["weight_bytes"] / 1e6, s["desc"]]
                        for lc, s in sizes["llamacpp"].items()] +
                       [[ds_name(d), "", s["weight_bytes"] / 1e6,
                         ", ".join(f"{k} {v / 1e6:.1f}" for k, v in s["by_format"].items())]
                        for d, s in sizes["deltaserve"].items()]))
    print("decode tok/s")
    print(format_table(["batch", *[f"llama.cpp {n}" if side == "llamacpp" else ds_name(n) for side, n in order]],
                       [[pt["batch"], *[cell(pt["summary"][side][n]["decode_tokens_per_s"]) for side, n in order]]
                        for pt in points]))
    rows = []
    for pt in points:
        for d, lc in pairs:
            ratio, agree = pt["summary"]["ratio"][f"{d}/{lc}"], pt["summary"]["agreement"][f"{d}/{lc}"]
            rows.append([pt["batch"], f"{ds_name(d)} / llama.cpp {lc}", cell(ratio["decode_ratio"]),
                         cell(ratio["output_ratio"]), cell(pt["summary"]["llamacpp"][lc]["ttft_s"]),
                         cell(pt["summary"]["deltaserve"][d]["ttft_s"]), f"{agree['agree']['median']:.2f}",
                         f"{agree['prefix']['median']:.1f}"])
    print(format_table(["batch", "pair", "DS/llama.cpp decode", "DS/llama.cpp output", "llama.cpp TTFT s",
                        "DS TTFT s", "agree", "prefix"], rows))
    if hf is not None:
        print(format_table(["batch", "HF decode tok/s", *[f"{ds_name(d)}/HF decode" for d in schemes],
                            *[f"agree {ds_name(d)}-HF" for d in schemes]],
                           [[pt["batch"], cell(pt["summary"]["transformers"]["decode_tokens_per_s"]),
                             *[cell(pt["summary"]["ratio_vs_hf"][d]) for d in schemes],
                             *[f"{pt['summary']['agree_hf'][d]['median']:.2f}" for d in schemes]] for pt in points]))
    if prefill:
        s = prefill["summary"]
        for d, lc in pairs:
            print(f"prefill {args.prefill_len} tokens: llama.cpp {lc} {cell(s['llamacpp'][lc])} tok/s, "
                  f"{ds_name(d)} {cell(s['deltaserve'][d])} tok/s, DS/llama.cpp {cell(s['ratio'][f'{d}/{lc}'])}")
    if args.json:
        write_json(args.json, {"bench": "peers-llamacpp", "config": vars(args), "machine": machine_info(),
                               "llama_cpp_python": version, "checkpoint": Path(args.checkpoint).name,
                               "pairs": [list(x) for x in pairs], "sizes": sizes, "points": points,
                               "prefill": prefill})
    return 0


if __name__ == "__main__":
    sys.exit(main())
