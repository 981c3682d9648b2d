"""The C8 (8-bit) KV cache, `--kv-cache-dtype int8|fp8` (docs/ops.md §9): byte layout of the latent pages, what only
the touched rows cost, the memory accounting, and greedy agreement with the model-dtype cache."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.cache.page_pool import PagePool, c8_row_bytes
from deltaserve.config import ModelConfig
from deltaserve.engine.config import CACHE_8BIT, EngineArgs
from deltaserve.engine.pools import size_pools
from deltaserve.ops.qsfa import quantize_latent
from deltaserve.tools.presets import get_preset
from engine_utils import assert_pools_free, make_llm, random_prompts

from deltaserve.default_model import default_model_path


def _config(preset: str) -> ModelConfig:
    return ModelConfig.from_dict(get_preset(preset).config)


def test_bytes_per_token_at_k31_pro_shapes():
    """docs/ops.md §9: 1152 -> 656 bytes a token per MLA/DSA layer, 256 -> 132 per DSA layer's indexer key (bf16)."""
    c = _config("k31-pro")
    assert c8_row_bytes(c, torch.bfloat16) == 656
    n_mla, n_dsa = len(c.mla_layers), len(c.dsa_layers)
    bf16 = PagePool.bytes_per_token(c, torch.bfloat16)
    for dt in CACHE_8BIT.values():
        assert PagePool.bytes_per_token(c, torch.bfloat16, dt, dt) == 656 * n_mla + 132 * n_dsa
    assert bf16 == 1152 * n_mla + 256 * n_dsa


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_tokens_that_fit(kv):
    """Same kv_cache_memory: the C8 pool holds >= 1.7x the bf16 pool's tokens at K3.1 shapes (k31-small: r = 512,
    rho = 64). At k31-tiny's toy shapes (r = 32) the per-row scale and the unquantised k_pe weigh more (~1.5x)."""
    c = _config("k31-small")
    base = dict(dtype="bfloat16", max_num_seqs=1, enable_prefix_caching=False, kv_cache_memory="48MiB",
                block_size=16)
    fits = {}
    for name in ("auto", kv):
        sizes = size_pools(c, EngineArgs(kv_cache_dtype=name, **base), torch.bfloat16, ())
        fits[name] = sizes.num_blocks * base["block_size"]
    assert fits[kv] >= 1.7 * fits["auto"], fits


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_latent_page_layout_and_round_trip(kv):
    """One byte page per layer, rows of [r values | r/128 fp32 scales | k_pe in the model dtype]: the bytes are
    exactly those of the quantiser's output, k_pe is bit-exact, other rows are untouched, and reads dequantise
    within half a quantisation step (int8: amax/254 per tile; e4m3: |x| 2^-4, or s 2^-10 when subnormal)."""
    c = _config("k31-small")
    dt = CACHE_8BIT[kv]
    pool = PagePool(c, 3, 4, torch.bfloat16, latent_8bit=dt, keys_8bit=dt)
    layer = c.mla_layers[0]
    r, rho = c.kv_lora_rank, c.qk_rope_head_dim
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, r + rho, generator=g) * torch.tensor([1.0, 30.0, 1e-3, 1.0, 4.0]).unsqueeze(1))
    x = x.to(torch.bfloat16)
    x[3, :r] = 0
    rows = torch.tensor([0, 5, 6, 11, 2])
    keys = torch.randn(5, c.index_head_dim, generator=g)
    pool.write(layer, rows, x, keys if layer in c.dsa_layers else None)
    page = pool.named_storage()[f"latent.{layer}"].view(-1, 656)
    want = quantize_latent(x, r, 128, dt)
    for i, row in enumerate(rows.tolist()):
        assert torch.equal(page[row, :r], want.values[i].view(torch.uint8))
        assert torch.equal(page[row, r:r + 16], want.scales[i].contiguous().view(torch.uint8))
        assert torch.equal(page[row, r + 16:], x[i, r:].contiguous().view(torch.uint8))
    untouched = [j for j in range(12) if j not in rows.tolist()]
    assert (page[untouched] == 0).all()
    back, _ = pool.read(layer, rows)
    assert back.dtype == torch.bfloat16 and torch.equal(back[:, r:], x[:, r:])
    assert (back[3, :r] == 0).all()
    xf, bf = x[:, :r].float().view(5, r // 128, 128), back[:, :r].float().view(5, r // 128, 128)
    amax = xf.abs().amax(-1, keepdim=True)
    if kv == "int8":
        bound = amax / 254
    else:
        bound = torch.maximum(xf.abs() * 2 ** -4, amax / 448 * 2 ** -10)
    # + one bf16 rounding of the dequantised value on the way out
    assert ((bf - xf).abs() <= bound * 1.0001 + bf.abs() * 2 ** -8).all()


@pytest.mark.slow
def test_c8_fast_ops_equal_reference_ops(make_checkpoint):
    """With a C8 latent the fast path (QLI + QSFA gathering and dequantising only the selected rows) and the
    reference path (whole sequence dequantised, dense indexer + masked attention) read the same stored bytes, so
    greedy output is identical. Keys stay in the model dtype here so both paths select from the same scores."""
    path = make_checkpoint("k31-tiny")
    prompts = random_prompts([20, 37, 50, 9], seed=4, high=700)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for ops in ("fast", "reference"):
        llm = make_llm(path, kv_cache_dtype="int8", index_cache_dtype="model", ops=ops)
        assert llm.engine.pages.latent_8bit == torch.int8 and llm.engine.pages.keys_8bit is None
        outs[ops] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_pools_free(llm.engine)
    assert outs["fast"] == outs["reference"]


@pytest.mark.slow
def test_c8_greedy_agreement_with_model_dtype_cache():
    """Greedy tokens with the C8 cache (latent and indexer keys in 8 bits) against the model-dtype cache over a fixed
    prompt set: at least 4 of the 6 sequences identical, and where one differs, it first differs at a near-tie of the
    model-dtype run (its top-2 logprobs within 0.1 nats), a choice an 8-bit rounding of the context may flip; after
    that the two sequences continue from different tokens, so positions after a flip say nothing about the cache.
    Which near-ties flip depends on the CPU's bf16 kernels (AMX tiles or AVX-512 BF16 sum in different orders): one
    sequence of six on the Xeon with AMX, two on an AMD EPYC with AVX-512 BF16, each at such a near-tie.
    Measured on the trained default model (a K3.1 model: KDA + DSA + AttnRes + latent MoE): the random tiny presets
    have near-uniform next-token distributions (top-2 logprob gaps ~0.1), so any rounding flips their argmax and
    agreement there says nothing about the cache."""
    text = (default_model_path().parent / "validation.txt").read_text()
    prompts = [text[s:s + 300] for s in (0, 9000, 21000, 33000, 47000, 60000)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    runs = {}
    for kv in ("auto", "int8", "fp8"):
        llm = LLM(None, kv_cache_dtype=kv, max_num_batched_tokens=256, kv_cache_memory="64MiB")
        runs[kv] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_pools_free(llm.engine)
    for kv in ("int8", "fp8"):
        differ = 0
        for base, c8 in zip(runs["auto"], runs[kv]):
            first = next((i for i, (a, b) in enumerate(zip(base.token_ids, c8.token_ids)) if a != b), None)
            if first is not None:
                differ += 1
                (_, top1), (_, top2) = base.logprobs[first].top[:2]
                assert top1 - top2 < 0.1, (kv, first, top1 - top2)
        assert differ <= 2, (kv, differ)
