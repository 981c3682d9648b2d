/* Routed experts over column-packed weights: the outer-product form of the expert products.
 *
 * Why: at prefill each expert sees a handful of tokens (128 tokens x top-4 of 64 experts: ~8 each). The
 * dot-product tiles of products.c spend a good part of their time there in horizontal sums and spills, and fall
 * behind oneDNN's GEMM with the weights in cache. Here a tile of up to MAX_T tokens keeps 4 zmm accumulators of 64
 * output columns per token; each step loads 64 columns x one pair of k (4 zmm, the weights in VNNI pair order) and
 * multiplies them by each token's broadcast pair of inputs, with no reductions, so the experts run faster than on
 * the row packs at prefill and at decode.
 *
 * Layout (ops/native.py pack_columns): per [N, K] matrix, blocks of COL_BLOCK output columns, each
 * [ceil(K/2)][COL_BLOCK][2] with columns and K zero-padded: one block is one sequential stream.
 *
 * Weights stream once from DRAM: for an expert of up to TILED_TOKENS tokens a block is walked in chunks of K_CHUNK
 * pairs (8 KiB), and every token tile of the expert runs over a chunk while it sits in L1 (the tiles' sums wait in
 * an fp32 scratch between chunks), so the stream is consumed at an even rate and the prefetchers keep DRAM busy
 * during the multiplies; above it the multiplies dominate and each tile runs the whole block (block_product).
 *
 * With `tiles` on and the AMX tile unit present (tiles.c), products of TILE_MIN_ROWS rows or more run there instead:
 * an expert's input rows are gathered once into one strided matrix (xg) and its hidden rows are written in expert
 * order (h + s * I), so both read as A tiles in place. */
#include "kernels.h"

#define K_CHUNK 32      /* k pairs per chunk: 32 x 64 x 2 bf16 = 8 KiB (larger chunks gain nothing) */
#define TILED_TOKENS 24 /* above this many tokens an expert's tiles each run the whole K (see block_product) */
#define DOWN_GROUP 4    /* down-product blocks per phase-2 item: 128 KiB of one expert's stream at I = 256 */
#define MAX_T 6         /* tokens per register tile: 6 x 4 accumulators + 4 weight vectors */

static inline int64_t pairs_of(int64_t K) { return (K + 1) / 2; }

/* The pair (x[2p], x[2p+1]) of a row of K bf16 as one 32-bit word (x[K] read as 0 when K is odd). */
static inline int32_t input_pair(const bf16 *x, int64_t p, int64_t K) {
    uint32_t lo = x[2 * p], hi = 2 * p + 1 < K ? x[2 * p + 1] : 0;
    return (int32_t)(lo | hi << 16);
}

/* acc[i][c] += sum_{p in [p0, p1)} x_i[2p] w[p][c][0] + x_i[2p+1] w[p][c][1] for NT tokens and the block's 64
 * columns c; w is the block's [pairs][64][2] stream from pair p0 on, acc [NT][64] fp32. NT is a compile-time constant at every
 * call (see outer_tile), so the accumulators stay in registers. `stream`: w is a weight stream to prefetch ahead
 * in; 0 for a decoded chunk already in L1 (prefetching past its end would ask for pages nobody has touched, each a
 * page walk that finds nothing). */
