"""The tensor- and expert-parallel sharding rules (deltaserve/distributed/sharding.py, docs/parallel.md §2): which
parameter splits along which dimension, that the ranks' parts tile every split tensor, the layouts refused, and the
per-rank accounting `make-model --meta` prints from the same rules."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cli import main
from deltaserve.config import ModelConfig
from deltaserve.distributed import ParallelConfig, component, local_shape, shard, split_dim
from deltaserve.errors import ConfigError
from deltaserve.layers.quantized import W4A8_MXFP4, W8A8_MXFP8, quantized_tensors, swap_in
from deltaserve.models.registry import model_class
from deltaserve.tools.accounting import account_ranks
from deltaserve.tools.presets import get_preset

TP2, EP2 = ParallelConfig(2), ParallelConfig(2, enable_expert_parallel=True)


def _model(preset: str, device: str = "meta"):
    config = ModelConfig.from_dict(get_preset(preset).config)
    with torch.device(device):
        return config, model_class(config)(config)


@pytest.mark.parametrize("name, tp, ep", [
    ("layers.0.self_attn.q_proj.weight", 0, 0),  # KDA heads / MLA heads (output rows, head-major)
    ("layers.0.self_attn.q_conv1d.weight", 0, 0),
    ("layers.0.self_attn.A_log", 0, 0),
    ("layers.0.self_attn.dt_bias", 0, 0),
    ("layers.0.self_attn.b_proj.weight", 0, 0),
    ("layers.0.self_attn.f_a_proj.weight", None, None),  # low rank: whole on every rank
    ("layers.0.self_attn.f_b_proj.weight", 0, 0),
    ("layers.0.self_attn.o_norm.weight", None, None),
    ("layers.0.self_attn.o_proj.weight", 1, 1),  # row parallel
    ("layers.3.self_attn.q_a_proj.weight", None, None),
    ("layers.3.self_attn.q_b_proj.weight", 0, 0),
    ("layers.3.self_attn.kv_a_proj_with_mqa.weight", None, None),
    ("layers.3.self_attn.kv_b_proj.weight", 0, 0),
    ("layers.3.self_attn.indexer.wq_b.weight", 0, 0),
    ("layers.3.self_attn.indexer.weights_proj.weight", 0, 0),
    ("layers.3.self_attn.indexer.wk.weight", None, None),
    ("layers.1.ffn.gate.weight", None, None),  # the router
    ("layers.1.ffn.experts.w1", 1, 0),
    ("layers.1.ffn.experts.w2", 2, 0),
    ("layers.1.ffn.experts.w2_packed", 2, 0),
    ("layers.1.ffn.experts.w1_scale", 1, 0),
    ("layers.1.ffn.routed_expert_down_proj.weight", None, None),
    ("layers.1.ffn.routed_expert_up_proj.weight", 1, 1),
    ("layers.1.ffn.shared_experts.up_proj.weight", 0, 0),
    ("layers.1.ffn.shared_experts.down_proj.weight", 1, 1),
    ("layers.1.ffn.shared_experts.down_proj.weight_packed", 1, 1),
    ("layers.0.ffn.gate_proj.weight", 0, 0),
    ("layers.0.ffn.down_proj.weight", 1, 1),
    ("embed_tokens.weight", 0, 0),  # vocabulary parallel
    ("lm_head.weight", 0, 0),
    ("norm.weight", None, None),
    ("output_attn_res.proj.weight", None, None),
    ("mtp.0.eh_proj.weight", None, None),
    ("mtp.0.block.self_attn.o_proj.weight", 1, 1),
    ("mtp.0.shared_head.head.weight", 0, 0),
])
def test_each_parameter_splits_where_its_layer_shards(name, tp, ep):
    assert split_dim(name, TP2) == tp
    assert split_dim(name, EP2) == ep
    assert split_dim(name, ParallelConfig(1)) is None


@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny", "deepseek-v32-tiny", "k3-tiny"])
@pytest.mark.parametrize("parallel", [TP2, EP2, ParallelConfig(4), ParallelConfig(4, enable_expert_parallel=True)])
def test_the_ranks_parts_tile_every_tensor(preset, parallel):
    """Every parameter of the tiny presets, MX-quantised ones too (where whole blocks fall on every rank: whole
    experts, or a shared expert 64 wide over 2 ranks): the ranks' parts, put back along the rule's dimension, are the
    whole tensor; a replicated tensor is every rank's whole."""
    config, model = _model(preset, "cpu")
    if parallel.enable_expert_parallel:
        swap_in(model, "layers.1.ffn.experts", W4A8_MXFP4)
    if parallel.world_size == 2 and preset == "k31-tiny":
        swap_in(model, "layers.1.ffn.shared_experts.down_proj", W8A8_MXFP8)
    tensors = dict(model.named_parameters()) | quantized_tensors(model)
    parallel.check(config, {n: tuple(t.shape) for n, t in tensors.items()})
    n = parallel.world_size
    split = 0
    for name, t in tensors.items():
        t = torch.arange(t.numel()).reshape(t.shape)
        dim = split_dim(name, parallel)
        parts = [shard(t, dim, r, n) for r in range(n)]
        assert all(tuple(p.shape) == local_shape(tuple(t.shape), dim, n) for p in parts), name
        assert torch.equal(torch.cat(parts, dim) if dim is not None else parts[0], t), name
        split += dim is not None
    assert split > len(tensors) // 3


