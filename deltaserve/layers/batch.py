"""StepBatch: what one forward step computes, built once and handed to every layer.

Tokens of all sequences in a step are flattened into one [N] array; sequence i owns the rows
`query_start[i]:query_start[i+1]`, which sit at positions `context_lens[i] .. context_lens[i] + n_i - 1` of that
sequence. Layers never look at global state: everything about sequences and caches comes through this object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import torch

from ..ops.opset import OpSet, get_ops
from ..ops.qli import StepIndexMeta


class DraftSlot(NamedTuple):
    """A KDA snapshot target among the cache's speculative-decoding draft states (docs/serving.md §9.3): the state
    after a verify step's draft position, kept until the step's drafts are accepted or rejected. A plain int target is
    a prefix-cache checkpoint slot."""

    slot: int

    @classmethod
    def of(cls, working_slot: int, per_slot: int, index: int) -> "DraftSlot":
        """Draft state `index` of working slot `working_slot`, each working slot owning `per_slot` of them."""
        return cls(working_slot * per_slot + index)


class StepLayout(NamedTuple):
    """One forward step in integers: the rows' tokens and positions, per sequence its first row (`query_start`,
    B + 1), cached tokens, state slot, page table and KDA snapshots (as `StepBatch.kda_snapshots`), the rows whose
    logits are sampled, and each prompt scoring's (first row, row count)."""

    ids: list[int]
    positions: list[int]
    query_start: list[int]
    context_lens: list[int]
    slots: list[int]
    tables: list[list[int]]
    snapshots: list[list[tuple[int, "int | DraftSlot"]]]
    sample_rows: list[int]
    score_rows: list[tuple[int, int]]


