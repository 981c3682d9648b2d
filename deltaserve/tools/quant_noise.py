"""Quantisation noise for training (Fan et al., "Training with Quantization Noise for Extreme Model Compression"): at
each step every layer a quantisation scheme would change runs, with probability ``p``, on the values that scheme's MX
layers compute with, weights and inputs fake-quantised (layers/quantized.py; ops/mx.py), the gradient passing
straight through. A model trained so keeps its choices when a scheme quantises it, and stays a bf16 model: the
exported weights are the unquantised ones, and in eval mode the layers are plain.

`QuantNoise.attach` puts noisy forms in place of the target layers; they share the original parameters (same names,
same tensors), so optimiser state, checkpoints and the export are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import Linear
from ..layers.mlp import glu_activation
from ..layers.moe import Experts
from ..layers.quantized import MXScheme, Quantization, is_dense_target, replace_module
from ..ops.mx import ScaleMode, fake_quantize_mx


def straight_through(x: torch.Tensor, fmt, mode: ScaleMode) -> torch.Tensor:
    """x's fake-quantised values forward, the identity backward."""
    return x + (fake_quantize_mx(x.detach(), fmt, mode) - x).detach()


def _noisy_linear(x: torch.Tensor, weight: torch.Tensor, scheme: MXScheme) -> torch.Tensor:
    """What an MX linear of `scheme` computes (weights FLOOR-scaled, inputs per the scheme), straight through."""
    w = straight_through(weight, scheme.weight, ScaleMode.FLOOR)
    if scheme.act is not None:
        x = straight_through(x, scheme.act, scheme.act_mode)
    return F.linear(x, w)


def _sharing(cls, module: nn.Module, attributes: tuple[str, ...], scheme: MXScheme):
    """An instance of `cls` (a noisy form) holding `module`'s `attributes`, its parameters themselves in its order
    (so state_dict keys keep theirs), and `scheme`."""
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    for name in attributes:
        setattr(m, name, getattr(module, name))
    m.scheme = scheme
    return m


class NoisyLinear(Linear):
    """A dense target linear that, when `noisy` and training, computes as its MX form would."""

    scheme: MXScheme
    noisy: bool = False

    @classmethod
    def of(cls, linear: Linear, scheme: MXScheme) -> "NoisyLinear":
        return _sharing(cls, linear, ("in_features", "out_features", "weight", "bias"), scheme)

    def forward(self, x):
        if self.noisy and self.training:
            return _noisy_linear(x, self.weight, self.scheme)
        return F.linear(x, self.weight)


class NoisyExperts(Experts):
    """Routed experts that, when `noisy` and training, compute as their MX form would (each expert's three products,
    the down projection's input quantised too)."""

    scheme: MXScheme
    noisy: bool = False

    @classmethod
    def of(cls, experts: Experts, scheme: MXScheme) -> "NoisyExperts":
        return _sharing(cls, experts, ("config", "w1", "w3", "w2"), scheme)

    def run_expert(self, e: int, xe: torch.Tensor) -> torch.Tensor:
        if not (self.noisy and self.training):
            return super().run_expert(e, xe)
        s = self.scheme
        hidden = glu_activation(self.config, _noisy_linear(xe, self.w1[e], s), _noisy_linear(xe, self.w3[e], s))
        return _noisy_linear(hidden, self.w2[e], s)


class QuantNoise:
    """The noisy forms of a model's quantisation targets under `quantization`, and each step's draw of which are on
    (`draw`, from its own seeded generator, so the data order does not depend on it)."""

    def __init__(self, layers: list[NoisyLinear | NoisyExperts], p: float, seed: int):
        self.layers, self.p = layers, p
        self.gen = torch.Generator().manual_seed(seed)

    @classmethod
    def attach(cls, model: nn.Module, quantization: Quantization, p: float, seed: int) -> "QuantNoise":
        layers = []
        for path, module in list(model.named_modules()):
            new = None
            if quantization.dense is not None and type(module) is Linear and is_dense_target(path, module.in_features):
                new = NoisyLinear.of(module, quantization.dense)
            elif quantization.experts is not None and type(module) is Experts:
                new = NoisyExperts.of(module, quantization.experts)
            if new is not None:
                replace_module(model, path, new)
                layers.append(new)
        return cls(layers, p, seed)

    def draw(self) -> int:
        """Turn each layer's noise on with probability p for the next step; the number turned on."""
        on = (torch.rand(len(self.layers), generator=self.gen) < self.p).tolist()
        for layer, noisy in zip(self.layers, on):
            layer.noisy = noisy
        return sum(on)
