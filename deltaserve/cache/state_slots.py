"""StateSlots: one slot per running request holding the fp32 KDA state of every KDA layer (docs/serving.md §3.2):
conv windows [n_kda, 3, P, W-1] and recurrent states [n_kda, H, K, V]. Sized up front; a slot is zeroed when
allocated so a new request starts from the empty state.

On one rank of a tensor-parallel group (`shard`) a slot holds that rank's KDA heads. The pools of every rank hold
the same slots; rank 0's scheduler decides, and its pools write each change of their contents (a slot zeroed or
copied) to `journal` (a list shared with the page pool, when set) for the other ranks to replay in order
(engine/workers.py)."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..distributed import Shard

# Journal entries, one tuple each: (ZERO, pool, slot), (COPY, source pool, slot, destination pool, slot) and the page
# pool's (COPY_BLOCK, source block, destination block); pools by `StateSlots.pool_id`.
ZERO, COPY, COPY_BLOCK = 1, 2, 3


class StateSlots:
    def __init__(self, config: ModelConfig, num_slots: int, device: str | torch.device = "cpu",
                 shard: Shard = Shard(), pool_id: int = 0):
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.num_slots, self.pool_id = num_slots, pool_id
        self.journal: list[tuple[int, ...]] | None = None
        self.layer_index = {l: i for i, l in enumerate(config.kda_layers)}
        n = len(config.kda_layers)
        H, K, W = shard.part(config.kda_num_heads), config.kda_head_dim, config.kda_conv_size
        P = H * K
        self.conv = torch.zeros(num_slots, n, 3, P, max(W - 1, 0), dtype=torch.float32, device=device)
        self.recurrent = torch.zeros(num_slots, n, H, K, K, dtype=torch.float32, device=device)
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @staticmethod
    def bytes_per_slot(config: ModelConfig, shard: Shard = Shard()) -> int:
        n = len(config.kda_layers)
        W = max(config.kda_conv_size - 1, 0)
        H, K = shard.part(config.kda_num_heads), config.kda_head_dim
        return 4 * n * (3 * H * K * W + H * K ** 2)

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
        self.zero(slot)
        return slot

    def zero(self, slot: int) -> None:
        self.conv[slot].zero_()
        self.recurrent[slot].zero_()
        if self.journal is not None:
            self.journal.append((ZERO, self.pool_id, slot))

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
        if self.journal is not None:
            self.journal.append((COPY, self.pool_id, src, other.pool_id, dst))

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