@pytest.mark.parametrize("preset, parallel, needle", [
    ("k31-tiny", ParallelConfig(3), "does not divide by tensor_parallel_size = 3"),
    ("k31-pro", ParallelConfig(64, enable_expert_parallel=True), "num_attention_heads = 96"),
    ("k31-pro", ParallelConfig(48, enable_expert_parallel=True), "vocab_size = 163840"),
])
def test_a_layout_that_cuts_a_head_is_refused(preset, parallel, needle):
    config, model = _model(preset)
    with pytest.raises(ConfigError, match=needle):
        parallel.check(config, {n: tuple(p.shape) for n, p in model.named_parameters()})


def test_mx_blocks_are_never_cut():
    config, model = _model("k31-tiny", "cpu")
    swap_in(model, "layers.1.ffn.experts", W4A8_MXFP4)  # expert width 32: one MX block along w2's input
    shapes = {n: tuple(t.shape) for n, t in (dict(model.named_parameters()) | quantized_tensors(model)).items()}
    with pytest.raises(ConfigError, match=r"w2_scale .*an MX tensor's blocks would be cut"):
        ParallelConfig(2).check(config, shapes)
    ParallelConfig(2, enable_expert_parallel=True).check(config, shapes)  # whole experts: nothing cut


def test_rank_accounting_is_the_rules_sum():
    """k31-pro over 8 ranks with expert parallelism: each component's bytes a rank are its split bytes / 8 plus its
    replicated bytes, the rank's total is within 10% of total / 8 plus what every rank holds whole, and the routed
    experts (98% of the bytes) are exactly an eighth."""
    a = account_ranks(*_model("k31-pro")[:1], ParallelConfig(8, enable_expert_parallel=True))
    parts = a["components"]
    assert sum(p["total"] for p in parts.values()) == pytest.approx(a["total_weight_bytes"], abs=len(parts))
    replicated = sum(p["replicated"] for p in parts.values())
    assert a["rank_weight_bytes"] <= 1.1 * (a["total_weight_bytes"] / 8) + replicated
    assert parts["routed experts"]["split"] == pytest.approx(parts["routed experts"]["total"] / 8, rel=1e-9)
    assert parts["routed experts"]["replicated"] == 0 and parts["routers"]["split"] == 0
    assert parts["KDA attention"]["split"] > 10 * parts["KDA attention"]["replicated"]
    assert a["rank_kda_state_bytes_per_seq"] * 8 == pytest.approx(443.1 * (1 << 20), rel=1e-3)


def test_component_names():
    config = ModelConfig.from_dict(get_preset("k31-tiny").config)
    kda, mla = config.kda_layers[0], config.mla_layers[0]
    assert component(f"layers.{kda}.self_attn.q_proj.weight", config) == "KDA attention"
    assert component(f"layers.{mla}.self_attn.q_b_proj.weight", config) == "MLA/DSA attention"
    assert component(f"layers.{mla}.self_attn.indexer.wk.weight", config) == "DSA indexers"
    assert component("mtp.0.block.ffn.experts.w1", config) == "MTP layers"


def test_make_model_meta_prints_each_ranks_share(capsys):
    assert main(["make-model", "--preset", "k31-pro", "--meta", "--tensor-parallel-size", "8",
                 "--enable-expert-parallel"]) == 0
    out = capsys.readouterr().out
    assert "k31-pro over 8 ranks (tensor parallel 8, routed experts placed whole (expert parallel))" in out
    assert "routed experts" in out and "GiB a rank" in out and "KDA state a rank per sequence: 58,079,232 B" in out
    assert main(["make-model", "--preset", "k31-pro", "--meta", "--tensor-parallel-size", "64",
                 "--enable-expert-parallel"]) == 2
    assert "num_attention_heads = 96 does not divide by tensor_parallel_size = 64" in capsys.readouterr().err
