"""Bias-free linear layer. Every projection of the supported models is bias-free."""

import torch
import torch.nn.functional as F
from torch import nn

from .prepack import PackedWeights, native_product, packed_linear


class Linear(nn.Linear):
    """`nn.Linear` without bias; a distinct class so quantized and parallel variants can replace it by name.

    With `prepack` on (set by `layers.prepack.enable_prepacking`), the bf16 weight is packed once for oneDNN and
    products run on the packed copy: bit-identical to `F.linear`, faster at decode sizes. With `native` on (set by
    `layers.native_path.enable_native_kernels`), bf16 rows run the native kernels on their own packed copies
    (`prepack.native_product`: 4-row tiles for a few rows, column blocks above), equal to `F.linear` to fp32
    rounding of the sums."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.prepack = False
        self.native = False
        self._packed = PackedWeights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = native_product(x, [self.weight], self._packed) if self.native else None
        if y is not None:
            return y
        if self.prepack:
            return packed_linear(x, self._packed.get([self.weight]))
        return F.linear(x, self.weight)

    def packable_dtype(self) -> torch.dtype:
        return self.weight.dtype

    def packable_device(self) -> torch.device:
        return self.weight.device
