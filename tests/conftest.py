"""Shared fixtures: checkpoints written once per session by `make-model` in the real layout."""

import pytest
import torch

from deltaserve.tools.make_model import write_checkpoint
from deltaserve.tools.presets import get_preset


@pytest.fixture(scope="session", autouse=True)
def _fixed_threads():
    # CPU results are deterministic for a fixed thread count (docs/oracles.md §1).
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float32)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """make_checkpoint(preset, **options) -> folder, cached per (preset, options)."""
    made = {}

    def make(preset: str, **options):
        key = (preset, tuple(sorted(options.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(preset.replace("-", "_"))
            made[key] = write_checkpoint(get_preset(preset), out, **options)
        return made[key]

    return make
