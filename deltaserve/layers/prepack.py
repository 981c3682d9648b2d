"""Prepacked bf16 weights for oneDNN on the CPU.

`F.linear` on bf16 CPU tensors reorders the weight into oneDNN's blocked layout on every call; at decode sizes
that reorder costs more than the product. Packing once and calling oneDNN's linear on the packed weight gives
bit-identical outputs (the same kernel; tests/test_prepack.py checks equality) without the reorder.

`PackedWeights` keeps one packed copy of a weight matrix (or of several stacked) and repacks when the source's storage or version counter
moves, so it never goes stale. The packed copy is extra memory (one more copy of every packed matrix); the engine
packs only with `--ops fast`, bf16 weights and oneDNN bf16 support, and `--no-prepack-weights` turns it off. It
also holds the native kernels' forms of the same weights (`get_native`, `get_columns`): with the native kernels on,
linears run those at every row count (`native_product`) and the oneDNN form is never built.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

import torch

from ..ops.native import linear_columns, linear_packed, pack_columns, pack_rows
from .native_path import LINEAR_MAX_ROWS, switch_modules, takes_native


def prepack_supported(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """oneDNN's packed bf16 linear exists on this build and machine, for weights of this dtype and device."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


_VERSION = attrgetter("_version")


class Derived:
    """A value built from some weights (a converted, stacked, split or packed copy), kept until any source's
    storage or version counter moves, so it never goes stale."""

    def __init__(self):
        self._key: tuple | None = None
        self._value = None

    def get(self, sources: list[torch.Tensor], build: Callable[[], Any]) -> Any:
        key = (tuple(map(torch.Tensor.data_ptr, sources)), tuple(map(_VERSION, sources)))
        if key != self._key:
            self._value, self._key = build(), key
        return self._value


class PackedWeights:
    """Packed copies of one weight, or of several weights that read the same input (their rows stacked in order:
    one product instead of one per weight): oneDNN's blocked form (`get`) and the native kernels' row tiles
    (`get_native`, ops/native.py), each built on first use and rebuilt when a source changes."""

    def __init__(self):
        self._forms = Derived()  # form name -> packed tensor, a fresh dict whenever the sources change

    def _form(self, weights: list[torch.Tensor], name: str, pack) -> torch.Tensor:
        forms = self._forms.get(weights, dict)
        if name not in forms:
            forms[name] = pack(torch.cat([w.detach() for w in weights], dim=0))
        return forms[name]

    def get(self, weights: list[torch.Tensor]) -> torch.Tensor:
        return self._form(weights, "onednn", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None))

    def get_native(self, weights: list[torch.Tensor]) -> torch.Tensor:
        return self._form(weights, "native", pack_rows)

    def get_columns(self, weights: list[torch.Tensor]) -> torch.Tensor:
        return self._form(weights, "columns", pack_columns)


def native_product(x: torch.Tensor, weights: list[torch.Tensor], packed: PackedWeights) -> torch.Tensor | None:
    """x @ (the weights stacked)^T on the native kernels when x takes them (bf16 rows): the 4-row dot tiles up to
    `LINEAR_MAX_ROWS` rows, the column-packed product above (layers/native_path.py); None otherwise."""
    n_out = sum(w.shape[0] for w in weights)
    if takes_native(x, LINEAR_MAX_ROWS):
        return linear_packed(x, packed.get_native(weights), n_out)
    if takes_native(x, None):
        return linear_columns(x, packed.get_columns(weights), n_out)
    return None


def linear_group(x: torch.Tensor, weights: list[torch.Tensor], packed: PackedWeights) -> list[torch.Tensor]:
    """[x @ w.T for w in weights] as one product over the stacked packed weights, split (each part made contiguous:
    later elementwise ops on strided column slices run several times slower on the CPU)."""
    y = packed_linear(x, packed.get(weights))
    return [part.contiguous() for part in torch.split(y, [w.shape[0] for w in weights], dim=-1)]


def stacked_product(x: torch.Tensor, modules: list[torch.nn.Module], packed: PackedWeights) -> torch.Tensor | None:
    """The modules' products side by side, [rows, sum N], computed as one product over their stacked weights when
    every module is a Linear on the native kernels or prepacked; None otherwise (an MX linear, or both off: each
    module runs on its own)."""
    weights = [getattr(m, "weight", None) for m in modules]
    if all(getattr(m, "native", False) for m in modules):
        y = native_product(x, weights, packed)
        if y is not None:
            return y
    if all(getattr(m, "prepack", False) for m in modules):
        return packed_linear(x, packed.get(weights))
    return None


def module_group(x: torch.Tensor, modules: list[torch.nn.Module], packed: PackedWeights) -> list[torch.Tensor]:
    """[m(x) for m in modules], as one product when `stacked_product` makes one. The parts are column views of its
    output at a few rows (strided views cost nothing there), contiguous copies above (later elementwise ops on
    strided column slices run several times slower on the CPU)."""
    y = stacked_product(x, modules, packed)
    if y is None:
        return [m(x) for m in modules]
    parts = torch.split(y, [m.weight.shape[0] for m in modules], dim=-1)
    return list(parts) if y.shape[0] <= LINEAR_MAX_ROWS else [part.contiguous() for part in parts]


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W^T with W packed by `PackedWeights` (same result as `F.linear(x, W)`)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def enable_prepacking(model: torch.nn.Module) -> int:
    """Switch every module with a `prepack` switch (Linear, stacked Experts) whose weights are packable to packed
    weights; modules with a `pack_now` (experts, each used only when routed to) pack at once, the others on their
    first call. Returns how many modules were switched."""
    return switch_modules(model, "prepack", prepack_supported)
