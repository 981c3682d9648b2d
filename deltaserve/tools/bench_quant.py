"""Quantization benchmark (issue 8's benchmark line, weight half): per scheme, the stored weight bytes, end-to-end
greedy generation tokens/s at batch 1 and 16, and the logit KL divergence and top-1 agreement against the
unquantised model, teacher-forced over the shipped validation text. Printed, never asserted.

Run: `python -m deltaserve.tools.bench_quant [MODEL] [--tokens N]` (MODEL defaults to the shipped trained model;
intended for k31-small at most). Weight bytes count what a layer stores (MX bytes + scales, or its parameters), not
the dequantised copies an MXLinear caches for speed.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..engine.config import QUANTIZATIONS
from ..engine.llm import LLM
from ..engine.sampling_params import SamplingParams
from ..models.loader import load_model
from ..tokenizer import load_tokenizer
from .corpus import VALIDATION_PATH

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def push(self, item):", "for i in range(10):"]


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def logit_quality(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(mean KL(ref || got), top-1 agreement) of [T, V] logits."""
    kl = torch.nn.functional.kl_div(got.float().log_softmax(-1), ref.float().log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    return kl, (ref.argmax(-1) == got.argmax(-1)).float().mean().item()


def decode_tokens_per_s(model: str | None, scheme: str | None, batch: int, tokens: int, dtype: str) -> float:
    llm = LLM(model, dtype=dtype, quantization=scheme)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def run_quant_bench(model: str | None, tokens: int = 32, eval_tokens: int = 256, dtype: str = "bfloat16") -> str:
    from ..default_model import default_model_path

    path = model or str(default_model_path())
    ids = torch.tensor(load_tokenizer(path).encode(VALIDATION_PATH.read_text()[:20000])[:eval_tokens])
    ref = load_model(path, dtype=dtype).reference_logits(ids)
    rows = [f"{'scheme':<12} {'weight MB':>10} {'tok/s b1':>9} {'tok/s b16':>10} {'KL':>8} {'top-1':>7}"]
    for scheme in (None, *QUANTIZATIONS):
        m = load_model(path, dtype=dtype, quantization=scheme)
        kl, agree = logit_quality(ref, m.reference_logits(ids))
        b1, b16 = (decode_tokens_per_s(model, scheme, b, tokens, dtype) for b in (1, 16))
        rows.append(f"{scheme or dtype:<12} {weight_bytes(m) / 1e6:>10.2f} {b1:>9.1f} {b16:>10.1f} {kl:>8.4f} "
                    f"{agree:>7.1%}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deltaserve.tools.bench_quant")
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    parser.add_argument("--eval-tokens", type=int, default=256, help="validation tokens for KL / agreement")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args(argv)
    print(run_quant_bench(args.model, args.tokens, args.eval_tokens, args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
