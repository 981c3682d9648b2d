/* KDA steps, QSFA sparse attention and KDA's gated output norm. */
#include "kernels.h"

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

#if defined(__AVX512F__)
/* Tokens [0, nb) of the delta rule (see delta_block) on 16 NV columns (NV <= 4) of one head's state S [K, K] (S,
 * v and o point at the block's first column), one sweep over the block a token: the sweep that writes token i's
 * new rows also accumulates token i+1's S^T ekq and S^T eqq from them, where token by token the state is read twice
 * a token (the sums, then the update). Each element sees the same operations in the same order as in delta_block:
 * equal bit for bit. pre [nb][4K] holds each token's ekq | eqq | d | k; token i's v is at v + i * ldv, its output
 * at o + i * ldo. */
static inline __attribute__((always_inline)) void delta_sweeps(float *S, int64_t K, const int NV, int64_t nb,
                                                               const float *pre, const float *v, int64_t ldv,
                                                               const float *bt, const float *kq, float *o,
                                                               int64_t ldo) {
    __m512 sk[4], sq[4], dl[4];
    for (int j = 0; j < NV; j++) sk[j] = sq[j] = _mm512_setzero_ps();
    for (int64_t r = 0; r < K; r++) { /* token 0's sums over the state as it stands */
        __m512 a = _mm512_set1_ps(pre[r]), e = _mm512_set1_ps(pre[K + r]);
        for (int j = 0; j < NV; j++) {
            __m512 srow = _mm512_loadu_ps(S + r * K + 16 * j);
            sk[j] = _mm512_fmadd_ps(a, srow, sk[j]);
            sq[j] = _mm512_fmadd_ps(e, srow, sq[j]);
        }
    }
    for (int64_t i = 0; i < nb; i++) {
        const float *d = pre + i * 4 * K + 2 * K, *k = d + K;
        __m512 b = _mm512_set1_ps(bt[i]), kqv = _mm512_set1_ps(kq[i]);
        for (int j = 0; j < NV; j++) {
            dl[j] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + i * ldv + 16 * j), sk[j]), b);
            _mm512_storeu_ps(o + i * ldo + 16 * j, _mm512_fmadd_ps(kqv, dl[j], sq[j]));
        }
        if (i + 1 == nb) {
            for (int64_t r = 0; r < K; r++) {
                __m512 dr = _mm512_set1_ps(d[r]), kr = _mm512_set1_ps(k[r]);
                for (int j = 0; j < NV; j++) {
                    float *p = S + r * K + 16 * j;
                    _mm512_storeu_ps(p, _mm512_fmadd_ps(dr, _mm512_loadu_ps(p), _mm512_mul_ps(kr, dl[j])));
                }
            }
            break;
        }
        const float *ekq = pre + (i + 1) * 4 * K, *eqq = ekq + K;
        for (int j = 0; j < NV; j++) sk[j] = sq[j] = _mm512_setzero_ps();
        for (int64_t r = 0; r < K; r++) {
            __m512 dr = _mm512_set1_ps(d[r]), kr = _mm512_set1_ps(k[r]);
            __m512 a = _mm512_set1_ps(ekq[r]), e = _mm512_set1_ps(eqq[r]);
            for (int j = 0; j < NV; j++) {
                float *p = S + r * K + 16 * j;
                __m512 srow = _mm512_fmadd_ps(dr, _mm512_loadu_ps(p), _mm512_mul_ps(kr, dl[j]));
                _mm512_storeu_ps(p, srow);
                sk[j] = _mm512_fmadd_ps(a, srow, sk[j]);
                sq[j] = _mm512_fmadd_ps(e, srow, sq[j]);
            }
        }
    }
}

/* delta_sweeps for K in {16, 32, ..., 128}, in column blocks of up to 64: the columns of the state evolve
 * independently (each sum and update reads its own column), and a block's [K, 64] fp32 (32 KiB at K = 128) stays
 * in L1 for all nb tokens, where the whole 64 KiB state would go through L2 every token (the same outputs bit for
 * bit; the gain is small where the sweep is bound by the FMA rate rather than by L2). Returns 0 (nothing done) for
 * other K. */
