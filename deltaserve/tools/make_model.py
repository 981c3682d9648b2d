"""`deltaserve make-model`: write a seeded, randomly initialised checkpoint in the family's real file layout
(config.json, safetensors with the real tensor names, tiktoken.model, tokenizer_config.json, and the equivalent
tokenizer.json for Hugging Face tools), or, with `--meta`, build the model on the meta device and print its parameter
and memory accounting."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from ..models.registry import model_class
from ..ops.mx import quant_mxfp4
from .presets import MXFP4_EXPERTS_QUANT_CONFIG, Preset
from .tokenizer_files import write_tokenizer_files

FP32_LEAVES = ("A_log", "dt_bias", "_conv1d.weight", "e_score_correction_bias")


def build_random(config: ModelConfig, seed: int) -> torch.nn.Module:
    """The family's model with seeded weights scaled as in docs/oracles.md §3.1 (matrices ~ fan_in^-1/2, norms near 1),
    KDA decay parameters initialised as FLA does, so activations stay O(1) through the stack."""
    gen = torch.Generator().manual_seed(seed)
    model = model_class(config)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif leaf == "dt_bias":
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif leaf == "e_score_correction_bias":
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            elif "norm" in name and p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def checkpoint_tensors(model: torch.nn.Module, config: ModelConfig, dtype: torch.dtype,
                       mxfp4_experts: bool = False) -> dict[str, torch.Tensor]:
    """Internal parameters -> tensors under the family's real checkpoint names (inverse of models/weights.py)."""
    kimi = config.family in ("kimi_k3", "kimi_linear")
    prefix = "language_model." if config.family == "kimi_k3" else ""
    L = config.num_layers
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach()
        t = t.float() if name.endswith(FP32_LEAVES) else t.to(dtype)
        m = re.match(r"^mtp\.(\d+)\.(block\.)?(.*)$", name)
        if m:
            name = f"layers.{L + int(m.group(1))}.{m.group(3)}"
        name = re.sub(r"(self_attention_res|mlp_res|output_attn_res)\.(proj|norm)\.weight$", r"\1_\2.weight", name)
        lm = re.match(r"^layers\.(\d+)\.ffn\.(.*)$", name)
        if lm:
            layer, rest = int(lm.group(1)), lm.group(2)
            moe = config.ffn_kind(layer) == "moe"
            block = "block_sparse_moe" if (moe and kimi) else "mlp"
            if rest in ("experts.w1", "experts.w2", "experts.w3"):
                leaf = rest[-2:] if kimi else {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[rest[-2:]]
                for e in range(t.shape[0]):
                    key = f"{prefix}model.layers.{layer}.{block}.experts.{e}.{leaf}"
                    if mxfp4_experts:
                        packed, scale = quant_mxfp4(t[e])
                        out[f"{key}.weight_packed"], out[f"{key}.weight_scale"] = packed, scale
                    else:
                        out[f"{key}.weight"] = t[e].contiguous()
                continue
            name = f"layers.{layer}.{block}.{rest}"
        if name.endswith("self_attn.A_log"):
            t = _stored_a_log(t, config)
        full = f"{prefix}lm_head.weight" if name == "lm_head.weight" else f"{prefix}model.{name}"
        out[full] = t.contiguous()
    return out


def _stored_a_log(a_log: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """K3 stores a length-K vector whose first H entries are used (fill the rest with junk the loader must
    ignore); Kimi-Linear stores [1, 1, H, 1]."""
    if config.family == "kimi_k3":
        junk = torch.full((config.kda_head_dim - a_log.shape[0],), 7.0)
        return torch.cat([a_log, junk])
    return a_log.reshape(1, 1, -1, 1)


def write_checkpoint(preset: Preset, out: Path, seed: int = 0, dtype: str | None = None,
                     mxfp4_experts: bool = False, shard_bytes: int = 2 << 30) -> Path:
    """Write `preset` into folder `out` and return it."""
    raw = json.loads(json.dumps(preset.config))
    config = ModelConfig.from_dict(raw)
    if mxfp4_experts:
        if config.family != "kimi_k3" or config.is_k31:
            raise ValueError("--mxfp4-experts applies to K3 presets (routed experts of k3-*)")
        raw["text_config"]["quantization_config"] = MXFP4_EXPERTS_QUANT_CONFIG
    torch_dtype = torch.bfloat16 if (dtype or preset.dtype) in ("bfloat16", "bf16") else torch.float32
    model = build_random(config, seed)
    tensors = checkpoint_tensors(model, config, torch_dtype, mxfp4_experts)
    out.mkdir(parents=True, exist_ok=True)
    target = raw["text_config"] if "text_config" in raw else raw
    target["torch_dtype"] = "bfloat16" if torch_dtype == torch.bfloat16 else "float32"
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if preset.media_proc_cfg is not None:
        tensors |= _random_vision(raw, config.hidden_size, torch_dtype, seed)
        (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": preset.media_proc_cfg},
                                                                 indent=2) + "\n")
    _save_sharded(tensors, out, shard_bytes)
    write_tokenizer_files(out, preset.tokenizer_family, preset.num_bpe_ranks, seed=seed)
    return out


def _random_vision(raw: dict, text_hidden: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The vision tower's and projector's tensors under their checkpoint names, seeded (matrices ~ fan_in^-1/2,
    norms near 1, the position table ~ 0.2)."""
    from ..models.vision import VisionConfig, VisionModel

    gen = torch.Generator().manual_seed(seed + 1)
    model = VisionModel(VisionConfig.from_dict(raw["vision_config"], text_hidden))
    out = {}
    for name, p in model.named_parameters():
        if p.ndim == 1:
            value = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith("pos_emb.weight"):
            value = 0.2 * torch.randn(p.shape, generator=gen)
        else:
            value = torch.randn(p.shape, generator=gen) * p[0].numel() ** -0.5
        out[name] = value.to(dtype).contiguous()
    return out


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
