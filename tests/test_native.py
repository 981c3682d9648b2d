"""The native small-batch bf16 kernels (ops/native.py, ops/native_src/) against their torch twins: F.linear
and the torch MoE dispatch / MLP, from one row to past the row limits, with K and N tails; wrong input is a
ValueError; a failed build leaves the torch paths; and the engine's greedy tokens do not move."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from deltaserve.config import ModelConfig
from deltaserve.layers.linear import Linear
from deltaserve.layers.mlp import MLP
from deltaserve.layers.moe import Experts, Routing
from deltaserve.backends import adopt
from deltaserve.backends.native import modules as native_modules
from deltaserve.backends.native.modules import NATIVE_FORMS, NativeLinear, kernels_take
from deltaserve.ops import native
from deltaserve.ops.activation import silu_glu
from deltaserve.ops.native_contract import MLP_MAX_ROWS
from deltaserve.tools.presets import get_preset
from engine_utils import assert_pools_free, make_llm, random_prompts
from deltaserve.engine.sampling_params import SamplingParams


def enable_native_kernels(module: torch.nn.Module) -> int:
    """Give the module (and its children) their native forms where the kernels take their weights, as the native
    backend does at load; returns how many changed."""
    return adopt(module, NATIVE_FORMS, kernels_take)

pytestmark = pytest.mark.skipif(native.native_library() is None, reason="no C compiler to build the kernels")


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


def _assert_rounded_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got is x @ w.T accumulated to fp32 accuracy, then rounded once to bf16 (half a bf16 step, plus slack for
    the fp32 accumulation measured against the sum of |products|)."""
    exact = _exact(x, w)
    slack = (x.double().abs() @ w.double().abs().T) * 1e-5
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + slack).all()


@pytest.mark.parametrize("K", [1024, 96, 37])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 9])
def test_linear_matches_the_exact_product_rounded(M, K):
    g = torch.Generator().manual_seed(M * 1000 + K)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    weights = [torch.randn(n, K, generator=g).to(torch.bfloat16) for n in (1, 7, 33, 256)]
    stacked = torch.cat(weights)  # several weights over one input: one packed matrix, as module_group packs them
    packed = native.pack_rows(stacked)
    assert packed.shape == native.packed_shape(stacked.shape)
    y = native.linear_packed(x, packed, stacked.shape[0])
    for w, part in zip(weights, torch.split(y, [w.shape[0] for w in weights], dim=-1)):
        _assert_rounded_product(part, x, w)
        torch.testing.assert_close(part, F.linear(x, w), atol=0, rtol=2 ** -7)  # the oneDNN twin, within a step


@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("K", [1024, 96, 37])
@pytest.mark.parametrize("M", [5, 9, 33, 130, 300, 513])
def test_column_linear_matches_the_exact_product_rounded(M, K, tiles):
    """`linear_columns` (above the 4-row tiles): every output the exact product rounded once, for stacked weights
    whose widths fall on and off the 64-column blocks, odd K, row counts below and above a register tile (6) and
    the count where tiles run the whole K (24), up to prefill sizes; rows read at a stride. Both forms: the AMX
    tile unit's (where the CPU has one; whole 16-row tiles and a partial one, K past its last group of 32 on the
    pair products) and the AVX512 pair products'."""
    g = torch.Generator().manual_seed(M * 1000 + K + 1)
    x = torch.randn(M, K + 3, generator=g).to(torch.bfloat16)[:, :K]  # rows at a stride of K + 3
    weights = [torch.randn(n, K, generator=g).to(torch.bfloat16) for n in (1, 7, 64, 200)]
    stacked = torch.cat(weights)
    packed = native.pack_columns(stacked)
    y = native.linear_columns(x, packed, stacked.shape[0], tiles=tiles)
    for w, part in zip(weights, torch.split(y, [w.shape[0] for w in weights], dim=-1)):
        _assert_rounded_product(part, x, w)
        # the oneDNN twin, within a step (an output near 0 from cancellation may differ by its fp32 sums' rounding)
        torch.testing.assert_close(part, F.linear(x, w), atol=1e-4, rtol=2 ** -7)
    with pytest.raises(ValueError, match="pack_columns"):
        native.linear_columns(x, native.pack_rows(stacked), stacked.shape[0])