static inline __attribute__((always_inline)) void outer_tile_n(const bf16 *const *x, const int NT, const bf16 *w,
                                                               int64_t p0, int64_t p1, int64_t K, int stream,
                                                               float *acc) {
#if defined(__AVX512BF16__)
    __m512 a[MAX_T][4];
    for (int i = 0; i < NT; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm512_loadu_ps(acc + i * COL_BLOCK + 16 * j);
    int64_t full = K / 2 < p1 ? K / 2 : p1; /* pairs with both inputs inside the row */
    int64_t p = p0;
    for (; p < full; p++) {
        const bf16 *wp = w + (p - p0) * 2 * COL_BLOCK;
        /* the stream ahead into L2 and L1 (every tile: the first one reads DRAM; the L1 part keeps the loads from
         * waiting on L2, as in the dot tiles) */
        if (stream)
            for (int j = 0; j < 4; j++) ask_stream(wp + 32 * j);
        __m512i wv[4];
        for (int j = 0; j < 4; j++) wv[j] = _mm512_loadu_si512(wp + 32 * j);
        for (int i = 0; i < NT; i++) {
            int32_t xp;
            memcpy(&xp, x[i] + 2 * p, 4);
            __m512i xb = _mm512_set1_epi32(xp);
            for (int j = 0; j < 4; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], (__m512bh)xb, (__m512bh)wv[j]);
        }
    }
    for (; p < p1; p++) { /* the last pair of an odd K */
        const bf16 *wp = w + (p - p0) * 2 * COL_BLOCK;
        for (int i = 0; i < NT; i++) {
            __m512i xb = _mm512_set1_epi32(input_pair(x[i], p, K));
            for (int j = 0; j < 4; j++)
                a[i][j] = _mm512_dpbf16_ps(a[i][j], (__m512bh)xb, (__m512bh)_mm512_loadu_si512(wp + 32 * j));
        }
    }
    for (int i = 0; i < NT; i++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + i * COL_BLOCK + 16 * j, a[i][j]);
#elif defined(__AVX2__) && defined(__FMA__)
    /* VW vectors of 8 columns per row at a time, so NT x VW sums stay in the 16 registers and enough of them are
     * independent to cover the FMA latency; the order of each column's sum does not depend on NT. Each pair word
     * gives an even and an odd fp32 vector (bf16 widening is a shift). The inputs of K_CHUNK pairs are widened once
     * into xf and broadcast from there for every group of columns. */
    const int VW = NT == 1 ? 8 : NT == 2 ? 4 : 2;
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    float xf[MAX_T][2 * K_CHUNK];
    for (int64_t c0 = p0; c0 < p1; c0 += K_CHUNK) {
        const int64_t c1 = c0 + K_CHUNK < p1 ? c0 + K_CHUNK : p1;
        for (int i = 0; i < NT; i++)
            for (int64_t p = c0; p < c1; p++) {
                uint32_t xp = (uint32_t)input_pair(x[i], p, K);
                xf[i][2 * (p - c0)] = bf16_to_f32((bf16)(xp & 0xffff));
                xf[i][2 * (p - c0) + 1] = bf16_to_f32((bf16)(xp >> 16));
            }
        for (int q = 0; q < COL_BLOCK; q += 8 * VW) {
            __m256 a[MAX_T][8];
            for (int i = 0; i < NT; i++)
                for (int v = 0; v < VW; v++) a[i][v] = _mm256_loadu_ps(acc + i * COL_BLOCK + q + 8 * v);
            for (int64_t p = c0; p < c1; p++) {
                const bf16 *wp = w + (p - p0) * 2 * COL_BLOCK + 2 * q;
                if (stream && q == 0)
                    for (int j = 0; j < 4; j++) ask_stream(wp + 32 * j);
                for (int v = 0; v < VW; v++) {
                    __m256i wv = _mm256_loadu_si256((const __m256i *)(wp + 16 * v));
                    __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
                    __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
                    for (int i = 0; i < NT; i++) {
                        const float *xi = xf[i] + 2 * (p - c0);
                        a[i][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xi), even, a[i][v]);
                        a[i][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xi + 1), odd, a[i][v]);
                    }
                }
            }
            for (int i = 0; i < NT; i++)
                for (int v = 0; v < VW; v++) _mm256_storeu_ps(acc + i * COL_BLOCK + q + 8 * v, a[i][v]);
        }
    }
#else
    for (int i = 0; i < NT; i++)
        for (int64_t p = p0; p < p1; p++) {
            int32_t xp = input_pair(x[i], p, K);
            float x0 = bf16_to_f32((bf16)(xp & 0xffff)), x1 = bf16_to_f32((bf16)((uint32_t)xp >> 16));
            for (int c = 0; c < COL_BLOCK; c++)
                acc[i * COL_BLOCK + c] += x0 * bf16_to_f32(w[((p - p0) * COL_BLOCK + c) * 2]) +
                                          x1 * bf16_to_f32(w[((p - p0) * COL_BLOCK + c) * 2 + 1]);
        }
#endif
}

static inline void outer_tile(const bf16 *const *x, int nt, const bf16 *w, int64_t p0, int64_t p1, int64_t K,
                              int stream, float *acc) {
    switch (nt) {
    case 1: outer_tile_n(x, 1, w, p0, p1, K, stream, acc); break;
    case 2: outer_tile_n(x, 2, w, p0, p1, K, stream, acc); break;
    case 3: outer_tile_n(x, 3, w, p0, p1, K, stream, acc); break;
    case 4: outer_tile_n(x, 4, w, p0, p1, K, stream, acc); break;
    case 5: outer_tile_n(x, 5, w, p0, p1, K, stream, acc); break;
    default: outer_tile_n(x, 6, w, p0, p1, K, stream, acc); break;
    }
}