static int delta_sweeps_k(float *S, int64_t K, int64_t nb, const float *pre, const float *v, int64_t ldv,
                          const float *bt, const float *kq, float *o, int64_t ldo) {
    if (K % 16 || K > 128 || K < 16) return 0;
    for (int64_t c0 = 0; c0 < K; c0 += 64) {
        switch ((K - c0) / 16 >= 4 ? 4 : (K - c0) / 16) {
        case 1: delta_sweeps(S + c0, K, 1, nb, pre, v + c0, ldv, bt, kq, o + c0, ldo); break;
        case 2: delta_sweeps(S + c0, K, 2, nb, pre, v + c0, ldv, bt, kq, o + c0, ldo); break;
        case 3: delta_sweeps(S + c0, K, 3, nb, pre, v + c0, ldv, bt, kq, o + c0, ldo); break;
        default: delta_sweeps(S + c0, K, 4, nb, pre, v + c0, ldv, bt, kq, o + c0, ldo); break;
        }
    }
    return 1;
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

/* KDA over the tokens of several sequences, from the projections to the core output (docs/model.md §8.2, §8.5): per
 * token, the short convs of q, k, v over the slot's window (SiLU, rounded to the input dtype as the torch conv
 * returns it), q and k L2-normalised in fp32 (eps 1e-6 inside the sqrt), q scaled, then the gated delta rule on
 * the slot's fp32 state [H, K, K] in place: S' = D S + k d^T with D = diag(e^g), d = beta (v - S^T (e^g k)),
 * out = S'^T q (both matvecs read the old state); the window ends holding the last W-1 inputs.
 * Sequence b owns tokens [cu[b], cu[b+1]) and slot slots[b]; a slot < 0 is padding (zeros out, no state).
 * x [T, 3P] rows hold q | k | v before the conv (bf16 when x_bf16, else fp32; row stride ldx), P = H K;
 * g [T, H, K], beta [T, H] fp32 contiguous; out [T, H, K] fp32. conv_w [3P, W] fp32; the window of slot s,
 * channel c is at conv + s * conv_slot_stride + c * (W - 1) (oldest first); the state of slot s at
 * rec + s * rec_slot_stride.
 * One work item per (sequence, head): items touch disjoint channels and state, and a head's 64 KiB state stays
 * in the core's cache for all of its tokens. Per block of KDA_BLOCK tokens: the inputs converted to fp32 once
 * (not at every use), the convs vectorised over channels, each token's vectors, then the delta rule one sweep over
 * the state a token (delta_sweeps) rather than two passes; the outputs are those of the token-by-token form bit for
 * bit. With `snaps` (NULL: none), a row t with snaps->rows[t] >= 0 also leaves the head's state and window after
 * it in that slot of the snapshot pools (a block then ends at that row). */
#define KDA_BLOCK 32
void ds_kda_step(int64_t nseq, const int64_t *cu, int64_t H, int64_t K, const void *x, int64_t ldx, int x_bf16,
                 const float *conv_w, int64_t W, float *conv, int64_t conv_slot_stride, const float *g,
                 const float *beta, float scale, float *rec, int64_t rec_slot_stride, const int64_t *slots,
                 const kda_snapshots *snaps, float *out, int nthreads) {
    int64_t P = H * K, C3 = 3 * K;
#pragma omp parallel num_threads(nthreads)
    {
        /* hist [W-1][3K]: the window of the head's channels, tap-major; y [KDA_BLOCK][3K]: conv outputs */
        float *hist = malloc(sizeof(float) * (size_t)((W > 1 ? W - 1 : 1) * C3));
        float *y = malloc(sizeof(float) * (size_t)(KDA_BLOCK * C3));
        float *xin = malloc(sizeof(float) * (size_t)((KDA_BLOCK + W) * C3)); /* a block's inputs and its window */
        float *vec = malloc(sizeof(float) * (size_t)(3 * K)), *taps = malloc(sizeof(float) * (size_t)(W * C3));
        float *pre = malloc(sizeof(float) * (size_t)(KDA_BLOCK * 4 * K)), bt[KDA_BLOCK], kq[KDA_BLOCK];
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
            memcpy((dst), hist + (W - 1 + i_) * C3, sizeof(float) * (size_t)C3);                                 \
        } else {                                                                                                 \
            for (int j_ = 0; j_ < 3; j_++) {                                                                     \
                int64_t base_ = (t0 + i_) * ldx + j_ * P + h * K;                                                \
                for (int64_t c_ = 0; c_ < K; c_++)                                                               \
                    (dst)[j_ * K + c_] = x_bf16 ? bf16_to_f32(((const bf16 *)x)[base_ + c_])                     \
                                              : ((const float *)x)[base_ + c_];                                  \
            }                                                                                                    \
        }                                                                                                        \
    } while (0)
            /* the window after sequence row `last` (its last W-1 inputs, oldest first) into window `dst` */
#define STORE_WINDOW(dst, last)                                                                                  \
    for (int64_t u = 0; u < W - 1; u++) {                                                                        \
        LOAD_INPUT((last) - (W - 2) + u, vec);                                                                   \
        for (int j = 0; j < 3; j++)                                                                              \
            for (int64_t c = 0; c < K; c++) (dst)[(j * P + h * K + c) * (W - 1) + u] = vec[j * K + c];           \
    }
            for (int64_t i0 = 0, nb; i0 < n; i0 += nb) {
                nb = n - i0 < KDA_BLOCK ? n - i0 : KDA_BLOCK;
                for (int64_t i = 0; snaps != NULL && i < nb - 1; i++) /* end the block at a snapshot */
                    if (snaps->rows[t0 + i0 + i] >= 0) nb = i + 1;
                for (int64_t i = 0; i < nb + W - 1; i++) /* the block's inputs, each converted once */
                    LOAD_INPUT(i0 + i - (W - 1), xin + i * C3);
                for (int64_t i = 0; i < nb; i++) { /* conv: acc = sum_u w[u] x[i - (W-1) + u] */
                    float *acc = y + i * C3;
                    for (int64_t c = 0; c < C3; c++) acc[c] = 0.f;
                    for (int64_t u = 0; u < W; u++) {
                        const float *wu = taps + u * C3, *xu = xin + (i + u) * C3;
                        for (int64_t c = 0; c < C3; c++) acc[c] += wu[c] * xu[c];
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
                for (int64_t i = 0; i < nb; i++) { /* each token's vectors: pre [ekq | eqq | d | k] */
                    int64_t t = t0 + i0 + i;
                    float *q = y + i * C3, *k = q + K;
                    float *ekq = pre + i * 4 * K, *eqq = ekq + K, *d = eqq + K, *kn = d + K;
                    float rq = scale / sqrtf(dotf(q, q, K) + 1e-6f), rk = 1.f / sqrtf(dotf(k, k, K) + 1e-6f);
                    vexp(d, g + (t * H + h) * K, K);
                    for (int64_t c = 0; c < K; c++) {
                        q[c] *= rq;
                        kn[c] = k[c] * rk;
                        ekq[c] = d[c] * kn[c];
                        eqq[c] = d[c] * q[c];
                    }
                    kq[i] = dotf(kn, q, K);
                    bt[i] = beta[t * H + h];
                }
                float *o = out + ((t0 + i0) * H + h) * K, *v = y + 2 * K;
                int swept = 0;
#if defined(__AVX512F__)
                swept = delta_sweeps_k(S, K, nb, pre, v, C3, bt, kq, o, P);
#endif
                for (int64_t i = 0; !swept && i < nb; i++) { /* the delta rule, token by token */
                    const float *ekq = pre + i * 4 * K;
                    delta_rule_token(S, K, ekq, ekq + K, ekq + 2 * K, ekq + 3 * K, v + i * C3, bt[i], kq[i],
                                     o + i * P, vec);
                }
                int64_t snap = snaps != NULL ? snaps->rows[t0 + i0 + nb - 1] : -1;
                if (snap >= 0) { /* the state and the window after the block's last row */
                    memcpy(snaps->rec + snap * snaps->rec_stride + h * K * K, S, sizeof(float) * (size_t)(K * K));
                    STORE_WINDOW(snaps->conv + snap * snaps->conv_stride, i0 + nb - 1)
                }
            }
            STORE_WINDOW(win, n - 1) /* the slot's window after the sequence's last row */
#undef STORE_WINDOW
#undef LOAD_INPUT
        }
        free(hist);
        free(y);
        free(xin);
        free(vec);
        free(taps);
        free(pre);
    }
}

