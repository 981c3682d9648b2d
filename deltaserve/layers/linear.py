"""Bias-free linear layer. Every projection of the supported models is bias-free."""

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.native import linear_packed
from .native_path import LINEAR_MAX_ROWS, takes_native
from .prepack import PackedWeights, packed_linear


class Linear(nn.Linear):
    """`nn.Linear` without bias; a distinct class so quantized and parallel variants can replace it by name.

    With `prepack` on (set by `layers.prepack.enable_prepacking`), the bf16 weight is packed once for oneDNN and
    products run on the packed copy: bit-identical to `F.linear`, faster at decode sizes. With `native` on (set by
    `layers.native_path.enable_native_kernels`), a few rows run the native bf16 kernel on its own packed copy."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.prepack = False
        self.native = False
        self._packed = PackedWeights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and takes_native(x, LINEAR_MAX_ROWS):
            return linear_packed(x, self._packed.get_native([self.weight]), self.out_features)
        if self.prepack:
            return packed_linear(x, self._packed.get([self.weight]))
        return F.linear(x, self.weight)

    def packable_dtype(self) -> torch.dtype:
        return self.weight.dtype

    def packable_device(self) -> torch.device:
        return self.weight.device
