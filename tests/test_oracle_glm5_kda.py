"""The K3 lower-bound ("safe") KDA gate, checked as a whole KDA layer against transformers' glm5_next
(docs/oracles.md §3.5): same weights, same input, same output and the same state after a split."""

import json

import torch
from transformers.models.glm5_next import modeling_glm5_next as glm
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

from deltaserve.cache.sequence_cache import SequenceCache
from deltaserve.config import ModelConfig
from deltaserve.layers.batch import StepBatch
from deltaserve.layers.kda import KimiDeltaAttention
from deltaserve.tools.presets import get_preset
from oracle_utils import randomize_

HEADS, HEAD_DIM, HIDDEN = 2, 32, 64


def _oracle_layer() -> torch.nn.Module:
    cfg = Glm5NextTextConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        layer_types=["linear_attention", "deepseek_sparse_attention"] * 2,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], indexer_types=["full"] * 4,
        first_k_dense_replace=1,
        linear_attn_config={"num_heads": HEADS, "head_dim": HEAD_DIM, "short_conv_kernel_size": 4,
                            "gate_lower_bound": -5.0, "kda_layers": [0, 2], "full_attn_layers": [1, 3]},
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=0, v_head_dim=32, index_topk=8, index_n_heads=8, index_head_dim=32, index_kpool=4,
        index_kpool_always_select_tail=True, index_kpool_compress=True, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        scoring_func="sigmoid", topk_method="noaux_tc", swiglu_limit=1.0, hc_mult=4, hc_sinkhorn_iters=20,
        hc_eps=1e-6, mhc=True, rms_norm_eps=1e-5, num_nextn_predict_layers=0, attention_bias=False,
        hidden_act="silu", tie_word_embeddings=False, pad_token_id=0)
    cfg._attn_implementation = "eager"
    layer = glm.Glm5NextTextLinearAttention(cfg, 0).eval()
    randomize_(layer, seed=11)
    with torch.no_grad():
        layer.forget_gate.A_log.copy_(torch.empty(HEADS).uniform_(1, 16, generator=torch.Generator().manual_seed(2)).log())
    return layer


def _deltaserve_layer(oracle: torch.nn.Module) -> KimiDeltaAttention:
    raw = json.loads(json.dumps(get_preset("k3-tiny").config))
    text = raw["text_config"]
    text.update(hidden_size=HIDDEN, rms_norm_eps=1e-5)
    text["linear_attn_config"].update(num_heads=HEADS, head_dim=HEAD_DIM, use_full_rank_gate=False,
                                      gate_lower_bound=-5.0)
    config = ModelConfig.from_dict(raw)
    layer = KimiDeltaAttention(config, 0).eval()
    P = HEADS * HEAD_DIM
    src = dict(oracle.named_parameters())
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
            getattr(layer, name).weight.copy_(src[f"{name}.weight"])
        for name in ("f_a_proj", "f_b_proj"):
            getattr(layer, name).weight.copy_(src[f"forget_gate.{name}.weight"])
        layer.A_log.copy_(src["forget_gate.A_log"])
        layer.dt_bias.copy_(src["forget_gate.dt_bias"])
        layer.o_norm.weight.copy_(src["o_norm.weight"])
        for i, conv in enumerate((layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)):
            conv.weight.copy_(src["conv1d.weight"][i * P:(i + 1) * P])
    return layer


@torch.no_grad()
def test_kda_layer_with_lower_bound_gate_matches_glm5_next():
    oracle = _oracle_layer()
    mine = _deltaserve_layer(oracle)
    T = 70  # crosses one 64-token chunk boundary
    x = torch.randn(1, T, HIDDEN, generator=torch.Generator().manual_seed(5))
    want = oracle(x)[0]
    got = mine(x[0], StepBatch.single(T))
    assert (got - want).abs().max().item() <= 1e-5
    # the gate really is the lower-bound form: dropping it changes the layer
    mine.config.kda_gate_lower_bound = None
    assert (mine(x[0], StepBatch.single(T)) - want).abs().max().item() > 1e-3
    mine.config.kda_gate_lower_bound = -5.0
    # split at an arbitrary point with the carried conv window and recurrent state
    cache = SequenceCache(mine.config)
    seq = cache.new_sequence()
    first = mine(x[0, :23], StepBatch.single(23, 0, cache, seq))
    rest = mine(x[0, 23:], StepBatch.single(T - 23, 23, cache, seq))
    assert (torch.cat([first, rest]) - want).abs().max().item() <= 1e-5