/* acc [m][64] = rows x[0..m) (K bf16 each) times one block wb of a column-packed matrix, in fp32. A few tokens
 * walk the block in chunks that each serve every tile from L1 (the stream is consumed at an even rate); past
 * TILED_TOKENS each tile runs the whole K with its sums in registers and re-reads the block from L2: chunked,
 * the sums of many tokens (2 x 32 KiB for gate and up at 128 tokens) would go through L1/L2 once a chunk, which
 * costs more than re-reading the block. */
static void block_product(const bf16 *const *x, int64_t m, const bf16 *wb, int64_t K, float *acc) {
    memset(acc, 0, sizeof(float) * (size_t)(m * COL_BLOCK));
    int64_t chunk = m > TILED_TOKENS ? pairs_of(K) : K_CHUNK;
    for (int64_t p0 = 0; p0 < pairs_of(K); p0 += chunk) {
        int64_t p1 = p0 + chunk < pairs_of(K) ? p0 + chunk : pairs_of(K);
        for (int64_t i0 = 0; i0 < m; i0 += MAX_T)
            outer_tile(x + i0, m - i0 < MAX_T ? (int)(m - i0) : MAX_T, wb + p0 * 2 * COL_BLOCK, p0, p1, K, 1,
                       acc + i0 * COL_BLOCK);
    }
}

/* block_product for rows that are also one matrix at a stride (x, ld): with `tiles` and TILE_MIN_ROWS rows or more,
 * K's whole groups of 32 run on the tile unit (tiles.c) and the pairs past them on the pair products here. */
static void bf16_rows_product(const bf16 *const *rows, const bf16 *x, int64_t ld, int64_t m, const bf16 *w,
                              int64_t b, int64_t K, int tiles, float *acc) {
    if (!tiles || m < TILE_MIN_ROWS) {
        block_product(rows, m, w + b * COL_BLOCK * 2 * pairs_of(K), K, acc);
        return;
    }
    tile_block_product(x, ld, m, w, b, K, acc);
    int64_t p0 = K / 32 * 16;
    for (int64_t i0 = 0; p0 < pairs_of(K) && i0 < m; i0 += MAX_T)
        outer_tile(rows + i0, m - i0 < MAX_T ? (int)(m - i0) : MAX_T, w + (b * pairs_of(K) + p0) * 2 * COL_BLOCK,
                   p0, pairs_of(K), K, 1, acc + i0 * COL_BLOCK);
}

/* bf16 elements of the per-thread scratch rows_product decodes an MX block of K into (none for bf16) */
static inline int64_t decode_scratch(const mx_matrix *w, int64_t K) {
    return w->format == MAT_BF16 ? 0 : pairs_of(K) * 2 * COL_BLOCK;
}

/* bf16_rows_product over block b of any column-packed matrix w (mx.c). On the tile unit (from TILE_MIN_ROWS rows, as
 * bf16 products), up to TILE_MAX_ROWS rows take tile_mx_block (a group of 32 of K decoded into `scratch`, then
 * multiplied); more rows decode the whole block once, which the bf16 product then reads as its one block. Off it,
 * up to MX_FEW_ROWS rows take mx_block_few, which decodes in registers; more decode a chunk of K_CHUNK pairs at a
 * time into `scratch` (decode_scratch elements), each serving every token tile from L1 as block_product's chunks
 * do, or past TILED_TOKENS rows the whole block. */
