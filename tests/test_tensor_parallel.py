"""Tensor and expert parallelism of the model's math (docs/parallel.md): 2 and 4 gloo ranks, each holding its
shard (heads, widths, vocabulary slices; experts split in width or placed whole), give the logits of one process."""

from __future__ import annotations

import pytest
import torch

from deltaserve.models.loader import load_model
from parallel_utils import LAYOUTS, sharded_logits


@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny", "deepseek-v32-tiny"])
def test_sharded_forward_equals_one_process(make_checkpoint, tmp_path, preset):
    """A 40-token prompt (past the tiny DSA presets' indexer top-k of 16, so the indexers' summed scores choose)
    through every layout: the gathered logits are one process's to fp32 rounding, with the same argmax."""
    path = make_checkpoint(preset)
    prompt = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    want = load_model(path, "float32").reference_logits(torch.tensor(prompt))
    got = sharded_logits(path, prompt, tmp_path)
    assert sorted(got) == sorted(f"tp{n}-ep{int(ep)}-g{g}" for n, ep in LAYOUTS for g in range(4 // n))
    for name, logits in got.items():
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=5e-4, msg=name)
        assert torch.equal(logits.argmax(-1), want.argmax(-1)), name
