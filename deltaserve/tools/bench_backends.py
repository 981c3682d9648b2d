"""`deltaserve bench backends`: how closely the native backend agrees with the torch backend (printed and written with
--json, never asserted). The refactor's acceptance: on the trained default model in bf16, greedy agreement >= 99% over
8 prompts x 256 tokens, with the mean |delta logprob| reported (docs/architecture.md "How the model runs").

Two engines on one checkpoint and dtype, `--backend native` and `--backend torch`. Prompts: `--num-prompts` pieces of
the shipped validation text (held-out stdlib files, the default model's domain), one per file, the largest files
first, the generated codec tables (`encodings/`) left out; each piece is the first `--input-len` tokens from a line of
its file drawn with `--seed`, so the prompts are fixed for a seed.
  1. teacher-forced: the native engine generates `--output-len` tokens per prompt (greedy, ignore_eos, its programs
     over the paged caches); then prompt + continuation is scored by one cacheless forward under each backend
     (`backend.forward` of a `StepBatch.single`: the modules, the native ones in their native forms, which the
     programs equal bit for bit). Per generated position: whether the torch argmax is the native token, and
     |logprob_native(token) - logprob_torch(token)|. As a check of the scoring itself, the share of positions where
     the native cacheless argmax is the token the native engine generated is reported too.
  2. free-running: the torch engine's own greedy continuation of every prompt against the native one: the identical
     prefix (tokens before the first divergence; mean and min over prompts) and the identical positions overall.
Wall times are the greedy generation of all prompts at once by each engine (native first, no warm-up).
JSON: {"bench", "config", "machine", "backends", "summary", "prompts": [per-prompt figures]}.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time

import torch

from ..engine.config import EngineArgs
from ..engine.llm_engine import LLMEngine
from ..layers.batch import StepBatch
from .bench import drive
from .bench_report import emit, format_table, machine_info, new_figure, save_figure
from .corpus import VALIDATION_PATH

_FILE_HEADER = re.compile(r"(?m)^(?=# [\w./-]+\.py\n)")  # validation.txt: "# <relative path>\n<file text>"


def validation_files() -> list[tuple[str, str]]:
    """(relative path, text) of every held-out file in the shipped validation text, the generated codec tables
    (encodings/) left out, the largest first (ties by path)."""
    files = []
    for part in _FILE_HEADER.split(VALIDATION_PATH.read_text(encoding="utf-8")):
        if part.strip():
            header, _, text = part.partition("\n")
            files.append((header[2:].strip(), text))
    files = [(rel, text) for rel, text in files if not rel.startswith("encodings/")]
    return sorted(files, key=lambda f: (-len(f[1]), f[0]))


def validation_prompts(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids, one per validation file (cycling when there are more prompts than
    files), each starting at a non-blank line of its file drawn with `seed`; a prompt starts at its file's beginning
    when the drawn line has fewer than `length` tokens after it (and is shorter when the whole file is)."""
    files, rng, prompts = validation_files(), random.Random(seed), []
    for i in range(count):
        _, text = files[i % len(files)]
        starts = [m.start() for m in re.finditer(r"(?m)^(?=\S)", text)]
        start = rng.choice(starts) if starts else 0
        ids = tokenizer.encode(text[start:start + 16 * length])
        if len(ids) < length:
            ids = tokenizer.encode(text[:16 * length])
        prompts.append(ids[:length])
    return prompts


@torch.inference_mode()
def forward_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] of one cacheless forward of `ids` on `engine`'s model and backend (its
    quantisation and op set apply; no cache is read or written)."""
    core = engine.core
    batch = StepBatch.single(len(ids))
    batch.ops = core.backend.ops  # the op set the runner hands this backend's steps
    return core.model.compute_logits(core.backend.forward(core.model, torch.tensor(ids, dtype=torch.long), batch))


@torch.inference_mode()
def score(engine: LLMEngine, prompt: list[int], continuation: list[int]) -> tuple[list[int], list[float]]:
    """One cacheless forward of prompt + continuation on `engine`'s backend: per continuation position, the argmax
    token and the log-probability of the continuation's token there."""
    logits = forward_logits(engine, prompt + continuation)
    rows = logits[len(prompt) - 1:len(prompt) - 1 + len(continuation)].log_softmax(-1)
    chosen = rows.gather(1, torch.tensor(continuation, dtype=torch.long).unsqueeze(1)).squeeze(1)
    return rows.argmax(-1).tolist(), chosen.tolist()


def identical_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _engine(args: argparse.Namespace, backend: str) -> LLMEngine:
    engine_args = EngineArgs.from_cli(args, args.model)
    engine_args.backend = backend
    return LLMEngine(engine_args)


