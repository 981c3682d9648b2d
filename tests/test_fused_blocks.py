"""Fused residual blocks (layers/fused_blocks.py, native_src/blocks.c) against the modules they fuse, bit for bit
(K3's DSA block to bf16 rounding), over several decode steps of every layer of the tiny presets; the native router
and KDA gate against their torch twins; and an engine decode that goes through the blocks."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.paged_cache import PagedCache, SeqHandle
from deltaserve.cache.state_slots import StateSlots
from deltaserve.layers.batch import StepBatch
from deltaserve.layers import fused_attention, fused_blocks
from deltaserve.layers.fused_blocks import attention_block, ffn_block
from deltaserve.layers.kda import KimiDeltaAttention
from deltaserve.layers.moe import MoE, Router
from deltaserve.layers.native_path import enable_native_kernels
from deltaserve.models import decoder
from deltaserve.models.loader import load_config
from deltaserve.ops import native
from deltaserve.ops.kda_native import kda_gate_beta, kda_gate_beta_native, kda_gate_beta_ref
from deltaserve.ops.opset import get_ops
from deltaserve.ops.qli import build_index_meta, qli_topk
from block_utils import decode_batch, fused_and_module_tokens, native_model, twin_caches
from engine_utils import random_prompts

pytestmark = pytest.mark.skipif(native.native_library() is None, reason="no C compiler to build the kernels")


def _with_residual(out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return out if residual is None else residual + out


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k31-tiny", "deepseek-v32-tiny"])
@pytest.mark.parametrize("slots", [[2], [0, 3, 1], [4, 1, 2, 0]])
def test_blocks_equal_the_modules_bit_for_bit(make_checkpoint, preset, slots):
    """Each layer's blocks against its modules on the same input and states, three steps running (conv windows
    and recurrent states carried; the states after each step must agree too), with the three residual forms: the
    input itself (plain layers), another tensor and none (K3's AttnRes layers)."""
    _blocks_against_modules(native_model(make_checkpoint(preset)), slots)


@pytest.mark.parametrize("slots", [[5, 0, 3, 1, 2], [8, 2, 0, 7, 1, 5, 3, 4, 6], list(range(17, -1, -1))])
def test_wide_blocks_equal_the_modules_bit_for_bit(make_checkpoint, slots):
    """Decode steps of 5, 9 and 18 sequences (past the dot tiles' 4 rows and the MLP's 8: the column packs, on the
    tile unit where there is one; 16 rows and more fill a whole tile) through kimi-linear-tiny's KDA, MLA and FFN
    blocks, against the modules as above."""
    _blocks_against_modules(native_model(make_checkpoint("kimi-linear-tiny")), slots)


@pytest.mark.parametrize("rows", [9, 40, 130])
def test_ffn_block_takes_prefill_rows_as_the_modules(make_checkpoint, rows):
    """The FFN block has no decode-only condition: a prefill chunk's rows (up to BLOCK_MAX_ROWS) give the modules'
    output bit for bit, dense MLP and MoE layers alike."""
    model = native_model(make_checkpoint("kimi-linear-tiny"))
    g = torch.Generator().manual_seed(rows)
    with torch.inference_mode():
        for layer in model.layers:
            x = torch.randn(rows, model.config.hidden_size, generator=g).to(torch.bfloat16)
            got = ffn_block(layer, x, x)
            assert got is not None and torch.equal(got, x + layer.ffn(layer.post_attention_layernorm(x)))


def test_kda_block_takes_prefill_chunks_as_the_module(make_checkpoint):
    """A step of prefill chunks and a decode token (5, 1 and 12 rows, contexts 3, 7 and 0) through each KDA layer's
    block and through its module: outputs, slot states and the prefix-cache checkpoints of the snapshots at the
    chunks' ends agree bit for bit (the module on the native op set, whose kernels the block runs)."""
    model = native_model(make_checkpoint("kimi-linear-tiny"))
    caches = twin_caches(model, 3)
    for cache in caches:
        cache.checkpoints = StateSlots(model.config, 3)
    lengths, contexts, slots = [5, 1, 12], [3, 7, 0], [2, 0, 3]
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, lengths)])
    starts = [0, 5, 6, 18]

    def chunk_batch(cache):
        handles = [SeqHandle(s, torch.arange(c + n)) for s, c, n in zip(slots, contexts, lengths)]
        return StepBatch(positions, starts, contexts, cache, handles, kda_snapshots=[[(5, 0)], [], [(12, 2)]],
                         ops=get_ops("native"))

    g = torch.Generator().manual_seed(3)
    kda = [l for l in model.layers if isinstance(l.self_attn, KimiDeltaAttention)]
    with torch.inference_mode():
        for layer in kda:
            x = torch.randn(18, model.config.hidden_size, generator=g).to(torch.bfloat16)
            got = attention_block(layer, x, chunk_batch(caches[0]), x)
            want = x + layer.self_attn(layer.input_layernorm(x), chunk_batch(caches[1]))
            assert got is not None and torch.equal(got, want), f"layer {layer.layer}"
    assert kda
    fused, module = caches
    assert torch.equal(fused.states.conv, module.states.conv)
    assert torch.equal(fused.states.recurrent, module.states.recurrent)
    assert torch.equal(fused.checkpoints.recurrent, module.checkpoints.recurrent)
    assert torch.equal(fused.checkpoints.conv, module.checkpoints.conv)
    assert fused.checkpoints.recurrent[[0, 2]].abs().sum() > 0 and fused.checkpoints.recurrent[1].abs().sum() == 0


