"""Choosing the backend, once, at load (docs/architecture.md "How the model runs")."""

from __future__ import annotations

from ..errors import ConfigError
from ..ops.native import native_choice, native_library
from . import Backend
from .native import NativeBackend
from .torch_backend import TorchBackend


def select_backend(name: str, ops: str, tensor_parallel_size: int = 1) -> Backend:
    """The backend for `--backend name` ("auto", "torch" or "native") and `--ops ops`, with the reason it was
    chosen. `--ops reference` runs on torch; auto takes native where `ops/native.py native_choice` says the kernels
    suit this CPU. Raises ConfigError for native when the kernels did not build, or with the reference ops. Over a
    tensor-parallel group the modules run (the native programs do not all-reduce between their blocks)."""
    if tensor_parallel_size > 1:
        if name == "native":
            raise ConfigError("--backend native does not run tensor parallel yet; use --backend torch or auto")
        return TorchBackend("reference" if ops == "reference" else "fast",
                            f"tensor parallel over {tensor_parallel_size} ranks: the modules, which all-reduce")
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
