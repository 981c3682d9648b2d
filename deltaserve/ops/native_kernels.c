/* Small-batch bf16 products for the CPU decode path (issue 10). Built at first use by ops/native.py with the
 * system compiler for this machine (-march=native) and called through ctypes with raw pointers.
 *
 * Why: at decode a step multiplies 1-16 rows by ~200 weight matrices. oneDNN's packed linear pays 20-70 us of
 * fixed cost per call at these sizes and the MoE dispatch adds a dozen torch ops per expert; these kernels read
 * each weight row once, straight from its row-major [N, K] storage (no packed copy), in one OpenMP region per
 * call, and accumulate in fp32 with AVX512-BF16 dot products (AVX512F or plain C where that is missing).
 *
 * Rounding follows the torch reference twins: each product is rounded to bf16 (round to nearest even) where
 * the reference's F.linear output is, the activation is taken in fp32 of the rounded gate/up and rounded, and
 * the MoE combine sums the k weighted outputs in fp32 in routing order before one rounding. The dot products
 * accumulate in a different order than oneDNN's, so results agree to fp32 rounding, not bit for bit.
 *
 * OpenMP: the library links libgomp.so.1, which resolves to the copy torch already loaded, so these regions
 * share torch's thread pool; the caller passes torch's thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

typedef uint16_t bf16;

#define TILE_ROWS 4   /* weight rows per tile */
#define BLOCK_ROWS 32 /* weight rows per work item */
#define MAX_X 4       /* input rows per tile */

static inline float bf16_to_f32(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN (quiet) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if defined(__AVX512F__)
/* The four horizontal sums [sum(a), sum(b), sum(c), sum(d)] at once (halves added, then three hadds): about a
 * third of the instructions of four separate reductions, which at M >= 4 cost as much as the dot products. */
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m256 a2 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    __m256 c2 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    __m256 d2 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a2, b2), _mm256_hadd_ps(c2, d2));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

/* out[i][j] = dot(x[i], w[j]) over K for i < NX (<= MAX_X) and TILE_ROWS rows j (row pointers may repeat).
 * NX is a compile-time constant at every call (see dot_tile), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_tile_n(const bf16 *const *x, const int NX,
                                                             const bf16 *const *w, int64_t K, const int64_t kstep,
                                                             float out[MAX_X][TILE_ROWS]) {
#if defined(__AVX512BF16__)
    __m512 acc[MAX_X][TILE_ROWS];
    for (int i = 0; i < NX; i++)
        for (int j = 0; j < TILE_ROWS; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i wv[TILE_ROWS];
        for (int j = 0; j < TILE_ROWS; j++) wv[j] = _mm512_loadu_si512(w[j] + k / 32 * kstep);
        for (int i = 0; i < NX; i++) {
            __m512i xv = _mm512_loadu_si512(x[i] + k);
            for (int j = 0; j < TILE_ROWS; j++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
    if (k < K) {
        __mmask32 m = (__mmask32)((1u << (K - k)) - 1u);
        __m512i wv[TILE_ROWS];
        for (int j = 0; j < TILE_ROWS; j++) wv[j] = _mm512_maskz_loadu_epi16(m, w[j] + k / 32 * kstep);
        for (int i = 0; i < NX; i++) {
            __m512i xv = _mm512_maskz_loadu_epi16(m, x[i] + k);
            for (int j = 0; j < TILE_ROWS; j++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
    for (int i = 0; i < NX; i++) _mm_storeu_ps(out[i], reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
#elif defined(__AVX512F__)
    __m512 acc[MAX_X][TILE_ROWS];
    for (int i = 0; i < NX; i++)
        for (int j = 0; j < TILE_ROWS; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __mmask16 m = K - k >= 16 ? (__mmask16)0xffffu : (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv[TILE_ROWS];
        for (int j = 0; j < TILE_ROWS; j++)
            wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w[j] + k / 32 * kstep + k % 32)), 16));
        for (int i = 0; i < NX; i++) {
            __m512 xv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x[i] + k)), 16));
            for (int j = 0; j < TILE_ROWS; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < NX; i++)
        for (int j = 0; j < TILE_ROWS; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
#else
    for (int i = 0; i < NX; i++)
        for (int j = 0; j < TILE_ROWS; j++) {
            float s = 0.f;
            for (int64_t k = 0; k < K; k++) s += bf16_to_f32(x[i][k]) * bf16_to_f32(w[j][k / 32 * kstep + k % 32]);
            out[i][j] = s;
        }
#endif
}

static void dot_tile(const bf16 *const *x, int nx, const bf16 *const *w, int64_t K, int64_t kstep,
                     float out[MAX_X][TILE_ROWS]) {
    switch (nx) {
    case 1: dot_tile_n(x, 1, w, K, kstep, out); break;
    case 2: dot_tile_n(x, 2, w, K, kstep, out); break;
    case 3: dot_tile_n(x, 3, w, K, kstep, out); break;
    default: dot_tile_n(x, 4, w, K, kstep, out); break;
    }
}

/* The packed layout of a [N, K] weight (see pack_rows in ops/native.py): tiles of TILE_ROWS rows, each tile
 * [ceil(K/32)][TILE_ROWS][32] with rows and K zero-padded, so one tile is one sequential stream (the hardware
 * prefetchers follow one stream far better than TILE_ROWS short ones: ~30% more bandwidth at decode). */
