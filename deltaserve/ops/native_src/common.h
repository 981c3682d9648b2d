/* Shared by the native CPU kernels (products.c, attention.c, blocks.c): bf16 conversions, vectorised fp32 helpers and the
 * bf16 dot-product tiles over row-major or packed weights. Built at first use by ops/native.py with the system
 * compiler for this machine (-march=native) and called through ctypes with raw pointers.
 *
 * Why: at decode a step multiplies 1-16 rows by ~200 weight matrices. oneDNN's packed linear pays a fixed cost
 * per call that is large against products of that size, the MoE dispatch adds a dozen torch ops per expert, and
 * KDA / QSFA are chains of small ops. These kernels read each weight once in one OpenMP region per call and
 * accumulate in fp32 with AVX512-BF16 dot products (AVX512F or plain C where that is missing).
 *
 * Rounding follows the torch reference twins: a product is rounded to bf16 (round to nearest even) where the
 * reference's output is bf16, activations are taken in fp32 of the rounded inputs, and sums the reference takes
 * in fp32 stay fp32. Dot products accumulate in another order than oneDNN's, so results agree to fp32 rounding,
 * not bit for bit.
 *
 * OpenMP: the library links libgomp.so.1, which resolves to the copy torch already loaded, so these regions
 * share torch's thread pool; the caller passes torch's thread count.
 */
#ifndef DELTASERVE_NATIVE_COMMON_H
#define DELTASERVE_NATIVE_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* every use of an intrinsic sits under the feature macro it needs */
#endif

typedef uint16_t bf16;

#define TILE_ROWS 4   /* weight rows per tile */
#define BLOCK_ROWS 32 /* weight rows per work item */
#define MAX_X 4       /* input rows per tile */
/* How far ahead in a packed weight stream the dot tiles prefetch into L2: one 4-row tile at K = 1024. With more
 * than 4 input rows a tile is read twice (the second pass from cache) and the hardware prefetcher stalls behind
 * the compute; prefetching keeps DRAM busy (it pays off in prefill's expert products, and costs the few-row
 * products nothing). */
#define PREFETCH_BYTES 8192
/* and how far ahead into L1: the dot tiles' loads otherwise wait on L2 (as the tile unit's did, tiles.c). 2 KiB
 * was the best of the distances tried from 512 B to 4 KiB at batch-1 decode; batch 4 neither gains nor loses. */
#define PREFETCH_L1_BYTES 2048

/* Ask for the weight stream ahead of the line at p: into L2 PREFETCH_BYTES on, into L1 PREFETCH_L1_BYTES on.
 * always_inline: as a plain inline function inside the always-inline tiles, gcc dropped both prefetches (none left
 * in dot_tile or outer_tile, and batch-1 decode slowed down markedly). */
static inline __attribute__((always_inline)) void ask_stream(const void *p) {
    __builtin_prefetch((const char *)p + PREFETCH_BYTES, 0, 2);    /* prefetcht1 on x86 */
    __builtin_prefetch((const char *)p + PREFETCH_L1_BYTES, 0, 3); /* prefetcht0 */
}

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
        if (kstep == TILE_ROWS * 32) /* packed: one stream, asked ahead (see PREFETCH_BYTES) */
            for (int j = 0; j < TILE_ROWS; j++) ask_stream(w[j] + k / 32 * kstep);
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
#elif defined(__AVX2__) && defined(__FMA__)
    /* Two input rows at a time (2 x TILE_ROWS sums fill half the 16 registers; the tile's stream is read again from
     * cache for rows 2 and 3). 16 of K a step as two vectors, the even and the odd elements of its pairs (bf16
     * widening is a shift or a mask); the tail past the last 16 is added in scalar code. */
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int i0 = 0; i0 < NX; i0 += 2) {
        const int nx = NX - i0 < 2 ? NX - i0 : 2;
        __m256 acc[2][TILE_ROWS];
        for (int i = 0; i < nx; i++)
            for (int j = 0; j < TILE_ROWS; j++) acc[i][j] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            if (kstep == TILE_ROWS * 32 && i0 == 0 && k % 32 == 0)
                for (int j = 0; j < TILE_ROWS; j++) ask_stream(w[j] + k / 32 * kstep);
            __m256 we[TILE_ROWS], wo[TILE_ROWS];
            for (int j = 0; j < TILE_ROWS; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(w[j] + k / 32 * kstep + k % 32));
                we[j] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                wo[j] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            }
            for (int i = 0; i < nx; i++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(x[i0 + i] + k));
                __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                __m256 xo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                for (int j = 0; j < TILE_ROWS; j++)
                    acc[i][j] = _mm256_fmadd_ps(xo, wo[j], _mm256_fmadd_ps(xe, we[j], acc[i][j]));
            }
        }
        for (int i = 0; i < nx; i++)
            for (int j = 0; j < TILE_ROWS; j++) {
                __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[i][j]), _mm256_extractf128_ps(acc[i][j], 1));
                h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                float s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
                for (int64_t t = k; t < K; t++)
                    s += bf16_to_f32(x[i0 + i][t]) * bf16_to_f32(w[j][t / 32 * kstep + t % 32]);
                out[i0 + i][j] = s;
            }
    }