def test_tiles_are_usable_where_the_cpu_has_amx_bf16():
    """The library takes the AMX tile unit on a CPU that reports AMX-BF16 (the build enables it with -march=native
    and the process asks the OS for the tile state), and never elsewhere."""
    with open("/proc/cpuinfo") as f:
        flags = {w for line in f if line.startswith("flags") for w in line.split()}
    assert native.tiles_usable() == ({"amx_bf16", "amx_tile"} <= flags)


def test_stacked_native_product_gives_each_linears_product():
    """KDA's input projections as one product over the stacked weights: each part is that linear's own product."""
    from deltaserve.backends.packs import PackedWeights, native_product
    g = torch.Generator().manual_seed(2)
    linears = [Linear(64, n).to(torch.bfloat16) for n in (16, 8, 40)]
    with torch.no_grad():
        for lin in linears:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
            enable_native_kernels(lin)
    for rows in (3, 9):
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        y = native_product(x, [lin.weight for lin in linears], PackedWeights())
        for lin, part in zip(linears, torch.split(y, [16, 8, 40], dim=-1)):
            assert torch.equal(part, lin(x))  # the same kernel, one call instead of three


def test_native_linear_follows_weight_changes():
    g = torch.Generator().manual_seed(3)
    lin = Linear(64, 40).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 64, generator=g))
    assert enable_native_kernels(lin) == 1
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    _assert_rounded_product(lin(x), x, lin.weight)
    with torch.no_grad():
        lin.weight.mul_(-3.0)  # in place: the packed copy must follow
    _assert_rounded_product(lin(x), x, lin.weight)
    lin.weight = torch.nn.Parameter(torch.randn(40, 64, generator=g).to(torch.bfloat16))  # replaced
    _assert_rounded_product(lin(x), x, lin.weight)


def test_linear_takes_row_strided_inputs_and_weights():
    g = torch.Generator().manual_seed(1)
    big = torch.randn(3, 200, generator=g).to(torch.bfloat16)
    wbig = torch.randn(50, 300, generator=g).to(torch.bfloat16)
    x, w = big[:, :128], wbig[:20, 100:228]  # row strides 200 and 300
    _assert_rounded_product(native.linear_packed(x, native.pack_rows(w), 20), x, w)


def test_large_packs_start_on_a_huge_page_and_keep_their_memory():
    """pack_rows' output of 2 MiB and more lies at a 2 MiB boundary of its own mapping (advised for huge pages),
    holds the same tiles as a plain copy, and stays valid once every other reference to the mapping is gone."""
    w = torch.randn(1030, 1100).to(torch.bfloat16)  # 1032 x 1120 packed: 2.2 MiB
    packed = native.pack_rows(w)
    padded = torch.nn.functional.pad(w, (0, 20, 0, 2))
    plain = padded.reshape(258, 4, 35, 32).transpose(1, 2).contiguous()
    assert packed.data_ptr() % native.HUGE_PAGE == 0 and packed.is_contiguous()
    assert torch.equal(packed, plain)
    del w, padded
    gc.collect()
    assert torch.equal(packed.clone(), plain)
    small = native.huge_page_empty((3, 5), torch.float32)  # under 2 MiB: an ordinary tensor
    assert small.shape == (3, 5) and small.dtype == torch.float32