static inline int64_t padded_k(int64_t K) { return (K + 31) / 32 * 32; }

/* dots[i][n - n0] = dot(x rows[i], w row n) for n in [n0, n1) (n0 a multiple of TILE_ROWS), all M rows (in tiles
 * of MAX_X inputs). w is row-major with row stride ldw, or packed (ldw < 0). */
static void dot_block(const bf16 *const *xrows, int64_t M, const bf16 *w, int64_t ldw, int64_t N, int64_t n0,
                      int64_t n1, int64_t K, float *dots /* [M][BLOCK_ROWS] */) {
    for (int64_t n = n0; n < n1; n += TILE_ROWS) {
        const bf16 *wr[TILE_ROWS];
        int64_t kstep = 32;
        if (ldw < 0) {
            const bf16 *tile = w + n * padded_k(K);
            for (int j = 0; j < TILE_ROWS; j++) wr[j] = tile + j * 32;
            kstep = TILE_ROWS * 32;
        } else {
            for (int j = 0; j < TILE_ROWS; j++) wr[j] = w + (n + j < N ? n + j : N - 1) * ldw;
        }
        for (int64_t i0 = 0; i0 < M; i0 += MAX_X) {
            int nx = M - i0 < MAX_X ? (int)(M - i0) : MAX_X;
            float out[MAX_X][TILE_ROWS];
            dot_tile(xrows + i0, nx, wr, K, kstep, out);
            for (int i = 0; i < nx; i++)
                for (int j = 0; j < TILE_ROWS && n + j < n1; j++) dots[(i0 + i) * BLOCK_ROWS + (n + j - n0)] = out[i][j];
        }
    }
}

/* Linear products of M rows: for each task t, y_t [M, N_t] (row stride ldy_t) = x_t [M, K] (row stride ldx_t) @
 * W_t^T with W_t [N_t, K] row-major (row stride ldw_t) or packed (ldw_t = -1), rounded to bf16. desc holds 7
 * int64 per task: W_t's address, ldw_t, N_t, y_t's address, ldy_t, x_t's address, ldx_t (tasks may share x:
 * several weights over one input, or differ: one weight per attention head). */
#define DESC 7
void ds_linear_bf16(int64_t M, int64_t K, int64_t ntasks, const int64_t *desc, int nthreads) {
    int64_t nitems = 0;
    for (int64_t t = 0; t < ntasks; t++) nitems += (desc[t * DESC + 2] + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel num_threads(nthreads)
    {
        const bf16 **xrows = malloc(sizeof(bf16 *) * (size_t)M);
        float *dots = malloc(sizeof(float) * (size_t)(M * BLOCK_ROWS));
        int64_t xt = -1;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < nitems; item++) {
            int64_t t = 0, b = item;
            while (b >= (desc[t * DESC + 2] + BLOCK_ROWS - 1) / BLOCK_ROWS)
                b -= (desc[t++ * DESC + 2] + BLOCK_ROWS - 1) / BLOCK_ROWS;
            const int64_t *d = desc + t * DESC;
            const bf16 *w = (const bf16 *)(intptr_t)d[0];
            int64_t ldw = d[1], N = d[2], ldy = d[4];
            bf16 *y = (bf16 *)(intptr_t)d[3];
            if (t != xt) {
                for (int64_t i = 0; i < M; i++) xrows[i] = (const bf16 *)(intptr_t)d[5] + i * d[6];
                xt = t;
            }
            int64_t n0 = b * BLOCK_ROWS, n1 = n0 + BLOCK_ROWS < N ? n0 + BLOCK_ROWS : N;
            dot_block(xrows, M, w, ldw, N, n0, n1, K, dots);
            for (int64_t i = 0; i < M; i++)
                for (int64_t n = n0; n < n1; n++) y[i * ldy + n] = f32_to_bf16(dots[i * BLOCK_ROWS + n - n0]);
        }
        free(xrows);
        free(dots);
    }
}

