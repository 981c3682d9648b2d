"""What a prefill instance (P) hands a decode instance (D) for one request (docs/disaggregation.md §2).

For a prompt of L tokens P computes the first n = L - 1, and D takes them as a prefix hit of n tokens, computing the
last prompt token itself (which gives it the first logits and, for a drafter, the target's state there). So what
travels is everything the model keeps for those n tokens:
  * every page tensor of the request's first ceil(n / B) pages, as stored: the MLA latent of each MLA/DSA layer (the
    C8 cache's byte pages as they are) and each DSA layer's indexer keys (and their per-token scales when 8-bit).
    A drafter's layers (MTP, DSpark) do not travel: D's drafter catches its own rows up (spec_decode), so the two
    sides may draft differently or not at all;
  * the KDA state after n tokens: every KDA layer's conv windows and recurrent state (one state slot).
Rows of the last page past n are whatever P holds there; D overwrites them as it computes those positions.

The two sides must hold their caches in the same format — the same model, block size, dtypes, C8 layout, layers and
head split — which `cache_format` describes and `check_format` compares (the handshake): a payload is never
reinterpreted."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

import torch

from ..cache.page_pool import PagePool
from ..cache.state_slots import StateSlots
from ..errors import KVTransferError

STATE_CONV, STATE_RECURRENT = "state.conv", "state.recurrent"


class KVPayload(NamedTuple):
    """One request's cache for its first `num_tokens` tokens: page tensors by `PagePool.named_storage` name, each
    [pages, B, ...] for its pages `first_page` .. ceil(num_tokens / B) - 1 (the loading side holds the earlier ones
    already), and the KDA state (STATE_CONV, STATE_RECURRENT: one slot's tensors); `tokens`: the `token_digest` of
    those tokens, which the loading side checks against its own prompt."""

    num_tokens: int
    tensors: dict[str, torch.Tensor]
    tokens: str
    first_page: int = 0

    def from_page(self, first: int) -> "KVPayload":
        """This payload less its pages before page `first` (views)."""
        if not self.first_page <= first <= self.first_page + self.num_pages:
            raise KVTransferError(f"page {first} is outside the payload's pages {self.first_page} .. "
                                  f"{self.first_page + self.num_pages - 1}")
        cut = first - self.first_page
        return KVPayload(self.num_tokens, {n: t if n in (STATE_CONV, STATE_RECURRENT) else t[cut:]
                                           for n, t in self.tensors.items()}, self.tokens, first)

    @property
    def num_pages(self) -> int:
        return next((t.shape[0] for n, t in self.tensors.items() if n not in (STATE_CONV, STATE_RECURRENT)), 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def token_digest(ids: list[int], images: tuple[str, ...] = ()) -> str:
    """A digest of token ids and the content digests of the images among them: what a cache was computed from."""
    return hashlib.sha256((",".join(map(str, ids)) + "|" + ",".join(images)).encode()).hexdigest()[:32]


def _slot_tensors(states: StateSlots) -> dict[str, torch.Tensor]:
    return {STATE_CONV: states.conv, STATE_RECURRENT: states.recurrent}


FINGERPRINT_SAMPLE = 1 << 16  # bytes read from each end of each weight file


def model_fingerprint(path: Path) -> str:
    """Which model a checkpoint folder holds, cheaply: a hash of its config.json and, per safetensors file, its name,
    size, header (tensor names, shapes, dtypes, offsets) and the first and last 64 KiB of its data — two checkpoints
    of one architecture with different weights differ there."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        with file.open("rb") as f:
            header = f.read(int.from_bytes(f.read(8), "little"))
            head = f.read(FINGERPRINT_SAMPLE)
            f.seek(max(size - FINGERPRINT_SAMPLE, 0))
            tail = f.read()
        digest.update(f"{file.name}|{size}|".encode() + header + head + tail)
    return digest.hexdigest()[:32]


def cache_format(model: str, pages: PagePool, states: StateSlots) -> dict:
    """The handshake's description of a side's cache (msgpack-able): the model fingerprint, the block size, and per
    tensor of a payload its dtype and per-page (per-slot) shape."""
    every = {**pages.named_storage(drafter=False), **_slot_tensors(states)}
    return {"model": model, "block_size": pages.block_size,
            "tensors": {name: [str(t.dtype).removeprefix("torch."), list(t.shape[1:])]
                        for name, t in sorted(every.items())}}


def check_format(mine: dict, theirs: dict) -> None:
    """Raise KVTransferError naming the first thing two sides' cache formats disagree on."""
    for key in ("model", "block_size"):
        if mine.get(key) != theirs.get(key):
            raise KVTransferError(f"the peer's {key} is {theirs.get(key)!r}, this instance's {mine.get(key)!r}")
    a, b = mine.get("tensors", {}), theirs.get("tensors", {})
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            raise KVTransferError(f"the peer's cache tensor {name!r} is {b.get(name)!r}, this instance's "
                                  f"{a.get(name)!r} (cache dtype, layers, drafter or tensor-parallel layout differ)")


def export_kv(pages: PagePool, states: StateSlots, block_ids: list[int], slot: int, tokens: list[int],
              images: tuple[str, ...] = ()) -> KVPayload:
    """Copy out the pages of a request's first len(`tokens`) tokens (it holds `block_ids`; `images`: the digests of
    the images among them) and its KDA state `slot` (which must be the state after exactly those tokens)."""
    num_tokens = len(tokens)
    count = pages.blocks_needed(num_tokens)
    if count > len(block_ids):
        raise KVTransferError(f"{num_tokens} tokens need {count} pages; the request holds {len(block_ids)}")
    index = torch.tensor(block_ids[:count], dtype=torch.long)
    tensors = {name: t.index_select(0, index) for name, t in pages.named_storage(drafter=False).items()}
    tensors.update({name: t[slot].clone() for name, t in _slot_tensors(states).items()})
    return KVPayload(num_tokens, tensors, token_digest(tokens, images))


def import_kv(payload: KVPayload, pages: PagePool, states: StateSlots, block_ids: list[int], slot: int,
              tokens: list[int], images: tuple[str, ...] = ()) -> None:
    """Write `payload` into pages `block_ids` (its first ceil(num_tokens / B)) and state `slot`, after checking that
    it was computed from `tokens` (this side's first num_tokens) and the images `images` (their digests) and holds
    exactly this side's tensors in this side's shapes and dtypes."""
    if len(tokens) != payload.num_tokens or token_digest(tokens, images) != payload.tokens:
        raise KVTransferError(f"the transferred cache was computed from other tokens than this prompt's first "
                              f"{payload.num_tokens}", "load")
    first, count = payload.first_page, pages.blocks_needed(payload.num_tokens) - payload.first_page
    if first + count > len(block_ids):
        raise KVTransferError(f"{payload.num_tokens} tokens need {first + count} pages; {len(block_ids)} were "
                              f"allocated")
    page_tensors, slot_tensors = pages.named_storage(drafter=False), _slot_tensors(states)
    want = {**{n: (t.dtype, (count, *t.shape[1:])) for n, t in page_tensors.items()},
            **{n: (t.dtype, tuple(t.shape[1:])) for n, t in slot_tensors.items()}}
    got = {n: (t.dtype, tuple(t.shape)) for n, t in payload.tensors.items()}
    if got != want:
        wrong = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
        raise KVTransferError(f"the payload's tensor {wrong[0]!r} is {got.get(wrong[0])}, expected "
                              f"{want.get(wrong[0])}")
    index = torch.tensor(block_ids[first:first + count], dtype=torch.long)
    for name, t in page_tensors.items():  # as bytes: index_copy_ has no 8-bit float kernel
        t.view(torch.uint8).index_copy_(0, index, payload.tensors[name].view(torch.uint8))
    for name, t in slot_tensors.items():
        t[slot].copy_(payload.tensors[name])


def transfer_bytes(config, pages: PagePool, num_tokens: int, first_page: int = 0) -> int:
    """The accounting of one request's payload from the model's shapes, as the pools are sized (not from the
    payload): its pages from `first_page` on (latent, indexer keys and scales) and one KDA state slot."""
    per_token = PagePool.bytes_per_token(config, pages.dtype, pages.latent_8bit, pages.keys_8bit)
    count = pages.blocks_needed(num_tokens) - first_page
    return count * pages.block_size * per_token + StateSlots.bytes_per_slot(config)