def _blocks_against_modules(model, slots: list[int]) -> None:
    g = torch.Generator().manual_seed(len(slots))
    pages = (4 + 2 + len(slots)) // 16 + 1  # sequence i decodes at positions 4 + i .. 6 + i
    fused_cache, module_cache = twin_caches(model, len(slots), pages, sequences=max(4, len(slots)))
    fused_attention = fused_ffn = 0
    with torch.inference_mode():
        for step in range(3):
            fused_batch = decode_batch(fused_cache, slots, 4 + step, model.config, pages)
            module_batch = decode_batch(module_cache, slots, 4 + step, model.config, pages)
            for layer in model.layers:
                x = torch.randn(len(slots), model.config.hidden_size, generator=g).to(torch.bfloat16)
                residual = [x, torch.randn(x.shape, generator=g).to(torch.bfloat16), None][step]
                got = attention_block(layer, x, fused_batch, residual)
                attn = layer.self_attn
                want = _with_residual(attn(layer.input_layernorm(x), module_batch), residual)
                if isinstance(attn, KimiDeltaAttention) or attn.indexer is None:
                    assert got is not None and torch.equal(got, want), f"layer {layer.layer} attention"
                    fused_attention += 1
                else:  # DSA (K3 NoPE, DeepSeek RoPE): LayerNorm statistics and sigmoid in another order
                    assert got is not None, f"layer {layer.layer} DSA"
                    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
                    assert (got == want).float().mean() > 0.9
                    fused_attention += 1
                got = ffn_block(layer, x, residual)
                assert got is not None, f"layer {layer.layer} FFN"
                want = _with_residual(layer.ffn(layer.post_attention_layernorm(x)), residual)
                assert torch.equal(got, want), f"layer {layer.layer} FFN"
                fused_ffn += 1
            assert torch.equal(fused_cache.states.conv, module_cache.states.conv)
            assert torch.equal(fused_cache.states.recurrent, module_cache.states.recurrent)
            for l in fused_cache.pages.latent:
                assert torch.equal(fused_cache.pages.latent_rows(l), module_cache.pages.latent_rows(l))
            for l in fused_cache.pages.index_keys:  # the indexer keys' LayerNorm: to a bf16 step
                torch.testing.assert_close(fused_cache.pages.key_rows(l)[0].float(),
                                           module_cache.pages.key_rows(l)[0].float(), rtol=1e-2, atol=1e-2)
    assert fused_attention == 3 * len(model.layers)
    assert fused_ffn == 3 * len(model.layers)


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


