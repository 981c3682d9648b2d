"""Bias-free linear layer. Every projection of the supported models is bias-free."""

import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """`nn.Linear` without bias; a distinct class so quantized, parallel and backend variants can replace it by name
    (layers/quantized.py; backends/ swap in forms that run the same product on packed weights)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        return F.linear(x, self.weight)