static void rows_product(const bf16 *const *rows, const bf16 *x, int64_t ld, int64_t m, const mx_matrix *w,
                         int64_t b, int64_t K, int tiles, float *acc, bf16 *scratch) {
    if (w->format == MAT_BF16) {
        bf16_rows_product(rows, x, ld, m, (const bf16 *)w->data, b, K, tiles, acc);
        return;
    }
    int64_t pairs = pairs_of(K);
    const int tiled = tiles && m >= TILE_MIN_ROWS;
    if (tiled && m <= TILE_MAX_ROWS) {
        tile_mx_block(x, ld, m, w, b, K, acc, scratch);
        return;
    }
#if MX_FEW_ROWS
    if (m <= MX_FEW_ROWS && !tiled) {
        mx_block_few(rows, (int)m, w, b, K, acc);
        return;
    }
#endif
    if (tiled || m > TILED_TOKENS) {
        mx_decode_pairs(w, b, 0, pairs, K, scratch);
        bf16_rows_product(rows, x, ld, m, scratch, 0, K, tiles, acc);
        return;
    }
    memset(acc, 0, sizeof(float) * (size_t)(m * COL_BLOCK));
    for (int64_t p0 = 0; p0 < pairs; p0 += K_CHUNK) {
        int64_t p1 = p0 + K_CHUNK < pairs ? p0 + K_CHUNK : pairs;
        mx_decode_pairs(w, b, p0, p1, K, scratch);
        for (int64_t i0 = 0; i0 < m; i0 += MAX_T)
            outer_tile(rows + i0, m - i0 < MAX_T ? (int)(m - i0) : MAX_T, scratch, p0, p1, K, 0,
                       acc + i0 * COL_BLOCK);
    }
}

/* dst[c] = bf16(src[c]) for the n <= COL_BLOCK columns of an expert's output row. */
static inline void round_row(const float *src, int64_t n, bf16 *dst) {
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= n; c += 16) store_bf16_16(dst + c, (__mmask16)0xffff, _mm512_loadu_ps(src + c));
#endif
    for (; c < n; c++) dst[c] = f32_to_bf16(src[c]);
}

/* out[c] = bf16(sum_j wt[j] y[j][c]) over a token's k expert outputs y [k][D] (bf16 rows, summed in fp32 in j
 * order from 0, as the scalar loop: equal bit for bit). */
static inline void combine_row(const bf16 *y, const float *wt, int64_t k, int64_t D, bf16 *out) {
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c < D; c += 16) {
        __mmask16 m = D - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - c)) - 1u);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; j++) {
            __m512 yj = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const __m256i *)(y + j * D + c))), 16));
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(wt[j]), yj));
        }
        store_bf16_16(out + c, m, acc);
    }
#endif
    for (; c < D; c++) {
        float acc = 0.f;
        for (int64_t j = 0; j < k; j++) acc += wt[j] * bf16_to_f32(y[j * D + c]);
        out[c] = f32_to_bf16(acc);
    }
}

/* ds_moe_bf16 over column-packed w1, w3 [E] x [I, D] and w2 [E] x [D, I] (see products.c for the contract and
 * the roundings, which are the same; only the order of each dot product's fp32 sum differs), bf16 or MX (mx.c; then
 * ds_mx_moe's contract). The pairs are grouped by expert (order/start/used as there); xrows are the pairs' input
 * rows in that order (already quantised when w1 quantises its inputs); each hidden row is quantised after its
 * activation when w2 quantises its inputs. With a shared expert (sh not NULL) every token also runs through it and out is
 * bf16(routed + shared), each rounded to bf16 first: the reference's MoE output plus its shared MLP's.
 * Phase 1: per (expert, block of 64 of I) the gate and up products and the activation into h, the shared
 * expert's blocks (all T tokens each: compute-bound) spread among the routed ones, whose stream they overlap;
 * phase 2: per (expert, DOWN_GROUP blocks of 64 of D) the down products, each pair's output rounded into y;
 * phase 3: per token the weighted sum of its k outputs (plus the shared expert's). A phase-2 item reads
 * DOWN_GROUP blocks of one expert's stream (128 KiB at I = 256) rather than one block (32 KiB): longer runs of
 * one stream read faster at 32-128 tokens, and cost nothing at 1-8. */
