"""Before/after speed of two checkouts of deltaserve on one checkpoint, taken pair by pair.

    python benchmarks/compare_trees.py BEFORE_TREE AFTER_TREE MODEL [--rounds 6] [--workloads decode1 prefill2048]
        [--quantization mxfp]

Each measurement is a fresh process that imports deltaserve from one tree (PYTHONPATH) and runs one workload with
`LLM` and `engine.step()`: `decodeB` (the median of 24 decode steps after B prompts of 128 tokens, in tok/s),
`ttft128` (the median time to the first token of 3 prompts of 128 tokens, s), `prefill2048` (one 2,048-token prompt
in one step, s). The two trees alternate workload by workload, in ABBA order across rounds, so that the machine's
drift falls on both; every pair gives a ratio (after / before in speed: > 1 means the after tree is faster), and the
table shows each side's median [min, max] and the median [min, max] of the ratios. Both trees run the same
interpreter and the same settings (bf16, 2 threads, 4,096 tokens per step, prefix caching off, one warm-up request),
and with `--quantization` the same weight scheme.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKLOADS = ("decode1", "decode8", "decode32", "ttft128", "prefill2048")

ONE = r'''
import json, statistics, sys, time
import torch
torch.set_num_threads(2)
from deltaserve import LLM, SamplingParams
model, workload, quantization = sys.argv[1], sys.argv[2], sys.argv[3] or None
llm = LLM(model=model, dtype="bfloat16", max_num_seqs=32, max_num_batched_tokens=4096, kv_cache_memory="2GiB",
          enable_prefix_caching=False, seed=0, quantization=quantization)
engine = llm.engine
g = torch.Generator().manual_seed(0)
prompts = lambda n, length: [torch.randint(100, 30000, (length,), generator=g).tolist() for _ in range(n)]
params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
def run(rid, prompt, n):
    engine.add_request(rid, prompt, params(n))
    while engine.has_unfinished_requests():
        engine.step()
run("warm-up", prompts(1, 16)[0], 4)
if workload.startswith("decode"):
    batch = int(workload[len("decode"):])
    for i, p in enumerate(prompts(batch, 128)):
        engine.add_request(f"r{i}", p, params(26))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
        if engine.core.scheduler.waiting or any(r.num_computed_tokens < r.prompt_len
                                                for r in engine.core.scheduler.running):
            steps.clear()  # still prefilling: only steps after every prompt is in count
    value = batch / statistics.median(steps[1:-1])
elif workload == "ttft128":
    times = []
    for i, p in enumerate(prompts(3, 128)):
        start = time.perf_counter()
        run(f"t{i}", p, 1)
        times.append(time.perf_counter() - start)
    value = statistics.median(times)
else:
    start = time.perf_counter()
    run("p", prompts(1, 2048)[0], 1)
    value = time.perf_counter() - start
print(json.dumps({"workload": workload, "value": value}))
'''


def measure(tree: str, model: str, workload: str, quantization: str | None) -> float:
    env = dict(os.environ, PYTHONPATH=tree, OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run([sys.executable, "-c", ONE, model, workload, quantization or ""], env=env,
                         capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])["value"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--quantization", help="weight scheme of both sides (w8a8-mxfp8, w4a8-mxfp4, mxfp)")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args()
    runs: dict[str, dict[str, list[float]]] = {w: {"before": [], "after": []} for w in args.workloads}
    for r in range(args.rounds):
        for w in args.workloads:
            for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                runs[w][side].append(measure(getattr(args, side), args.model, w, args.quantization))
    print("| workload | before | after | after / before (speed), median of pairs [min, max] |")
    print("|---|---|---|---|")
    for w, sides in runs.items():
        faster_is_bigger = w.startswith("decode")
        ratios = [(a / b if faster_is_bigger else b / a) for b, a in zip(sides["before"], sides["after"])]
        cell = lambda v: f"{statistics.median(v):.4g} [{min(v):.4g}, {max(v):.4g}]"
        print(f"| {w} ({'tok/s' if faster_is_bigger else 's'}) | {cell(sides['before'])} | {cell(sides['after'])} | "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
