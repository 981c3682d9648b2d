"""Parameter and memory accounting of a model built on the meta device (no weights are allocated)."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from ..config import ModelConfig
from ..distributed import ParallelConfig, component, local_shape, split_dim
from ..models.registry import model_class

_FP32 = ("A_log", "dt_bias", "_conv1d.weight", "e_score_correction_bias")
MXFP4_BYTES_PER_PARAM = 0.5 + 1 / 32  # E2M1 element + one E8M0 scale per 32


def _routed_mxfp4(config: ModelConfig) -> bool:
    q = config.quantization_config or {}
    return q.get("format") == "mxfp4-pack-quantized"


def _bytes_per_param(name: str, config: ModelConfig) -> float:
    if name.endswith(("experts.w1", "experts.w2", "experts.w3")) and _routed_mxfp4(config):
        return MXFP4_BYTES_PER_PARAM
    return 4 if name.endswith(_FP32) else 2


def account_ranks(config: ModelConfig, parallel: ParallelConfig) -> dict:
    """Weight bytes each rank holds under `parallel`, by component (the sharding rules the loader reads: split
    parts and replicated tensors apart), and each rank's cache: MLA latent and indexer keys per token (every rank
    holds them whole: the latent is shared by all heads) and KDA state per sequence (its heads' share). Every rank
    holds the same bytes: the rules cut into equal parts."""
    with torch.device("meta"):
        model = model_class(config)(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    parallel.check(config, shapes)
    n = parallel.world_size
    parts: dict[str, dict[str, float]] = defaultdict(lambda: {"total": 0.0, "split": 0.0, "replicated": 0.0})
    for name, shape in shapes.items():
        per_param = _bytes_per_param(name, config)
        dim = split_dim(name, parallel)
        whole = math.prod(shape) * per_param
        part = parts[component(name, config)]
        part["total"] += whole
        part["split" if dim is not None else "replicated"] += math.prod(local_shape(shape, dim, n)) * per_param
    single = account(config)
    kda = single["kda_recurrent_bytes_per_seq"] + single["kda_conv_bytes_per_seq"]
    return {
        "tensor_parallel_size": n,
        "enable_expert_parallel": parallel.enable_expert_parallel,
        "components": {k: {kind: int(v) for kind, v in part.items()} for k, part in sorted(parts.items())},
        "rank_weight_bytes": int(sum(p["split"] + p["replicated"] for p in parts.values())),
        "total_weight_bytes": int(sum(p["total"] for p in parts.values())),
        "rank_cache_bytes_per_token": single["mla_latent_bytes_per_token"] + single["indexer_key_bytes_per_token"],
        "rank_kda_state_bytes_per_seq": kda // n,
    }


def format_rank_accounting(name: str, a: dict) -> str:
    gib = 1 << 30
    n = a["tensor_parallel_size"]
    layout = f"tensor parallel {n}" + (", routed experts placed whole (expert parallel)"
                                      if a["enable_expert_parallel"] else ", routed experts split in width")
    lines = [f"{name} over {n} ranks ({layout}): each rank holds {a['rank_weight_bytes']:,} weight bytes "
             f"({a['rank_weight_bytes'] / gib:.2f} GiB) of {a['total_weight_bytes']:,} "
             f"({a['total_weight_bytes'] / gib:.2f} GiB; total / {n} = {a['total_weight_bytes'] / n / gib:.2f} GiB)"]
    width = max(map(len, a["components"]))
    for comp, p in a["components"].items():
        rank = p["split"] + p["replicated"]
        lines.append(f"  {comp:<{width}}  {rank / gib:10.3f} GiB a rank ({p['split'] / gib:.3f} split + "
                     f"{p['replicated'] / gib:.3f} replicated) of {p['total'] / gib:.3f} GiB")
    lines.append(f"  cache a rank per token: {a['rank_cache_bytes_per_token']:,} B (MLA latent + indexer keys, whole "
                 f"on every rank); KDA state a rank per sequence: {a['rank_kda_state_bytes_per_seq']:,} B")
    return "\n".join(lines)


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