def _generate(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> tuple[list[list[int]], float]:
    run = drive(engine, prompts, output_len, tag)
    return run["tokens"], run["end"] - run["start"]


def run_backends(args: argparse.Namespace) -> str:
    if args.output_len < 1 or args.num_prompts < 1:
        raise SystemExit("bench backends: --num-prompts and --output-len must be >= 1")
    native = _engine(args, "native")
    prompts = validation_prompts(native.tokenizer, args.num_prompts, args.input_len, args.seed)
    native_tokens, native_wall = _generate(native, prompts, args.output_len, "native")
    t0 = time.perf_counter()
    native_scores = [score(native, p, c) for p, c in zip(prompts, native_tokens)]
    native_score_wall = time.perf_counter() - t0
    backends = {"native": native.core.backend.describe()}
    model_path, dtype = str(native.model_path), native.dtype
    del native

    torch_engine = _engine(args, "torch")
    torch_tokens, torch_wall = _generate(torch_engine, prompts, args.output_len, "torch")
    t0 = time.perf_counter()
    torch_scores = [score(torch_engine, p, c) for p, c in zip(prompts, native_tokens)]
    torch_score_wall = time.perf_counter() - t0
    backends["torch"] = torch_engine.core.backend.describe()
    del torch_engine

    per_prompt, deltas = [], []
    agree = self_agree = total = same_free = 0
    for i, (prompt, tok_n, tok_t, (arg_n, lp_n), (arg_t, lp_t)) in enumerate(
            zip(prompts, native_tokens, torch_tokens, native_scores, torch_scores)):
        d = [abs(a - b) for a, b in zip(lp_n, lp_t)]
        deltas += d
        total += len(tok_n)
        agree_i = sum(a == t for a, t in zip(arg_t, tok_n))
        agree += agree_i
        self_agree += sum(a == t for a, t in zip(arg_n, tok_n))
        same_i = sum(a == b for a, b in zip(tok_n, tok_t))
        same_free += same_i
        per_prompt.append({"prompt_tokens": len(prompt), "generated": len(tok_n), "teacher_forced_agree": agree_i,
                           "mean_abs_dlogprob": statistics.fmean(d) if d else float("nan"),
                           "max_abs_dlogprob": max(d, default=float("nan")),
                           "free_identical_prefix": identical_prefix(tok_n, tok_t),
                           "free_identical_positions": same_i, "native_tokens": tok_n, "torch_tokens": tok_t})
    prefixes = [p["free_identical_prefix"] for p in per_prompt]
    summary = {
        "prompts": len(prompts), "tokens": total,
        "teacher_forced_agreement_pct": 100 * agree / max(total, 1),
        "mean_abs_dlogprob": statistics.fmean(deltas) if deltas else float("nan"),
        "max_abs_dlogprob": max(deltas, default=float("nan")),
        "free_identical_prefix_mean": statistics.fmean(prefixes), "free_identical_prefix_min": min(prefixes),
        "free_identical_positions": same_free,
        "native_self_agreement_pct": 100 * self_agree / max(total, 1),
        "native_generate_s": native_wall, "torch_generate_s": torch_wall,
        "native_score_s": native_score_wall, "torch_score_s": torch_score_wall,
    }
    config = {"model": model_path, "dtype": dtype, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
              "threads": torch.get_num_threads()}
    payload = {"bench": "backends", "config": config, "machine": machine_info(), "backends": backends,
               "summary": summary, "prompts": per_prompt}
    s = summary
    rows = [
        ["prompts", s["prompts"]],
        ["tokens (generated by native, scored by both)", s["tokens"]],
        ["teacher-forced argmax agreement (%)", s["teacher_forced_agreement_pct"]],
        ["mean |dlogprob|", s["mean_abs_dlogprob"]],
        ["max |dlogprob|", s["max_abs_dlogprob"]],
        ["free-running identical prefix (mean/min)",
         f"{s['free_identical_prefix_mean']:.4g}/{s['free_identical_prefix_min']}"],
        ["free-running identical positions", f"{same_free}/{total}"],
        ["native cacheless argmax = native generated (%)", s["native_self_agreement_pct"]],
        ["wall time native (generate / score, s)", f"{native_wall:.4g} / {native_score_wall:.4g}"],
        ["wall time torch (generate / score, s)", f"{torch_wall:.4g} / {torch_score_wall:.4g}"],
    ]
    table = (f"backends  model={model_path} dtype={dtype} threads={torch.get_num_threads()} "
             f"prompts={args.num_prompts} input_len={args.input_len} output_len={args.output_len} seed={args.seed}\n"
             + "\n".join(f"{name}: {b['reason']} (ops {b['ops']})" for name, b in backends.items()) + "\n"
             + format_table(["figure", "value"], rows))

    def plot(path: str) -> None:
        fig, (agree_ax, prefix_ax) = new_figure(2)
        xs = range(len(per_prompt))
        agree_ax.bar(xs, [100 * p["teacher_forced_agree"] / max(p["generated"], 1) for p in per_prompt])
        agree_ax.set(xlabel="prompt", ylabel="%", title="teacher-forced argmax agreement")
        prefix_ax.bar(xs, prefixes)
        prefix_ax.set(xlabel="prompt", ylabel="tokens", title="free-running identical prefix")
        save_figure(fig, path)

    return emit(args, payload, table, plot)


def add_backends_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(dtype="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts compared")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (a piece of validation.txt)")
    parser.add_argument("--output-len", type=int, default=256, help="tokens compared per prompt")