/* o[h][0, r) += sum_{j < nb} p[h][j] c_j[0, r) for NH <= 4 heads (o rows at stride r, p rows at stride
 * QSFA_ROWS, c_j = row + j * width): 32 output floats of every head held in registers over the rows, so each row
 * slice is loaded once for the heads, where head by head every row added to o through memory. */
#define QSFA_ROWS 16
static inline __attribute__((always_inline)) void qsfa_accumulate_n(float *o, const int NH, int64_t r, const float *p,
                                                                    const float *row, int64_t width, int64_t nb) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 32 <= r; i += 32) {
        __m512 a[4][2];
        for (int h = 0; h < NH; h++) {
            a[h][0] = _mm512_loadu_ps(o + h * r + i);
            a[h][1] = _mm512_loadu_ps(o + h * r + i + 16);
        }
        for (int64_t j = 0; j < nb; j++) {
            __m512 c0 = _mm512_loadu_ps(row + j * width + i), c1 = _mm512_loadu_ps(row + j * width + i + 16);
            for (int h = 0; h < NH; h++) {
                __m512 pv = _mm512_set1_ps(p[h * QSFA_ROWS + j]);
                a[h][0] = _mm512_fmadd_ps(pv, c0, a[h][0]);
                a[h][1] = _mm512_fmadd_ps(pv, c1, a[h][1]);
            }
        }
        for (int h = 0; h < NH; h++) {
            _mm512_storeu_ps(o + h * r + i, a[h][0]);
            _mm512_storeu_ps(o + h * r + i + 16, a[h][1]);
        }
    }