/* sum_i a[i] b[i] in fp32, 16 lanes at a time with AVX512 (a fixed summation order, not the sequential one). */
static inline float dotf(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.f;
#if defined(__AVX512F__)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out[i] = exp(in[i]) for n values: Cephes' single-precision polynomial (about 1 ulp) scaled by 2^round(x log2 e)
 * with AVX512 (scalef handles overflow and underflow); expf elsewhere. in and out may alias. */
static void vexp(float *out, const float *in, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), c1 = _mm512_set1_ps(0.693359375f),
                 c2 = _mm512_set1_ps(-2.12194440e-4f), lo = _mm512_set1_ps(-104.f), hi = _mm512_set1_ps(88.75f);
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_loadu_ps(in + i), lo), hi);
        __m512 m = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(m, c2, _mm512_fnmadd_ps(m, c1, x));
        __m512 p = _mm512_set1_ps(1.9875691500e-4f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
        p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
        _mm512_storeu_ps(out + i, _mm512_scalef_ps(p, m));
    }
#endif
    for (; i < n; i++) out[i] = expf(in[i]);
}

/* The gated activation of n columns of one token, from the fp32 dot products g (gate) and u (up), which are
 * first rounded to bf16 as the reference's products are. act->kind 0: SiLU-GLU, bf16(bf16(silu(g)) * u) (torch's
 * silu rounds, then the product rounds); 1: SiTU, bf16((beta tanh(g / beta)) sigmoid(g) * up) in fp32 with up =
 * u, or lin_beta tanh(u / lin_beta) when has_lin. Exponentials vectorised (vexp); tanh(x) = 1 - 2 / (e^{2x} + 1). */
typedef struct {
    int kind, has_lin;
    float beta, lin_beta;
} glu_act;

static void glu_block(float *g, float *u, int64_t n, const glu_act *act, bf16 *out) {
    float e[BLOCK_ROWS], t[BLOCK_ROWS];
    for (int64_t c = 0; c < n; c++) {
        g[c] = round_bf16(g[c]);
        u[c] = round_bf16(u[c]);
        e[c] = -g[c];
    }
    vexp(e, e, n);
    if (act->kind == 0) {
        for (int64_t c = 0; c < n; c++) out[c] = f32_to_bf16(round_bf16(g[c] / (1.f + e[c])) * u[c]);
        return;
    }
    for (int64_t c = 0; c < n; c++) t[c] = 2.f * g[c] / act->beta;
    vexp(t, t, n);
    for (int64_t c = 0; c < n; c++) g[c] = (act->beta * (1.f - 2.f / (t[c] + 1.f))) * (1.f / (1.f + e[c]));
    if (act->has_lin) {
        for (int64_t c = 0; c < n; c++) t[c] = 2.f * u[c] / act->lin_beta;
        vexp(t, t, n);
        for (int64_t c = 0; c < n; c++) u[c] = act->lin_beta * (1.f - 2.f / (t[c] + 1.f));
    }
    for (int64_t c = 0; c < n; c++) out[c] = f32_to_bf16(g[c] * u[c]);
}

/* Gated experts over a few tokens: out [T, D] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t]), where
 * expert_e(v) = W2[e] @ act(W1[e] v, W3[e] v) with act SiLU-GLU (act_kind 0) or SiTU (1: beta, lin_beta, NaN
 * for none; see glu_block). W1/W3 are [E, I, D], W2 is [E, D, I], contiguous, or each
 * expert's matrix packed (packed != 0).
 * Each expert runs once over the tokens that picked it. h [T*k, I] is scratch. Rounding as the reference:
 * gate, up, silu(gate), the GLU product and each expert's output are bf16; the combine is fp32, rounded once.
 * A dense MLP is the case E = 1, k = 1, weight 1. Returns 0, or -1 (nothing computed) for an id outside [0, E). */
