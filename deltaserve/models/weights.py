"""Checkpoint tensor names -> model parameters (docs/model.md §14, docs/oracles.md §3.2).

Every family's spellings are first brought to one canonical form (K3's names without the `language_model.model.`
prefix, MoE under `ffn.`), then mapped to a parameter and an optional expert index. Conversions (A_log narrowing,
[P, W] conv weights, transformers' fused tensors) happen here and nowhere else. MX tensors (`weight_packed`,
`weight_scale`, float8 `weight`) map to the same-named buffers of the MX layers (layers/quantized.py), and a routed
expert's `w1.weight_packed` / `w1.weight_scale` to row e of the stacked `experts.w1_packed` / `experts.w1_scale`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import ModelConfig

VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "vision_model.")
# Auxiliary tensors of compressed-tensors exports that carry no weights of their own.
_AUX_SUFFIXES = (".weight_shape", ".weight_global_scale")

_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|weight_packed|weight_scale)$")
_EXPERT_LEAF = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_RENAMES = [
    (re.compile(r"\.(block_sparse_moe|mlp)\."), ".ffn."),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
    (re.compile(r"(self_attention_res|mlp_res|output_attn_res)_(proj|norm)\.weight$"), r"\1.\2.weight"),
    (re.compile(r"(self_attention_res|mlp_res|output_attn_res)\.(proj|norm)_weight$"), r"\1.\2.weight"),
]
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


@dataclass
class Target:
    """Where one checkpoint tensor goes: `param` (internal name), an expert index for stacked experts, and a
    function turning the stored tensor into the parameter's layout."""

    param: str
    expert: int | None = None
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None


def canonical(name: str) -> str | None:
    """Strip family prefixes; None for tensors deltaserve does not load (vision tower, auxiliary tensors)."""
    if name.startswith(VISION_PREFIXES) or name.endswith(_AUX_SUFFIXES):
        return None
    for prefix in ("language_model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def targets(name: str, config: ModelConfig, shape: tuple[int, ...]) -> list[Target] | None:
    """Map a canonical checkpoint name to its parameter(s); [] means known but intentionally unused;
    None means unknown (the loader reports it as unexpected)."""
    m = re.match(r"^layers\.(\d+)\.(.*)$", name)
    if m and int(m.group(1)) >= config.num_layers:
        j, rest = int(m.group(1)) - config.num_layers, m.group(2)
        if j >= config.num_nextn_predict_layers:
            return None
        if rest == "embed_tokens.weight" or "_res." in rest:
            return []  # shared embedding / AttnRes vectors are not used by MTP blocks
        prefix = f"mtp.{j}." if rest.startswith(_MTP_OWN) else f"mtp.{j}.block."
        return _layer_targets(prefix + rest, rest, config, shape)
    if m:
        return _layer_targets(name, m.group(2), config, shape)
    return [Target(name)]


def _layer_targets(full: str, rest: str, config: ModelConfig, shape: tuple[int, ...]) -> list[Target]:
    e = _EXPERT.match(full)
    if e:
        stack, idx, leaf, kind = e.group(1), int(e.group(2)), e.group(3), e.group(4)
        suffix = {"weight": "", "weight_packed": "_packed", "weight_scale": "_scale"}[kind]
        return [Target(f"{stack}.{_EXPERT_LEAF.get(leaf, leaf)}{suffix}", idx)]
    if full.endswith(".ffn.experts.gate_up_proj"):  # transformers fused [E, 2I, d], gate rows first
        half = shape[1] // 2
        base = full[: -len("gate_up_proj")]
        return [Target(base + "w1", convert=lambda t: t[:, :half]), Target(base + "w3", convert=lambda t: t[:, half:])]
    if full.endswith(".ffn.experts.down_proj"):
        return [Target(full[: -len("down_proj")] + "w2")]
    if rest == "self_attn.conv1d.weight":  # transformers concatenates q|k|v convs
        P = shape[0] // 3
        base = full[: -len("conv1d.weight")]
        return [Target(f"{base}{n}_conv1d.weight", convert=lambda t, i=i: _conv_layout(t[i * P:(i + 1) * P]))
                for i, n in enumerate("qkv")]
    if rest.endswith("_conv1d.weight"):
        return [Target(full, convert=_conv_layout)]
    if rest == "self_attn.A_log":
        H = config.kda_num_heads
        return [Target(full, convert=lambda t: t.reshape(-1)[:H])]
    return [Target(full)]


def _conv_layout(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], 1, t.shape[-1])
