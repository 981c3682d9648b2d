"""Parameter and memory accounting of a model built on the meta device (no weights are allocated)."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..config import ModelConfig
from ..models.registry import model_class

_FP32 = ("A_log", "dt_bias", "_conv1d.weight", "e_score_correction_bias")
MXFP4_BYTES_PER_PARAM = 0.5 + 1 / 32  # E2M1 element + one E8M0 scale per 32


def _routed_mxfp4(config: ModelConfig) -> bool:
    q = config.quantization_config or {}
    return q.get("format") == "mxfp4-pack-quantized"


def account(config: ModelConfig) -> dict:
    """Totals for the main model (MTP reported apart), active parameters per token, weight bytes by storage
    format, cache bytes per token and KDA state bytes per sequence."""
    with torch.device("meta"):
        model = model_class(config)(config)
    counts: dict[str, int] = defaultdict(int)
    bytes_by_format: dict[str, int] = defaultdict(int)
    for name, p in model.named_parameters():
        n = p.numel()
        if name.startswith("mtp."):
            counts["mtp"] += n
            continue
        if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            counts["routed"] += n
            fmt = "mxfp4" if _routed_mxfp4(config) else "bf16"
        else:
            counts["embedding" if name == "embed_tokens.weight" else "dense"] += n
            fmt = "fp32" if name.endswith(_FP32) else "bf16"
        bytes_by_format[fmt] += int(n * {"fp32": 4, "bf16": 2, "mxfp4": MXFP4_BYTES_PER_PARAM}[fmt])
    moe_layers = sum(config.ffn_kind(l) == "moe" for l in range(config.num_layers))
    per_expert = 3 * config.moe_intermediate_size * (config.routed_expert_hidden_size or config.hidden_size)
    active_routed = moe_layers * config.num_experts_per_token * per_expert if config.num_experts else 0
    mla = len(config.mla_layers)
    kda = len(config.kda_layers)
    latent_bytes = mla * (config.kv_lora_rank + config.qk_rope_head_dim) * 2
    index_bytes = len(config.dsa_layers) * config.index_head_dim * 2
    rec = kda * config.kda_num_heads * config.kda_head_dim * config.kda_head_dim * 4
    conv = kda * 3 * config.kda_dim * (config.kda_conv_size - 1) * 4
    return {
        "total_params": counts["embedding"] + counts["dense"] + counts["routed"],
        "active_params": counts["dense"] + active_routed,
        "embedding_params": counts["embedding"],
        "non_routed_params": counts["dense"],
        "routed_params": counts["routed"],
        "routed_params_per_expert": per_expert,
        "moe_layers": moe_layers,
        "mtp_params": counts["mtp"],
        "weight_bytes": dict(bytes_by_format),
        "mla_latent_bytes_per_token": latent_bytes,
        "indexer_key_bytes_per_token": index_bytes,
        "kda_recurrent_bytes_per_seq": rec,
        "kda_conv_bytes_per_seq": conv,
    }


def format_accounting(name: str, a: dict) -> str:
    gib = 1 << 30
    lines = [
        f"{name}: {a['total_params']:,} parameters ({a['total_params'] / 1e12:.3f} T) total, "
        f"{a['active_params']:,} ({a['active_params'] / 1e9:.1f} B) active per token (without the embedding)",
        f"  embedding {a['embedding_params']:,}; non-routed {a['non_routed_params']:,}; routed experts "
        f"{a['routed_params']:,} ({a['moe_layers']} MoE layers, {a['routed_params_per_expert']:,} per expert); "
        f"MTP {a['mtp_params']:,}",
    ]
    for fmt, b in sorted(a["weight_bytes"].items()):
        lines.append(f"  weights {fmt}: {b:,} bytes ({b / gib:.2f} GiB)")
    lines.append(f"  cache per token: MLA latent {a['mla_latent_bytes_per_token']:,} B + indexer keys "
                 f"{a['indexer_key_bytes_per_token']:,} B (bf16)")
    lines.append(f"  KDA state per sequence: recurrent {a['kda_recurrent_bytes_per_seq']:,} B (fp32) + conv "
                 f"{a['kda_conv_bytes_per_seq']:,} B (fp32) = "
                 f"{(a['kda_recurrent_bytes_per_seq'] + a['kda_conv_bytes_per_seq']) / (1 << 20):.1f} MiB")
    return "\n".join(lines)