int ds_moe_bf16(const bf16 *x, int64_t T, int64_t D, const int64_t *experts, const float *weights, int64_t k,
                const bf16 *w1, const bf16 *w3, const bf16 *w2, int64_t E, int64_t I, int packed, int act_kind,
                float beta, float lin_beta, bf16 *h, bf16 *out, int nthreads) {
    glu_act actv = {act_kind, !isnan(lin_beta), beta, lin_beta}, *act = &actv;
    /* per-expert matrix strides and row strides: row-major, or packed (row stride -1) */
    int64_t s13 = packed ? (I + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS * padded_k(D) : I * D;
    int64_t s2 = packed ? (D + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS * padded_k(I) : D * I;
    int64_t ld13 = packed ? -1 : D, ld2 = packed ? -1 : I;
    int64_t P = T * k;
    for (int64_t p = 0; p < P; p++)
        if (experts[p] < 0 || experts[p] >= E) return -1;
    /* pairs grouped by expert, ascending expert then pair index: order[start[e] .. start[e+1]) */
    int64_t *start = calloc((size_t)(E + 1), sizeof(int64_t));
    int64_t *order = malloc(sizeof(int64_t) * (size_t)P), *fill = malloc(sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t p = 0; p < P; p++) start[experts[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t p = 0; p < P; p++) order[fill[experts[p]]++] = p;
    int64_t *used = malloc(sizeof(int64_t) * (size_t)E), nused = 0;
    for (int64_t e = 0; e < E; e++)
        if (start[e + 1] > start[e]) used[nused++] = e;
    const bf16 **xrows = malloc(sizeof(bf16 *) * (size_t)P), **hrows = malloc(sizeof(bf16 *) * (size_t)P);
    for (int64_t s = 0; s < P; s++) {
        xrows[s] = x + (order[s] / k) * D;
        hrows[s] = h + order[s] * I;
    }
    int64_t iblocks = (I + BLOCK_ROWS - 1) / BLOCK_ROWS, dblocks = (D + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel num_threads(nthreads)
    {
        float *g = malloc(sizeof(float) * (size_t)(P * BLOCK_ROWS));
        float *u = malloc(sizeof(float) * (size_t)(P * BLOCK_ROWS));
#pragma omp for schedule(dynamic, 1) /* experts differ in token count */
        for (int64_t item = 0; item < nused * iblocks; item++) {
            int64_t e = used[item / iblocks], n0 = (item % iblocks) * BLOCK_ROWS;
            int64_t n1 = n0 + BLOCK_ROWS < I ? n0 + BLOCK_ROWS : I, s0 = start[e], m = start[e + 1] - s0;
            dot_block(xrows + s0, m, w1 + e * s13, ld13, I, n0, n1, D, g);
            dot_block(xrows + s0, m, w3 + e * s13, ld13, I, n0, n1, D, u);
            for (int64_t i = 0; i < m; i++)
                glu_block(g + i * BLOCK_ROWS, u + i * BLOCK_ROWS, n1 - n0, act, h + order[s0 + i] * I + n0);
        }
        /* implicit barrier: every h row is complete */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < dblocks; item++) {
            int64_t n0 = item * BLOCK_ROWS, n1 = n0 + BLOCK_ROWS < D ? n0 + BLOCK_ROWS : D;
            float *y = g; /* [P][BLOCK_ROWS] expert outputs of this row block, in pair order */
            for (int64_t ue = 0; ue < nused; ue++) {
                int64_t e = used[ue], s0 = start[e], m = start[e + 1] - s0;
                dot_block(hrows + s0, m, w2 + e * s2, ld2, D, n0, n1, I, u);
                for (int64_t i = 0; i < m; i++)
                    for (int64_t n = n0; n < n1; n++)
                        y[order[s0 + i] * BLOCK_ROWS + n - n0] = round_bf16(u[i * BLOCK_ROWS + n - n0]);
            }
            for (int64_t t = 0; t < T; t++)
                for (int64_t n = n0; n < n1; n++) {
                    float acc = 0.f;
                    for (int64_t j = 0; j < k; j++) acc += weights[t * k + j] * y[(t * k + j) * BLOCK_ROWS + n - n0];
                    out[t * D + n] = f32_to_bf16(acc);
                }
        }
        free(g);
        free(u);
    }
    free(start);
    free(order);
    free(fill);
    free(used);
    free(xrows);
    free(hrows);
    return 0;
}

/* One token of the gated delta rule on a [K, K] state S (row r = key index), in place: with ekq = e^g k and
 * eqq = e^g q, sk = S^T ekq and sq = S^T eqq over the old state, delta = bt (v - sk), o = sq + kq delta, then
 * S[r] = d[r] S[r] + k[r] delta. With AVX512 and K % 16 == 0 it runs column block by column block (up to 64
 * columns: both passes over a block's 32 KiB stay in L1, the sums in registers). */
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void delta_block(float *S, int64_t K, int64_t c0, const int NV,
                                                              const float *ekq, const float *eqq, const float *d,
                                                              const float *k, const float *v, float bt, float kq,
                                                              float *o) {
    __m512 sk[4], sq[4], dl[4];
    for (int j = 0; j < NV; j++) sk[j] = sq[j] = _mm512_setzero_ps();
    for (int64_t r = 0; r < K; r++) {
        __m512 a = _mm512_set1_ps(ekq[r]), e = _mm512_set1_ps(eqq[r]);
        for (int j = 0; j < NV; j++) {
            __m512 srow = _mm512_loadu_ps(S + r * K + c0 + 16 * j);
            sk[j] = _mm512_fmadd_ps(a, srow, sk[j]);
            sq[j] = _mm512_fmadd_ps(e, srow, sq[j]);
        }
    }
    __m512 b = _mm512_set1_ps(bt), kqv = _mm512_set1_ps(kq);
    for (int j = 0; j < NV; j++) {
        dl[j] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + c0 + 16 * j), sk[j]), b);
        _mm512_storeu_ps(o + c0 + 16 * j, _mm512_fmadd_ps(kqv, dl[j], sq[j]));
    }
    for (int64_t r = 0; r < K; r++) {
        __m512 dr = _mm512_set1_ps(d[r]), kr = _mm512_set1_ps(k[r]);
        for (int j = 0; j < NV; j++) {
            float *p = S + r * K + c0 + 16 * j;
            _mm512_storeu_ps(p, _mm512_fmadd_ps(dr, _mm512_loadu_ps(p), _mm512_mul_ps(kr, dl[j])));
        }
    }
}
#endif