#endif
    for (int h = 0; h < NH; h++)
        for (int64_t j = 0; j < nb; j++)
            for (int64_t c = i; c < r; c++) o[h * r + c] += p[h * QSFA_ROWS + j] * row[j * width + c];
}

#if defined(__AVX512F__)
/* out[i][j] = a_i . b_j over L floats for 4 vectors a and 4 vectors b (16 lanes a step, the tail masked). */
static inline void dot4x4(const float *const *a, const float *const *b, int64_t L, float out[4][4]) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < L; k += 16) {
        __mmask16 m = L - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (L - k)) - 1u);
        __m512 bv[4];
        for (int j = 0; j < 4; j++) bv[j] = _mm512_maskz_loadu_ps(m, b[j] + k);
        for (int i = 0; i < 4; i++) {
            __m512 av = _mm512_maskz_loadu_ps(m, a[i] + k);
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < 4; i++) _mm_storeu_ps(out[i], reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
}
#endif

/* sc[h][j] = scale (q_lat[h] . c_j + q_pe[h] . kpe_j) for nh heads (q rows at strides r and rho) and the nb rows
 * c_j | kpe_j = row + j * width, sc rows at stride QSFA_ROWS: tiles of 4 heads x 4 rows (a partial tile repeats
 * its last head or row), so each loaded slice serves 4 products. */