class ModelCache(ABC):
    """Per-layer storage of the cross-token state of a hybrid model, addressed by an opaque per-sequence handle.

    Contract: `kda_state` returns tensors the KDA layer reads and then overwrites in place (conv window
    [3, P, W-1] and recurrent state [H, K, V], both fp32). `write_mla` stores rows for positions
    `start .. start + n - 1`; `read_mla` returns rows for positions `0 .. length - 1` (index keys are None for
    layers without an indexer). A layer writes its new rows before reading, so a sequence sees its own chunk.
    """

    @abstractmethod
    def kda_state(self, layer: int, handle: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def write_mla(self, layer: int, handle: Any, start: int, latent: torch.Tensor,
                  index_keys: torch.Tensor | None) -> None: ...

    @abstractmethod
    def read_mla(self, layer: int, handle: Any, length: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def mla_pages(self, layer: int) -> tuple | None:
        """One MLA layer's flat page rows (latent [rows, r + rho] or a C8Latent of 8-bit views, indexer keys
        [rows, D_I] or None, and their per-token scales when the keys are 8-bit) for ops that gather rows themselves, or None when this cache
        stores sequences contiguously."""
        return None

    def kda_slot_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One KDA layer's states of every slot ([slots, 3, P, W-1], [slots, H, K, V]) for batched in-place ops
        addressed by `handle.slot`, or None when this cache keeps per-sequence state only."""
        return None

    def kda_draft_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One KDA layer's speculative-decoding draft states (`DraftSlot.slot` indexes them), in `kda_slot_pool`'s
        layout, or None when this cache keeps none."""
        return None

    def save_kda_checkpoint(self, layer: int, checkpoint: "int | DraftSlot", conv: torch.Tensor,
                            recurrent: torch.Tensor) -> None:
        """Copy one KDA layer's state into prefix-cache checkpoint `checkpoint`, or into a draft state for a
        `DraftSlot` (caches with those pools only)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state checkpoints")


@dataclass
class StepBatch:
    """One step's flattened token layout. `cache=None` means a plain forward of fresh sequences (context 0)."""

    positions: torch.Tensor  # [N] int64, absolute position of every token within its own sequence
    query_start: list[int]  # [B+1] row offsets of each sequence in the flattened tokens
    context_lens: list[int]  # [B] tokens already cached for each sequence before this step
    cache: ModelCache | None = None
    handles: list[Any] = field(default_factory=list)  # [B] per-sequence cache handles
    # [B] per sequence: (offset within its rows, target) where the KDA state is snapshotted: a prefix-cache
    # checkpoint slot, or a DraftSlot after each draft position of a verify step; offsets ascending, in (0, n_i]
    kda_snapshots: list[list[tuple[int, "int | DraftSlot"]]] = field(default_factory=list)
    ops: OpSet = field(default_factory=lambda: get_ops("fast"))
    index_meta: StepIndexMeta | None = None  # DSA indexer metadata for paged fast ops, built once per step
    write_rows: torch.Tensor | None = None  # [N] flat page row of each new token (paged caches), built once per step
    # every row attends in the decode form (`context_rows`) whatever its sequence's row count: for callers whose
    # layers keep no KDA state, as the MTP block's catch-up of several positions
    decode_form: bool = False
    # (rows [R] int64, values [R, d]): rows whose input embedding is given instead of their token's (an image's
    # features in place of its placeholder tokens, docs/vision.md); None: every row embeds its token
    input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @cached_property
    def decode_slots(self) -> torch.Tensor | None:
        """[B] int64 state slot of every sequence when this step is pure decode (one row per sequence, in order)
        over a cache whose handles carry slots; else None. Built once per step and read, through `kda_sequences`, by the
        native program's KDA blocks, which also take the step's prefix-cache snapshots: on such a step each falls
        after its sequence's one token."""
        return self._handle_slots if self._one_row_each() else None

    @cached_property
    def _handle_slots(self) -> torch.Tensor | None:
        """[B] int64 state slot of every sequence's handle, or None when a handle carries none."""
        slots = [getattr(h, "slot", None) for h in self.handles]
        return None if None in slots else torch.tensor(slots, dtype=torch.int64)

    @cached_property
    def kda_sequences(self) -> tuple[int, torch.Tensor | None, torch.Tensor] | None:
        """(sequence count, [B+1] int64 row offsets or None when each sequence has one row, [B] int64 state slots)
        of a step whose prefix-cache snapshots all fall at the end of their sequence's rows (draft states may follow
        any row: `kda_draft_rows`), over a cache whose handles carry slots (a pure decode step: `decode_slots`); else
        None, as when a prefix-cache snapshot cuts a chunk. Built once per step, read by the native program's KDA
        blocks (backends/native/program.py)."""
        if self.decode_slots is not None:
            return self.num_seqs, None, self.decode_slots
        B, slots = self.num_seqs, self._handle_slots
        if B == 0 or self.cache is None or slots is None or slots.numel() != B:
            return None
        if any(off != self.rows(i).stop - self.rows(i).start and not isinstance(target, DraftSlot)
               for i in range(B) for off, target in self.snapshots(i)):
            return None  # a prefix-cache snapshot inside a chunk: the module cuts the chunk there
        return B, torch.tensor(self.query_start, dtype=torch.int64), slots

    @cached_property
    def kda_draft_rows(self) -> torch.Tensor | None:
        """[N] int64: per row, the draft state (`DraftSlot.slot`) that takes its sequence's KDA state after that row,
        -1 for none; None when the step keeps no draft states. Read by the native program's KDA blocks."""
        drafts = [(self.query_start[i] + off - 1, target.slot) for i in range(self.num_seqs)
                  for off, target in self.snapshots(i) if isinstance(target, DraftSlot)]
        if not drafts:
            return None
        out = torch.full((self.query_start[-1],), -1, dtype=torch.int64)
        for row, slot in drafts:
            out[row] = slot
        return out

    @cached_property
    def context_rows(self) -> torch.Tensor | None:
        """[N, max position + 1] int64: per row, the flat cache rows of its sequence's positions up to its own, -1
        padded, when every sequence of this step over a paged cache (handles with `rows`) computes one token, or one
        token and the drafts after it whose KDA states it keeps (a verify step, whose rows then attend causally to
        each other's cache rows), or any rows when `decode_form` says so; else None. Built once per step, read by the native program's MLA and DSA blocks,
        which write every row's cache row before any row attends."""
        B = self.num_seqs
        if B == 0 or self.cache is None or len(self.handles) != B:
            return None
        rows = [getattr(h, "rows", None) for h in self.handles]
        if any(r is None for r in rows):
            return None
        drafts = [sum(isinstance(t, DraftSlot) for _, t in self.snapshots(i)) for i in range(B)]
        if not self.decode_form and any(self.rows(i).stop - self.rows(i).start != 1 + drafts[i] for i in range(B)):
            return None
        lengths = (self.positions + 1).tolist()
        out = torch.full((len(lengths), max(lengths)), -1, dtype=torch.int64)
        for i in range(B):
            for j in range(self.rows(i).start, self.rows(i).stop):
                out[j, :lengths[j]] = rows[i][:lengths[j]]
        return out

    def _one_row_each(self) -> bool:
        """A cached step where every sequence computes exactly one token, rows in sequence order."""
        B = self.num_seqs
        return (B > 0 and self.cache is not None and len(self.handles) == B
                and self.query_start == list(range(B + 1)))

    def rows(self, i: int) -> slice:
        return slice(self.query_start[i], self.query_start[i + 1])

    def snapshots(self, i: int) -> list[tuple[int, "int | DraftSlot"]]:
        return self.kda_snapshots[i] if self.kda_snapshots else []

    def handle(self, i: int) -> Any:
        return self.handles[i] if self.handles else None

    @classmethod
    def single(cls, num_tokens: int, context_len: int = 0, cache: ModelCache | None = None,
               handle: Any = None, device: torch.device | str = "cpu") -> "StepBatch":
        """A batch of one sequence computing `num_tokens` tokens after `context_len` cached ones."""
        if cache is None and context_len:
            raise ValueError("a StepBatch without a cache cannot continue a sequence (context_len must be 0)")
        positions = torch.arange(context_len, context_len + num_tokens, device=device)
        return cls(positions, [0, num_tokens], [context_len], cache, [handle] if cache is not None else [])
