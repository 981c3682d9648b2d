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

/* out[i][j] = dot(x[i], w[j]) over K for i < NX (<= MAX_X) and TILE_ROWS rows j (row pointers may repeat).
 * NX is a compile-time constant at every call (see dot_tile), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_tile_n(const bf16 *const *x, const int NX,
                                                             const bf16 *const *w, int64_t K,
                                                             float out[MAX_X][TILE_ROWS]) {
#if defined(__AVX512BF16__)
    __m512 acc[MAX_X][TILE_ROWS];
    for (int i = 0; i < NX; i++)
        for (int j = 0; j < TILE_ROWS; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i wv[TILE_ROWS];
        for (int j = 0; j < TILE_ROWS; j++) wv[j] = _mm512_loadu_si512(w[j] + k);
        for (int i = 0; i < NX; i++) {
            __m512i xv = _mm512_loadu_si512(x[i] + k);
            for (int j = 0; j < TILE_ROWS; j++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
    if (k < K) {
        __mmask32 m = (__mmask32)((1u << (K - k)) - 1u);
        __m512i wv[TILE_ROWS];
        for (int j = 0; j < TILE_ROWS; j++) wv[j] = _mm512_maskz_loadu_epi16(m, w[j] + k);
        for (int i = 0; i < NX; i++) {
            __m512i xv = _mm512_maskz_loadu_epi16(m, x[i] + k);
            for (int j = 0; j < TILE_ROWS; j++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
    for (int i = 0; i < NX; i++)
        for (int j = 0; j < TILE_ROWS; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
#elif defined(__AVX512F__)
    __m512 acc[MAX_X][TILE_ROWS];
    for (int i = 0; i < NX; i++)
        for (int j = 0; j < TILE_ROWS; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __mmask16 m = K - k >= 16 ? (__mmask16)0xffffu : (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv[TILE_ROWS];
        for (int j = 0; j < TILE_ROWS; j++)
            wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w[j] + k)), 16));
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
            for (int64_t k = 0; k < K; k++) s += bf16_to_f32(x[i][k]) * bf16_to_f32(w[j][k]);
            out[i][j] = s;
        }
#endif
}

static void dot_tile(const bf16 *const *x, int nx, const bf16 *const *w, int64_t K, float out[MAX_X][TILE_ROWS]) {
    switch (nx) {
    case 1: dot_tile_n(x, 1, w, K, out); break;
    case 2: dot_tile_n(x, 2, w, K, out); break;
    case 3: dot_tile_n(x, 3, w, K, out); break;
    default: dot_tile_n(x, 4, w, K, out); break;
    }
}

/* dots[i][n - n0] = dot(x rows[i], w row n) for n in [n0, n1), all M rows (in tiles of MAX_X inputs). */
static void dot_block(const bf16 *const *xrows, int64_t M, const bf16 *w, int64_t ldw, int64_t N, int64_t n0,
                      int64_t n1, int64_t K, float *dots /* [M][BLOCK_ROWS] */) {
    for (int64_t n = n0; n < n1; n += TILE_ROWS) {
        const bf16 *wr[TILE_ROWS];
        for (int j = 0; j < TILE_ROWS; j++) wr[j] = w + (n + j < N ? n + j : N - 1) * ldw;
        for (int64_t i0 = 0; i0 < M; i0 += MAX_X) {
            int nx = M - i0 < MAX_X ? (int)(M - i0) : MAX_X;
            float out[MAX_X][TILE_ROWS];
            dot_tile(xrows + i0, nx, wr, K, out);
            for (int i = 0; i < nx; i++)
                for (int j = 0; j < TILE_ROWS && n + j < n1; j++) dots[(i0 + i) * BLOCK_ROWS + (n + j - n0)] = out[i][j];
        }
    }
}

/* Linear products sharing one input x [M, K] (row stride ldx): for each task t, y_t [M, N_t] (row stride ldy_t)
 * = x @ W_t^T with W_t [N_t, K] row-major (row stride ldw_t), rounded to bf16. desc holds 5 int64 per task:
 * W_t's address, ldw_t, N_t, y_t's address, ldy_t. */