static void qsfa_scores(const float *ql, const float *qp, int64_t nh, int64_t r, int64_t rho, const float *row,
                        int64_t width, int64_t nb, float scale, float *sc) {
#if defined(__AVX512F__)
    for (int64_t h0 = 0; h0 < nh; h0 += 4)
        for (int64_t j0 = 0; j0 < nb; j0 += 4) {
            const float *qa[4], *qb[4], *ca[4], *cb[4];
            for (int i = 0; i < 4; i++) {
                int64_t h = h0 + i < nh ? h0 + i : nh - 1, j = j0 + i < nb ? j0 + i : nb - 1;
                qa[i] = ql + h * r;
                qb[i] = qp + h * rho;
                ca[i] = row + j * width;
                cb[i] = ca[i] + r;
            }
            float lat[4][4], pe[4][4];
            dot4x4(qa, ca, r, lat);
            dot4x4(qb, cb, rho, pe);
            for (int64_t i = 0; i < 4 && h0 + i < nh; i++)
                for (int64_t j = 0; j < 4 && j0 + j < nb; j++)
                    sc[(h0 + i) * QSFA_ROWS + j0 + j] = (lat[i][j] + pe[i][j]) * scale;
        }
#else
    for (int64_t h = 0; h < nh; h++)
        for (int64_t j = 0; j < nb; j++)
            sc[h * QSFA_ROWS + j] = (dotf(ql + h * r, row + j * width, r) + dotf(qp + h * rho, row + j * width + r,
                                                                                rho)) * scale;
#endif
}

static void qsfa_accumulate(float *o, int64_t nh, int64_t r, const float *p, const float *row, int64_t width,
                            int64_t nb) {
    for (int64_t h = 0; h < nh; h += 4) {
        float *oh = o + h * r;
        const float *ph = p + h * QSFA_ROWS;
        switch (nh - h >= 4 ? 4 : nh - h) {
        case 1: qsfa_accumulate_n(oh, 1, r, ph, row, width, nb); break;
        case 2: qsfa_accumulate_n(oh, 2, r, ph, row, width, nb); break;
        case 3: qsfa_accumulate_n(oh, 3, r, ph, row, width, nb); break;
        default: qsfa_accumulate_n(oh, 4, r, ph, row, width, nb); break;
        }
    }
}

/* Sparse absorbed MLA attention (QSFA, docs/ops.md §4.5) over bf16 or fp32 latent rows: for query t and head h, the
 * softmax over its selected rows j (selected[t, :] up to the first -1) of scale (q_lat[t,h] . c_j + q_pe[t,h] .
 * kpe_j), out_lat[t,h] = sum_j p_j c_j and lse[t,h] = log sum_j exp(score_j) (-inf and a zero output when no row
 * is selected). q_lat [T, H, r], q_pe [T, H, rho] fp32 contiguous; latent rows [c | kpe] of width r + rho at
 * row stride ld (bf16 when lat_bf16). One pass over the rows with a running max (rows read once per item);
 * an item is one query and a group of heads (all heads unless there are fewer queries than threads). The scores
 * and the weighted sums of a block of rows run in tiles over heads (qsfa_scores, qsfa_accumulate), so each row
 * slice loaded serves several heads.
 * Returns 0, or -1 (nothing computed) when a selected row is not below nrows. */
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
                qsfa_scores(q_lat + (t * H + h0) * r, q_pe + (t * H + h0) * rho, nh, r, rho, row, width, nb, scale,
                            sc);
                for (int64_t h = 0; h < nh; h++) {
                    float bmax = -INFINITY;
                    for (int64_t j = 0; j < nb; j++) bmax = sc[h * QSFA_ROWS + j] > bmax ? sc[h * QSFA_ROWS + j] : bmax;
                    float nm = bmax > mx[h] ? bmax : mx[h];
                    float rescale = mx[h] == -INFINITY ? 0.f : expf(mx[h] - nm);
                    float *oh = o + h * r;
                    if (rescale != 1.f)
                        for (int64_t i = 0; i < r; i++) oh[i] *= rescale;
                    z[h] *= rescale;
                    mx[h] = nm;
                    for (int64_t j = 0; j < nb; j++) sc[h * QSFA_ROWS + j] -= nm;
                    vexp(sc + h * QSFA_ROWS, sc + h * QSFA_ROWS, nb);
                    for (int64_t j = 0; j < nb; j++) z[h] += sc[h * QSFA_ROWS + j];
                }
                qsfa_accumulate(o, nh, r, sc, row, width, nb);
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

