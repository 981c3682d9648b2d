"""The native backend: the model on the native CPU kernels (docs/architecture.md "How the model runs").

At load, the leaf modules whose weights the kernels take get their native forms (modules.py). Each step of a kind
the programs take (program.py: a step over the paged caches of at most `BLOCK_MAX_ROWS` rows) runs as that kind's
program of fused blocks (blocks.py), with the modules of the sub-blocks the blocks cannot take in between; any other
step (a plain forward without a cache, a longer step) runs the modules, on their native forms. On a rank of a
tensor-parallel group a block writes the rank's partial output, all-reduced between the native segments before the
residual add (program.py); blocks that need the other ranks inside the kernel run the modules (docs/parallel.md).
"""

from __future__ import annotations

import torch

from ...layers.batch import StepBatch
from ...models.decoder import Eager
from ...ops.opset import get_ops
from .. import Backend, adopt
from .modules import NATIVE_FORMS, kernels_take
from .program import Programs, SingleLayer


class NativeBackend(Backend):
    def __init__(self, reason: str):
        super().__init__("native", reason, get_ops("native"))
        self.programs = Programs()
        self.layer_programs: dict[int, tuple[SingleLayer, Programs]] = {}  # per layer run by `run_block`

    def prepare(self, model: torch.nn.Module) -> str:
        dtype = model.embed_tokens.weight.dtype  # MX modules hold no float weights: the model's dtype decides
        changed = adopt(model, NATIVE_FORMS, lambda module: kernels_take(module, dtype))
        ranks = f" (rank {model.shard.rank} of {model.shard.size})" if model.shard.size > 1 else ""
        return f"native forms for {changed} modules{ranks}"

    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        h = model.embed(input_ids, batch)
        out = self.programs.run(model, h, batch)
        return out if out is not None else model.run_layers(h, Eager(batch))

    def run_block(self, layer: torch.nn.Module, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The layer as a program of its own (the MTP block's MLA and FFN blocks on the steps they take)."""
        stack, programs = self.layer_programs.setdefault(id(layer), (SingleLayer(layer), Programs()))
        out = programs.run(stack, h, batch)
        return out if out is not None else layer(h, batch)

