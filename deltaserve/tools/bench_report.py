"""Shared output of `deltaserve bench`: summaries of repeated runs, percentiles, text tables, JSON files, PNG plots.

Contracts:
- `summarize(values)` -> {"median", "min", "max", "n"} (NaN-free input expected; an empty list is an error).
- `percentiles(values)` -> {"p50", "p90", "p99", "mean"} by linear interpolation, so p50 <= p90 <= p99 always.
- `emit(args, payload, table, plot)` prints the table, writes `payload` as JSON to `args.json` when given and, when
  `args.plot` is given, calls `plot(path)`; every bench subcommand ends with it so all share one output contract.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..ops.native import tiles_usable


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG plot (needs matplotlib)")


def summarize(values: Sequence[float]) -> dict:
    if not values:
        raise ValueError("summarize: no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize_runs(runs: Sequence[dict]) -> dict:
    """Per numeric key of the run dicts: the summary over runs."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {k: summarize([r[k] for r in runs]) for k in keys}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentiles(values: Sequence[float]) -> dict:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": statistics.fmean(values) if values else math.nan}


def fmt(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_summary(summary: dict) -> str:
    """A table of `summarize_runs` output: one metric a row, median [min, max]."""
    return format_table(["metric", "median", "min", "max", "runs"],
                        [[k, s["median"], s["min"], s["max"], s["n"]] for k, s in summary.items()])


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "amx_tiles": tiles_usable()}  # whether the column-packed products ran on the tile unit


def write_json(path: str | Path, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def new_figure(ncols: int = 1):
    """(figure, axes list) on the file-only Agg backend; raises a clear error when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as e:  # an optional extra: pip install 'deltaserve[bench]'
        raise SystemExit("--plot needs matplotlib: pip install 'deltaserve[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig, path: str | Path) -> None:
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def emit(args: argparse.Namespace, payload: dict, table: str, plot: Callable[[str], None] | None) -> str:
    """Write JSON / plot as asked; return the table for printing."""
    if getattr(args, "json", None):
        write_json(args.json, payload)
    if getattr(args, "plot", None) and plot is not None:
        plot(args.plot)
    return table


def parallel_lines(engine) -> tuple[dict, str]:
    """The engine's tensor-parallel report (engine/core.py `parallel_report`) for a bench payload, and its lines
    for the table ("" and {} for one process)."""
    report = engine.core.parallel_report()
    if report is None:
        return {}, ""
    ranks = ", ".join(f"rank {r}: {w / 1e6:.1f} MB weights + {p / 1e6:.1f} MB pools"
                      for r, (w, p) in enumerate(zip(report["rank_weight_bytes"], report["rank_pool_bytes"])))
    return {"parallel": report}, (f"\ntensor parallel {report['tensor_parallel_size']}"
                                  f"{' (expert parallel)' if report['enable_expert_parallel'] else ''}: {ranks}; "
                                  f"rank 0 in collectives {1e3 * report['comm_s_per_step']:.2f} ms a step "
                                  f"({report['comm_calls_per_step']:.1f} calls)")
