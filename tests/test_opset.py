"""`--ops reference` swaps every op for its readable twin; the engine's greedy output is the same either way."""

import dataclasses

import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.engine.config import CACHE_8BIT
from deltaserve.layers.kda import KimiDeltaAttention
from deltaserve.layers.mla import MLAttention
from deltaserve.ops.opset import OP_SETS, get_ops
from engine_utils import assert_pools_free, assert_same_greedy, make_llm, new_stats


def test_reference_set_is_made_of_twins():
    fast, ref = get_ops("fast"), get_ops("reference")
    for name in ("kda_chunk", "kda_recurrent", "short_conv", "attn_res_mix", "kda_decode_step", "kda_step_varlen",
                 "kda_gate_beta", "qsfa", "mla_preprocess"):
        assert getattr(ref, name).__name__ == getattr(fast, name).__name__ + "_ref", name
    assert set(OP_SETS) == {"fast", "reference", "native"}
    with pytest.raises(ValueError, match="unknown op set"):
        get_ops("turbo")


@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny"])
def test_engine_greedy_output_is_the_same_with_reference_ops(make_checkpoint, preset, monkeypatch):
    path = make_checkpoint(preset)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 700, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 28, 55)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    batched_rows = []
    original = KimiDeltaAttention._decode_batched

    def spy(self, qkv, *args):
        batched_rows.append(qkv.shape[0])
        return original(self, qkv, *args)

    monkeypatch.setattr(KimiDeltaAttention, "_decode_batched", spy)
    sparse_calls = []
    original_sparse = MLAttention._sparse_paged

    def sparse_spy(self, *args):
        sparse_calls.append(self.layer)
        return original_sparse(self, *args)

    monkeypatch.setattr(MLAttention, "_sparse_paged", sparse_spy)
    varlen_seqs = []
    original_varlen = KimiDeltaAttention._prefill_varlen

    def varlen_spy(self, qkv, g, beta, core, seqs, *args):
        varlen_seqs.append(len(seqs))
        return original_varlen(self, qkv, g, beta, core, seqs, *args)

    monkeypatch.setattr(KimiDeltaAttention, "_prefill_varlen", varlen_spy)
    fast_llm = make_llm(path, max_num_batched_tokens=48, backend="torch")
    fast = fast_llm.generate(prompts, params, use_tqdm=False)
    assert max(batched_rows) > 1  # decode tokens of several sequences went through one batched op
    assert max(varlen_seqs) > 1  # prefill chunks of several sequences went through one varlen op
    # K3.1: every DSA layer ran QLI + QSFA over the pages (fast set); the reference set never does
    assert bool(sparse_calls) == (fast_llm.engine.config.has_dsa)
    sparse_calls.clear()
    ref_llm = make_llm(path, max_num_batched_tokens=48, ops="reference")
    ref = ref_llm.generate(prompts, params, use_tqdm=False)
    assert ref_llm.engine.runner.ops.name == "reference" and fast_llm.engine.runner.ops.name == "fast"
    assert not sparse_calls
    stats = new_stats(f"ops fast vs reference {preset}")
    for p, a, b in zip(prompts, fast, ref):
        assert_same_greedy(a.outputs[0].token_ids, p, fast_llm.engine.model, stats)
        assert_same_greedy(b.outputs[0].token_ids, p, ref_llm.engine.model, stats)
        if a.outputs[0].token_ids != b.outputs[0].token_ids:
            stats.near_ties.append("fast != reference")
    stats.assert_rare()
    assert_pools_free(fast_llm.engine)
    assert_pools_free(ref_llm.engine)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8bit_indexer_key_cache(make_checkpoint, monkeypatch, fmt):
    """--index-cache-dtype int8|fp8: keys live Hadamard-rotated in 8 bits with a per-token scale, reads give them
    back in model space within 8-bit rounding, and the engine's QLI selections over the 8-bit pages agree with
    selections over the same keys dequantised (only the query's rounding differs: ~1e-2 relative on the scores for
    int8, a few % for e4m3, so a row may swap a key at a near-tie). Short prompts (every key selected) give exactly the fp32-cache tokens."""
    from deltaserve.ops.qli import hadamard, qli_topk

    path = make_checkpoint("k31-tiny")
    g = torch.Generator().manual_seed(12)
    exact = make_llm(path, max_num_batched_tokens=64)
    q8 = make_llm(path, max_num_batched_tokens=64, index_cache_dtype=fmt)
    config, pages = q8.engine.config, q8.engine.pages
    layer = config.dsa_layers[0]
    dtype = CACHE_8BIT[fmt]
    assert pages.index_keys[layer].dtype == dtype and pages.index_scales[layer].dtype == torch.float32
    assert (pages.bytes_per_token(config, torch.float32, keys_8bit=dtype)
            < exact.engine.pages.bytes_per_token(config, torch.float32))
    keys = torch.randn(5, config.index_head_dim, generator=g)
    rows = torch.tensor([3, 17, 18, 40, 63])
    pages.write(layer, rows, torch.zeros(5, pages.latent[layer].shape[-1]), keys)
    _, back = pages.read(layer, rows)
    # L2 error: the rotation is orthonormal, so the error of the rotated 8-bit values carries over unchanged
    step = (keys.norm(dim=1) * 2 ** -4) if fmt == "fp8" else hadamard(keys).abs().amax(1) / 254 * keys.shape[1] ** 0.5
    assert ((back - keys).norm(dim=1) <= step * 1.0001).all()

    agree, total = [0], [0]
    original = MLAttention._sparse_paged

    def check(self, q_nope, q_pe, iq, iw, pages_, batch):
        latent, key_rows, scales = pages_
        if scales is None:  # the fp32-cache engine of this test
            return original(self, q_nope, q_pe, iq, iw, pages_, batch)
        fast = qli_topk(iq, iw, key_rows, scales, batch.index_meta, quantized=True, rotate=True)
        dequant = hadamard(key_rows.float() * scales.unsqueeze(-1))
        ref = qli_topk(iq, iw, dequant, None, batch.index_meta, quantized=False, rotate=False)
        for a, b in zip(fast.tolist(), ref.tolist()):
            agree[0] += set(a) == set(b)
            total[0] += 1
        return original(self, q_nope, q_pe, iq, iw, pages_, batch)

    monkeypatch.setattr(MLAttention, "_sparse_paged", check)
    long_prompts = [torch.randint(5, 700, (n,), generator=g).tolist() for n in (30, 45, 60)]
    short_prompts = [torch.randint(5, 700, (n,), generator=g).tolist() for n in (8, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    q8.generate(long_prompts, params, use_tqdm=False)
    print(f"{fmt}: {agree[0]} of {total[0]} rows select the same keys")
    assert total[0] > 100 and agree[0] >= 0.9 * total[0], (agree, total)
    a = exact.generate(short_prompts, params, use_tqdm=False)
    b = q8.generate(short_prompts, params, use_tqdm=False)
    assert [x.outputs[0].token_ids for x in a] == [y.outputs[0].token_ids for y in b]
    assert_pools_free(q8.engine)


def test_engine_runs_mlapo_with_weights_fused_once(make_checkpoint, monkeypatch):
    """On the fast set every DSA layer's pre-processing is one MLAPO call per step (fused input GEMM, cache writes
    at the step's rows). The fused weights are built once per layer for the engine's lifetime and rebuilt when a
    source weight changes in place, so they never go stale: the changed weight changes the output exactly as it
    does on the reference path, which never fuses."""
    from deltaserve.ops import mlapo

    path = make_checkpoint("k31-tiny")
    calls, fuses = [], []
    original_pre, original_fuse = mlapo.mla_preprocess, mlapo.MLAWeights.fuse

    def pre_spy(x, *args, **kwargs):
        calls.append(x.shape[0])
        return original_pre(x, *args, **kwargs)

    def fuse_spy(self):
        fuses.append(self)
        return original_fuse(self)

    monkeypatch.setitem(OP_SETS, "fast", dataclasses.replace(OP_SETS["fast"], mla_preprocess=pre_spy))
    monkeypatch.setattr(mlapo.MLAWeights, "fuse", fuse_spy)
    prompts = [torch.randint(5, 700, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (30, 7, 44)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    fast = make_llm(path, max_num_batched_tokens=32, backend="torch")
    ref = make_llm(path, max_num_batched_tokens=32, ops="reference")
    n_dsa = len(fast.engine.config.dsa_layers)
    before = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    assert len(calls) == n_dsa * fast.engine.num_steps and len(fuses) == n_dsa
    assert before == [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    assert len(calls) == n_dsa * fast.engine.num_steps  # the reference set never calls MLAPO

    for llm in (fast, ref):
        with torch.no_grad():
            for layer in llm.engine.config.dsa_layers:
                llm.engine.model.layers[layer].self_attn.kv_a_proj_with_mqa.weight.mul_(-3.0)
    after = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    assert len(fuses) == 2 * n_dsa  # rebuilt once after the change
    assert after != before
    assert after == [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    assert_pools_free(fast.engine)
    assert_pools_free(ref.engine)
