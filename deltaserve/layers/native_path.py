"""Which modules take the native small-batch kernels (`ops/native.py`) and when.

`enable_native_kernels` switches `native` on for every module that has the switch and bf16 CPU weights, once the
kernels have built. Linears take the 4-row dot tiles up to `LINEAR_MAX_ROWS` rows and the column-packed product
above (`ops/native.py` linear_columns: faster than oneDNN's packed product from just above `LINEAR_MAX_ROWS` to
a few hundred rows and close to it at the largest prefill chunks, so one packed copy serves every size; with AMX
it runs on the tile unit, level with oneDNN's AMX product over the middle sizes, behind it only at the largest,
and well ahead of the AVX512 pair products); dense MLPs take the fused expert kernel at every size, on their
linears' row packs up to `MLP_MAX_ROWS` tokens and their column packs above (bit for bit the linears' column
products around the torch activation). Routed experts take the fused kernel at every size: each expert sees only
a share of the tokens, and one call over all of them beats the per-expert oneDNN dispatch at every size, from one
token to a long prefill chunk.
"""

from __future__ import annotations

import torch

from ..ops.native import native_usable
from ..ops.native_contract import LINEAR_MAX_ROWS, MLP_MAX_ROWS

# The fused blocks (layers/fused_blocks.py) and the decode stack take steps of up to this many rows (KDA and FFN
# blocks any step's rows, MLA blocks and the stack decode steps): above LINEAR_MAX_ROWS their products read the
# column packs, as the modules do. The bound is high because the Python and torch glue between the kernels is a
# sizeable share of a step at many rows too (a decode step of 32 sequences, a prefill chunk), not only at a few;
# it caps a block's scratch (~25 KiB a row on kimi-linear-small's KDA block).
BLOCK_MAX_ROWS = 8192

__all__ = ["BLOCK_MAX_ROWS", "LINEAR_MAX_ROWS", "MLP_MAX_ROWS", "takes_native", "enable_native_kernels",
           "switch_modules"]


def takes_native(x: torch.Tensor, max_rows: int | None) -> bool:
    """x is a bf16 [rows, K] matrix with contiguous rows and at most max_rows rows (None: any number)."""
    return (x.dim() == 2 and (max_rows is None or x.shape[0] <= max_rows) and x.dtype == torch.bfloat16
            and x.stride(1) == 1)


def enable_native_kernels(model: torch.nn.Module) -> int:
    """Switch on `native` in every module that has it and whose weights the kernels take (modules with a `pack_now`,
    the experts, pack at once); returns how many."""
    return switch_modules(model, "native", native_usable)


def switch_modules(model: torch.nn.Module, switch: str, supported) -> int:
    """Set the boolean attribute `switch` on every module that has it and whose weights `supported(dtype, device)`
    accepts; a module with a `pack_now` packs at once. Returns how many modules were switched (shared with
    `prepack.enable_prepacking`)."""
    switched = 0
    for module in model.modules():
        if hasattr(module, switch) and supported(module.packable_dtype(), module.packable_device()):
            setattr(module, switch, True)
            if hasattr(module, "pack_now"):
                module.pack_now()
            switched += 1
    return switched
