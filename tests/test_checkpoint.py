"""make-model writes the real layout; the loader reads it back and names whatever is wrong with a bad one."""

import json
import logging
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import deltaserve
from deltaserve.config import ModelConfig
from deltaserve.errors import CheckpointError, ConfigError
from deltaserve.layers.batch import StepBatch
from deltaserve.tools.presets import get_preset


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_layout_of_a_k31_checkpoint(make_checkpoint):
    path = make_checkpoint("k31-tiny")
    assert {p.name for p in path.iterdir()} == {"config.json", "model.safetensors", "tiktoken.model",
                                                "tokenizer_config.json", "tokenizer.json"}
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["text_config"]["model_type"] == "kimi_linear"
    text = cfg["text_config"]
    for key in ("activation_situ_beta", "activation_situ_linear_beta", "mla_use_nope", "attn_res_block_size",
                "routed_expert_hidden_size", "latent_moe_use_norm", "mla_use_output_gate"):
        assert text[key] is not None, key
    assert text["linear_attn_config"]["num_heads"] == text["num_attention_heads"]
    assert text["moe_intermediate_size"] % 32 == 0 and text["routed_expert_hidden_size"] % 32 == 0
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice("language_model.model.layers.0.self_attn.A_log").get_shape() == [16]
        assert f.get_tensor("language_model.model.layers.0.self_attn.q_conv1d.weight").dtype == torch.float32
        assert f.get_tensor("language_model.model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16
    assert "language_model.lm_head.weight" in names
    assert "language_model.model.layers.3.self_attn.indexer.wq_b.weight" in names
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight" in names
    assert "language_model.model.layers.0.self_attention_res_proj.weight" in names
    assert "language_model.model.layers.8.eh_proj.weight" in names  # MTP at index L
    config = deltaserve.load_model(path).config
    assert config.is_k31 and config.dsa_layers == (3, 7) and config.attn_kind(0) == "kda"
    tok = deltaserve.load_tokenizer(path)
    assert tok.vocab_size == config.vocab_size
    assert tok.token_to_id("<|end_of_msg|>") == config.eos_token_ids[0]


def test_make_model_is_seeded_and_reproducible(tmp_path):
    from deltaserve.tools.make_model import write_checkpoint

    a = write_checkpoint(get_preset("kimi-linear-tiny"), tmp_path / "a", seed=5)
    b = write_checkpoint(get_preset("kimi-linear-tiny"), tmp_path / "b", seed=5)
    c = write_checkpoint(get_preset("kimi-linear-tiny"), tmp_path / "c", seed=6)
    for name in ("model.safetensors", "tiktoken.model", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_sharded_checkpoint_loads_like_a_single_file(make_checkpoint):
    single = make_checkpoint("k31-tiny")
    sharded = make_checkpoint("k31-tiny", shard_bytes=200_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    ids = torch.arange(20) * 7
    a = deltaserve.load_model(single).reference_logits(ids)
    b = deltaserve.load_model(sharded).reference_logits(ids)
    assert torch.equal(a, b)


def test_bfloat16_load_keeps_fp32_state_parameters(make_checkpoint):
    model = deltaserve.load_model(make_checkpoint("k31-tiny"), dtype="bfloat16")
    kda = model.layers[0].self_attn
    assert kda.q_proj.weight.dtype == torch.bfloat16
    assert kda.A_log.dtype == kda.dt_bias.dtype == kda.q_conv1d.weight.dtype == torch.float32
    assert model.layers[1].ffn.gate.e_score_correction_bias.dtype == torch.float32
    # Random tiny models are chaotic in bf16 as a whole (transformers' own Kimi-Linear gives cosine ~0.5 between
    # bf16 and fp32 logits on oracle-style random weights), so compare layer by layer on the same input.
    fp32 = deltaserve.load_model(make_checkpoint("k31-tiny"))
    batch = StepBatch.single(24)
    x = torch.randn(24, fp32.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for lo_layer, hi_layer in zip(model.layers, fp32.layers):
        for run in (lambda m, t: m.self_attn(t, batch), lambda m, t: m.ffn(t)):
            lo, hi = run(lo_layer, x.bfloat16()).float(), run(hi_layer, x)
            assert torch.nn.functional.cosine_similarity(lo, hi, dim=-1).min().item() > 0.995


def _decode_mxfp4_numpy(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Independent decoder: E2M1 = sign | 2-bit exponent | 1-bit mantissa, bias 1; E8M0 scale = 2^(s-127)."""
    def e2m1(code):
        sign = -1.0 if code & 8 else 1.0
        e, m = (code >> 1) & 3, code & 1
        return sign * (m * 0.5 if e == 0 else (1 + m * 0.5) * 2.0 ** (e - 1))

    lut = np.array([e2m1(c) for c in range(16)], dtype=np.float64)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return lut[codes] * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=1)


def test_mxfp4_experts_load_packed(make_checkpoint):
    dense_path = make_checkpoint("k3-tiny")
    mx_path = make_checkpoint("k3-tiny", mxfp4_experts=True)
    cfg = json.loads((mx_path / "config.json").read_text())
    assert cfg["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    with safe_open(mx_path / "model.safetensors", "pt") as f:
        key = "language_model.model.layers.2.block_sparse_moe.experts.3.w1"
        packed, scale = f.get_tensor(key + ".weight_packed"), f.get_tensor(key + ".weight_scale")
        assert packed.dtype == torch.uint8 and scale.shape[1] * 32 == packed.shape[1] * 2
        assert key + ".weight" not in f.keys()
    mx = deltaserve.load_model(mx_path)
    dense = deltaserve.load_model(dense_path)
    got = mx.layers[2].ffn.experts.expert_weight("w1", 3)  # kept packed; dequantised per call
    want = _decode_mxfp4_numpy(packed.numpy(), scale.numpy())
    assert np.array_equal(got.double().numpy(), want)
    ref = dense.layers[2].ffn.experts.w1[3]
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()).item()
    assert 15 < sqnr < 25  # E2M1 on gaussian weights is ~18.8 dB (docs/oracles.md §6)
    # everything that is not a routed expert is unquantised and identical
    assert torch.equal(mx.layers[2].ffn.routed_expert_down_proj.weight, dense.layers[2].ffn.routed_expert_down_proj.weight)


def test_missing_tensor_is_named(make_checkpoint, tmp_path):
    path = _copy(make_checkpoint("k3-tiny"), tmp_path / "m")
    name = "language_model.model.layers.2.self_attn.k_proj.weight"
    _edit_tensors(path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"layers\.2\.self_attn\.k_proj\.weight"):
        deltaserve.load_model(path)


def test_missing_expert_is_named(make_checkpoint, tmp_path):
    path = _copy(make_checkpoint("k3-tiny"), tmp_path / "m")
    _edit_tensors(path, lambda t: t.pop("language_model.model.layers.5.block_sparse_moe.experts.6.w3.weight"))
    with pytest.raises(CheckpointError, match=r"expert 6 .*layers\.5\..*experts\.w3"):
        deltaserve.load_model(path)


def test_misshaped_tensor_names_both_shapes(make_checkpoint, tmp_path):
    path = _copy(make_checkpoint("k3-tiny"), tmp_path / "m")
    name = "language_model.model.layers.3.self_attn.kv_b_proj.weight"
    _edit_tensors(path, lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight.*\[127, 32\].*\[128, 32\]"):
        deltaserve.load_model(path)


def test_unexpected_tensor_is_named(make_checkpoint, tmp_path):
    path = _copy(make_checkpoint("kimi-linear-tiny"), tmp_path / "m")
    _edit_tensors(path, lambda t: t.__setitem__("model.layers.1.self_attn.bogus.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.1\.self_attn\.bogus\.weight'"):
        deltaserve.load_model(path)


def test_removed_config_key_is_named(make_checkpoint, tmp_path):
    path = _copy(make_checkpoint("k3-tiny"), tmp_path / "m")
    _edit_config(path, lambda c: c["text_config"].pop("kv_lora_rank"))
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        deltaserve.load_model(path)


def test_k31_signals_must_agree(make_checkpoint, tmp_path):
    no_block = _copy(make_checkpoint("k31-tiny"), tmp_path / "a")
    _edit_config(no_block, lambda c: c["text_config"].pop("dsa_config"))
    with pytest.raises(ConfigError, match="indexer.*tensors but no dsa_config"):
        deltaserve.load_model(no_block)
    no_tensors = _copy(make_checkpoint("k3-tiny"), tmp_path / "b")
    _edit_config(no_tensors, lambda c: c["text_config"].__setitem__(
        "dsa_config", {"index_topk": 4, "dsa_layers": [4, 8], "index_n_heads": 8, "index_head_dim": 16}))
    with pytest.raises(ConfigError, match="dsa_config block but no self_attn.indexer"):
        deltaserve.load_model(no_tensors)


def test_checkpoint_without_mtp_warns_and_partial_mtp_fails(make_checkpoint, tmp_path, caplog):
    none = _copy(make_checkpoint("k3-tiny"), tmp_path / "none")
    _edit_tensors(none, lambda t: [t.pop(n) for n in list(t) if ".layers.8." in n])
    with caplog.at_level(logging.WARNING):
        model = deltaserve.load_model(none)
    assert not model.mtp_available and "MTP is unavailable" in caplog.text
    partial = _copy(make_checkpoint("k3-tiny"), tmp_path / "partial")
    _edit_tensors(partial, lambda t: t.pop("language_model.model.layers.8.eh_proj.weight"))
    with pytest.raises(CheckpointError, match=r"MTP layer is partly present.*eh_proj"):
        deltaserve.load_model(partial)
    full = deltaserve.load_model(make_checkpoint("k3-tiny"))
    assert full.mtp_available and len(full.mtp) == 1


def test_k3_text_loader_leaves_vision_tensors_to_the_vision_loader(make_checkpoint, tmp_path):
    """The text model loads as without them; the vision loader (models/vision.py) finds the tower incomplete."""
    from deltaserve.models.vision import load_vision

    path = _copy(make_checkpoint("k3-tiny"), tmp_path / "v")
    _edit_tensors(path, lambda t: t.update({"vision_tower.patch_embed.proj.weight": torch.zeros(1024, 3, 14, 14),
                                            "mm_projector.proj.0.weight": torch.zeros(4, 4)}))
    model = deltaserve.load_model(path)
    with pytest.raises(CheckpointError, match="vision tensor"):
        load_vision(path)
    ids = torch.arange(10)
    assert torch.equal(model.reference_logits(ids), deltaserve.load_model(make_checkpoint("k3-tiny")).reference_logits(ids))


def test_a_log_junk_beyond_the_heads_is_ignored(make_checkpoint, tmp_path):
    path = _copy(make_checkpoint("k3-tiny"), tmp_path / "a")
    name = "language_model.model.layers.0.self_attn.A_log"
    _edit_tensors(path, lambda t: t[name][4:].fill_(-30.0))
    ids = torch.arange(12) * 3
    base = deltaserve.load_model(make_checkpoint("k3-tiny"))
    assert torch.equal(deltaserve.load_model(path).reference_logits(ids), base.reference_logits(ids))


def test_tied_embeddings_without_lm_head(make_checkpoint, tmp_path):
    path = _copy(make_checkpoint("kimi-linear-tiny"), tmp_path / "t")
    _edit_tensors(path, lambda t: t.pop("lm_head.weight"))
    _edit_config(path, lambda c: c.__setitem__("tie_word_embeddings", True))
    model = deltaserve.load_model(path)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


def test_transformers_style_fused_tensors_load(make_checkpoint, tmp_path):
    """transformers' renames: forget_gate.*, concatenated conv1d, fused expert tensors (docs/oracles.md §3.2)."""
    path = _copy(make_checkpoint("kimi-linear-tiny"), tmp_path / "hf")

    def fuse(t):
        p = "model.layers.1."
        for leaf in ("f_a_proj.weight", "f_b_proj.weight", "A_log", "dt_bias"):
            t[p + "self_attn.forget_gate." + leaf] = t.pop(p + "self_attn." + leaf)
        t[p + "self_attn.conv1d.weight"] = torch.cat([t.pop(p + f"self_attn.{n}_conv1d.weight") for n in "qkv"])
        gate_up = [torch.cat([t.pop(p + f"block_sparse_moe.experts.{e}.w1.weight"),
                              t.pop(p + f"block_sparse_moe.experts.{e}.w3.weight")]) for e in range(8)]
        t[p + "mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        t[p + "mlp.experts.down_proj"] = torch.stack([t.pop(p + f"block_sparse_moe.experts.{e}.w2.weight")
                                                       for e in range(8)])

    _edit_tensors(path, fuse)
    ids = torch.arange(16) * 11
    want = deltaserve.load_model(make_checkpoint("kimi-linear-tiny")).reference_logits(ids)
    assert torch.equal(deltaserve.load_model(path).reference_logits(ids), want)


def test_dsa_config_spellings_and_refusals(make_checkpoint):
    base = get_preset("k31-tiny").config

    def cfg_with(block):
        c = json.loads(json.dumps(base))
        c["text_config"]["dsa_config"] = block
        return c

    ok = ModelConfig.from_dict(cfg_with({"topk": 5, "layers": [4, 8], "n_heads": 8, "head_dim": 16, "x": 1}))
    assert ok.index_topk == 5 and ok.dsa_layers == (3, 7) and ok.index_norm_eps == ok.rms_norm_eps
    with pytest.raises(ConfigError, match="index_topk"):
        ModelConfig.from_dict(cfg_with({"dsa_layers": [4, 8]}))
    with pytest.raises(ConfigError, match="use_rope"):
        ModelConfig.from_dict(cfg_with({"index_topk": 4, "dsa_layers": [4, 8], "use_rope": True}))
    with pytest.raises(ConfigError, match="MLA layers"):
        ModelConfig.from_dict(cfg_with({"index_topk": 4, "dsa_layers": [4]}))
    with pytest.raises(ConfigError, match="index_n_heads.*disagrees"):
        shapes = {"language_model.model.layers.3.self_attn.indexer.wk.weight": (16, 64),
                  "language_model.model.layers.3.self_attn.indexer.weights_proj.weight": (8, 64)}
        ModelConfig.from_dict(cfg_with({"index_topk": 4, "dsa_layers": [4, 8], "index_n_heads": 4}),
                              tensor_shapes=shapes)


def test_config_errors_name_the_key():
    base = get_preset("kimi-linear-tiny").config
    bad = json.loads(json.dumps(base))
    bad["linear_attn_config"]["kda_layers"] = [1, 2]
    with pytest.raises(ConfigError, match="kda_layers"):
        ModelConfig.from_dict(bad)
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_dict({**base, "model_type": "llama"})
    bad = json.loads(json.dumps(base))
    bad["hidden_act"] = "gelu"
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelConfig.from_dict(bad)


def _k31_pro_counts_by_hand() -> tuple[int, int]:
    """Parameter counts of K3.1 Pro from docs/model.md §14-15 dimensions, written out independently of the code."""
    d, V, L, H = 7168, 163840, 93, 96
    kda_layers, mla_layers = 69, 24
    P, Kd, W = 96 * 128, 128, 4
    kda = 3 * P * d + 3 * P * W + Kd * d + P * Kd + H + P + H * d + P * d + Kd + d * P
    q_lora, r, rho, n, v = 1536, 512, 64, 128, 128
    mla = d * q_lora + q_lora + q_lora * H * (n + rho) + d * (r + rho) + r + r * H * (n + v) + d * H * v + H * v * d
    indexer = 32 * 128 * q_lora + 128 * d + 2 * 128 + 32 * d
    attnres = 4 * d
    norms = 2 * d
    dense = 3 * d * 33792
    E, I, R = 896, 3072, 3584
    moe_shared = d * E + E + 2 * d * R + R + 3 * d * (2 * I)
    expert = 3 * I * R
    layers = kda_layers * kda + mla_layers * (mla + indexer) + L * (attnres + norms) + dense + 92 * moe_shared
    top = V * d * 2 + d + 2 * d  # embedding, lm_head, final norm, output AttnRes query
    total = layers + top + 92 * E * expert
    active = total - V * d - 92 * (E - 16) * expert
    return total, active


def test_k31_pro_meta_counts_match_the_spec():
    out = subprocess.run([sys.executable, "-m", "deltaserve.cli", "make-model", "--preset", "k31-pro", "--meta"],
                         capture_output=True, text=True, check=True).stdout
    total, active = _k31_pro_counts_by_hand()
    assert f"{total:,} parameters" in out and f"{active:,} (" in out
    assert 2.75e12 < total < 2.82e12 and 100e9 < active < 108e9  # "about 2.8T total / ~104B active"
    assert "27,648 B" in out and "6,144 B" in out and "1,446,456,066,048 bytes" in out


def test_import_does_not_load_the_oracles():
    code = "import sys, deltaserve, deltaserve.models; print('transformers' in sys.modules, 'fla' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
