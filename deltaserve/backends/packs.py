"""Packed copies of weight matrices, for the backends' products (docs/architecture.md "How the model runs").

`PackedWeights` keeps the packed forms of one weight matrix, or of several that read the same input (their rows
stacked in order: one product instead of one per weight), each built on first use and rebuilt when a source's storage
or version counter moves, so it never goes stale:
* `onednn`: oneDNN's blocked layout (the torch backend). `F.linear` on bf16 CPU tensors reorders the weight into
  that layout on every call; multiplying with the packed copy runs the same kernel without the reorder, so the
  result is bit-identical (tests/test_prepack.py).
* `rows` and `columns`: the native kernels' layouts (ops/native.py `pack_rows`: 4-row dot tiles for a few rows;
  `pack_columns`: column blocks above).
"""

from __future__ import annotations

import torch

from ..layers.derived import Derived
from ..ops.native import linear_columns, linear_packed, pack_columns, pack_rows
from ..ops.native_contract import LINEAR_MAX_ROWS


def prepack_supported(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """oneDNN's packed bf16 linear exists on this build and machine, for weights of this dtype and device."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedWeights:
    """The packed forms of one weight, or of several stacked, each built on first use."""

    def __init__(self):
        self._forms = Derived()  # form name -> packed tensor, a fresh dict whenever the sources change

    def _form(self, weights: list[torch.Tensor], name: str, pack) -> torch.Tensor:
        forms = self._forms.get(weights, dict)
        if name not in forms:
            forms[name] = pack(torch.cat([w.detach() for w in weights], dim=0))
        return forms[name]

    def onednn(self, weights: list[torch.Tensor]) -> torch.Tensor:
        return self._form(weights, "onednn", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None))

    def rows(self, weights: list[torch.Tensor]) -> torch.Tensor:
        return self._form(weights, "rows", pack_rows)

    def columns(self, weights: list[torch.Tensor]) -> torch.Tensor:
        return self._form(weights, "columns", pack_columns)


def takes_native(x: torch.Tensor, max_rows: int | None) -> bool:
    """x is a bf16 [rows, K] matrix with contiguous rows and at most max_rows rows (None: any number)."""
    return (x.dim() == 2 and (max_rows is None or x.shape[0] <= max_rows) and x.dtype == torch.bfloat16
            and x.stride(1) == 1)


def native_product(x: torch.Tensor, weights: list[torch.Tensor], packed: PackedWeights) -> torch.Tensor | None:
    """x @ (the weights stacked)^T on the native kernels when x takes them (bf16 rows): the 4-row dot tiles up to
    `LINEAR_MAX_ROWS` rows, the column-packed product above; None otherwise."""
    n_out = sum(w.shape[0] for w in weights)
    if takes_native(x, LINEAR_MAX_ROWS):
        return linear_packed(x, packed.rows(weights), n_out)
    if takes_native(x, None):
        return linear_columns(x, packed.columns(weights), n_out)
    return None


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W^T with W in oneDNN's layout (`PackedWeights.onednn`): the same result as `F.linear(x, W)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
