"""What a fused decode block (layers/fused_blocks.py) reads: its descriptor and its per-layer plan."""

from __future__ import annotations

import ctypes

import torch

from .prepack import Derived


def has_switches(*modules: torch.nn.Module | None) -> bool:
    """Every module exists and has a native switch (quantised modules have none)."""
    return all(m is not None and hasattr(m, "native") for m in modules)


def native_pack(linear: torch.nn.Module) -> torch.Tensor:
    return linear._packed.get_native([linear.weight])


def column_pack(linear: torch.nn.Module) -> torch.Tensor:
    """The linear's column pack, which it multiplies with above LINEAR_MAX_ROWS rows (and the blocks with it)."""
    return linear._packed.get_columns([linear.weight])


def takes_block(x: torch.Tensor, residual: torch.Tensor | None, max_rows: int) -> bool:
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous() and 0 < x.shape[0] <= max_rows
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape
                                      and residual.is_contiguous())))


def address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class Descriptor:
    """One block's descriptor struct (ops/native_contract.py: `KdaBlock`, `MoeBlock`, `MlaBlock` or `DsaBlock`), its
    address, and the tensors whose addresses it holds (kept alive)."""

    def __init__(self, block: ctypes.Structure, keep: list[torch.Tensor]):
        self.block, self.address, self.keep = block, ctypes.addressof(block), keep


class Plan:
    """One block of one layer: its `kind` ("kda", "mla", "dsa" or "ffn"), `module` (the attention or FFN it fuses),
    the modules whose native switches must be on, the weights the descriptor reads and its builder (which may give
    None: the block does not apply), `max_rows` it takes and, for attention, the function that runs it."""

    def __init__(self, kind: str, module: torch.nn.Module, switches: list[torch.nn.Module],
                 sources: list[torch.Tensor], build, max_rows: int, run=None):
        self.kind, self.module, self.switches, self.sources = kind, module, switches, sources
        self.build, self.max_rows = build, max_rows
        self.run = run  # attention blocks: (plan, descriptor, x, batch, residual) -> output or None
        self._descriptor = Derived()

    def descriptor(self, x: torch.Tensor, residual: torch.Tensor | None) -> Descriptor | None:
        """The descriptor when the block takes these inputs and every switch is on, else None."""
        if not takes_block(x, residual, self.max_rows):
            return None
        for m in self.switches:
            if not m.native:
                return None
        return self.weights_descriptor()

    def weights_descriptor(self) -> Descriptor | None:
        """The descriptor of the current weights (None when the builder found no native packs)."""
        return self._descriptor.get(self.sources, self.build)