void ds_linear_bf16(const bf16 *x, int64_t M, int64_t ldx, int64_t K, int64_t ntasks, const int64_t *desc,
                    int nthreads) {
    int64_t nitems = 0;
    for (int64_t t = 0; t < ntasks; t++) nitems += (desc[t * 5 + 2] + BLOCK_ROWS - 1) / BLOCK_ROWS;
    const bf16 **xrows = malloc(sizeof(bf16 *) * (size_t)M);
    for (int64_t i = 0; i < M; i++) xrows[i] = x + i * ldx;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t item = 0; item < nitems; item++) {
        int64_t t = 0, b = item;
        while (b >= (desc[t * 5 + 2] + BLOCK_ROWS - 1) / BLOCK_ROWS) b -= (desc[t++ * 5 + 2] + BLOCK_ROWS - 1) / BLOCK_ROWS;
        const bf16 *w = (const bf16 *)(intptr_t)desc[t * 5];
        int64_t ldw = desc[t * 5 + 1], N = desc[t * 5 + 2], ldy = desc[t * 5 + 4];
        bf16 *y = (bf16 *)(intptr_t)desc[t * 5 + 3];
        int64_t n0 = b * BLOCK_ROWS, n1 = n0 + BLOCK_ROWS < N ? n0 + BLOCK_ROWS : N;
        float *dots = malloc(sizeof(float) * (size_t)(M * BLOCK_ROWS));
        dot_block(xrows, M, w, ldw, N, n0, n1, K, dots);
        for (int64_t i = 0; i < M; i++)
            for (int64_t n = n0; n < n1; n++) y[i * ldy + n] = f32_to_bf16(dots[i * BLOCK_ROWS + n - n0]);
        free(dots);
    }
    free(xrows);
}

static inline float silu(float g) { return g / (1.f + expf(-g)); }

/* Gated experts over a few tokens: out [T, D] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t]), where
 * expert_e(v) = W2[e] @ (silu(W1[e] v) * (W3[e] v)). W1/W3 are [E, I, D], W2 is [E, D, I], contiguous.
 * Each expert runs once over the tokens that picked it. h [T*k, I] is scratch. Rounding as the reference:
 * gate, up, silu(gate), the GLU product and each expert's output are bf16; the combine is fp32, rounded once.
 * A dense MLP is the case E = 1, k = 1, weight 1. Returns 0, or -1 (nothing computed) for an id outside [0, E). */
