"""Bias-free linear layer. Every projection of the supported models is bias-free."""

from torch import nn


class Linear(nn.Linear):
    """`nn.Linear` without bias; a distinct class so quantized and parallel variants can replace it by name."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
