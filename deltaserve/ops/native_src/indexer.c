/* The lightning indexer's selection for one decode token over unquantised keys (ops/qli.py qli_topk with
 * quantized=False, rotate=False; docs/model.md §9.4-9.5), for the fused DSA block past the indexer's top-k. */
#include "kernels.h"

typedef struct {
    float score;
    int64_t pos;
} ranked;

/* a ranks before b: higher score, then larger position (-0.0 == +0.0 as floats compare) */
static int before(const ranked *a, const ranked *b) {
    return a->score > b->score || (a->score == b->score && a->pos > b->pos);
}

static int by_rank(const void *a, const void *b) { return before(a, b) ? -1 : before(b, a) ? 1 : 0; }

/* Moves the k best of v[0..n) (by `before`) to v[0..k), in no order: quickselect, middle pivot. */
static void select_best(ranked *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        ranked pivot = v[(lo + hi) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (before(&v[i], &pivot)) i++;
            while (before(&pivot, &v[j])) j--;
            if (i <= j) {
                ranked t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else return;
    }
}

/* sum_h w[h] relu(q_h . k) for one key k [DI] fp32 and the queries transposed, qt [DI][HI]: sixteen heads at a
 * time in a register (NaN passes the ReLU, as torch's does). */
static float score_key(const float *k, const float *qt, const float *w, int64_t HI, int64_t DI) {
    float s = 0.f;
    int64_t h0 = 0;
#if defined(__AVX512F__)
    for (; h0 + 16 <= HI; h0 += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < DI; d++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(k[d]), _mm512_loadu_ps(qt + d * HI + h0), acc);
        acc = _mm512_max_ps(_mm512_setzero_ps(), acc); /* the second operand when either is NaN */
        s += _mm512_reduce_add_ps(_mm512_mul_ps(acc, _mm512_loadu_ps(w + h0)));
    }
#endif
    for (; h0 < HI; h0++) {
        float a = 0.f;
        for (int64_t d = 0; d < DI; d++) a += k[d] * qt[d * HI + h0];
        s += (a < 0.f ? 0.f : a) * w[h0];
    }
    return s;
}

/* score_j = sum_h w[h] relu(q_h . key_j) for the token's context rows rows[0..n) (its positions 0..n-1; key j
 * at keys + rows[j] * ldk, bf16 when keys_bf16, else fp32), q [HI, DI] bf16 and w [HI] fp32 (the head weights
 * already times HI^-1/2 and DI^-1/2), summed over heads in order; NaN scores rank lowest (-FLT_MAX). Writes the
 * topk best rows to selected, by score then larger position, when n > topk; all n rows in position order
 * otherwise; the rest -1. Dot products accumulate in another order than torch's fp32 GEMM: scores agree to fp32
 * rounding, so a near-tie at the cut may select differently. */
void ds_index_select(const bf16 *q, const float *w, int64_t HI, int64_t DI, const int64_t *rows, int64_t n,
                     const void *keys, int64_t ldk, int keys_bf16, int64_t topk, int64_t *selected, int nthreads) {
    if (n <= topk) {
        for (int64_t j = 0; j < topk; j++) selected[j] = j < n ? rows[j] : -1;
        return;
    }
    float *qt = malloc(sizeof(float) * (size_t)(HI * DI)); /* [DI][HI]: a key element times every head */
    for (int64_t h = 0; h < HI; h++)
        for (int64_t d = 0; d < DI; d++) qt[d * HI + h] = bf16_to_f32(q[h * DI + d]);
    ranked *v = malloc(sizeof(ranked) * (size_t)n);
#pragma omp parallel num_threads(nthreads) if (n * HI * DI >= (1 << 18))
    {
        float *kf = malloc(sizeof(float) * (size_t)DI);
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            const char *row = (const char *)keys + rows[j] * ldk * (keys_bf16 ? 2 : 4);
            for (int64_t d = 0; d < DI; d++)
                kf[d] = keys_bf16 ? bf16_to_f32(((const bf16 *)row)[d]) : ((const float *)row)[d];
            float s = score_key(kf, qt, w, HI, DI);
            v[j].score = isnan(s) ? -3.402823466e38f : s + 0.f;
            v[j].pos = j;
        }
        free(kf);
    }
    select_best(v, n, topk);
    qsort(v, (size_t)topk, sizeof(ranked), by_rank);
    for (int64_t j = 0; j < topk; j++) selected[j] = rows[v[j].pos];
    free(v);
    free(qt);
}