#else
    for (int i = 0; i < NX; i++)
        for (int j = 0; j < TILE_ROWS; j++) {
            float s = 0.f;
            for (int64_t k = 0; k < K; k++) s += bf16_to_f32(x[i][k]) * bf16_to_f32(w[j][k / 32 * kstep + k % 32]);
            out[i][j] = s;
        }
#endif
}

static inline void dot_tile(const bf16 *const *x, int nx, const bf16 *const *w, int64_t K, int64_t kstep,
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
 * prefetchers follow one stream far better than TILE_ROWS short ones, and decode waits on that bandwidth). */
static inline int64_t padded_k(int64_t K) { return (K + 31) / 32 * 32; }

/* dots[i][n - n0] = dot(x rows[i], w row n) for n in [n0, n1) (n0 a multiple of TILE_ROWS), all M rows (in tiles
 * of MAX_X inputs). w is row-major with row stride ldw, or packed (ldw < 0). */
static inline void dot_block(const bf16 *const *xrows, int64_t M, const bf16 *w, int64_t ldw, int64_t N, int64_t n0,
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
#if defined(__AVX512F__)
static inline __m512 vexp16(__m512 in) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), c1 = _mm512_set1_ps(0.693359375f),
                 c2 = _mm512_set1_ps(-2.12194440e-4f);
    __m512 x = _mm512_min_ps(_mm512_max_ps(in, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.75f));
    __m512 m = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(m, c2, _mm512_fnmadd_ps(m, c1, x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
    /* the clamp turns a NaN into -104: put it back, so a NaN stays NaN as with expf */
    return _mm512_mask_mov_ps(_mm512_scalef_ps(p, m), _mm512_cmp_ps_mask(in, in, _CMP_UNORD_Q), in);
}

/* f32_to_bf16 on 16 lanes (round to nearest even, NaN kept quiet), the bf16 in each lane's low half. */
static inline __m512i bf16_bits16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
    return _mm512_srli_epi32(r, 16);
}

/* round_bf16 on 16 lanes */
static inline __m512 round_bf16_16(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(x), 16)); }

/* the lanes of mask m of x, rounded to bf16, to dst */
static inline void store_bf16_16(bf16 *dst, __mmask16 m, __m512 x) {
    _mm256_mask_storeu_epi16(dst, m, _mm512_cvtepi32_epi16(bf16_bits16(x)));
}
#endif

/* out[c] = bf16(a[c] + b[c]) for n elements: two bf16 tensors added as torch adds them (fp32 sum, rounded once);
 * out may be a or b. */
static inline void add_bf16(const bf16 *a, const bf16 *b, int64_t n, bf16 *out) {
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= n; c += 16) {
        __m512 x = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + c))), 16));
        __m512 y = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + c))), 16));
        store_bf16_16(out + c, (__mmask16)0xffff, _mm512_add_ps(x, y));
    }
#endif
    for (; c < n; c++) out[c] = f32_to_bf16(bf16_to_f32(a[c]) + bf16_to_f32(b[c]));
}