def test_packs_take_ordinary_pages_where_huge_pages_are_refused(monkeypatch):
    """A kernel without transparent huge pages refuses the advice (EINVAL): the pack is still made, same tiles."""
    real_mmap = native.mmap.mmap

    class Refusing(real_mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(native.mmap, "mmap", Refusing)
    w = torch.randn(1030, 1100).to(torch.bfloat16)
    packed = native.pack_rows(w)
    monkeypatch.undo()
    assert packed.data_ptr() % native.HUGE_PAGE == 0 and torch.equal(packed, native.pack_rows(w))


def test_linear_rejects_what_the_kernel_cannot_read():
    x = torch.randn(2, 16).to(torch.bfloat16)
    w = torch.randn(4, 16).to(torch.bfloat16)
    with pytest.raises(ValueError):
        native.linear_packed(x.float(), native.pack_rows(w), 4)  # fp32 input
    with pytest.raises(ValueError):
        native.linear_packed(x, native.pack_rows(w).float(), 4)  # not bf16
    with pytest.raises(ValueError):
        native.linear_packed(x, native.pack_rows(torch.randn(4, 40).to(torch.bfloat16)), 4)  # another K
    with pytest.raises(ValueError):
        native.linear_packed(x, native.pack_rows(w), 8)  # more rows than were packed


def _experts(E: int, D: int, I: int, seed: int, preset: str = "kimi-linear-tiny") -> Experts:
    config = ModelConfig.from_dict(get_preset(preset).config)
    g = torch.Generator().manual_seed(seed)
    experts = Experts(config, E, D, I)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return experts.to(torch.bfloat16)


@pytest.mark.parametrize("T", [1, 2, 5, 16, 130])
def test_moe_matches_the_torch_dispatch(T):
    E, D, I, k = 8, 96, 40, 3
    experts = _experts(E, D, I, T)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    routing = Routing(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]), torch.rand(T, k, generator=g))
    ref = experts(x, routing)
    got = native.moe_bf16(x, routing.experts, routing.weights, experts.w1, experts.w3, experts.w2)
    # the same roundings in the same places; only the fp32 accumulation order of the dot products differs, which
    # can move an intermediate bf16 rounding by one step
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2 ** -6)
    assert (got == ref).float().mean() > 0.9
    # the module's native path reads the column-packed stacks (the outer-product kernel): the same contract
    columns = tuple(native.pack_columns(w) for w in (experts.w1, experts.w3, experts.w2))
    got_columns = native.moe_bf16(x, routing.experts, routing.weights, experts.w1, experts.w3, experts.w2,
                                  packed=columns)
    torch.testing.assert_close(got_columns, ref, atol=2e-3, rtol=2 ** -6)
    assert (got_columns == ref).float().mean() > 0.9
    assert enable_native_kernels(experts) == 1
    assert torch.equal(experts(x, routing), got_columns)


@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("T", [5, 40, 150])
@pytest.mark.parametrize("D, I", [(97, 33), (64, 128), (130, 70)])
def test_column_packed_experts_match_the_torch_dispatch_at_odd_sizes(D, I, T, tiles):
    """The outer-product kernel over pack_columns: odd K (the last pair half padding), widths past and short of
    the 64-column blocks, and experts with more tokens than a register tile (6) and with none; at 150 tokens each
    expert has ~60, past the count where its tiles run the whole K instead of chunks (TILED_TOKENS). With `tiles`,
    experts of TILE_MIN_ROWS (4) tokens or more run on the AMX tile unit where the CPU has one: at 5 tokens some
    experts have fewer, so one call mixes both forms."""
    E, k = 6, 2
    experts = _experts(E, D, I, T)
    g = torch.Generator().manual_seed(D)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    picks = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])  # expert E - 1: no token
    routing = Routing(picks, torch.rand(T, k, generator=g))
    packed = tuple(native.pack_columns(w) for w in (experts.w1, experts.w3, experts.w2))
    assert [tuple(p.shape) for p in packed] == [native.column_packed_shape(w.shape)
                                                for w in (experts.w1, experts.w3, experts.w2)]
    assert packed[0].shape[-4:] == (-(-I // 64), -(-D // 2), 64, 2)
    got = native.moe_bf16(x, routing.experts, routing.weights, experts.w1, experts.w3, experts.w2, packed=packed,
                          tiles=tiles)
    ref = experts(x, routing)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2 ** -6)
    assert (got == ref).float().mean() > 0.9


@pytest.mark.parametrize("linear_beta", [None, 3.0])
@pytest.mark.parametrize("T", [1, 6, 300])
def test_moe_with_situ_matches_the_torch_dispatch(T, linear_beta):
    import dataclasses
    E, D, I, k = 8, 96, 40, 2
    experts = _experts(E, D, I, T, preset="k31-tiny")
    experts.config = dataclasses.replace(experts.config, situ_linear_beta=linear_beta)
    assert experts.config.hidden_act == "situ"
    g = torch.Generator().manual_seed(T)
    x = (torch.randn(T, D, generator=g) * 4).to(torch.bfloat16)  # gate values past beta: tanh saturates
    routing = Routing(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]), torch.rand(T, k, generator=g))
    ref = experts(x, routing).detach()
    assert enable_native_kernels(experts) == 1
    got = experts(x, routing)
    # one bf16 step of an intermediate (gate, up or h) may round the other way: a step of the output's scale
    torch.testing.assert_close(got, ref, atol=float(ref.abs().max()) * 2 ** -7, rtol=2 ** -6)
    assert (got == ref).float().mean() > 0.9