static void delta_rule_token(float *S, int64_t K, const float *ekq, const float *eqq, const float *d, const float *k,
                             const float *v, float bt, float kq, float *o, float *scratch /* [3K] */) {
#if defined(__AVX512F__)
    if (K % 16 == 0) {
        for (int64_t c0 = 0; c0 < K;) {
            int64_t left = (K - c0) / 16;
            switch (left >= 4 ? 4 : left) {
            case 1: delta_block(S, K, c0, 1, ekq, eqq, d, k, v, bt, kq, o); c0 += 16; break;
            case 2: delta_block(S, K, c0, 2, ekq, eqq, d, k, v, bt, kq, o); c0 += 32; break;
            case 3: delta_block(S, K, c0, 3, ekq, eqq, d, k, v, bt, kq, o); c0 += 48; break;
            default: delta_block(S, K, c0, 4, ekq, eqq, d, k, v, bt, kq, o); c0 += 64; break;
            }
        }
        return;
    }
#endif
    float *sk = scratch, *sq = scratch + K, *delta = scratch + 2 * K;
    for (int64_t c = 0; c < K; c++) sk[c] = sq[c] = 0.f;
    for (int64_t r = 0; r < K; r++)
        for (int64_t c = 0; c < K; c++) {
            sk[c] += ekq[r] * S[r * K + c];
            sq[c] += eqq[r] * S[r * K + c];
        }
    for (int64_t c = 0; c < K; c++) {
        delta[c] = (v[c] - sk[c]) * bt;
        o[c] = sq[c] + kq * delta[c];
    }
    for (int64_t r = 0; r < K; r++)
        for (int64_t c = 0; c < K; c++) S[r * K + c] = d[r] * S[r * K + c] + k[r] * delta[c];
}

/* KDA over the tokens of several sequences, from the projections to the core output (model.md §8.2, §8.5): per
 * token, the short convs of q, k, v over the slot's window (SiLU, rounded to the input dtype as the torch conv
 * returns it), q and k L2-normalised in fp32 (eps 1e-6 inside the sqrt), q scaled, then the gated delta rule on
 * the slot's fp32 state [H, K, K] in place: S' = D S + k d^T with D = diag(e^g), d = beta (v - S^T (e^g k)),
 * out = S'^T q (both matvecs read the old state); the window ends holding the last W-1 inputs.
 * Sequence b owns tokens [cu[b], cu[b+1]) and slot slots[b]; a slot < 0 is padding (zeros out, no state).
 * x [T, 3P] rows hold q | k | v before the conv (bf16 when x_bf16, else fp32; row stride ldx), P = H K;
 * g [T, H, K], beta [T, H] fp32 contiguous; out [T, H, K] fp32. conv_w [3P, W] fp32; the window of slot s, channel c is at conv + s * conv_slot_stride + c * (W - 1) (oldest
 * first); the state of slot s at rec + s * rec_slot_stride.
 * One work item per (sequence, head): items touch disjoint channels and state, and a head's 64 KiB state stays
 * in the core's cache for all of its tokens. The convs of a block of tokens run first, vectorised over channels. */
