"""Native kernels that are not products (tests/test_native.py has those): the DSA block's index selection against
QLI, the KDA gate against its torch twin, and the router against the torch router."""

from __future__ import annotations

import pytest
import torch

from deltaserve.backends import adopt
from deltaserve.backends.native.modules import NATIVE_FORMS, NativeRouter, kernels_take
from deltaserve.layers.moe import Router
from deltaserve.models.loader import load_config
from deltaserve.ops import native
from deltaserve.ops.kda_native import kda_gate_beta, kda_gate_beta_native, kda_gate_beta_ref
from deltaserve.ops.qli import build_index_meta, qli_topk

pytestmark = pytest.mark.skipif(native.native_library() is None, reason="no C compiler to build the kernels")


@pytest.mark.parametrize("keys_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, heads, nan_keys", [(5, 4, 0), (16, 4, 0), (17, 20, 0), (300, 20, 0), (20, 16, 8)])
def test_native_index_selection_matches_qli(keys_dtype, n, heads, nan_keys):
    """ds_index_select against qli_topk (unquantised keys, no rotation): the same rows in the same order, by score
    then larger position; n <= top-k gives every row in position order; NaN scores rank last, by position. 16 and
    20 heads take the vector path, 4 and the last 4 of 20 the scalar one."""
    g = torch.Generator().manual_seed(n + nan_keys)
    H, D, topk, rows_total = heads, 32, 16, 320
    keys = torch.randn(rows_total, D, generator=g).to(keys_dtype)
    rows = torch.randperm(rows_total, generator=g)[:n]  # the sequence's page rows, positions 0..n-1
    keys[rows[:nan_keys]] = float("nan")  # 12 scored rows of 20 and 8 NaN ones: the 4 at the largest positions go
    q = torch.randn(1, H, D, generator=g).to(torch.bfloat16)
    w = torch.randn(1, H, generator=g)
    meta = build_index_meta([torch.tensor([0])], [n], torch.tensor([0]), torch.tensor([n - 1]), rows_total,
                            topk)
    meta = meta._replace(rows=(rows,))
    want = qli_topk(q, w, keys, None, meta, quantized=False, rotate=False)[0]
    got = torch.full((topk,), -2, dtype=torch.int64)
    w_eff = (w[0] * D ** -0.5).contiguous()
    native.native_library().ds_index_select(q.data_ptr(), w_eff.data_ptr(), H, D, rows.contiguous().data_ptr(), n,
                                            keys.data_ptr(), D, keys_dtype == torch.bfloat16, topk, got.data_ptr(),
                                            2)
    assert torch.equal(got, want)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_gate_beta_native_matches_its_torch_twin(lower_bound):
    g = torch.Generator().manual_seed(3)
    T, H, K = 5, 3, 16
    u = (torch.randn(T, H * K, generator=g) * 8).to(torch.bfloat16)  # some u + dt_bias above softplus' 20
    b = torch.randn(T, 4 * H, generator=g).to(torch.bfloat16)[:, :H]  # a column slice, as the layer's b is
    dt_bias, a_log = torch.randn(H * K, generator=g) * 10, torch.randn(H, generator=g)
    got, want = (f(u, b, dt_bias, a_log, lower_bound) for f in (kda_gate_beta_native, kda_gate_beta))
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_gate_beta_native_matches_its_torch_twin_over_the_whole_range(lower_bound):
    """The vectorised exp and log1p over full rows of 128 channels: u + dt_bias from -52 to 54 (softplus near 0,
    near the identity, past its cut at 20), every value to fp32 rounding (a few ulp). The torch twin runs the
    reference's fp32 operations in the reference's order: equal to it bit for bit."""
    g = torch.Generator().manual_seed(4)
    T, H, K = 40, 4, 128
    u = torch.linspace(-40, 40, T * H * K)[torch.randperm(T * H * K, generator=g)].view(T, H * K).to(torch.bfloat16)
    u[3, 5] = u[7, 200] = float("nan")  # a NaN stays NaN, as in torch
    b = (torch.randn(T, H, generator=g) * 6).to(torch.bfloat16)
    dt_bias, a_log = torch.randn(H * K, generator=g) * 5, torch.randn(H, generator=g)
    got, want, ref = (f(u, b, dt_bias, a_log, lower_bound)
                      for f in (kda_gate_beta_native, kda_gate_beta, kda_gate_beta_ref))
    assert want[0].isnan().sum() == 2
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-7, equal_nan=True)
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(want[0], ref[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(want[1], ref[1], rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "deepseek-v32-tiny", "k31-tiny"])
def test_native_router_matches_the_torch_router(make_checkpoint, preset):
    """Same experts in the same order and the same weights to fp32 rounding (sigmoid; groups for DeepSeek)."""
    config = load_config(make_checkpoint(preset))
    router = Router(config).to(torch.bfloat16)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(config.num_experts, generator=g) * 0.1)
    x = torch.randn(37, config.hidden_size, generator=g).to(torch.bfloat16)
    want = router(x)
    assert adopt(router, NATIVE_FORMS, kernels_take) == 1 and type(router) is NativeRouter
    got = router(x)
    assert torch.equal(got.experts, want.experts)
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("E, D", [(64, 1024), (7, 100), (10, 48)])
def test_native_router_tiles_sum_as_one_token_at_a_time(E, D):
    """The router's logits tiles (4 tokens x 2 experts) sum in the same order as its one-token path: each token's
    experts and weights are bit for bit what it gets alone, whatever the token count, with odd expert counts and
    widths off the 32-float steps."""
    g = torch.Generator().manual_seed(E + D)
    w, bias = torch.randn(E, D, generator=g), torch.randn(E, generator=g) * 0.1
    x = torch.randn(11, D, generator=g).to(torch.bfloat16)
    k = min(4, E)
    together = native.router_bf16(x, w, bias, k, False, 1, 1, True, 2.5)
    alone = [native.router_bf16(x[i:i + 1], w, bias, k, False, 1, 1, True, 2.5) for i in range(x.shape[0])]
    assert torch.equal(together[0], torch.cat([a[0] for a in alone]))
    assert torch.equal(together[1], torch.cat([a[1] for a in alone]))


def test_native_router_rejects_an_impossible_top_k():
    x = torch.randn(2, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="top-5 of 4 experts"):
        native.router_bf16(x, torch.randn(4, 8), torch.zeros(4), 5, False, 1, 1, True, 1.0)
