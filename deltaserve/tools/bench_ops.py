"""`deltaserve bench ops`: each fast op against its reference twin at k31-small shapes (printed, never asserted).

Shapes: KDA 8 heads x 128; indexer 16 heads x 64, top-k 512; MLA 8 heads, latent 512 + 64; hidden 1024.
Cases: decode batch 1 and 16 at 4k and 32k context, and one 4k-token prefill chunk; QLI with int8 and fp8 keys;
QSFA over the model-dtype latent and the C8 latent; MLAPO (fused pre-processing + page writes) at decode and
prefill sizes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..config import ModelConfig
from ..layers.mla import MLAttention
from ..ops import attn_res, kda, kda_batched, mlapo, qli, qsfa
from .presets import get_preset

H_KDA, K_KDA, H_I, D_I, TOPK, H_MLA, R, RHO, D_MODEL, BLOCK = 8, 128, 16, 64, 512, 8, 512, 64, 1024, 64


def _time(fn: Callable, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _kda_inputs(T: int, gen: torch.Generator):
    q = kda.l2_normalize(torch.randn(T, H_KDA, K_KDA, generator=gen))
    k = kda.l2_normalize(torch.randn(T, H_KDA, K_KDA, generator=gen))
    v = torch.randn(T, H_KDA, K_KDA, generator=gen)
    g = -5 * torch.sigmoid(torch.randn(T, H_KDA, K_KDA, generator=gen))
    beta = torch.sigmoid(torch.randn(T, H_KDA, generator=gen))
    return q, k, v, g, beta


def _dsa_case(batch: int, context: int, gen: torch.Generator):
    blocks = -(-context // BLOCK)
    tables = [torch.arange(i * blocks, (i + 1) * blocks) for i in range(batch)]
    rows = batch * blocks * BLOCK
    keys, scales = qli.quantize_index_keys(torch.randn(rows, D_I, generator=gen))
    positions = torch.full((batch,), context - 1)
    meta = qli.build_index_meta(tables, [context] * batch, torch.arange(batch), positions, BLOCK, TOPK)
    q = torch.randn(batch, H_I, D_I, generator=gen)
    w = torch.randn(batch, H_I, generator=gen) * H_I ** -0.5
    latent = torch.randn(rows, R + RHO, generator=gen)
    return meta, q, w, keys, scales, latent


def run_ops_bench(repeats: int = 3) -> str:
    gen = torch.Generator().manual_seed(0)
    lines = [f"{'op':<44}{'fast ms':>10}{'ref ms':>10}{'speedup':>9}"]

    def row(name: str, fast: Callable, ref: Callable, reps: int = repeats) -> None:
        tf, tr = _time(fast, reps), _time(ref, max(1, reps // 3))
        lines.append(f"{name:<44}{tf * 1e3:>10.2f}{tr * 1e3:>10.2f}{tr / tf:>8.1f}x")

    q, k, v, g, beta = _kda_inputs(4096, gen)
    row("kda_chunk prefill 4k tokens", lambda: kda.kda_chunk(q, k, v, g, beta),
        lambda: kda.kda_chunk_ref(q, k, v, g, beta), reps=1)
    for n in (1, 16):
        q, k, v, g, beta = _kda_inputs(n, gen)
        states = torch.randn(32, H_KDA, K_KDA, K_KDA, generator=gen) * 0.1
        slots = torch.arange(n)
        row(f"kda_decode_batched batch {n}", lambda: kda_batched.kda_decode_batched(q, k, v, g, beta, None, states, slots),
            lambda: kda_batched.kda_decode_batched_ref(q, k, v, g, beta, None, states, slots))
    for n in (1, 16):
        for ctx in (4096, 32768):
            meta, qq, w, keys, scales, latent = _dsa_case(n, ctx, gen)
            row(f"qli_topk decode batch {n} ctx {ctx // 1024}k", lambda: qli.qli_topk(qq, w, keys, scales, meta),
                lambda: qli.qli_topk_ref(qq, w, keys, scales, meta))
            sel = qli.qli_topk(qq, w, keys, scales, meta)
            q_lat = torch.randn(n, H_MLA, R, generator=gen)
            q_pe = torch.randn(n, H_MLA, RHO, generator=gen)
            row(f"qsfa decode batch {n} ctx {ctx // 1024}k", lambda: qsfa.qsfa(q_lat, q_pe, latent, sel, 0.07),
                lambda: qsfa.qsfa_ref(q_lat, q_pe, latent, sel, 0.07))
    f8, f8_scales = qli.quantize_index_keys(torch.randn(16 * 32768, D_I, generator=gen), dtype=torch.float8_e4m3fn)
    meta, qq, w, _, _, latent = _dsa_case(16, 32768, gen)
    row("qli_topk fp8 keys decode batch 16 ctx 32k", lambda: qli.qli_topk(qq, w, f8, f8_scales, meta),
        lambda: qli.qli_topk_ref(qq, w, f8, f8_scales, meta))
    c8 = qsfa.quantize_latent(latent, R)
    sel = qli.qli_topk(qq, w, f8, f8_scales, meta)
    q_lat, q_pe = torch.randn(16, H_MLA, R, generator=gen), torch.randn(16, H_MLA, RHO, generator=gen)
    row("qsfa C8 latent decode batch 16 ctx 32k", lambda: qsfa.qsfa(q_lat, q_pe, c8, sel, 0.07),
        lambda: qsfa.qsfa_ref(q_lat, q_pe, c8, sel, 0.07))
    weights = _mla_weights(gen)
    for n in (1, 16, 4096):
        x = torch.randn(n, D_MODEL, generator=gen)
        rows = torch.arange(n)
        pages = torch.zeros(n, R + RHO)
        keys = torch.zeros(n, D_I)
        row(f"mla_preprocess {n} tokens", lambda: mlapo.mla_preprocess(x, weights, out_rows=rows, latent_cache=pages,
                                                                       index_cache=keys),
            lambda: mlapo.mla_preprocess_ref(x, weights, out_rows=rows, latent_cache=pages, index_cache=keys),
            reps=repeats if n < 4096 else 1)
    sources = [torch.randn(4096, D_MODEL, generator=gen) for _ in range(5)]
    query, norm = torch.randn(D_MODEL, generator=gen), torch.ones(D_MODEL)
    row("attn_res_mix 5 sources x 4k tokens", lambda: attn_res.attn_res_mix(sources, query, norm, 1e-5),
        lambda: attn_res.attn_res_mix_ref(sources, query, norm, 1e-5))
    return f"threads={torch.get_num_threads()}\n" + "\n".join(lines)


def _mla_weights(gen: torch.Generator) -> mlapo.MLAWeights:
    """A k31-small DSA layer's weights (random), fused once as the engine does."""
    config = ModelConfig.from_dict(get_preset("k31-small").config)
    layer = MLAttention(config, config.dsa_layers[0], True)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return mlapo.MLAWeights.from_layer(layer).fuse()