#define KDA_BLOCK 32
void ds_kda_step(int64_t nseq, const int64_t *cu, int64_t H, int64_t K, const void *x, int64_t ldx, int x_bf16,
                 const float *conv_w, int64_t W, float *conv, int64_t conv_slot_stride, const float *g,
                 const float *beta, float scale, float *rec, int64_t rec_slot_stride, const int64_t *slots,
                 float *out, int nthreads) {
    int64_t P = H * K, C3 = 3 * K;
#pragma omp parallel num_threads(nthreads)
    {
        /* hist [W-1][3K]: the window of the head's channels, tap-major; y [KDA_BLOCK][3K]: conv outputs */
        float *hist = malloc(sizeof(float) * (size_t)((W > 1 ? W - 1 : 1) * C3));
        float *y = malloc(sizeof(float) * (size_t)(KDA_BLOCK * C3)), *xin = malloc(sizeof(float) * (size_t)C3);
        float *vec = malloc(sizeof(float) * (size_t)(7 * K)), *taps = malloc(sizeof(float) * (size_t)(W * C3));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < nseq * H; item++) {
            int64_t b = item / H, h = item % H, s = slots[b], t0 = cu[b], n = cu[b + 1] - cu[b];
            if (s < 0) {
                for (int64_t t = t0; t < t0 + n; t++) memset(out + (t * H + h) * K, 0, sizeof(float) * (size_t)K);
                continue;
            }
            float *win = conv + s * conv_slot_stride, *S = rec + s * rec_slot_stride + h * K * K;
            for (int j = 0; j < 3; j++) /* the head's conv weights, tap-major [W][3K] */
                for (int64_t c = 0; c < K; c++)
                    for (int64_t u = 0; u < W; u++) taps[u * C3 + j * K + c] = conv_w[(j * P + h * K + c) * W + u];
            for (int j = 0; j < 3; j++)
                for (int64_t c = 0; c < K; c++)
                    for (int64_t u = 0; u < W - 1; u++) hist[u * C3 + j * K + c] = win[(j * P + h * K + c) * (W - 1) + u];
            /* input at sequence position i (may be negative: then from the window) for the head's channels */
#define LOAD_INPUT(i, dst)                                                                                       \
    do {                                                                                                         \
        int64_t i_ = (i);                                                                                        \
        if (i_ < 0) {                                                                                            \
            memcpy(dst, hist + (W - 1 + i_) * C3, sizeof(float) * (size_t)C3);                                  \
        } else {                                                                                                 \
            for (int j_ = 0; j_ < 3; j_++) {                                                                     \
                int64_t base_ = (t0 + i_) * ldx + j_ * P + h * K;                                                \
                for (int64_t c_ = 0; c_ < K; c_++)                                                               \
                    dst[j_ * K + c_] = x_bf16 ? bf16_to_f32(((const bf16 *)x)[base_ + c_])                      \
                                              : ((const float *)x)[base_ + c_];                                  \
            }                                                                                                    \
        }                                                                                                        \
    } while (0)
            for (int64_t i0 = 0; i0 < n; i0 += KDA_BLOCK) {
                int64_t nb = n - i0 < KDA_BLOCK ? n - i0 : KDA_BLOCK;
                for (int64_t i = 0; i < nb; i++) { /* conv: acc = sum_u w[u] x[i - (W-1) + u] */
                    float *acc = y + i * C3;
                    for (int64_t c = 0; c < C3; c++) acc[c] = 0.f;
                    for (int64_t u = 0; u < W; u++) {
                        LOAD_INPUT(i0 + i - (W - 1) + u, xin);
                        const float *wu = taps + u * C3;
                        for (int64_t c = 0; c < C3; c++) acc[c] += wu[c] * xin[c];
                    }
                    float *e = vec; /* silu(a) = a / (1 + e^-a), in blocks of K */
                    for (int64_t c0 = 0; c0 < C3; c0 += K) {
                        for (int64_t c = 0; c < K; c++) e[c] = -acc[c0 + c];
                        vexp(e, e, K);
                        for (int64_t c = 0; c < K; c++) {
                            float act = acc[c0 + c] / (1.f + e[c]);
                            acc[c0 + c] = x_bf16 ? round_bf16(act) : act;
                        }
                    }
                }
                for (int64_t i = 0; i < nb; i++) { /* the delta rule, token by token */
                    int64_t t = t0 + i0 + i;
                    float *q = y + i * C3, *k = q + K, *v = q + 2 * K;
                    float *d = vec, *ekq = vec + K, *eqq = vec + 2 * K, *sk = vec + 3 * K; /* sk: [3K] scratch */
                    float rq = scale / sqrtf(dotf(q, q, K) + 1e-6f), rk = 1.f / sqrtf(dotf(k, k, K) + 1e-6f);
                    vexp(d, g + (t * H + h) * K, K);
                    for (int64_t c = 0; c < K; c++) {
                        q[c] *= rq;
                        k[c] *= rk;
                        ekq[c] = d[c] * k[c];
                        eqq[c] = d[c] * q[c];
                    }
                    float kq = dotf(k, q, K);
                    delta_rule_token(S, K, ekq, eqq, d, k, v, beta[t * H + h], kq, out + (t * H + h) * K, sk);
                }
            }
            /* the window keeps the last W-1 inputs, oldest first */
            for (int64_t u = 0; u < W - 1; u++) {
                LOAD_INPUT(n - (W - 1) + u, xin);
                for (int j = 0; j < 3; j++)
                    for (int64_t c = 0; c < K; c++) win[(j * P + h * K + c) * (W - 1) + u] = xin[j * K + c];
            }
#undef LOAD_INPUT
        }
        free(hist);
        free(y);
        free(xin);
        free(vec);
        free(taps);
    }
}

