"""What a loaded engine core is: the facts the server's start-up banner shows (docs/serving.md §13).

`EngineSummary` holds plain values only (strings and ints), so the engine-core process can send it to the API
process inside its Ready message (server/messages.py) and the API process needs neither the model nor torch to
print it. `EngineCore.summary()` fills it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..layers.quantized import E2M1, MXExperts, MXLinear, MXScheme

_ATTN_NAMES = {"kda": "KDA", "mla": "MLA", "dsa": "DSA"}


@dataclass
class EngineSummary:
    model_path: str
    family: str  # config.json model_type, e.g. kimi_k3
    architecture: str  # config.json architectures[0], or "" when it names none
    layers: str  # e.g. "6 layers: 4 KDA, 2 DSA; 5 MoE (16 experts, top-2)"
    dtype: str  # "float32" or "bfloat16"
    dtype_reason: str  # where it came from (engine/config.py resolve_dtype)
    backend: str
    backend_reason: str
    backend_prepared: str  # what the backend did to the loaded model (Backend.prepare)
    ops: str
    quantization: str  # MX layers and where they came from, or "none"
    kv_cache_dtype: str  # the MLA latent pages' value type
    weight_bytes: int  # the weights as loaded, each storage once
    weight_bytes_by_format: dict[str, int]  # the same bytes split as weight_bytes_by_format says
    kv_cache_memory: int  # the budget split below
    num_pages: int
    block_size: int
    page_bytes: int  # one page of every MLA/DSA layer's latent and indexer rows
    num_state_slots: int  # KDA working slots, one per running sequence
    num_checkpoints: int  # KDA state checkpoints of the prefix cache
    state_slot_bytes: int  # one slot (or checkpoint) of every KDA layer's state
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefix_caching: bool


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, a tensor shared by several modules (tied weights) once."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def weight_format(t: torch.Tensor) -> str:
    """The name a plain tensor's bytes are reported under: its dtype ("bfloat16", "float32", ...)."""
    return str(t.dtype).removeprefix("torch.")


def weight_bytes_by_format(model: torch.nn.Module) -> dict[str, int]:
    """weight_bytes split by storage format: every tensor an MXLinear or MXExperts holds (elements and scales,
    whatever the buffers are named: a backend may substitute subclasses with their own layout) under "MXFP4" or
    "MXFP8" by its scheme's weight elements, every other parameter and buffer under its dtype name. Tensors are
    taken in weight_bytes' order and deduplicated by the same rule, so the values sum to weight_bytes(model)."""
    mx = {id(t): "MXFP4" if m.scheme.weight is E2M1 else "MXFP8"
          for m in model.modules() if isinstance(m, (MXLinear, MXExperts)) for t in (*m.parameters(), *m.buffers())}
    seen, out = set(), Counter()
    for t in (*model.parameters(), *model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[mx.get(id(t)) or weight_format(t)] += t.numel() * t.element_size()
    return dict(out)


def layer_mix(config: ModelConfig) -> str:
    """The decoder stack in a few words: attention kinds, and the MoE layers with their routing."""
    kinds = Counter(config.attn_kind(layer) for layer in range(config.num_layers))
    text = f"{config.num_layers} layers: " + ", ".join(f"{n} {_ATTN_NAMES[k]}" for k, n in kinds.items())
    moe = sum(config.ffn_kind(layer) == "moe" for layer in range(config.num_layers))
    if moe:
        text += f"; {moe} MoE ({config.num_experts} experts, top-{config.num_experts_per_token})"
    return text


def _scheme_name(scheme: MXScheme) -> str:
    bits, fmt = (4, "MXFP4") if scheme.weight is E2M1 else (8, "MXFP8")
    return f"W{bits}A{8 if scheme.act is not None else 16} {fmt}"


def quantization_text(model: torch.nn.Module, config: ModelConfig, requested: str | None) -> str:
    """The MX layers of the loaded model by scheme, and whether the checkpoint stored them or `--quantization`
    made them at load; "none" without any."""
    kinds = Counter(_scheme_name(m.scheme) for m in model.modules() if isinstance(m, (MXLinear, MXExperts)))
    if not kinds:
        return "none"
    sources = (["stored in the checkpoint"] if config.quantization_config else []) + (
        [f"--quantization {requested} at load"] if requested else [])
    return ", ".join(f"{n} {kind} modules" for kind, n in kinds.items()) + f" ({'; '.join(sources)})"
