"""A checkpoint whose greedy continuation of given prompts is given text: a tiny preset trained on those examples
until every target token wins by a clear margin, then written in the real layout. Lets a test drive a real server
into outputs a random model never writes, such as a tool call (tests/test_responses.py)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from deltaserve.tools.presets import get_preset
from deltaserve.tools.train import build_model, export_model, step_batch

# Every target token must beat the runner-up by this many nats in fp32, so that the served model, whose products
# may round differently (bf16 kernels, another summation order), still picks it.
MARGIN = 4.0


def _target_logits(model, prompt: list[int], target: list[int]) -> torch.Tensor:
    """Logits [len(target), vocab] predicting each target token after prompt + the target tokens before it."""
    ids = torch.tensor(prompt + target[:-1])
    h = model(ids, step_batch(1, len(ids)))
    return model.compute_logits(h)[len(prompt) - 1:]


def _margin(logits: torch.Tensor, target: torch.Tensor) -> float:
    """The smallest lead of a target token's logit over the best other token's."""
    chosen = logits.gather(1, target[:, None])[:, 0]
    others = logits.scatter(1, target[:, None], float("-inf")).max(dim=1).values
    return (chosen - others).min().item()


def memorize(preset: str, tokenizer_dir: Path, examples: list[tuple[list[int], list[int]]], out: Path,
             max_steps: int = 300, lr: float = 1e-2, seed: int = 0) -> Path:
    """Train `preset`'s seeded model on (prompt ids, target ids) pairs until each target is its prompt's greedy
    continuation with every token ahead by MARGIN; write it (float32) to `out` with the tokenizer files of
    `tokenizer_dir`. Raises AssertionError if `max_steps` do not get there."""
    raw = get_preset(preset).config
    model, config = build_model(raw, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    targets = [torch.tensor(t) for _, t in examples]
    model.train()
    margins: list[float] = []
    for _ in range(max_steps):
        opt.zero_grad(set_to_none=True)
        margins = []
        for (prompt, target), y in zip(examples, targets):
            logits = _target_logits(model, prompt, target)
            F.cross_entropy(logits, y).backward()
            margins.append(_margin(logits.detach(), y))
        if min(margins) >= MARGIN:
            break
        opt.step()
    assert min(margins) >= MARGIN, f"not memorised after {max_steps} steps: margins {margins}"
    model.eval()
    return export_model(model, config, raw, tokenizer_dir, out, dtype=torch.float32)