/* Sparse absorbed MLA attention (QSFA, ops.md §4.5) over bf16 or fp32 latent rows: for query t and head h, the
 * softmax over its selected rows j (selected[t, :] up to the first -1) of scale (q_lat[t,h] . c_j + q_pe[t,h] .
 * kpe_j), out_lat[t,h] = sum_j p_j c_j and lse[t,h] = log sum_j exp(score_j) (-inf and a zero output when no row
 * is selected). q_lat [T, H, r], q_pe [T, H, rho] fp32 contiguous; latent rows [c | kpe] of width r + rho at
 * row stride ld (bf16 when lat_bf16). One pass over the rows with a running max (rows read once per item);
 * an item is one query and a group of heads (all heads unless there are fewer queries than threads).
 * Returns 0, or -1 (nothing computed) when a selected row is not below nrows. */
#define QSFA_ROWS 16
int ds_qsfa(int64_t T, int64_t H, int64_t r, int64_t rho, const float *q_lat, const float *q_pe, const void *lat,
            int64_t ld, int64_t nrows, int lat_bf16, const int64_t *selected, int64_t kmax, float scale, float *out,
            float *lse, int nthreads) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < kmax && selected[t * kmax + j] >= 0; j++)
            if (selected[t * kmax + j] >= nrows) return -1;
    int64_t split = T < nthreads ? (H < nthreads ? H : nthreads) : 1, hper = (H + split - 1) / split;
    int64_t width = r + rho;