@pytest.mark.parametrize("linear_beta", [None, 3.0])
def test_moe_with_situ_keeps_a_nan_token_nan(linear_beta):
    """A NaN input row gives NaN outputs on both expert forms, as the torch dispatch does (the vectorised
    exponential clamps its input, so the tanh forms must carry the NaN past it); the other rows are unaffected."""
    import dataclasses
    E, D, I, k, T = 6, 64, 40, 2, 9
    experts = _experts(E, D, I, T, preset="k31-tiny")
    experts.config = dataclasses.replace(experts.config, situ_linear_beta=linear_beta)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    x[4] = float("nan")
    picks = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    routing = Routing(picks, torch.rand(T, k, generator=g))
    ref = experts(x, routing).detach()
    assert ref[4].isnan().all() and not ref[torch.arange(T) != 4].isnan().any()
    situ = (experts.config.situ_beta, linear_beta)
    for pack in (native.pack_rows, native.pack_columns):
        packed = tuple(pack(w) for w in (experts.w1, experts.w3, experts.w2))
        got = native.moe_bf16(x, routing.experts, routing.weights, experts.w1, experts.w3, experts.w2, packed=packed,
                              situ=situ)
        assert got[4].isnan().all(), pack.__name__
        torch.testing.assert_close(got, ref, atol=float(ref[~ref.isnan()].abs().max()) * 2 ** -7, rtol=2 ** -6,
                                   equal_nan=True)