static inline void vexp(float *out, const float *in, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, vexp16(_mm512_loadu_ps(in + i)));
#endif
    for (; i < n; i++) out[i] = expf(in[i]);
}

/* out[i] = log1p(in[i]) for n values >= 0: log(u) of u = 1 + x by Cephes' single-precision polynomial on the
 * mantissa (about 1 ulp), times x / (u - 1) to undo the rounding of u (exact when u - 1 is); log1pf elsewhere.
 * in and out may alias. */
static inline void vlog1p(float *out, const float *in, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f), sqrt2 = _mm512_set1_ps(1.41421356237f);
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(in + i), u = _mm512_add_ps(x, one);
        __m512 e = _mm512_getexp_ps(u), m = _mm512_getmant_ps(u, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
        __mmask16 big = _mm512_cmp_ps_mask(m, sqrt2, _CMP_GT_OQ); /* m in [sqrt(1/2), sqrt(2)) */
        m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
        e = _mm512_mask_add_ps(e, big, e, one);
        __m512 f = _mm512_sub_ps(m, one), z = _mm512_mul_ps(f, f);
        __m512 y = _mm512_set1_ps(7.0376836292e-2f);
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.1514610310e-1f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.1676998740e-1f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.2420140846e-1f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.4249322787e-1f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.6668057665e-1f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.0000714765e-1f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-2.4999993993e-1f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(3.3333331174e-1f));
        y = _mm512_mul_ps(_mm512_mul_ps(y, f), z);
        y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
        y = _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), z, y);
        __m512 r = _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(f, y));
        __m512 d = _mm512_sub_ps(u, one);
        __mmask16 moved = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_OQ);
        _mm512_storeu_ps(out + i, _mm512_mask_div_ps(x, moved, _mm512_mul_ps(r, x), d));
    }
#endif
    for (; i < n; i++) out[i] = log1pf(in[i]);
}

/* The gated activation of n columns of one token, from the fp32 dot products g (gate) and u (up), which are
 * first rounded to bf16 as the reference's products are. act->kind 0: SiLU-GLU, bf16(bf16(silu(g)) * u) (torch's
 * silu rounds, then the product rounds); 1: SiTU, bf16((beta tanh(g / beta)) sigmoid(g) * up) in fp32 with up =
 * u, or lin_beta tanh(u / lin_beta) when has_lin; tanh(x) = 1 - 2 / (e^{2x} + 1). n <= BLOCK_ROWS; g and u are
 * scratch. With AVX512 16 columns at a time (about a sixth of the experts' time at prefill when scalar). */
typedef struct {
    int kind, has_lin;
    float beta, lin_beta;
} glu_act;

static inline void glu_block(float *g, float *u, int64_t n, const glu_act *act, bf16 *out) {
#if defined(__AVX512F__)
    /* the scalar loops below, 16 lanes at a time: the same operations in the same order, equal bit for bit (the
     * exponentials of a tail shorter than 16 come from vexp16 instead of expf) */
    const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 m = n - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - c)) - 1u);
        __m512 gv = round_bf16_16(_mm512_maskz_loadu_ps(m, g + c));
        __m512 uv = round_bf16_16(_mm512_maskz_loadu_ps(m, u + c));
        __m512 e = vexp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        if (act->kind == 0) {
            store_bf16_16(out + c, m, _mm512_mul_ps(round_bf16_16(_mm512_div_ps(gv, _mm512_add_ps(one, e))), uv));
            continue;
        }
        __m512 beta = _mm512_set1_ps(act->beta);
        __m512 t = vexp16(_mm512_div_ps(_mm512_mul_ps(two, gv), beta));
        gv = _mm512_mul_ps(_mm512_mul_ps(beta, _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(t, one)))),
                           _mm512_div_ps(one, _mm512_add_ps(one, e)));
        if (act->has_lin) {
            __m512 lb = _mm512_set1_ps(act->lin_beta);
            t = vexp16(_mm512_div_ps(_mm512_mul_ps(two, uv), lb));
            uv = _mm512_mul_ps(lb, _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(t, one))));
        }
        store_bf16_16(out + c, m, _mm512_mul_ps(gv, uv));
    }
#else
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
#endif
}

#endif
