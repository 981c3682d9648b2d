"""`deltaserve bench long-context`: prefill time, decode time per token and cache bytes versus context length.

For each context L in --contexts: one request of L random prompt tokens and --output-len new tokens (greedy,
ignore_eos) on an engine with one sequence and prefix caching off, so every page in use belongs to it. Reports
prefill_s (time to first token), prefill_tokens_per_s, decode_token_s (median decode step), and from the pools' own
tensors: latent_cache_bytes and index_cache_bytes (pages held x bytes of one page of every MLA / DSA layer; they
grow with L) and kda_state_bytes (one state slot; constant in L). DSA layers attend to top-k selected rows, so
decode cost grows only through the indexer's scoring pass over the keys.

Checkpoints whose max_position_embeddings is below the longest context (k31-tiny: 4096) are run through a view
folder (weights symlinked) whose config.json allows it: the models here use NoPE MLA, so positions beyond the
trained length change nothing structural (figures of a random checkpoint measure speed, not quality).
JSON: {"bench", "config", "machine", "points": [{"context", "runs", "summary", <byte fields>}]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from ..cache.page_pool import PagePool
from ..cache.state_slots import StateSlots
from ..engine.config import EngineArgs, resolve_dtype
from ..engine.llm_engine import LLMEngine
from ..engine.sampling_params import SamplingParams
from ..models.loader import DTYPES, load_config
from .bench import random_prompts
from .bench_report import emit, format_table, machine_info, new_figure, save_figure, summarize_runs


def stretched_checkpoint(src: Path, max_len: int, dst: Path) -> Path:
    """`dst` holding symlinks to every file of `src` except config.json, whose position limits become `max_len`."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    for section in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "model_max_length"):
            if key in section:
                section[key] = max(section[key], max_len)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def page_bytes(pool: PagePool) -> tuple[int, int]:
    """(latent bytes, indexer bytes) of one page across all layers, from the pool's own tensors (an 8-bit latent
    entry is a tuple of strided views into one byte page: its parts are summed)."""
    def first_page(entry) -> int:
        return sum(part[0].nbytes for part in (entry if isinstance(entry, tuple) else (entry,)))

    latent = sum(first_page(t) for t in pool.latent.values())
    index = sum(first_page(t) for t in (*pool.index_keys.values(), *pool.index_scales.values()))
    return latent, index


def _one_context(engine: LLMEngine, prompt: list[int], output_len: int, tag: str) -> tuple[dict, int]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    pool = engine.pages
    start = time.perf_counter()
    engine.add_request(tag, prompt, params)
    stamps, pages = [], 0
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
        pages = max(pages, pool.num_blocks - pool.num_free)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    prefill = stamps[0] - start
    run = {"prefill_s": prefill, "prefill_tokens_per_s": len(prompt) / prefill,
           "decode_token_s": statistics.median(steps) if steps else float("nan")}
    return run, pages


def run_long_context(args: argparse.Namespace) -> str:
    from ..default_model import default_model_path

    src = Path(args.model) if args.model else default_model_path()
    need = max(args.contexts) + args.output_len
    config = load_config(src)
    dtype = resolve_dtype(args.dtype, config.torch_dtype).name
    per_token = PagePool.bytes_per_token(config, DTYPES[dtype])  # model-dtype pages: 8-bit ones are smaller
    slot = StateSlots.bytes_per_slot(config)
    eargs = argparse.Namespace(**vars(args))
    eargs.max_num_seqs, eargs.enable_prefix_caching, eargs.max_model_len = 1, False, need
    # room for the longest request (plus a page of slack per chunk boundary) and one state slot
    eargs.kv_cache_memory = per_token * (need + 4 * args.block_size) + slot
    with tempfile.TemporaryDirectory(prefix="deltaserve-long-") as tmp:
        model = stretched_checkpoint(src, need, Path(tmp) / "model") if config.max_position_embeddings < need else src
        engine = LLMEngine(EngineArgs.from_cli(eargs, str(model)))
        vocab = engine.config.vocab_size
        latent_page, index_page = page_bytes(engine.pages)
        _one_context(engine, random_prompts(vocab, 1, 256, args.seed + 10_000)[0], 2, "warmup")
        points = []
        for L in args.contexts:
            runs, pages = [], 0
            for r in range(args.runs):
                run, pages = _one_context(engine, random_prompts(vocab, 1, L, args.seed + 1000 * r + L)[0],
                                          args.output_len, f"L{L}-run{r}")
                runs.append(run)
            points.append({"context": L, "runs": runs, "summary": summarize_runs(runs), "pages": pages,
                           "latent_cache_bytes": pages * latent_page, "index_cache_bytes": pages * index_page,
                           "kda_state_bytes": slot})
    cfg = {"model": str(src), "dtype": dtype, "output_len": args.output_len, "runs": args.runs,
           "ops": args.ops, "index_cache_dtype": args.index_cache_dtype,
           "dsa_index_topk": config.index_topk if config.has_dsa else None}
    payload = {"bench": "long-context", "config": cfg, "machine": machine_info(), "points": points}
    rows = [[p["context"], p["summary"]["prefill_s"]["median"], p["summary"]["prefill_tokens_per_s"]["median"],
             p["summary"]["decode_token_s"]["median"] * 1e3, p["latent_cache_bytes"], p["index_cache_bytes"],
             p["kda_state_bytes"]] for p in points]
    table = ("long-context  " + " ".join(f"{k}={v}" for k, v in cfg.items()) + "\n"
             + format_table(["context", "prefill s", "prefill tok/s", "decode ms/tok", "latent B", "indexer B",
                             "KDA state B"], rows))

    def plot(path: str) -> None:
        fig, (ax1, ax2, ax3) = new_figure(3)
        xs = [p["context"] for p in points]
        ax1.plot(xs, [p["summary"]["prefill_s"]["median"] for p in points], marker="o")
        ax1.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="s", title="prefill time")
        ax2.plot(xs, [p["summary"]["decode_token_s"]["median"] * 1e3 for p in points], marker="o")
        ax2.set(xscale="log", xlabel="context tokens", ylabel="ms", title="decode time per token", ylim=(0, None))
        for key, label in (("latent_cache_bytes", "MLA latent cache"), ("index_cache_bytes", "DSA indexer cache"),
                           ("kda_state_bytes", "KDA state")):
            ax3.plot(xs, [max(p[key], 1) / 2 ** 20 for p in points], marker="o", label=label)
        ax3.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="MiB", title="cache memory")
        ax3.legend()
        save_figure(fig, path)

    return emit(args, payload, table, plot)