def _bf16_params(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return module.to(torch.bfloat16)


@pytest.mark.parametrize("T, IS", [(1, 40), (13, 136), (130, 64)])
def test_shared_expert_in_the_expert_pass_is_the_sum_of_both_outputs(T, IS):
    """`moe_bf16(shared=...)` runs a shared MLP in the routed experts' pass: bit for bit the routed output plus
    the MLP run alone on the same kernel (one expert of weight 1), each rounded to bf16 and summed in bf16, at
    widths on and off the 64-column blocks and with more tokens than a tile."""
    E, D, I, k = 8, 96, 40, 2
    experts = _experts(E, D, I, T)
    mlp = _bf16_params(MLP(experts.config, D, IS), IS)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    picks = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    routing = Routing(picks, torch.rand(T, k, generator=g))
    columns = tuple(native.pack_columns(w) for w in (experts.w1, experts.w3, experts.w2))
    weights = [m.weight for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    routed = native.moe_bf16(x, routing.experts, routing.weights, experts.w1, experts.w3, experts.w2, packed=columns)
    alone = native.moe_bf16(x, torch.zeros(T, 1, dtype=torch.int64), torch.ones(T, 1), *(w[None] for w in weights),
                            packed=tuple(native.pack_columns(w[None]) for w in weights))
    got = native.moe_bf16(x, routing.experts, routing.weights, experts.w1, experts.w3, experts.w2, packed=columns,
                          shared=(*(native.pack_columns(w) for w in weights), IS))
    assert torch.equal(got, routed + alone)
    torch.testing.assert_close(got, (experts(x, routing).float() + F.linear(
        F.silu(F.linear(x, weights[0])) * F.linear(x, weights[1]), weights[2]).float()).to(torch.bfloat16),
        atol=4e-3, rtol=2 ** -6)


def test_moe_block_runs_its_shared_mlp_in_the_expert_pass(monkeypatch):
    """MoE's native path hands its shared MLP to the expert kernel (one call: no separate MLP products) and
    gives the torch path's output to fp32 rounding of the dot products."""
    from deltaserve.layers.moe import MoE
    config = ModelConfig.from_dict(get_preset("kimi-linear-tiny").config)
    block = _bf16_params(MoE(config), 3)
    T = 40
    x = torch.randn(T, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = block(x).detach()
    assert enable_native_kernels(block) >= 4
    calls = []
    real = native_modules.moe_bf16
    monkeypatch.setattr(native_modules, "moe_bf16",
                        lambda *a, **kw: calls.append(kw.get("shared")) or real(*a, **kw))
    monkeypatch.setattr(native_modules.NativeMLP, "forward", lambda *a: pytest.fail("the shared MLP ran on its own"))
    got = block(x)
    assert len(calls) == 1 and calls[0] is not None and calls[0][3] == block.shared_experts.gate_proj.out_features
    torch.testing.assert_close(got, ref, atol=float(ref.abs().max()) * 2 ** -7, rtol=2 ** -6)
    assert (got == ref).float().mean() > 0.9


def test_moe_rejects_bad_expert_ids_and_shapes():
    experts = _experts(4, 32, 16, 0)
    x = torch.randn(2, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="expert ids"):
        native.moe_bf16(x, torch.tensor([[0], [4]]), torch.ones(2, 1), experts.w1, experts.w3, experts.w2)
    with pytest.raises(ValueError):
        native.moe_bf16(x, torch.tensor([[0], [1]]), torch.ones(2, 1), experts.w1, experts.w3, experts.w1)
    with pytest.raises(ValueError):
        native.moe_bf16(x, torch.tensor([[0, 1]]), torch.ones(1, 2), experts.w1, experts.w3, experts.w2)
    mixed = (native.pack_columns(experts.w1), native.pack_rows(experts.w3), native.pack_columns(experts.w2))
    with pytest.raises(ValueError, match="pack_rows or pack_columns"):
        native.moe_bf16(x, torch.tensor([[0], [1]]), torch.ones(2, 1), experts.w1, experts.w3, experts.w2,
                        packed=mixed)
    shapes = ((8, 32), (8, 32), (32, 8))
    shared = (*(native.pack_columns(torch.zeros(n, m, dtype=torch.bfloat16)) for n, m in shapes), 8)
    with pytest.raises(ValueError, match="shared expert"):  # the dot-product layouts take no shared expert
        native.moe_bf16(x, torch.tensor([[0], [1]]), torch.ones(2, 1), experts.w1, experts.w3, experts.w2,
                        shared=shared)
    columns = tuple(native.pack_columns(w) for w in (experts.w1, experts.w3, experts.w2))
    with pytest.raises(ValueError, match="shared expert"):  # a width that does not match its packs
        native.moe_bf16(x, torch.tensor([[0], [1]]), torch.ones(2, 1), experts.w1, experts.w3, experts.w2,
                        packed=columns, shared=(*shared[:3], 9))


@pytest.mark.parametrize("T", [1, 4, 7, MLP_MAX_ROWS + 5, 40])
def test_mlp_and_linear_modules_switch_to_the_kernels(T, monkeypatch):
    config = ModelConfig.from_dict(get_preset("kimi-linear-tiny").config)
    g = torch.Generator().manual_seed(T)
    mlp = MLP(config, 64, 48)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    mlp = mlp.to(torch.bfloat16)
    x = torch.randn(T, 64, generator=g).to(torch.bfloat16)
    plain = mlp(x)
    assert enable_native_kernels(mlp) == 4 and all(type(m) is NativeLinear for m in mlp.modules()
                                                   if isinstance(m, Linear))
    layouts = []
    monkeypatch.setattr(native_modules, "moe_bf16",
                        lambda *a, **kw: layouts.append(kw["packed"][0].shape[-2:]) or native.moe_bf16(*a, **kw))
    # the fused expert kernel at every size: on the row packs up to MLP_MAX_ROWS, the column packs above
    got = mlp(x)
    torch.testing.assert_close(got, plain, atol=2e-3, rtol=2 ** -6)
    assert layouts == [(4, 32) if T <= MLP_MAX_ROWS else (64, 2)]
    if T > MLP_MAX_ROWS:  # the same sums as the linears' column products around the torch activation
        gate, up, down = (native.pack_columns(m.weight) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        h = silu_glu(native.linear_columns(x, gate, 48), native.linear_columns(x, up, 48))
        assert torch.equal(got, native.linear_columns(h, down, 64))


def test_fp32_modules_are_not_switched():
    assert enable_native_kernels(Linear(32, 16)) == 0


def test_a_failed_build_leaves_the_torch_paths(tmp_path, monkeypatch):
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "broken.c").write_text("this is not C\n")
    monkeypatch.setenv("DELTASERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "SOURCES", broken)
    native.native_library.cache_clear()
    try:
        assert native.native_library() is None
        assert not native.native_usable(torch.bfloat16)
        assert enable_native_kernels(Linear(32, 16).to(torch.bfloat16)) == 0
        assert not list((tmp_path / "cache" / "native").glob("*.so"))  # no half-written library left behind
    finally:
        monkeypatch.undo()
        native.native_library.cache_clear()
    assert native.native_library() is not None


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "deepseek-v32-tiny"])
def test_engine_greedy_tokens_unchanged_by_the_kernels(make_checkpoint, preset):
    """A bf16 engine on the native backend and one on the torch backend: the same greedy tokens, sampled-token
    logprobs within bf16 noise."""
    prompts = random_prompts([9, 30, 17], seed=7, high=700)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    runs = []
    for backend in ("native", "torch"):
        llm = make_llm(make_checkpoint(preset), dtype="bfloat16", backend=backend)
        assert any(type(m) is NativeLinear for m in llm.engine.model.modules()) == (backend == "native")
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs])
        assert_pools_free(llm.engine)
    for (tokens_on, lp_on), (tokens_off, lp_off) in zip(*runs):
        assert tokens_on == tokens_off
        torch.testing.assert_close(torch.tensor(lp_on), torch.tensor(lp_off), atol=0.05, rtol=0)


