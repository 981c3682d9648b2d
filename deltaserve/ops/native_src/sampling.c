/* The greedy pick over rows of logits (engine/sampler.py). torch.argmax scans a row one element at a time; here a
 * row is scanned 16 lanes at a time (the maximum, then its first position) and the rows are spread over the
 * threads. */
#include "kernels.h"

/* out[i] = the index of the largest element of row i of x [rows, n] (fp32, row stride ld), as torch.argmax picks
 * it: the first of equal maxima (-0 equals +0), and the first NaN when the row has one. n >= 1. */
void ds_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out, int nthreads) {
#pragma omp parallel for num_threads(rows > 1 ? nthreads : 1) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *r = x + i * ld;
        float best = -INFINITY;
        int nan = 0;
        int64_t c = 0;
#if defined(__AVX512F__)
        __m512 m = _mm512_set1_ps(-INFINITY);
        __mmask16 unordered = 0;
        for (; c + 16 <= n; c += 16) { /* a NaN lane spoils m, but a row with a NaN answers its first NaN */
            __m512 v = _mm512_loadu_ps(r + c);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            m = _mm512_max_ps(m, v);
        }
        best = _mm512_reduce_max_ps(m);
        nan = unordered != 0;
#endif
        for (; c < n; c++) {
            if (r[c] != r[c])
                nan = 1;
            else if (r[c] > best)
                best = r[c];
        }
        int64_t at = 0, j = 0;
#if defined(__AVX512F__)
        __m512 want = _mm512_set1_ps(best);
        for (; j + 16 <= n; j += 16) {
            __m512 v = _mm512_loadu_ps(r + j);
            __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, want, _CMP_EQ_OQ);
            if (hit) {
                at = j + __builtin_ctz(hit);
                break;
            }
        }
        if (j + 16 > n)
#endif
            for (; j < n; j++)
                if (nan ? r[j] != r[j] : r[j] == best) {
                    at = j;
                    break;
                }
        out[i] = at;
    }
}