void moe_columns(const bf16 *const *xrows, const int64_t *order, const int64_t *start, const int64_t *used,
                 int64_t nused, int64_t T, int64_t D, int64_t k, const float *weights, const mx_matrix *w1,
                 const mx_matrix *w3, const mx_matrix *w2, int64_t I, const shared_expert *sh, const glu_act *act,
                 int tiles, bf16 *h, bf16 *out, int nthreads) {
    int64_t P = T * k, mmax = sh ? T : 0;
    for (int64_t u = 0; u < nused; u++)
        if (start[used[u] + 1] - start[used[u]] > mmax) mmax = start[used[u] + 1] - start[used[u]];
    /* the pairs' hidden rows in expert order (h + s * I for grouped pair s): each expert's rows are one strided
     * matrix, as the tile unit reads them; with tiles on, the pairs' input rows are gathered so too (xg) */
    const bf16 **hrows = malloc(sizeof(bf16 *) * (size_t)P);
    for (int64_t s = 0; s < P; s++) hrows[s] = h + s * I;
    tiles = tiles && mmax >= TILE_MIN_ROWS && ds_tiles_usable();
    bf16 *xg = tiles ? malloc(sizeof(bf16) * (size_t)(P * D)) : NULL;
    if (tiles) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t s = 0; s < P; s++) memcpy(xg + s * D, xrows[s], sizeof(bf16) * (size_t)D);
    }
    int64_t iblocks = (I + COL_BLOCK - 1) / COL_BLOCK, dblocks = (D + COL_BLOCK - 1) / COL_BLOCK;
    int64_t dgroups = (dblocks + DOWN_GROUP - 1) / DOWN_GROUP;
    /* every pair's expert output, rounded, then (with a shared expert) every token's shared output */
    bf16 *y = malloc(sizeof(bf16) * (size_t)((P + (sh ? T : 0)) * D)), *ys = y + P * D;
    int64_t IS = sh ? sh->I : 0, R = nused * iblocks, S = (IS + COL_BLOCK - 1) / COL_BLOCK, N = R + S;
    /* the shared expert's rows: every token, in order, and its hidden rows */
    const bf16 **sx = sh ? malloc(sizeof(bf16 *) * (size_t)(2 * T)) : NULL, **shrows = sh ? sx + T : NULL;
    bf16 *hs = sh ? malloc(sizeof(bf16) * (size_t)(T * IS)) : NULL;
    for (int64_t t = 0; sh && t < T; t++) {
        sx[t] = sh->x + t * D;
        shrows[t] = hs + t * IS;
    }
    /* phase 1's items in order: routed item r >= 0, shared block j as -1 - j, at evenly spaced places */
    int64_t *plan = malloc(sizeof(int64_t) * (size_t)(N + 1)), scratch = 0;
    const mx_matrix *mats[6] = {w1, w3, w2, sh ? &sh->w1 : w1, sh ? &sh->w3 : w1, sh ? &sh->w2 : w1};
    int64_t ks[6] = {D, D, I, D, D, IS};
    for (int j = 0; j < 6; j++)
        if (decode_scratch(mats[j], ks[j]) > scratch) scratch = decode_scratch(mats[j], ks[j]);
    for (int64_t i = 0, j = 0, r = 0; i < N; i++)
        plan[i] = j < S && (r == R || i >= (2 * j + 1) * N / (2 * S)) ? -1 - j++ : r++;
