"""Execution backends: how a loaded model runs, chosen once at load (docs/architecture.md "How the model runs").

The model (layers/, models/) is the readable torch forward of every family. A backend takes it as loaded and
decides how each step runs:
* `torch` (backends/torch_backend.py): the modules as written, with the fast or the reference op set, on any device;
* `native` (backends/native/): the native CPU kernels. Leaf modules whose weights the kernels take are replaced by
  forms that run them (backends/native/modules.py), and each kind of step runs as a program of fused native blocks
  for the layers the kernels take, the other layers' modules in between (backends/native/program.py).
`select_backend` (backends/select.py) picks one for `--backend auto|torch|native` and says why.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..layers.batch import StepBatch
from ..ops.opset import OpSet


class Backend:
    """Runs the steps of one loaded model. `name` and `reason` (why it was chosen) are logged and shown by /version;
    `ops` is the op set the runner hands the layers through each StepBatch."""

    def __init__(self, name: str, reason: str, ops: OpSet):
        self.name, self.reason, self.ops = name, reason, ops

    def prepare(self, model: torch.nn.Module) -> str:
        """Convert the loaded model for this backend, once, before its first step; returns a line for the log."""
        return ""

    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The pre-norm final hidden states [N, d] of the step's tokens (what `CausalLM.forward` returns)."""
        return model(input_ids, batch)

    def run_block(self, layer: torch.nn.Module, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """One ordinary pre-norm residual decoder layer outside the stack (an MTP layer's block, models/mtp.py) over
        `h` [N, d]: what `layer(h, batch)` returns."""
        return layer(h, batch)

    def describe(self) -> dict:
        return {"backend": self.name, "reason": self.reason, "ops": self.ops.name}


def adopt(model: torch.nn.Module, forms: dict[type, type], takes: Callable[[torch.nn.Module], bool]) -> int:
    """Give every module whose exact class is a key of `forms`, and that `takes` accepts, the class it maps to (a
    subclass that runs the same math another way), then `attach()` the state that class keeps. The module keeps its
    identity, parameters and state dict, except the MX forms, which keep their weights' bytes only in the kernels'
    order, under other buffer names (backends/native/modules.py); other variants (not an exact key class) are left
    alone. Returns how many modules changed."""
    changed = 0
    for module in list(model.modules()):
        form = forms.get(type(module))
        if form is not None and takes(module):
            module.__class__ = form
            module.attach()
            changed += 1
    return changed
