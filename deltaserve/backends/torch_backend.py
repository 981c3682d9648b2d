"""The torch backend: the model's own modules with the fast or the reference op set, on any torch device
(docs/architecture.md "How the model runs"). With the fast op set and bf16 CPU weights that oneDNN takes, the linears and routed experts
multiply with weights packed once for oneDNN (`backends/packs.py`): the same kernel as `F.linear`, bit for bit,
without reordering the weight on every call."""

from __future__ import annotations

import torch

from ..layers.linear import Linear
from ..layers.mlp import glu_activation
from ..layers.moe import Experts
from ..ops.opset import get_ops
from . import Backend, adopt
from .packs import PackedWeights, onednn_linear, prepack_supported


class PrepackedLinear(Linear):
    """A bf16 CPU Linear multiplying with its oneDNN pack."""

    def attach(self) -> None:
        self.packs = PackedWeights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packs.onednn([self.weight]))


class PrepackedExperts(Experts):
    """Routed experts each multiplying with oneDNN packs: gate and up stacked as one product, down on its own, all
    packed at load (an expert is first used whenever it is first routed to, so packing then would stall a step)."""

    def attach(self) -> None:
        self.packs = [(PackedWeights(), PackedWeights()) for _ in range(self.w1.shape[0])]
        for e, (gate_up, down) in enumerate(self.packs):
            gate_up.onednn([self.w1[e], self.w3[e]])
            down.onednn([self.w2[e]])

    def run_expert(self, e: int, xe: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.packs[e]
        y = onednn_linear(xe, gate_up.onednn([self.w1[e], self.w3[e]]))
        gate, up = (part.contiguous() for part in torch.split(y, self.w1.shape[1], dim=-1))
        return onednn_linear(glu_activation(self.config, gate, up), down.onednn([self.w2[e]]))


class TorchBackend(Backend):
    """The modules as written, with the op set `ops` ("fast" or "reference")."""

    def __init__(self, ops: str, reason: str):
        super().__init__("torch", reason, get_ops(ops))

    def prepare(self, model: torch.nn.Module) -> str:
        if self.ops.name != "fast":
            return "reference op set: the modules as written"
        packed = adopt(model, {Linear: PrepackedLinear, Experts: PrepackedExperts},
                       lambda m: prepack_supported(next(m.parameters()).dtype, next(m.parameters()).device))
        return f"fast op set; {packed} modules multiply with oneDNN packs"