#pragma omp parallel num_threads(nthreads)
    {
        float *g = malloc(sizeof(float) * (size_t)(mmax * COL_BLOCK));
        float *u = malloc(sizeof(float) * (size_t)(mmax * COL_BLOCK));
        bf16 *wd = scratch ? malloc(sizeof(bf16) * (size_t)scratch) : NULL; /* decoded MX pairs */
#pragma omp for schedule(dynamic, 1) /* experts differ in token count */
        for (int64_t i = 0; i < N; i++) {
            int64_t shared = plan[i] < 0, b = shared ? -1 - plan[i] : plan[i] % iblocks;
            int64_t e = shared ? 0 : used[plan[i] / iblocks], s0 = shared ? 0 : start[e];
            int64_t m = shared ? T : start[e + 1] - s0, width = shared ? IS : I;
            int64_t n0 = b * COL_BLOCK, n = width - n0 < COL_BLOCK ? width - n0 : COL_BLOCK;
            const bf16 *const *rows = shared ? sx : xrows + s0, *xe = shared ? sh->x : tiles ? xg + s0 * D : NULL;
            mx_matrix m1 = shared ? sh->w1 : mx_at(w1, e, I, D), m3 = shared ? sh->w3 : mx_at(w3, e, I, D);
            int down_act = (int)(shared ? sh->w2.act : w2->act);
            rows_product(rows, xe, D, m, &m1, b, D, tiles, g, wd);
            rows_product(rows, xe, D, m, &m3, b, D, tiles, u, wd);
            for (int64_t r = 0; r < m; r++) {
                bf16 *hr = shared ? hs + r * IS : h + (s0 + r) * I;
                for (int64_t c = 0; c < n; c += BLOCK_ROWS)
                    glu_block(g + r * COL_BLOCK + c, u + r * COL_BLOCK + c, n - c < BLOCK_ROWS ? n - c : BLOCK_ROWS,
                              act, hr + n0 + c);
                /* the down product's input quantisation, per 32 (n0 and n are multiples of 32 then) */
                if (down_act != ACT_NONE) mx_quantize_row(hr + n0, n, down_act);
            }
        }
        /* implicit barrier: every h row is complete */
#pragma omp for schedule(dynamic, 1) /* per expert, DOWN_GROUP adjacent blocks (one stream); the shared first */
        for (int64_t i = 0; i < (nused + (sh != NULL)) * dgroups; i++) {
            int64_t shared = sh && i < dgroups, ue = i / dgroups - (sh != NULL);
            int64_t e = shared ? 0 : used[ue], s0 = shared ? 0 : start[e];
            int64_t m = shared ? T : start[e + 1] - s0;
            int64_t b1 = (i % dgroups + 1) * DOWN_GROUP < dblocks ? (i % dgroups + 1) * DOWN_GROUP : dblocks;
            for (int64_t b = i % dgroups * DOWN_GROUP; b < b1; b++) {
                int64_t n0 = b * COL_BLOCK, n = D - n0 < COL_BLOCK ? D - n0 : COL_BLOCK;
                mx_matrix m2 = shared ? sh->w2 : mx_at(w2, e, D, I);
                rows_product(shared ? shrows : hrows + s0, shared ? hs : h + s0 * I, shared ? IS : I, m, &m2, b,
                             shared ? IS : I, tiles, g, wd);
                for (int64_t r = 0; r < m; r++)
                    round_row(g + r * COL_BLOCK, n, (shared ? ys + r * D : y + order[s0 + r] * D) + n0);
            }
        }
        /* implicit barrier: every pair's output row is complete */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            combine_row(y + t * k * D, weights + t * k, k, D, out + t * D);
            if (sh) add_bf16(out + t * D, ys + t * D, D, out + t * D); /* + the shared expert, as two bf16 tensors */
        }
        free(g);
        free(u);
        free(wd);
    }
    free(y);
    free(sx);
    free(hs);
    free(plan);
    free(hrows);
    free(xg);
}

/* out [M, N] = rows of x [M, K] (row stride ldx) times a column-packed [N, K] matrix w, each output rounded to
 * bf16 once from its fp32 sum (the contract of ds_linear_bf16). Why: the linears take this above LINEAR_MAX_ROWS
 * rows (the 4-row dot tiles' range). oneDNN's packed product, the alternative there, reads a weight the experts'
 * stream has evicted from cache before it multiplies; here each 64-column block streams under its first tile's
 * multiplies (block_product), which wins with the weights cold up to a few hundred rows.
 * With `tiles` and TILE_MIN_ROWS rows or more, the blocks run on the AMX tile unit where there is one (tiles.c). */
void ds_linear_columns(const bf16 *x, int64_t M, int64_t ldx, int64_t K, const bf16 *w, int64_t N, bf16 *out,
                       int tiles, int nthreads) {
    ds_heads_columns(x, M, ldx, 0, 1, K, w, N, out, tiles, nthreads);
}

/* Per head h < H: out[:, h] = x[:, h] W_h^T, for rows of x at stride ldx with head h at column h * hx, W_h [N, K]
 * column-packed one after another (pack_columns of [H, N, K]), out [M, H * N] contiguous; each output rounded to
 * bf16 once from its fp32 sum, as ds_linear_columns (which is the case H = 1). All heads' column blocks share one
 * parallel loop: MLA's absorbed products at decode are 8 heads of 2-8 blocks each (layers/mla.py). */
void ds_heads_columns(const bf16 *x, int64_t M, int64_t ldx, int64_t hx, int64_t H, int64_t K, const bf16 *w,
                      int64_t N, bf16 *out, int tiles, int nthreads) {
    mx_matrix m = {w, NULL, MAT_BF16, ACT_NONE};
    heads_columns(x, M, ldx, hx, H, K, &m, N, out, H * N, tiles, nthreads);
}

