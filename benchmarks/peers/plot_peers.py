"""Bar chart of decode tokens/s per engine (or engine variant) and batch from llamacpp_vs_deltaserve.py JSON files.

    python benchmarks/peers/plot_peers.py OUT.png RESULT.json [RESULT.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SIDES = [("llamacpp", "llama.cpp"), ("deltaserve", "deltaserve"), ("transformers", "transformers")]


def get(d: dict, keys: list[str]) -> dict:
    for k in keys:
        d = d[k]
    return d


def series(summary: dict) -> list[tuple[str, list[str]]]:
    """(legend, keys into a point's summary) per bar series: one per engine, or with several variants of an engine
    (--gguf LABEL=..., --quantization ...) one per variant."""
    out = []
    for side, label in SIDES:
        if side not in summary:
            continue
        if "decode_tokens_per_s" in summary[side]:
            out.append((label, [side]))
        else:
            out += [(f"{label} {name}", [side, name]) for name in summary[side]]
    return out


def main(argv: list[str]) -> int:
    out, files = argv[0], argv[1:]
    fig, axes = plt.subplots(1, len(files), figsize=(5.5 * len(files), 4), squeeze=False)
    for ax, f in zip(axes[0], files):
        d = json.load(open(f))
        pts = d["points"]
        sides = series(pts[0]["summary"])
        w = 0.8 / len(sides)
        for i, (label, keys) in enumerate(sides):
            s = [get(p["summary"], keys)["decode_tokens_per_s"] for p in pts]
            med = [x["median"] for x in s]
            err = [[x["median"] - x["min"] for x in s], [x["max"] - x["median"] for x in s]]
            ax.bar([j + (i - (len(sides) - 1) / 2) * w for j in range(len(pts))], med, w, yerr=err, capsize=3,
                   label=label)
        ax.set_xticks(range(len(pts)), [f"batch {p['batch']}" for p in pts])
        ax.set_ylabel("decode tokens/s")
        ax.set_title(Path(f).stem.removeprefix("peers-llamacpp-"), fontsize=10)
        ax.legend(fontsize=8)
    cfg = json.load(open(files[0]))["config"]
    fig.suptitle(f"{cfg['input_len']} → {cfg['output_len']} tokens, {cfg['dtype']}, {cfg['threads']} threads, "
                 f"median [min, max] of {cfg['runs']} runs", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