/* KDA's gated output norm (docs/model.md §8.7) in the reference rounding order: per row of K values, x = bf16(core)
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

/* KDA's forget gate and beta (docs/model.md §8.3) for T tokens: u = bf16 f_b_proj output [T, H K] (row stride ldu) +
 * dt_bias, a = exp(A_log[h]); g = -a softplus(u) (softplus(u) = u above 20), or, with a lower bound λ (not NaN),
 * λ sigmoid(a u); beta = sigmoid(b) for the bf16 b_proj output [T, H] (row stride ldb). g [T, H, K] and
 * beta [T, H] fp32. Twin: ops/kda.py kda_gate and torch.sigmoid (equal to fp32 rounding). */
void ds_kda_gate(const bf16 *u, int64_t ldu, const bf16 *b, int64_t ldb, int64_t T, int64_t H, int64_t K,
                 const float *dt_bias, const float *A_log, float lower_bound, float *g, float *beta, int nthreads) {
    int safe = !isnan(lower_bound);
#pragma omp parallel num_threads(nthreads) if (T * H * K >= (1 << 16))
    {
        float *v = malloc(sizeof(float) * (size_t)K), *e = malloc(sizeof(float) * (size_t)K);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) { /* a row of K channels, exponentials and logarithms vectorised */
                float a = expf(A_log[h]), *gr = g + (t * H + h) * K;
                beta[t * H + h] = 1.f / (1.f + expf(-bf16_to_f32(b[t * ldb + h])));
                for (int64_t c = 0; c < K; c++) {
                    v[c] = bf16_to_f32(u[t * ldu + h * K + c]) + dt_bias[h * K + c];
                    e[c] = safe ? -(a * v[c]) : v[c];
                }
                vexp(e, e, K);
                if (safe) {
                    for (int64_t c = 0; c < K; c++) gr[c] = lower_bound * (1.f / (1.f + e[c]));
                    continue;
                }
                vlog1p(e, e, K);
                for (int64_t c = 0; c < K; c++) gr[c] = -a * (v[c] > 20.f ? v[c] : e[c]);
            }
        free(v);
        free(e);
    }
}

/* AttnRes depth mixing (docs/model.md §5.3) of S bf16 sources [N, D] (contiguous; src holds their addresses): per row,
 * s_i = rsqrt(mean(v_i^2) + eps) * <v_i, norm_w * query>, alpha = softmax_i(s), out = bf16(sum_i alpha_i v_i) in
 * fp32. norm_w and query [D] bf16. Twin: ops/attn_res.py attn_res_mix (equal to fp32 rounding). */
void ds_attn_res_mix(const int64_t *src, int64_t S, int64_t N, int64_t D, const bf16 *norm_w, const bf16 *query,
                     float eps, bf16 *out, int nthreads) {
    float *c = malloc(sizeof(float) * (size_t)D);
    for (int64_t j = 0; j < D; j++) c[j] = bf16_to_f32(norm_w[j]) * bf16_to_f32(query[j]);
#pragma omp parallel num_threads(nthreads) if (N * S * D >= (1 << 16))
    {
        float *v = malloc(sizeof(float) * (size_t)D), *acc = malloc(sizeof(float) * (size_t)D);
        float *alpha = malloc(sizeof(float) * (size_t)S);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            float mx = -INFINITY, sum = 0.f;
            for (int64_t i = 0; i < S; i++) {
                const bf16 *row = (const bf16 *)src[i] + n * D;
                for (int64_t j = 0; j < D; j++) v[j] = bf16_to_f32(row[j]);
                alpha[i] = dotf(v, c, D) / sqrtf(dotf(v, v, D) / (float)D + eps);
                mx = alpha[i] > mx ? alpha[i] : mx;
            }
            for (int64_t i = 0; i < S; i++) {
                alpha[i] = expf(alpha[i] - mx);
                sum += alpha[i];
            }
            memset(acc, 0, sizeof(float) * (size_t)D);
            for (int64_t i = 0; i < S; i++) {
                const bf16 *row = (const bf16 *)src[i] + n * D;
                float a = alpha[i] / sum;
                for (int64_t j = 0; j < D; j++) acc[j] += a * bf16_to_f32(row[j]);
            }
            for (int64_t j = 0; j < D; j++) out[n * D + j] = f32_to_bf16(acc[j]);
        }
        free(v);
        free(acc);
        free(alpha);
    }
    free(c);
}