int ds_moe_bf16(const bf16 *x, int64_t T, int64_t D, const int64_t *experts, const float *weights, int64_t k,
                 const bf16 *w1, const bf16 *w3, const bf16 *w2, int64_t E, int64_t I, bf16 *h, bf16 *out,
                 int nthreads) {
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
#pragma omp for schedule(static)
        for (int64_t item = 0; item < nused * iblocks; item++) {
            int64_t e = used[item / iblocks], n0 = (item % iblocks) * BLOCK_ROWS;
            int64_t n1 = n0 + BLOCK_ROWS < I ? n0 + BLOCK_ROWS : I, s0 = start[e], m = start[e + 1] - s0;
            dot_block(xrows + s0, m, w1 + e * I * D, D, I, n0, n1, D, g);
            dot_block(xrows + s0, m, w3 + e * I * D, D, I, n0, n1, D, u);
            for (int64_t i = 0; i < m; i++)
                for (int64_t n = n0; n < n1; n++) {
                    float gi = round_bf16(g[i * BLOCK_ROWS + n - n0]), ui = round_bf16(u[i * BLOCK_ROWS + n - n0]);
                    h[order[s0 + i] * I + n] = f32_to_bf16(round_bf16(silu(gi)) * ui);
                }
        }
        /* implicit barrier: every h row is complete */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < dblocks; item++) {
            int64_t n0 = item * BLOCK_ROWS, n1 = n0 + BLOCK_ROWS < D ? n0 + BLOCK_ROWS : D;
            float *y = g; /* [P][BLOCK_ROWS] expert outputs of this row block, in pair order */
            for (int64_t ue = 0; ue < nused; ue++) {
                int64_t e = used[ue], s0 = start[e], m = start[e + 1] - s0;
                dot_block(hrows + s0, m, w2 + e * D * I, I, D, n0, n1, I, u);
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

/* One KDA decode token for each of n sequences (model.md §8.2, §8.5): the short convs of q, k, v from the slot's
 * window (SiLU, rounded to the input dtype as the torch conv returns it), the window shifted in place, q and k
 * L2-normalised in fp32 (eps 1e-6 inside the sqrt), q scaled, then the gated delta rule on the slot's fp32 state
 * [H, K, K] in place: S' = D S + k d^T with D = diag(e^g), d = beta (v - S^T (e^g k)), out = S'^T q.
 * x [n, 3P] rows hold q | k | v before the conv (bf16 when x_bf16, else fp32; row stride ldx), P = H K.
 * conv_w [3P, W] fp32; conv: slot s, channel c at conv + s * conv_slot_stride + c * (W - 1).
 * rec: slot s at rec + s * rec_slot_stride, [H, K, K] contiguous. A slot < 0 is padding: zeros out, no state.
 * One work item per (sequence, head); items touch disjoint channels and state. */
void ds_kda_decode(int64_t n, int64_t H, int64_t K, const void *x, int64_t ldx, int x_bf16, const float *conv_w,
                   int64_t W, float *conv, int64_t conv_slot_stride, const float *g, const float *beta, float scale,
                   float *rec, int64_t rec_slot_stride, const int64_t *slots, float *out, int nthreads) {
    int64_t P = H * K;
#pragma omp parallel num_threads(nthreads)
    {
        float *y = malloc(sizeof(float) * (size_t)(3 * K)), *kd = malloc(sizeof(float) * (size_t)(2 * K));
        float *pk = malloc(sizeof(float) * (size_t)(3 * K));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < n * H; item++) {
            int64_t i = item / H, h = item % H, s = slots[i];
            float *o = out + (i * H + h) * K;
            if (s < 0) {
                memset(o, 0, sizeof(float) * (size_t)K);
                continue;
            }
            for (int j = 0; j < 3; j++)
                for (int64_t c = 0; c < K; c++) {
                    int64_t ch = j * P + h * K + c;
                    float xv = x_bf16 ? bf16_to_f32(((const bf16 *)x)[i * ldx + ch]) : ((const float *)x)[i * ldx + ch];
                    const float *w = conv_w + ch * W;
                    float *win = conv + s * conv_slot_stride + ch * (W - 1);
                    float acc = xv * w[W - 1];
                    for (int64_t t = 0; t < W - 1; t++) acc = acc + win[t] * w[t];
                    for (int64_t t = 0; t + 1 < W - 1; t++) win[t] = win[t + 1];
                    if (W > 1) win[W - 2] = xv;
                    float act = silu(acc);
                    y[j * K + c] = x_bf16 ? round_bf16(act) : act;
                }
            float *q = y, *k = y + K, *v = y + 2 * K;
            float sq = 0.f, sk = 0.f;
            for (int64_t c = 0; c < K; c++) {
                sq += q[c] * q[c];
                sk += k[c] * k[c];
            }
            float rq = 1.f / sqrtf(sq + 1e-6f), rk = 1.f / sqrtf(sk + 1e-6f), kq = 0.f;
            const float *gi = g + (i * H + h) * K;
            float *ekq = kd, *eqq = kd + K; /* e^g k and e^g q (q normalised and scaled) */
            for (int64_t c = 0; c < K; c++) {
                q[c] = q[c] * rq * scale;
                k[c] = k[c] * rk;
                kq += k[c] * q[c];
                float d = expf(gi[c]);
                ekq[c] = d * k[c];
                eqq[c] = d * q[c];
            }
            float *S = rec + s * rec_slot_stride + h * K * K;
            float *sk_ = pk, *sq_ = pk + K, *delta = pk + 2 * K;
            for (int64_t c = 0; c < K; c++) sk_[c] = sq_[c] = 0.f;
            for (int64_t r = 0; r < K; r++) { /* old-state matvecs S^T (e^g k), S^T (e^g q) */
                const float *Sr = S + r * K;
                float a = ekq[r], b = eqq[r];
                for (int64_t c = 0; c < K; c++) {
                    sk_[c] += a * Sr[c];
                    sq_[c] += b * Sr[c];
                }
            }
            float bt = beta[i * H + h];
            for (int64_t c = 0; c < K; c++) {
                delta[c] = (v[c] - sk_[c]) * bt;
                o[c] = sq_[c] + kq * delta[c];
            }
            for (int64_t r = 0; r < K; r++) { /* S' = D S + k delta^T */
                float *Sr = S + r * K;
                float d = expf(gi[r]), kr = k[r];
                for (int64_t c = 0; c < K; c++) Sr[c] = d * Sr[c] + kr * delta[c];
            }
        }
        free(y);
        free(kd);
        free(pk);
    }
}