void heads_columns(const bf16 *x, int64_t M, int64_t ldx, int64_t hx, int64_t H, int64_t K, const mx_matrix *w,
                   int64_t N, bf16 *out, int64_t ldy, int tiles, int nthreads) {
    const bf16 **rows = malloc(sizeof(bf16 *) * (size_t)(H * M));
    for (int64_t h = 0; h < H; h++)
        for (int64_t i = 0; i < M; i++) rows[h * M + i] = x + h * hx + i * ldx;
    int64_t blocks = (N + COL_BLOCK - 1) / COL_BLOCK, scratch = decode_scratch(w, K);
    tiles = tiles && ds_tiles_usable();
#pragma omp parallel num_threads(nthreads)
    {
        float *acc = malloc(sizeof(float) * (size_t)(M * COL_BLOCK));
        bf16 *wd = scratch ? malloc(sizeof(bf16) * (size_t)scratch) : NULL;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < H * blocks; item++) {
            int64_t h = item / blocks, b = item % blocks;
            int64_t n0 = b * COL_BLOCK, n = N - n0 < COL_BLOCK ? N - n0 : COL_BLOCK;
            mx_matrix wh = mx_at(w, h, N, K);
            rows_product(rows + h * M, x + h * hx, ldx, M, &wh, b, K, tiles, acc, wd);
            for (int64_t i = 0; i < M; i++) round_row(acc + i * COL_BLOCK, n, out + i * ldy + h * N + n0);
        }
        free(acc);
        free(wd);
    }
    free(rows);
}

/* An MX matrix's K must be whole blocks of 32, as must the input of a product that quantises it. */
static int mx_shape_ok(const mx_matrix *w, int64_t K) {
    return (w->format == MAT_BF16 || K % 32 == 0) && (w->act == ACT_NONE || K % 32 == 0) &&
           w->format >= MAT_BF16 && w->format <= MAT_E2M1 && w->act >= ACT_NONE && w->act <= ACT_EVEN;
}

void mx_product(const bf16 *x, int64_t M, int64_t ldx, int64_t K, const mx_matrix *w, int64_t N, bf16 *y,
                int64_t ldy, int tiles, int nthreads) {
    mx_products(x, M, ldx, K, w, &N, 1, y, ldy, tiles, nthreads);
}

void mx_products(const bf16 *x, int64_t M, int64_t ldx, int64_t K, const mx_matrix *ws, const int64_t *widths, int n,
                 bf16 *y, int64_t ldy, int tiles, int nthreads) {
    int64_t items = 0, scratch = 0, first[MX_MAX_PIECES + 1], at[MX_MAX_PIECES];
    int alike = n <= MX_MAX_PIECES;
    for (int i = 0; alike && i < n; i++) {
        alike = ws[i].act == ws[0].act;
        first[i] = items, at[i] = i ? at[i - 1] + widths[i - 1] : 0;
        items += (widths[i] + COL_BLOCK - 1) / COL_BLOCK;
        if (decode_scratch(&ws[i], K) > scratch) scratch = decode_scratch(&ws[i], K);
    }
    if (!alike) { /* each its own pass */
        for (int i = 0, col = 0; i < n; col += (int)widths[i++])
            mx_product(x, M, ldx, K, &ws[i], widths[i], y + col, ldy, tiles, nthreads);
        return;
    }
    first[n] = items;
    const int act = ws[0].act;
    /* Quantised inputs: up to TILE_MAX_ROWS rows (decode) every thread quantises all of them into its own copy,
     * since rows another thread has just written cost a 32-row product more to read than quantising them again;
     * more rows are quantised once, a share per thread, into `shared`. */
    const int own_copy = act != ACT_NONE && M <= TILE_MAX_ROWS;
    const size_t bytes = (sizeof(bf16) * (size_t)(M * K) + 63) / 64 * 64;
    bf16 *shared = act != ACT_NONE && !own_copy ? aligned_alloc(64, bytes) : NULL;
    tiles = tiles && ds_tiles_usable();
#pragma omp parallel num_threads(nthreads)
    {
        float *acc = malloc(sizeof(float) * (size_t)(M * COL_BLOCK));
        bf16 *wd = scratch ? malloc(sizeof(bf16) * (size_t)scratch) : NULL;
        bf16 *mine = own_copy ? aligned_alloc(64, bytes) : NULL, *xq = own_copy ? mine : shared;
        if (own_copy)
            for (int64_t r = 0; r < M; r++) mx_quantize_copy(x + r * ldx, K, act, mine + r * K);
        if (shared) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++) mx_quantize_copy(x + r * ldx, K, act, shared + r * K);
        } /* implicit barrier: every row of `shared` is written */
        const bf16 *in = xq ? xq : x;
        const int64_t ld = xq ? K : ldx;
        const bf16 **rows = malloc(sizeof(bf16 *) * (size_t)M);
        for (int64_t r = 0; r < M; r++) rows[r] = in + r * ld;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            int i = 0;
            while (item >= first[i + 1]) i++;
            int64_t b = item - first[i], n0 = b * COL_BLOCK;
            int64_t cols = widths[i] - n0 < COL_BLOCK ? widths[i] - n0 : COL_BLOCK;
            rows_product(rows, in, ld, M, &ws[i], b, K, tiles, acc, wd);
            for (int64_t r = 0; r < M; r++) round_row(acc + r * COL_BLOCK, cols, y + r * ldy + at[i] + n0);
        }
        free(acc);
        free(wd);
        free(mine);
        free(rows);
    }
    free(shared);
}

