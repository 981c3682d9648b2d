"""StateSlots: one slot per running request holding the fp32 KDA state of every KDA layer (docs/serving.md §3.2):
conv windows [n_kda, 3, P, W-1] and recurrent states [n_kda, H, K, V]. Sized up front; a slot is zeroed when
allocated so a new request starts from the empty state."""

from __future__ import annotations

import torch

from ..config import ModelConfig


class StateSlots:
    def __init__(self, config: ModelConfig, num_slots: int, device: str | torch.device = "cpu"):
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.num_slots = num_slots
        self.layer_index = {l: i for i, l in enumerate(config.kda_layers)}
        n = len(config.kda_layers)
        H, K, P, W = config.kda_num_heads, config.kda_head_dim, config.kda_dim, config.kda_conv_size
        self.conv = torch.zeros(num_slots, n, 3, P, max(W - 1, 0), dtype=torch.float32, device=device)
        self.recurrent = torch.zeros(num_slots, n, H, K, K, dtype=torch.float32, device=device)
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @staticmethod
    def bytes_per_slot(config: ModelConfig) -> int:
        n = len(config.kda_layers)
        W = max(config.kda_conv_size - 1, 0)
        return 4 * n * (3 * config.kda_dim * W + config.kda_num_heads * config.kda_head_dim ** 2)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("state pool exhausted")
        slot = self._free.pop()
        self._used.add(slot)
        self.conv[slot].zero_()
        self.recurrent[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} freed twice")
        self._used.remove(slot)
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        self.copy_to(src, self, dst)

    def copy_to(self, src: int, other: "StateSlots", dst: int) -> None:
        """Copy slot `src` of this pool into slot `dst` of `other` (same model): working slot <-> checkpoint."""
        other.conv[dst].copy_(self.conv[src])
        other.recurrent[dst].copy_(self.recurrent[src])

    def state(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.layer_index[layer]
        return self.conv[slot, i], self.recurrent[slot, i]

    def check_integrity(self, holders: set[int] | None = None) -> None:
        """free + used == total, disjoint; optionally the used slots are exactly `holders`."""
        free = set(self._free)
        if len(free) != len(self._free) or free & self._used or len(free) + len(self._used) != self.num_slots:
            raise AssertionError(f"state pool: free {len(self._free)} + used {len(self._used)} != {self.num_slots}")
        if holders is not None and holders != self._used:
            raise AssertionError(f"state pool: used slots {sorted(self._used)} differ from holders {sorted(holders)}")
