"""SequenceCache: contiguous, growable per-sequence cache for the reference forward and split tests.

The paged pools of the engine implement the same `ModelCache` contract; this one trades memory planning for
simplicity: each sequence owns one tensor per layer that doubles when full.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..layers.batch import ModelCache


class SequenceState:
    """One sequence's KDA states and MLA/indexer rows, per layer."""

    def __init__(self) -> None:
        self.kda: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.latent: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}


class SequenceCache(ModelCache):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.config, self.dtype, self.device = config, dtype, device

    def new_sequence(self) -> SequenceState:
        return SequenceState()

    def kda_state(self, layer: int, handle: SequenceState) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in handle.kda:
            c = self.config
            conv = torch.zeros(3, c.kda_dim, c.kda_conv_size - 1, dtype=torch.float32, device=self.device)
            rec = torch.zeros(c.kda_num_heads, c.kda_head_dim, c.kda_head_dim, dtype=torch.float32,
                              device=self.device)
            handle.kda[layer] = (conv, rec)
        return handle.kda[layer]

    def write_mla(self, layer: int, handle: SequenceState, start: int, latent: torch.Tensor,
                  index_keys: torch.Tensor | None) -> None:
        _write(handle.latent, layer, start, latent)
        if index_keys is not None:
            _write(handle.index_keys, layer, start, index_keys)

    def read_mla(self, layer: int, handle: SequenceState, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        keys = handle.index_keys.get(layer)
        return handle.latent[layer][:length], None if keys is None else keys[:length]


def _write(store: dict[int, torch.Tensor], layer: int, start: int, rows: torch.Tensor) -> None:
    buf = store.get(layer)
    end = start + rows.shape[0]
    if buf is None or buf.shape[0] < end:
        grown = rows.new_zeros(max(end, 2 * (0 if buf is None else buf.shape[0])), rows.shape[1])
        if buf is not None:
            grown[: buf.shape[0]] = buf
        store[layer] = buf = grown
    buf[start:end] = rows
