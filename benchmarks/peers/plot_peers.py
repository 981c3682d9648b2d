"""Bar chart of decode tokens/s per engine and batch from llamacpp_vs_deltaserve.py JSON files.

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


def main(argv: list[str]) -> int:
    out, files = argv[0], argv[1:]
    fig, axes = plt.subplots(1, len(files), figsize=(5.5 * len(files), 4), squeeze=False)
    for ax, f in zip(axes[0], files):
        d = json.load(open(f))
        pts = d["points"]
        sides = [(k, label) for k, label in SIDES if k in pts[0]["summary"]]
        w = 0.8 / len(sides)
        for i, (side, label) in enumerate(sides):
            s = [p["summary"][side]["decode_tokens_per_s"] for p in pts]
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
