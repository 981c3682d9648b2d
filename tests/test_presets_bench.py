"""The deepseek_v32 benchmark presets: the config is what transformers' DeepseekV32Config takes, `make-model` writes
a checkpoint that transformers 5.23.0 loads without missing or unexpected weights, and deltaserve's logits match
transformers' in fp32 (on the tiny variant; `deepseek-v32-small` has the same layout at benchmark size)."""

from __future__ import annotations

import pytest
import torch

import deltaserve
from deltaserve.config import ModelConfig
from deltaserve.tools.presets import get_preset


def test_deepseek_v32_small_is_benchmark_sized():
    preset = get_preset("deepseek-v32-small")
    cfg = ModelConfig.from_dict(preset.config)
    assert cfg.family == "deepseek_v32" and cfg.num_layers == 16 and cfg.hidden_size == 1024
    assert cfg.dsa_layers == tuple(range(16)) and cfg.index_topk == 512 and cfg.index_n_heads == 16
    assert cfg.num_experts == 64 and cfg.num_experts_per_token == 4 and cfg.moe_intermediate_size == 256
    assert cfg.num_expert_group == 8 and cfg.topk_group == 4 and cfg.router_activation == "sigmoid"
    assert cfg.vocab_size == 32000 and not cfg.tie_word_embeddings


@pytest.mark.parametrize("name", ["deepseek-v32-small", "deepseek-v32-tiny"])
def test_deepseek_v32_presets_are_transformers_configs(name):
    from transformers import DeepseekV32Config

    raw = get_preset(name).config
    hf = DeepseekV32Config(**{k: v for k, v in raw.items() if k != "model_type"})
    for key in ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok", "n_group",
                "topk_group", "index_topk", "index_n_heads", "index_head_dim", "q_lora_rank", "kv_lora_rank"):
        assert getattr(hf, key) == raw[key], key


def test_deepseek_v32_tiny_matches_transformers(make_checkpoint):
    """fp32 checkpoint from make-model: transformers loads every tensor, logits over 24 tokens (> index_topk = 16,
    so the indexer selects) agree with deltaserve's reference path."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint("deepseek-v32-tiny", dtype="float32")
    hf, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager",
                                                    output_loading_info=True)
    assert type(hf).__name__ == "DeepseekV32ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, 768, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf.eval()(ids[None], position_ids=torch.arange(24)[None], use_cache=False).logits[0].float()
    ours = deltaserve.load_model(str(path), dtype="float32").reference_logits(ids).float()
    assert ref.abs().max() > 1.0
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4, f"max |dlogit| = {err:.3g}"