/* ds_linear_columns over any column-packed matrix w (bf16, or MX: mx.c), its input rows first quantised to MXFP8
 * per 32 when w->act says so: out = bf16(xq W^T), W the exactly decoded weights, summed in fp32 (the reference twin
 * ops/mx_linear.py mx_linear_ref, up to the order of the sum). Returns 0, or -3 (nothing computed) for a K the
 * format cannot hold. */
int ds_mx_linear(const bf16 *x, int64_t M, int64_t ldx, int64_t K, const mx_matrix *w, int64_t N, bf16 *out,
                 int tiles, int nthreads) {
    if (!mx_shape_ok(w, K)) return -3;
    mx_product(x, M, ldx, K, w, N, out, N, tiles, nthreads);
    return 0;
}

/* ds_moe_bf16 (column-packed form) over experts and a shared expert whose matrices are each bf16 or MX (mx.c; a
 * stack's experts all alike), each product quantising its input rows when its matrix says so (w1 and w3 alike, as
 * s1 and s3: they read the same rows): the reference MXExperts / MLP over MXLinears, up to the order of the fp32
 * sums. IS = 0 for no shared expert (s1, s3, s2 then unread). Returns 0, -1 (nothing computed) for an id outside
 * [0, E), or -3 for matrices that disagree on input quantisation or a K a format cannot hold. */
int ds_mx_moe(const bf16 *x, int64_t T, int64_t D, const int64_t *experts, const float *weights, int64_t k,
              const mx_matrix *w1, const mx_matrix *w3, const mx_matrix *w2, int64_t E, int64_t I, int act_kind,
              float beta, float lin_beta, const mx_matrix *s1, const mx_matrix *s3, const mx_matrix *s2, int64_t IS,
              int tiles, bf16 *out, int nthreads) {
    if (w1->act != w3->act || !mx_shape_ok(w1, D) || !mx_shape_ok(w3, D) || !mx_shape_ok(w2, I)) return -3;
    if (IS > 0 && (s1->act != s3->act || !mx_shape_ok(s1, D) || !mx_shape_ok(s3, D) || !mx_shape_ok(s2, IS)))
        return -3;
    pair_groups groups;
    bf16 *xq = NULL, *xs = NULL; /* the routed and the shared experts' quantised inputs */
    if (w1->act != ACT_NONE) {
        xq = malloc(sizeof(bf16) * (size_t)(T * D));
        ds_mx_quantize_rows(x, T, D, D, (int)w1->act, xq, nthreads);
    }
    if (group_pairs(experts, T, k, E, xq ? xq : x, D, &groups)) {
        free(xq);
        return -1;
    }
    shared_expert shared = {{0}, {0}, {0}, IS, x};
    if (IS > 0) {
        shared.w1 = *s1, shared.w3 = *s3, shared.w2 = *s2;
        if (s1->act == w1->act && xq) {
            shared.x = xq;
        } else if (s1->act != ACT_NONE) {
            xs = malloc(sizeof(bf16) * (size_t)(T * D));
            ds_mx_quantize_rows(x, T, D, D, (int)s1->act, xs, nthreads);
            shared.x = xs;
        }
    }
    glu_act act = {act_kind, !isnan(lin_beta), beta, lin_beta};
    bf16 *h = malloc(sizeof(bf16) * (size_t)(T * k * I));
    moe_columns(groups.xrows, groups.order, groups.start, groups.used, groups.nused, T, D, k, weights, w1, w3, w2,
                I, IS > 0 ? &shared : NULL, &act, tiles, h, out, nthreads);
    free(h);
    free(xq);
    free(xs);
    free_groups(&groups);
    return 0;
}
