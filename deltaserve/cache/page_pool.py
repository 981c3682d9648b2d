"""PagePool: fixed-size pages of MLA latent rows and DSA indexer keys (docs/serving.md §3.1).

Every MLA/DSA layer owns a latent page tensor; every DSA layer also owns indexer-key pages. All of them are
addressed by the same block ids: one block table per request.

Formats (docs/ops.md §9):
  * latent, model dtype: [num_blocks, B, r + rho] holding [c | k_pe];
  * latent, C8 (`latent_8bit` = torch.int8 or torch.float8_e4m3fn): one byte page [num_blocks, B, W] per layer in
    FlashMLA's fused order — r 8-bit values, then r/128 fp32 tile scales, then rho k_pe values in the model dtype
    (never quantised); W = 656 bytes at K3.1's r = 512, rho = 64 in bf16. The layer's `latent` entry is a
    `C8Latent` of strided views into that page, so ops gather and dequantise only the rows they touch;
  * indexer keys, model dtype: [num_blocks, B, D_I];
  * indexer keys, 8-bit (`keys_8bit`): Hadamard-rotated values [num_blocks, B, D_I] plus one fp32 scale per token
    [num_blocks, B] (132 bytes a token at D_I = 128, the budget of vLLM's fused page; kept as two tensors).
Blocks are reference-counted so several requests (n > 1, the prefix cache) can share one. A full page registered
under its prefix hash stays *cached* when its last holder lets go: it can be shared again by a later request with
the same prefix, and is evicted least-recently-used only when a fresh page is needed.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from ..config import ModelConfig
from ..ops.qli import hadamard, write_index_keys
from ..ops.qsfa import C8Latent, dequantize_latent, write_latent
from .state_slots import COPY_BLOCK


class PagePool:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", latent_8bit: torch.dtype | None = None,
                 keys_8bit: torch.dtype | None = None, drafter_layers: tuple[int, ...] = ()):
        if num_blocks < 1:
            raise ValueError("the page pool needs at least one block")
        self.block_size, self.num_blocks, self.dtype = block_size, num_blocks, dtype
        self.latent_8bit, self.keys_8bit = latent_8bit, keys_8bit
        r, rho = config.kv_lora_rank, config.qk_rope_head_dim
        self._storage: dict[str, torch.Tensor] = {}  # every page tensor by name (`named_storage`)
        self._drafter_names = {f"latent.{l}" for l in drafter_layers}
        self.journal: list[tuple[int, ...]] | None = None  # copies to replay on other ranks (cache/state_slots.py)
        self.latent: dict[int, torch.Tensor | C8Latent] = {}
        for l in mla_cache_layers(config, drafter_layers):
            if latent_8bit is None:
                self.latent[l] = torch.zeros(num_blocks, block_size, r + rho, dtype=dtype, device=device)
                self._storage[f"latent.{l}"] = self.latent[l]
            else:
                page = torch.zeros(num_blocks, block_size, c8_row_bytes(config, dtype), dtype=torch.uint8,
                                   device=device)
                self.latent[l] = _c8_views(page, r, rho, latent_8bit, dtype)
                self._storage[f"latent.{l}"] = page
        self.index_keys = {l: torch.zeros(num_blocks, block_size, config.index_head_dim, dtype=keys_8bit or dtype,
                                          device=device) for l in config.dsa_layers}
        self.index_scales = ({l: torch.zeros(num_blocks, block_size, dtype=torch.float32, device=device)
                              for l in config.dsa_layers} if keys_8bit is not None else {})
        self._storage.update({f"index_keys.{l}": t for l, t in self.index_keys.items()})
        self._storage.update({f"index_scales.{l}": t for l, t in self.index_scales.items()})
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # collision guard for hash hits
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed pages, least recent first
        self.num_evicted = 0

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype, latent_8bit: torch.dtype | None = None,
                        keys_8bit: torch.dtype | None = None, drafter_layers: tuple[int, ...] = ()) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        row = (c8_row_bytes(config, dtype) if latent_8bit is not None
               else itemsize * (config.kv_lora_rank + config.qk_rope_head_dim))
        key = config.index_head_dim + 4 if keys_8bit is not None else itemsize * config.index_head_dim
        return len(mla_cache_layers(config, drafter_layers)) * row + len(config.dsa_layers) * key

    # ---- allocation ----
    @property
    def num_free(self) -> int:
        """Pages a new allocation can take: never used or free, plus cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` fresh blocks with one reference each, evicting least-recently-used cached pages when
        the free list runs short. Caller checks `can_allocate` first."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"page pool exhausted: {num_blocks} blocks asked, {self.num_free} free")
        while len(self._free) < num_blocks:
            victim, _ = self._cached.popitem(last=False)
            self._forget(victim)
            self.num_evicted += 1
            self._free.append(victim)
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add one reference to each of `blocks` (another request now reads them); a cached page is revived."""
        for b in blocks:
            if self._refs[b] <= 0:
                if b not in self._cached:
                    raise RuntimeError(f"block {b} is free and cannot be shared")
                del self._cached[b]
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block (in the given order, which becomes the LRU order: pass chain tails
        first so they are evicted first); a hashed page with none left stays cached, any other returns free."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    # ---- prefix hashes ----
    def register(self, block: int, block_hash: bytes, tokens: tuple[int, ...]) -> None:
        """Record that full page `block` holds the prefix chain ending in `block_hash`. A hash already held by
        another page keeps that page (this one stays an unshared duplicate)."""
        if block_hash in self._by_hash or block in self._hash_of:
            return
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash
        self._tokens_of[block] = tokens

    def lookup(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        """The page holding this prefix chain, if any (token ids compared to guard against hash collisions)."""
        block = self._by_hash.get(block_hash)
        if block is None or self._tokens_of[block] != tokens:
            return None
        return block

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def _forget(self, block: int) -> None:
        h = self._hash_of.pop(block)
        del self._by_hash[h]
        del self._tokens_of[block]

    def storage(self) -> list[torch.Tensor]:
        """Every page tensor (latent pages, indexer keys and their scales)."""
        return list(self._storage.values())

    def named_storage(self, drafter: bool = True) -> dict[str, torch.Tensor]:
        """Every page tensor [num_blocks, B, ...] as stored (a C8 latent as its byte page), by name: `latent.L`,
        `index_keys.L`, `index_scales.L` (8-bit keys only) for layer L; without a drafter's layers unless
        `drafter`."""
        return {n: t for n, t in self._storage.items() if drafter or n not in self._drafter_names}

    def copy_block(self, src: int, dst: int) -> None:
        for t in self._storage.values():
            t[dst].copy_(t[src])
        if self.journal is not None:
            self.journal.append((COPY_BLOCK, src, dst))

    # ---- rows ----
    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat row indices (block * B + offset) of positions start..end-1 of a request."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def padded_slots(self, block_tables: list[list[int]], length: int) -> torch.Tensor:
        """[len(block_tables), length] flat rows of positions 0..length-1 of each request; positions past a request's
        pages read rows of block 0 (padding, for the caller to mask)."""
        width = max(1, -(-length // self.block_size))
        table = torch.tensor([blocks[:width] + [0] * (width - len(blocks[:width])) for blocks in block_tables],
                             dtype=torch.long).view(len(block_tables), width)
        pos = torch.arange(length)
        return table[:, pos // self.block_size] * self.block_size + pos % self.block_size

    def write(self, layer: int, rows: torch.Tensor, latent: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """Store this step's [c | k_pe] rows (quantised per tile for C8) and indexer keys (rotated and quantised
        per token for 8-bit keys) at flat page rows."""
        write_latent(latent, rows, self.latent_rows(layer))
        if index_keys is not None:
            keys, scales = self.key_rows(layer)
            eight = self.keys_8bit is not None
            write_index_keys(index_keys, rows, keys, scales, quantized=eight, rotate=eight)

    def read(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Latent and indexer-key rows in the model dtype; 8-bit entries come back dequantised (keys also rotated back: the
        Hadamard matrix is its own inverse), so readers see them in the model's own space."""
        lat = self.latent_rows(layer)
        lat = (dequantize_latent(C8Latent(lat.values[rows], lat.scales[rows], lat.k_pe[rows])) if self.latent_8bit
               else lat[rows]).to(self.dtype)
        if layer not in self.index_keys:
            return lat, None
        keys, scales = self.key_rows(layer)
        if self.keys_8bit is not None:
            return lat, hadamard(keys[rows].float() * scales[rows].unsqueeze(-1)).to(self.dtype)
        return lat, keys[rows]

    def latent_rows(self, layer: int) -> torch.Tensor | C8Latent:
        """Flat latent rows of a layer: [rows, r + rho], or a C8Latent of flat views."""
        lat = self.latent[layer]
        if isinstance(lat, C8Latent):
            return C8Latent(*(t.view(-1, *t.shape[2:]) for t in lat))
        return lat.view(-1, lat.shape[-1])

    def key_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Flat indexer-key rows of a DSA layer and, for the 8-bit cache, their per-token scales."""
        keys = self.index_keys[layer]
        scales = self.index_scales.get(layer)
        return keys.view(-1, keys.shape[-1]), None if scales is None else scales.view(-1)

    # ---- integrity ----
    def check_integrity(self, used_refs: dict[int, int] | None = None) -> None:
        """free + cached + used == total, pairwise disjoint; cached pages are hashed and unreferenced; optionally
        refcounts equal `used_refs` (block -> number of holders counted by the caller)."""
        free, cached = set(self._free), set(self._cached)
        if len(free) != len(self._free):
            raise AssertionError("page pool: a block is on the free list twice")
        used = {b for b, r in enumerate(self._refs) if r > 0}
        if free & used or cached & used or free & cached:
            raise AssertionError("page pool: a block is in two of free / cached / used")
        if len(free) + len(cached) + len(used) != self.num_blocks:
            raise AssertionError(f"page pool: free {len(free)} + cached {len(cached)} + used {len(used)} != total "
                                 f"{self.num_blocks}")
        if any(b not in self._hash_of for b in cached) or any(b in self._hash_of for b in free):
            raise AssertionError("page pool: cached pages must be hashed and free pages must not")
        if len(self._by_hash) != len(self._hash_of):
            raise AssertionError("page pool: hash maps disagree")
        if used_refs is not None:
            want = {b: r for b, r in used_refs.items() if r}
            got = {b: self._refs[b] for b in used}
            if want != got:
                raise AssertionError(f"page pool: refcounts {got} differ from holders {want}")


def mla_cache_layers(config: ModelConfig, drafter_layers: tuple[int, ...] = ()) -> list[int]:
    """Layers with a latent cache: the MLA/DSA layers of the main model, then a drafter's (`drafter_layers`, indices
    from num_layers on: the drafting MTP layer or the DSpark drafter's layers, docs/serving.md §9.4)."""
    return [*config.mla_layers, *drafter_layers]


C8_TILE = 128  # latent values per fp32 scale (docs/ops.md §9.1); a smaller latent rank uses one tile


def c8_row_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one C8 latent row: r values + one fp32 scale per tile + rho k_pe values in `dtype`, rounded up to
    4 so the fp32 scales of every row stay aligned (656 at K3.1's shapes in bf16)."""
    r, rho = config.kv_lora_rank, config.qk_rope_head_dim
    tile = min(C8_TILE, r)
    if r % tile or r % 4:
        raise ValueError(f"the C8 latent cache needs kv_lora_rank a multiple of {tile} and of 4, got {r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return -(-(r + 4 * (r // tile) + itemsize * rho) // 4) * 4


def _c8_views(page: torch.Tensor, r: int, rho: int, value_dtype: torch.dtype, dtype: torch.dtype) -> C8Latent:
    """Strided views of a C8 byte page [blocks, B, W]: values, tile scales, k_pe (writes go through)."""
    nt = r // min(C8_TILE, r)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return C8Latent(page[..., :r].view(value_dtype), page[..., r:r + 4 * nt].view(torch.float32),
                    page[..., r + 4 * nt:r + 4 * nt + itemsize * rho].view(dtype))