#pragma omp parallel num_threads(nthreads)
    {
        float *row = malloc(sizeof(float) * (size_t)(QSFA_ROWS * width));
        float *sc = malloc(sizeof(float) * (size_t)(QSFA_ROWS * hper)), *mx = malloc(sizeof(float) * (size_t)hper);
        float *z = malloc(sizeof(float) * (size_t)hper);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < T * split; item++) {
            int64_t t = item / split, h0 = (item % split) * hper, h1 = h0 + hper < H ? h0 + hper : H, nh = h1 - h0;
            if (nh <= 0) continue;
            const int64_t *sel = selected + t * kmax;
            int64_t n = 0;
            while (n < kmax && sel[n] >= 0) n++;
            float *o = out + (t * H + h0) * r;
            memset(o, 0, sizeof(float) * (size_t)(nh * r));
            for (int64_t h = 0; h < nh; h++) {
                mx[h] = -INFINITY;
                z[h] = 0.f;
            }
            for (int64_t j0 = 0; j0 < n; j0 += QSFA_ROWS) {
                int64_t nb = n - j0 < QSFA_ROWS ? n - j0 : QSFA_ROWS;
                for (int64_t j = 0; j < nb; j++) {
                    float *dst = row + j * width;
                    if (lat_bf16) {
                        const bf16 *src = (const bf16 *)lat + sel[j0 + j] * ld;
                        for (int64_t c = 0; c < width; c++) dst[c] = bf16_to_f32(src[c]);
                    } else {
                        memcpy(dst, (const float *)lat + sel[j0 + j] * ld, sizeof(float) * (size_t)width);
                    }
                }
                for (int64_t h = 0; h < nh; h++) {
                    const float *ql = q_lat + (t * H + h0 + h) * r, *qp = q_pe + (t * H + h0 + h) * rho;
                    float bmax = -INFINITY;
                    for (int64_t j = 0; j < nb; j++) {
                        const float *c = row + j * width;
                        float s = (dotf(ql, c, r) + dotf(qp, c + r, rho)) * scale;
                        sc[h * QSFA_ROWS + j] = s;
                        bmax = s > bmax ? s : bmax;
                    }
                    float nm = bmax > mx[h] ? bmax : mx[h];
                    float rescale = mx[h] == -INFINITY ? 0.f : expf(mx[h] - nm);
                    float *oh = o + h * r;
                    if (rescale != 1.f)
                        for (int64_t i = 0; i < r; i++) oh[i] *= rescale;
                    z[h] *= rescale;
                    mx[h] = nm;
                    for (int64_t j = 0; j < nb; j++) sc[h * QSFA_ROWS + j] -= nm;
                    vexp(sc + h * QSFA_ROWS, sc + h * QSFA_ROWS, nb);
                    for (int64_t j = 0; j < nb; j++) {
                        float p = sc[h * QSFA_ROWS + j];
                        const float *c = row + j * width;
                        z[h] += p;
                        for (int64_t i = 0; i < r; i++) oh[i] += p * c[i];
                    }
                }
            }
            for (int64_t h = 0; h < nh; h++) {
                float *oh = o + h * r;
                if (z[h] > 0.f) {
                    float inv = 1.f / z[h];
                    for (int64_t i = 0; i < r; i++) oh[i] *= inv;
                    lse[t * H + h0 + h] = mx[h] + logf(z[h]);
                } else {
                    lse[t * H + h0 + h] = -INFINITY;
                }
            }
        }
        free(row);
        free(sc);
        free(mx);
        free(z);
    }
    return 0;
}

/* RMSNorm of bf16 rows in the reference rounding order (model.md §3): out = w * bf16(x * rsqrt(mean(x^2) + eps)),
 * statistics in fp32, the product with the bf16 weight rounded once. x [M, D] at row stride ldx; out [M, D]. */
void ds_rmsnorm_bf16(const bf16 *x, int64_t M, int64_t D, int64_t ldx, const bf16 *w, float eps, bf16 *out,
                     int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * D >= (1 << 16))
    for (int64_t i = 0; i < M; i++) {
        float *xf = malloc(sizeof(float) * (size_t)D);
        for (int64_t c = 0; c < D; c++) xf[c] = bf16_to_f32(x[i * ldx + c]);
        float r = 1.f / sqrtf(dotf(xf, xf, D) / (float)D + eps);
        for (int64_t c = 0; c < D; c++) out[i * D + c] = f32_to_bf16(round_bf16(xf[c] * r) * bf16_to_f32(w[c]));
        free(xf);
    }
}

/* KDA's gated output norm (model.md §8.7) in the reference rounding order: per row of K values, x = bf16(core)
 * (the core output cast to the model dtype), y = w * (x * rsqrt(mean(x^2) + eps)) in fp32, out = bf16(y *
 * sigmoid(gate)). core [R, K] fp32 contiguous; gate rows [R, K] bf16 at row stride ldg; w [K] fp32; out [R, K]. */
void ds_gated_rmsnorm_bf16(const float *core, int64_t R, int64_t K, const bf16 *gate, int64_t ldg, const float *w,
                           float eps, bf16 *out, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (R * K >= (1 << 16))
    {
        float *x = malloc(sizeof(float) * (size_t)(2 * K)), *e = x + K;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < R; i++) {
            for (int64_t c = 0; c < K; c++) {
                x[c] = round_bf16(core[i * K + c]);
                e[c] = -bf16_to_f32(gate[i * ldg + c]);
            }
            float r = 1.f / sqrtf(dotf(x, x, K) / (float)K + eps);
            vexp(e, e, K);
            for (int64_t c = 0; c < K; c++) out[i * K + c] = f32_to_bf16(w[c] * (x[c] * r) * (1.f / (1.f + e[c])));
        }
        free(x);
    }
}