@pytest.mark.parametrize("preset", ["k31-tiny", "deepseek-v32-tiny"])
@pytest.mark.parametrize("position", [14, 30])
def test_dsa_block_selects_past_the_top_k(make_checkpoint, preset, position):
    """Contexts of 15-19 rows (some within the tiny presets' top-k of 16, some past it) or 31-35 rows: the block's
    indexer picks the rows (in C) where a context passes the top-k, and its output follows the modules' (QLI +
    QSFA) to bf16 rounding; cache pages agree."""
    model = native_model(make_checkpoint(preset))
    assert model.config.index_topk == 16
    g = torch.Generator().manual_seed(9)
    slots = [0, 3, 1, 2]
    fused_cache, module_cache = twin_caches(model, 5, pages_per_sequence=3)
    blocks = 0
    with torch.inference_mode():
        for step in range(2):
            fused_batch = decode_batch(fused_cache, slots, position + step, model.config, pages_per_sequence=3)
            module_batch = decode_batch(module_cache, slots, position + step, model.config, pages_per_sequence=3)
            assert not module_batch.index_meta.all_short
            for layer in model.layers:
                if isinstance(layer.self_attn, KimiDeltaAttention) or layer.self_attn.indexer is None:
                    continue
                x = torch.randn(len(slots), model.config.hidden_size, generator=g).to(torch.bfloat16)
                got = attention_block(layer, x, fused_batch, x)
                want = x + layer.self_attn(layer.input_layernorm(x), module_batch)
                assert got is not None, f"layer {layer.layer}"
                torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
                assert (got == want).float().mean() > 0.9
                blocks += 1
            for l in fused_cache.pages.latent:
                assert torch.equal(fused_cache.pages.latent_rows(l), module_cache.pages.latent_rows(l))
    assert blocks > 0


def test_blocks_step_aside_where_they_do_not_apply(make_checkpoint, monkeypatch):
    monkeypatch.setattr(fused_attention, "BLOCK_MAX_ROWS", 4)  # read when a layer's plans are gathered
    monkeypatch.setattr(fused_blocks, "BLOCK_MAX_ROWS", 8)
    model = native_model(make_checkpoint("kimi-linear-tiny"))
    layer = next(l for l in model.layers if isinstance(l.self_attn, KimiDeltaAttention) and isinstance(l.ffn, MoE))
    cache = PagedCache(PagePool(model.config, 8, 16, torch.bfloat16), StateSlots(model.config, 8))
    d = model.config.hidden_size
    h = torch.randn(5, d).to(torch.bfloat16)
    assert attention_block(layer, h, decode_batch(cache, [0, 1, 2, 3, 4], 3, model.config), h) is None  # > 4 rows
    big = torch.randn(9, d).to(torch.bfloat16)
    assert ffn_block(layer, big, big) is None  # > 8 rows
    assert ffn_block(layer, h.float(), None) is None
    assert ffn_block(layer, h, h[:2]) is None  # a residual of another shape
    chunk = StepBatch.single(2, 3, cache, SeqHandle(0, torch.arange(5)))
    assert chunk.decode_slots is None and chunk.decode_context_rows is None  # a prefill chunk is not a decode step
    mla = next(l for l in model.layers if not isinstance(l.self_attn, KimiDeltaAttention))
    assert attention_block(mla, h[:2], chunk, None) is None  # MLA blocks take decode steps only
    chunk.kda_snapshots = [[(1, 0)]]  # a snapshot inside the chunk: the module cuts the chunk there
    assert attention_block(layer, h[:2], chunk, None) is None
    layer.ffn.experts.native = False
    assert ffn_block(layer, h[:1], None) is None


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
    assert enable_native_kernels(router) == 1
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


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k31-tiny"])
def test_engine_decode_runs_through_the_blocks(make_checkpoint, monkeypatch, preset):
    """A bf16 engine's decode steps take the fused blocks layer by layer (the whole-stack call off:
    tests/test_fused_stack.py), and its greedy tokens are those of the modules."""
    path = make_checkpoint(preset)
    taken = []

    def counted(block):
        def run(*args):
            out = block(*args)
            taken.append(out is not None)
            return out
        return run

    monkeypatch.setattr(decoder, "attention_block", counted(attention_block))
    monkeypatch.setattr(decoder, "ffn_block", counted(ffn_block))
    fused, modules = fused_and_module_tokens(path, random_prompts([9, 30, 17], seed=5, high=700), stack=False)
    assert fused == modules
    assert sum(taken) > 0.5 * len(taken)
