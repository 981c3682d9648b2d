"""`deltaserve bench vision`: the image path of a checkpoint with a vision tower (docs/vision.md).

Per image size (square, `--sizes` pixels a side): the processor's time (decode, resize, patches) and the tower's
encode time, median of `--runs`; then the engine's time to first token for one chat prompt holding 1 and 4 images of
the first size (fresh images each run, so neither the feature cache nor the prefix cache answers), against the same
prompt's text alone. JSON: {"bench", "config", "machine", "encode": [...], "ttft": [...]}.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import numpy as np
from PIL import Image

from ..engine.config import EngineArgs
from ..engine.llm_engine import LLMEngine
from ..engine.sampling_params import SamplingParams
from ..vision import IMAGE_PLACEHOLDER, preprocess
from .bench_report import emit, format_table, machine_info


def add_vision_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=[224, 448, 896], help="image sides measured (pixels)")
    p.add_argument("--runs", type=int, default=3, help="timed runs of each point")


def _png(side: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def _ttft(engine: LLMEngine, images: list[bytes], tag: str) -> float:
    prompt = "Look: " + " and ".join([IMAGE_PLACEHOLDER] * len(images)) + ". What is it?"
    start = time.perf_counter()
    engine.add_request(tag, prompt, SamplingParams(temperature=0, max_tokens=1), images=images)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def run_vision(args: argparse.Namespace) -> str:
    engine = LLMEngine(EngineArgs.from_cli(args, args.model))
    core = engine.core
    if core.vision is None:
        raise SystemExit("bench vision: this checkpoint has no vision tower")
    encode = []
    for side in args.sizes:
        prep, enc = [], []
        for r in range(args.runs):
            data = _png(side, 1000 * side + r)
            t0 = time.perf_counter()
            image = preprocess(data, core.media)
            t1 = time.perf_counter()
            core.vision.encode(image.pixel_values, [image.grid])
            prep.append(t1 - t0)
            enc.append(time.perf_counter() - t1)
        encode.append({"side": side, "positions": image.num_tokens, "grid": list(image.grid),
                       "preprocess_s": statistics.median(prep), "encode_s": statistics.median(enc)})
    ttft, seed = [], 0
    _ttft(engine, [_png(args.sizes[0], 0)], "warmup")
    for count in (0, 1, 4):
        runs = []
        for r in range(args.runs):
            seed += 1
            runs.append(_ttft(engine, [_png(args.sizes[0], 7919 * seed + i) for i in range(count)], f"t{count}-{r}"))
        ttft.append({"images": count, "ttft_s": statistics.median(runs)})
    config = {"model": str(engine.model_path), "dtype": engine.dtype, "sizes": args.sizes, "runs": args.runs}
    payload = {"bench": "vision", "config": config, "machine": machine_info(), "encode": encode, "ttft": ttft}
    table = (f"vision  model={engine.model_path} dtype={engine.dtype} runs={args.runs}\n"
             + format_table(["side", "positions", "preprocess_s", "encode_s"],
                            [[e["side"], e["positions"], e["preprocess_s"], e["encode_s"]] for e in encode])
             + "\n" + format_table([f"images ({args.sizes[0]} px)", "ttft_s", "vs text alone"],
                                   [[t["images"], t["ttft_s"], t["ttft_s"] / ttft[0]["ttft_s"]] for t in ttft]))
    return emit(args, payload, table, None)
