/* The library's declarations: contract.h (generated from ops/native_contract.py) holds the entry points called
 * through ctypes, the records they take and the constants both sides read; here are the internal functions that
 * one source shares with another. Each is documented where it is defined. */
#ifndef DELTASERVE_NATIVE_KERNELS_H
#define DELTASERVE_NATIVE_KERNELS_H
#include "common.h"
#include "contract.h"

/* A shared expert beside column-packed routed ones: w1/w3 [IS, D] and w2 [D, IS], column-packed. */
typedef struct {
    const bf16 *w1, *w3, *w2;
    int64_t I;
} shared_expert;
/* experts.c: ds_moe_bf16's outer-product form over column-packed experts (packed 2), after the grouping. */
void moe_columns(const bf16 *x, const bf16 *const *xrows, const int64_t *order, const int64_t *start,
                 const int64_t *used, int64_t nused, int64_t T, int64_t D, int64_t k, const float *weights,
                 const bf16 *w1, const bf16 *w3, const bf16 *w2, int64_t I, const shared_expert *sh,
                 const glu_act *act, int tiles, bf16 *h, bf16 *out, int nthreads);
/* tiles.c: products of TILE_MIN_ROWS rows and more take the AMX tile unit (ds_tiles_usable), the AVX512-BF16 pair
 * products otherwise. tile_block_product is experts.c's block_product for rows at a stride over K's whole groups
 * of 32: acc [m][64] = x [m] (stride ldx) times block b of column-packed w [N, K], pairs [0, 16 (K / 32)) only;
 * experts.c adds the pairs past them. */
void tile_block_product(const bf16 *x, int64_t ldx, int64_t m, const bf16 *w, int64_t b, int64_t K, float *acc);

#endif