def _kda_inputs(N: int, H: int, K: int, W: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    P, layers, slots_total = H * K, 3, 6
    x = torch.randn(N, 3 * P, generator=g).to(dtype)
    weight = torch.randn(3 * P, W, generator=g) * 0.5
    conv = torch.randn(slots_total, layers, 3, P, W - 1, generator=g)  # the StateSlots layout: layer 1's view
    rec = torch.randn(slots_total, layers, H, K, K, generator=g) * 0.1
    gate = -torch.rand(N, H, K, generator=g)  # log decays <= 0
    beta = torch.rand(N, H, generator=g)
    return x, weight, conv, rec, gate, beta


# The KDA step ops in three forms: the native kernel against its torch twin (the fast form), and the torch twin
# against the reference, each pair within the same bound.
KDA_STEP_PAIRS = [("native", "fast"), ("fast", "ref")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slots", [[3], [0, 5, -1, 2]])
@pytest.mark.parametrize("pair", KDA_STEP_PAIRS)
def test_kda_decode_step_forms_agree_over_several_steps(dtype, slots, pair):
    from deltaserve.ops.kda_native import kda_decode_step, kda_decode_step_native, kda_decode_step_ref
    forms = {"native": kda_decode_step_native, "fast": kda_decode_step, "ref": kda_decode_step_ref}
    got, want = pair
    H, K, W = 2, 32, 4
    N = len(slots)
    x, weight, conv, rec, gate, beta = _kda_inputs(N, H, K, W, dtype, len(slots))
    pools = {name: (conv.clone(), rec.clone()) for name in pair}
    slot_t = torch.tensor(slots)
    for step in range(3):
        outs = {}
        for name in pair:
            c, r = pools[name]
            window = c[:, 1].view(c.shape[0], 3 * H * K, W - 1)
            outs[name] = forms[name](x + step, weight, window, gate, beta, K ** -0.5, r[:, 1], slot_t)
        torch.testing.assert_close(outs[got], outs[want], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pools[got][0], pools[want][0], atol=0, rtol=0)  # windows: exact shifts
        torch.testing.assert_close(pools[got][1], pools[want][1], atol=2e-5, rtol=1e-4)
    pad = [i for i, s in enumerate(slots) if s < 0]
    assert all(not outs[got][i].any() for i in pad)
    untouched = [s for s in range(6) if s not in slots]
    assert torch.equal(pools[got][1][untouched], rec[untouched])
    assert torch.equal(pools[got][1][:, [0, 2]], rec[:, [0, 2]])  # other layers' states untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lengths,slots", [([5], [2]), ([1, 0, 70, 3], [4, 1, 0, 5]), ([6, 9], [-1, 3])])
@pytest.mark.parametrize("pair", KDA_STEP_PAIRS)
def test_kda_step_varlen_forms_agree(dtype, lengths, slots, pair):
    from deltaserve.ops.kda_native import kda_step_varlen, kda_step_varlen_native, kda_step_varlen_ref
    forms = {"native": kda_step_varlen_native, "fast": kda_step_varlen, "ref": kda_step_varlen_ref}
    got, want = pair
    H, K, W = 2, 32, 4
    cu = torch.tensor([0] + lengths).cumsum(0)
    x, weight, conv, rec, gate, beta = _kda_inputs(int(cu[-1]), H, K, W, dtype, sum(lengths))
    outs, pools = {}, {}
    for name in pair:
        c, r = conv.clone(), rec.clone()
        outs[name] = forms[name](x, weight, c[:, 2].view(6, 3 * H * K, W - 1), gate, beta, None, cu, r[:, 2],
                                 torch.tensor(slots))
        pools[name] = (c, r)
    torch.testing.assert_close(outs[got], outs[want], atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(pools[got][0], pools[want][0], atol=0, rtol=0)
    torch.testing.assert_close(pools[got][1], pools[want][1], atol=5e-5, rtol=1e-4)
    for b, s in enumerate(slots):
        if s < 0:
            assert not outs[got][cu[b]:cu[b + 1]].any()
    used = {s for s, n in zip(slots, lengths) if s >= 0 and n}
    assert all(torch.equal(pools[got][1][s], rec[s]) for s in range(6) if s not in used)


def test_kda_step_varlen_equals_token_by_token_decode():
    """On the native kernel, a prefill round of n tokens leaves the same state and outputs as n decode steps, bit for
    bit (both run the same token-by-token recurrence)."""
    from deltaserve.ops.kda_native import kda_decode_step_native, kda_step_varlen_native
    H, K, W = 2, 32, 4
    x, weight, conv, rec, gate, beta = _kda_inputs(7, H, K, W, torch.bfloat16, 3)
    c1, r1, c2, r2 = conv.clone(), rec.clone(), conv.clone(), rec.clone()
    view = (lambda c: c[:, 0].view(6, 3 * H * K, W - 1))
    o1 = kda_step_varlen_native(x, weight, view(c1), gate, beta, None, torch.tensor([0, 7]), r1[:, 0],
                                torch.tensor([4]))
    o2 = torch.cat([kda_decode_step_native(x[t:t + 1], weight, view(c2), gate[t:t + 1], beta[t:t + 1], None,
                                           r2[:, 0], torch.tensor([4])) for t in range(7)])
    assert torch.equal(o1, o2) and torch.equal(c1, c2) and torch.equal(r1, r2)


def test_kda_native_ops_without_the_library_run_the_torch_ops(monkeypatch):
    from deltaserve.ops import kda_native
    H, K, W = 2, 16, 4
    x, weight, conv, rec, gate, beta = _kda_inputs(5, H, K, W, torch.float32, 9)
    runs = []
    for lib in (native.native_library, lambda: None):
        monkeypatch.setattr(native, "native_library", lib)
        c, r = conv.clone(), rec.clone()
        view = c[:, 0].view(6, 3 * H * K, W - 1)
        o = kda_native.kda_decode_step_native(x[:2], weight, view, gate[:2], beta[:2], None, r[:, 0],
                                              torch.tensor([1, 4]))
        o2 = kda_native.kda_step_varlen_native(x[2:], weight, view, gate[2:], beta[2:], None,
                                               torch.tensor([0, 1, 3]), r[:, 0], torch.tensor([2, 1]))
        runs.append((o, o2, c, r))
    for fast, fallback in zip(*runs):
        torch.testing.assert_close(fast, fallback, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("H, r, rho", [(3, 64, 16), (6, 40, 24)])  # head tiles of 4 and latent slices of 32: tails
def test_qsfa_kernel_matches_the_torch_form(monkeypatch, dtype, T, H, r, rho):
    from deltaserve.ops import qsfa as qsfa_mod
    g = torch.Generator().manual_seed(T)
    rows, k = 90, 40
    q_lat, q_pe = torch.randn(T, H, r, generator=g), torch.randn(T, H, rho, generator=g)
    latent = torch.randn(rows, r + rho, generator=g).to(dtype)
    selected = torch.stack([torch.randperm(rows, generator=g)[:k] for _ in range(T)])
    selected[0, 17:] = -1  # a short row (more than one block of 16 rows, then padding)
    if T > 1:
        selected[1] = -1   # no row at all: zeros and lse -inf
    on_kernel = qsfa_mod.qsfa_native(q_lat, q_pe, latent, selected, 0.3)
    torch_form = qsfa_mod.qsfa(q_lat, q_pe, latent, selected, 0.3)
    for a, b in zip(on_kernel, torch_form):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(native, "native_library", lambda: None)  # no library: exactly the torch form
    for a, b in zip(qsfa_mod.qsfa_native(q_lat, q_pe, latent, selected, 0.3), torch_form):
        assert torch.equal(a, b)
    monkeypatch.undo()
    with pytest.raises(IndexError):
        qsfa_mod.qsfa_native(q_lat, q_pe, latent, torch.full((T, 2), rows), 0.3)


@pytest.mark.parametrize("M", [1, 3, 40])
def test_rmsnorm_kernel_matches_the_module(M):
    from deltaserve.layers.norm import RMSNorm
    g = torch.Generator().manual_seed(M)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(M, 96, generator=g) * 3).to(torch.bfloat16)
    plain = norm(x)
    assert enable_native_kernels(norm) == 1
    got = norm(x)
    torch.testing.assert_close(got, plain, atol=0, rtol=2 ** -7)  # within one bf16 step
    assert (got == plain).float().mean() > 0.95
    assert not enable_native_kernels(RMSNorm(96, 1e-5))  # fp32 weights stay on torch


@pytest.mark.parametrize("R", [1, 8, 700])
def test_gated_rmsnorm_kernel_matches_the_torch_norm(R):
    from deltaserve.layers.norm import gated_rms_norm
    g = torch.Generator().manual_seed(R)
    K = 64
    core = torch.randn(R, K, generator=g) * 2
    wide = torch.randn(R, 3 * K, generator=g).to(torch.bfloat16)
    gate = wide[:, K:2 * K]  # a row-strided view, as the layer's gate can be
    weight = torch.randn(K, generator=g)
    gate[0, 17] = float("nan")  # a NaN gate gives a NaN output, as the sigmoid does (not a clamped one)
    got = native.gated_rmsnorm_bf16(core, gate, weight, 1e-5)
    ref = gated_rms_norm(core.to(torch.bfloat16), gate, weight, 1e-5)
    assert ref[0, 17].isnan() and got[0, 17].isnan()
    torch.testing.assert_close(got, ref, atol=0, rtol=2 ** -7, equal_nan=True)
    assert (got == ref).float().mean() > 0.95


@pytest.mark.parametrize("T", [1, 3])
def test_linear_heads_is_a_product_per_head(T):
    g = torch.Generator().manual_seed(T)
    H, K, N = 3, 48, 40
    wide = torch.randn(T, H, K + 16, generator=g).to(torch.bfloat16)
    x = wide[..., :K]  # strided heads, as the layers' q_nope views are
    w = torch.randn(H, N, K, generator=g).to(torch.bfloat16)
    y = native.linear_heads(x, native.pack_rows(w), N)
    assert y.shape == (T, H, N)
    for h in range(H):
        _assert_rounded_product(y[:, h], x[:, h], w[h])
    with pytest.raises(ValueError):
        native.linear_heads(x, native.pack_rows(w), N + 1)


@pytest.mark.parametrize("T, K, N", [(1, 48, 40), (5, 128, 512), (17, 100, 70), (40, 512, 128)])
def test_linear_heads_columns_is_linear_columns_per_head(T, K, N):
    """Each head's product over strided heads equals linear_columns on that head's rows and column pack bit for bit
    (the tile unit from TILE_MIN_ROWS rows where there is one), and the rounded fp32 product."""
    g = torch.Generator().manual_seed(T + K)
    H = 3
    wide = torch.randn(T, H, K + 16, generator=g).to(torch.bfloat16)
    x = wide[..., :K]
    w = torch.randn(H, N, K, generator=g).to(torch.bfloat16)
    y = native.linear_heads_columns(x, native.pack_columns(w), N)
    assert y.shape == (T, H, N)
    for h in range(H):
        assert torch.equal(y[:, h], native.linear_columns(x[:, h].contiguous(), native.pack_columns(w[h]), N))
        _assert_rounded_product(y[:, h], x[:, h], w[h])
    with pytest.raises(ValueError, match="pack_columns"):
        native.linear_heads_columns(x, native.pack_rows(w), N)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 1000, 32000])
def test_argmax_rows_is_torch_argmax(n):
    """The greedy pick against torch.argmax: ties to the first index, the first NaN of a row with NaNs (in the
    vector part or the tail), all -inf, -0 against +0, random rows, on rows at a stride."""
    g = torch.Generator().manual_seed(n)
    wide = torch.randn(9, n + 5, generator=g)
    x = wide[:, :n]
    if n > 1:
        x[1, n // 3] = x[1, n - 1] = x[1].max() + 1.0  # a tie: the first wins
        x[2, n - 1] = float("nan")  # a NaN in the tail
        x[3, n // 2] = x[3, n - 1] = float("nan")
        x[5, 0], x[5, n - 1] = -0.0, 0.0
        x[5, 1:n - 1] = -1.0
    x[4] = float("-inf")
    x[6] = 7.0
    assert torch.equal(native.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(native.argmax_rows(x[:1]), x[:1].argmax(dim=-1))
