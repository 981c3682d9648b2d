"""Checkpoint presets for `deltaserve make-model`: config.json dicts in each family's real layout.

Tiny and small presets are scale models of K3.1 Pro: KDA heads == MLA heads, MLA every 4th layer plus the last,
expert and latent widths multiples of 32 (MXFP4 packing applies), every K3 config key present with a real value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    config: dict  # config.json as written
    tokenizer_family: str  # for deltaserve.tools.tokenizer_files
    num_bpe_ranks: int
    dtype: str = "bfloat16"
    media_proc_cfg: dict | None = None  # preprocessor_config.json's, for a preset with a vision tower


# compressed-tensors block of the released checkpoints: routed experts only, E2M1 + E8M0 per 32 (docs/ops.md §8).
MXFP4_EXPERTS_QUANT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {"format": "mxfp4-pack-quantized",
                                  "targets": ["re:.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$"],
                                  "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                              "strategy": "group", "scale_dtype": "torch.uint8"}}},
}


def _mla_every_4th(num_layers: int) -> list[int]:
    """1-based MLA layers: every 4th, and always the last (as in every released Kimi hybrid)."""
    return sorted({l for l in range(4, num_layers + 1, 4)} | {num_layers})


def k3_text_config(*, hidden: int, layers: int, heads: int, head_dim: int, q_lora: int, kv_lora: int,
                   nope: int, rope: int, v: int, dense_width: int, experts: int, top_k: int, shared: int,
                   expert_width: int, latent: int, block: int, vocab: int, mtp: int, max_len: int,
                   num_bpe: int) -> dict:
    mla = _mla_every_4th(layers)
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "intermediate_size": dense_width,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": max_len,
        "model_max_length": max_len,
        "tie_word_embeddings": False,
        "q_lora_rank": q_lora,
        "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": experts,
        "num_experts_per_token": top_k,
        "num_shared_experts": shared,
        "moe_intermediate_size": expert_width,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": mtp,
        "linear_attn_config": {
            "kda_layers": [l for l in range(1, layers + 1) if l not in mla],
            "full_attn_layers": mla,
            "num_heads": heads,
            "head_dim": head_dim,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
        "attn_res_block_size": block,
        "routed_expert_hidden_size": latent,
        "latent_moe_use_norm": True,
        "bos_token_id": num_bpe,  # [BOS]
        "eos_token_id": num_bpe + 2,  # <|end_of_msg|>
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }


def k3_config(text: dict, *, indexer: dict | None, num_bpe: int) -> dict:
    """Top-level kimi_k3 config; `indexer` = (heads, head_dim, topk) makes it K3.1 Pro."""
    text = dict(text)
    arch = "KimiK3ForConditionalGeneration"
    if indexer is not None:
        arch = "KimiK31ForConditionalGeneration"
        text["dsa_config"] = {
            "index_n_heads": indexer["heads"],
            "index_head_dim": indexer["head_dim"],
            "index_topk": indexer["topk"],
            "dsa_layers": text["linear_attn_config"]["full_attn_layers"],
        }
    return {
        "model_type": "kimi_k3",
        "architectures": [arch],
        "text_config": text,
        "vision_config": {"model_type": "kimi_k3_vision", "text_hidden_size": text["hidden_size"]},
        "media_placeholder_token_id": num_bpe + 21,  # <|media_pad|>
        "image_placeholder": "<|kimi_image_placeholder|>",
        "pad_token_id": 0,
        "ignore_index": -100,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


_TINY = dict(hidden=64, layers=8, heads=4, head_dim=16, q_lora=32, kv_lora=32, nope=16, rope=8, v=16,
             dense_width=96, experts=8, top_k=2, shared=2, expert_width=32, latent=32, block=3, mtp=1,
             max_len=4096)
_TINY_BPE = 768
_SMALL = dict(hidden=1024, layers=16, heads=8, head_dim=128, q_lora=384, kv_lora=512, nope=128, rope=64, v=128,
              dense_width=2048, experts=128, top_k=4, shared=1, expert_width=256, latent=512, block=4, mtp=1,
              max_len=131072)
_SMALL_BPE = 32000 - 256
# The shipped default model (deltaserve/data/default_model), trained by deltaserve.tools.train on the stdlib.
_STDLIB = dict(hidden=192, layers=6, heads=4, head_dim=64, q_lora=128, kv_lora=128, nope=32, rope=32, v=64,
               dense_width=576, experts=16, top_k=2, shared=1, expert_width=256, latent=128, block=3, mtp=1,
               max_len=4096)
_STDLIB_BPE = 4096 - 256
_PRO = dict(hidden=7168, layers=93, heads=96, head_dim=128, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128,
            dense_width=33792, experts=896, top_k=16, shared=2, expert_width=3072, latent=3584, block=12, mtp=1,
            max_len=1048576)
_PRO_BPE = 163584


def _kimi_linear_tiny() -> dict:
    layers, num_bpe = 4, _TINY_BPE
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": num_bpe + 256,
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 96,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "model_max_length": 4096,
        "tie_word_embeddings": False,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "num_expert_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 4, "head_dim": 16,
                               "short_conv_kernel_size": 4},
        "bos_token_id": num_bpe,
        "eos_token_id": num_bpe + 2,  # <|im_end|>
        "pad_token_id": num_bpe + 255,
        "torch_dtype": "bfloat16",
    }


def _kimi_linear_small() -> dict:
    """The anchor checkpoint of BENCHMARKS.md ("Workloads and rules") (913.5M total, 173M active parameters): the same
    kimi_linear layout as kimi-linear-tiny at benchmark size, so transformers, llama.cpp and deltaserve share weights."""
    layers, num_bpe = 16, _SMALL_BPE
    config = _kimi_linear_tiny()
    config.update({
        "vocab_size": num_bpe + 256, "hidden_size": 1024, "num_hidden_layers": layers, "num_attention_heads": 8,
        "num_key_value_heads": 8, "intermediate_size": 2048, "model_max_length": 131072, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts": 64,
        "num_experts_per_token": 4, "moe_intermediate_size": 256,
        "linear_attn_config": {"kda_layers": [l for l in range(1, layers + 1) if l % 4],
                               "full_attn_layers": list(range(4, layers + 1, 4)), "num_heads": 8, "head_dim": 128,
                               "short_conv_kernel_size": 4},
        "bos_token_id": num_bpe, "eos_token_id": num_bpe + 2, "pad_token_id": num_bpe + 255,
    })
    return config


def _k3(dims: dict, num_bpe: int, indexer: dict | None, mxfp4: bool = False, vision: dict | None = None) -> dict:
    text = k3_text_config(**dims, vocab=num_bpe + 256, num_bpe=num_bpe)
    if mxfp4:
        text["quantization_config"] = MXFP4_EXPERTS_QUANT_CONFIG
    config = k3_config(text, indexer=indexer, num_bpe=num_bpe)
    if vision is not None:
        config["vision_config"] = {**config["vision_config"], **vision}
    return config


# A MoonViT-V2 of the K3 shape at toy size: attention width (qkv 64) differs from the width (32) as in K3's.
_TINY_VISION = {"patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
                "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear", "vt_num_hidden_layers": 2,
                "vt_hidden_size": 32, "vt_num_attention_heads": 2, "qkv_hidden_size": 64, "vt_intermediate_size": 48,
                "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal",
                "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
                "norm_type": "rmsnorm", "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
                "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh"}
_TINY_MEDIA = {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 256, "patch_limit_on_one_side": 32,
               "fixed_output_tokens": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def _deepseek_v32(*, hidden: int, layers: int, heads: int, q_lora: int | None, kv_lora: int, nope: int, rope: int,
                  v: int, dense_width: int, experts: int, top_k: int, shared: int, expert_width: int, groups: int,
                  topk_groups: int, index_heads: int, index_dim: int, index_topk: int, max_len: int,
                  num_bpe: int) -> dict:
    """A deepseek_v32 config.json in transformers' DeepseekV32Config layout: MLA with RoPE + the lightning indexer
    (DSA) on every layer, first layer dense, sigmoid noaux_tc routing over expert groups."""
    return {
        "model_type": "deepseek_v32",
        "architectures": ["DeepseekV32ForCausalLM"],
        "vocab_size": num_bpe + 256,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": dense_width,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_len,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "q_lora_rank": q_lora,
        "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
        "n_routed_experts": experts,
        "num_experts_per_tok": top_k,
        "n_shared_experts": shared,
        "moe_intermediate_size": expert_width,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "routed_scaling_factor": 2.5,
        "n_group": groups,
        "topk_group": topk_groups,
        "first_k_dense_replace": 1,
        "index_n_heads": index_heads,
        "index_head_dim": index_dim,
        "index_topk": index_topk,
        "bos_token_id": num_bpe,  # [BOS] of the K2 table the deepseek tokenizer family reuses
        "eos_token_id": num_bpe + 2,  # <|im_end|>
        "pad_token_id": num_bpe + 255,
        "torch_dtype": "bfloat16",
    }


# deepseek_v32 at benchmark size: the anchor's widths (hidden 1024, 16 layers, 64 experts top-4 of width 256, vocab
# 32,000) with MLA + indexer on every layer, so transformers and deltaserve can be compared on the second family.
_DSV32_SMALL = dict(hidden=1024, layers=16, heads=8, q_lora=384, kv_lora=512, nope=128, rope=64, v=128,
                    dense_width=2048, experts=64, top_k=4, shared=1, expert_width=256, groups=8, topk_groups=4,
                    index_heads=16, index_dim=64, index_topk=512, max_len=131072, num_bpe=_SMALL_BPE)
_DSV32_TINY = dict(hidden=64, layers=3, heads=4, q_lora=48, kv_lora=32, nope=16, rope=8, v=16, dense_width=96,
                   experts=8, top_k=2, shared=1, expert_width=32, groups=4, topk_groups=2, index_heads=8, index_dim=64,
                   index_topk=16, max_len=4096, num_bpe=_TINY_BPE)


PRESETS: dict[str, Preset] = {
    "k31-tiny": Preset("k31-tiny", _k3(_TINY, _TINY_BPE, {"heads": 8, "head_dim": 16, "topk": 16}), "kimi_k3",
                       _TINY_BPE),
    "k3-tiny": Preset("k3-tiny", _k3(_TINY, _TINY_BPE, None), "kimi_k3", _TINY_BPE),
    "k3-tiny-vision": Preset("k3-tiny-vision", _k3(_TINY, _TINY_BPE, None, vision=_TINY_VISION), "kimi_k3",
                             _TINY_BPE, media_proc_cfg=_TINY_MEDIA),
    "kimi-linear-tiny": Preset("kimi-linear-tiny", _kimi_linear_tiny(), "kimi_linear", _TINY_BPE),
    "k31-stdlib": Preset("k31-stdlib", _k3(_STDLIB, _STDLIB_BPE, {"heads": 8, "head_dim": 32, "topk": 128}),
                         "kimi_k3", _STDLIB_BPE),
    "k31-small": Preset("k31-small", _k3(_SMALL, _SMALL_BPE, {"heads": 16, "head_dim": 64, "topk": 512}), "kimi_k3",
                        _SMALL_BPE),
    "k31-pro": Preset("k31-pro", _k3(_PRO, _PRO_BPE, {"heads": 32, "head_dim": 128, "topk": 2048}, mxfp4=True), "kimi_k3",
                      _PRO_BPE),
    "kimi-linear-small": Preset("kimi-linear-small", _kimi_linear_small(), "kimi_linear", _SMALL_BPE),
    "deepseek-v32-small": Preset("deepseek-v32-small", _deepseek_v32(**_DSV32_SMALL), "deepseek", _SMALL_BPE),
    "deepseek-v32-tiny": Preset("deepseek-v32-tiny", _deepseek_v32(**_DSV32_TINY), "deepseek", _TINY_BPE),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
