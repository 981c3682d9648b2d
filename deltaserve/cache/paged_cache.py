"""PagedCache: the engine's `ModelCache`, backed by a PagePool and StateSlots. A sequence handle carries the
request's state slot and the flat page rows of its positions 0..end-1 for this step, computed once per step by the
runner and shared by every MLA/DSA layer (they all use the same block ids). KDA snapshots go to the prefix cache's
checkpoints (an int slot) or, with speculative decoding, to the draft states (a `DraftSlot`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..layers.batch import DraftSlot, ModelCache
from .page_pool import PagePool
from .state_slots import StateSlots


class SeqHandle(NamedTuple):
    slot: int
    rows: torch.Tensor  # [end] flat page-row index of each position of the sequence up to this step's last token


class PagedCache(ModelCache):
    def __init__(self, pages: PagePool, states: StateSlots, checkpoints: StateSlots | None = None,
                 drafts: StateSlots | None = None):
        self.pages, self.states, self.checkpoints, self.drafts = pages, states, checkpoints, drafts

    def handle(self, block_table: list[int], slot: int, end: int) -> SeqHandle:
        return SeqHandle(slot, self.pages.slots(block_table, 0, end))

    def kda_state(self, layer: int, handle: SeqHandle) -> tuple[torch.Tensor, torch.Tensor]:
        return self.states.state(layer, handle.slot)

    def mla_pages(self, layer: int):
        keys, scales = self.pages.key_rows(layer) if layer in self.pages.index_keys else (None, None)
        return self.pages.latent_rows(layer), keys, scales

    def kda_slot_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.states.layer_index[layer]
        return self.states.conv[:, i], self.states.recurrent[:, i]

    def kda_draft_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.drafts is None:
            return None
        i = self.drafts.layer_index[layer]
        return self.drafts.conv[:, i], self.drafts.recurrent[:, i]

    def save_kda_checkpoint(self, layer: int, checkpoint: int | DraftSlot, conv: torch.Tensor,
                            recurrent: torch.Tensor) -> None:
        if isinstance(checkpoint, DraftSlot):
            saved_conv, saved_rec = self.drafts.state(layer, checkpoint.slot)
        else:
            saved_conv, saved_rec = self.checkpoints.state(layer, checkpoint)
        saved_conv.copy_(conv)
        saved_rec.copy_(recurrent)

    def write_mla(self, layer: int, handle: SeqHandle, start: int, latent: torch.Tensor,
                  index_keys: torch.Tensor | None) -> None:
        self.pages.write(layer, handle.rows[start:start + latent.shape[0]], latent, index_keys)

    def write_mla_rows(self, layer: int, rows: torch.Tensor, latent: torch.Tensor,
                       index_keys: torch.Tensor | None) -> None:
        """One write of a whole step's rows at their flat page rows (`StepBatch.write_rows`)."""
        self.pages.write(layer, rows, latent, index_keys)

    def read_mla(self, layer: int, handle: SeqHandle, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.pages.read(layer, handle.rows[:length])

    def read_mla_rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """The latent rows [len(rows), r + rho] at flat page rows (`write_mla_rows`'s pair), in the model dtype."""
        return self.pages.read(layer, rows)[0]
