"""Choosing the backend, once, at load (docs/architecture.md "How the model runs")."""

from __future__ import annotations

from ..errors import ConfigError
from ..ops.native import native_choice, native_library
from . import Backend
from .native import NativeBackend
from .torch_backend import TorchBackend


def select_backend(name: str, ops: str) -> Backend:
    """The backend for `--backend name` ("auto", "torch" or "native") and `--ops ops`, with the reason it was
    chosen. `--ops reference` runs on torch; auto takes native where `ops/native.py native_choice` says the kernels
    suit this CPU. Raises ConfigError for native when the kernels did not build, or with the reference ops. Over a
    tensor-parallel group the native backend runs its modules' native forms, never its programs (their fused blocks
    do not stop for the all-reduces)."""
    if ops == "reference":
        if name == "native":
            raise ConfigError("--ops reference runs on the torch backend; it cannot run with --backend native")
        return TorchBackend("reference", "--ops reference: every op's readable reference")
    if name == "torch":
        return TorchBackend("fast", "--backend torch")
    usable, why = native_choice()
    if name == "native":
        if native_library() is None:
            raise ConfigError(f"--backend native: {why}")
        return NativeBackend(f"--backend native; {why}")
    return NativeBackend(f"auto: {why}") if usable else TorchBackend("fast", f"auto: {why}")
