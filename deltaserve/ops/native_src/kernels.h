/* The library's declarations: contract.h (generated from ops/native_contract.py) holds the entry points called
 * through ctypes, the records they take and the constants both sides read; here are the internal functions that
 * one source shares with another. Each is documented where it is defined. */
#ifndef DELTASERVE_NATIVE_KERNELS_H
#define DELTASERVE_NATIVE_KERNELS_H
#include "common.h"
#include "contract.h"

#define COL_BLOCK 64 /* output columns per column-packed block (experts.c, mx.c) */

/* A shared expert beside column-packed routed ones: w1/w3 [IS, D] and w2 [D, IS], and the rows it reads (x, or
 * their MXFP8 quantisation when w1 quantises its inputs). */
typedef struct {
    mx_matrix w1, w3, w2;
    int64_t I;
    const bf16 *x;
} shared_expert;
/* products.c: the (token, slot) pairs of an expert product grouped by expert, ascending expert then pair index:
 * order[start[e] .. start[e+1]) for expert e, the experts with pairs in `used`, each pair's input row (x + token *
 * D) in that order in xrows. group_pairs returns -1 (and holds nothing) for an id outside [0, E). */
typedef struct {
    int64_t *start, *order, *used, nused;
    const bf16 **xrows;
} pair_groups;
int group_pairs(const int64_t *experts, int64_t T, int64_t k, int64_t E, const bf16 *x, int64_t D, pair_groups *g);
void free_groups(pair_groups *g);
/* experts.c: ds_moe_bf16's outer-product form over column-packed experts (packed 2) and ds_mx_moe's, after the
 * grouping; w1/w3/w2 are the stacks (expert e at mx_at(w, e, ...)). */
void moe_columns(const bf16 *const *xrows, const int64_t *order, const int64_t *start, const int64_t *used,
                 int64_t nused, int64_t T, int64_t D, int64_t k, const float *weights, const mx_matrix *w1,
                 const mx_matrix *w3, const mx_matrix *w2, int64_t I, const shared_expert *sh, const glu_act *act,
                 int tiles, bf16 *h, bf16 *out, int nthreads);
/* experts.c: ds_heads_columns over any column-packed matrix (bf16 or MX; inputs as the caller gives them), head h's
 * outputs of row i at out + i * ldy + h * N; and mx_product, ds_mx_linear's product (its input rows quantised as w
 * says, on the tile unit where `tiles` and usable) into y [M, N] at row stride ldy (the blocks' MX products; K as the format
 * needs, which the caller has checked). */
void heads_columns(const bf16 *x, int64_t M, int64_t ldx, int64_t hx, int64_t H, int64_t K, const mx_matrix *w,
                   int64_t N, bf16 *out, int64_t ldy, int tiles, int nthreads);
void mx_product(const bf16 *x, int64_t M, int64_t ldx, int64_t K, const mx_matrix *w, int64_t N, bf16 *y,
                int64_t ldy, int tiles, int nthreads);
/* experts.c: mx_product of n <= MX_MAX_PIECES matrices [widths[i], K] over the same rows, their outputs side by side
 * in y (row stride ldy), in one parallel pass over all their column blocks with the input quantised once (each
 * column as mx_product gives it; matrices that quantise their inputs differently run one pass each). */
#define MX_MAX_PIECES 8
void mx_products(const bf16 *x, int64_t M, int64_t ldx, int64_t K, const mx_matrix *ws, const int64_t *widths, int n,
                 bf16 *y, int64_t ldy, int tiles, int nthreads);
/* mx.c: the bytes of one column-packed [N, K] matrix's data and scales, matrix e of a stack, the bf16 pairs
 * [p0, p1) of block b of a matrix (decoded from MX codes: dst [p1 - p0][64][2]), and MXFP8 fake quantisation of
 * n values (a multiple of 32) of a bf16 row in place, by ACT_* rule. */
int64_t mx_data_bytes(int64_t format, int64_t N, int64_t K);
int64_t mx_scale_bytes(int64_t format, int64_t N, int64_t K);
mx_matrix mx_at(const mx_matrix *w, int64_t e, int64_t N, int64_t K);
void mx_decode_pairs(const mx_matrix *w, int64_t b, int64_t p0, int64_t p1, int64_t K, bf16 *dst);
void mx_quantize_row(bf16 *x, int64_t n, int act);
/* mx.c: out [n] = x [n] quantised by rule act (mx_quantize_row; ACT_NONE: a copy). */
void mx_quantize_copy(const bf16 *x, int64_t n, int act, bf16 *out);
#if defined(__AVX512BW__)
/* mx.c: group g (pairs 16 g .. 16 g + 15) of MX block b, columns 32 half .. 32 half + 31 only, decoded with their
 * scales: out [16][32][2] bf16 (tiles.c's two-row-tile product). */
void mx_decode_half(const mx_matrix *w, int64_t b, int64_t g, int64_t K, int half, bf16 *out);
#endif
/* mx.c: acc [m][64] = m <= MX_FEW_ROWS rows x (K bf16 each, K a multiple of 32) times MX block b of w, its codes
 * decoded in registers and the scales applied per 32 of K to the fp32 sums (AVX-512 BF16 builds and AVX2 + FMA +
 * F16C ones; others 0). */
#if defined(__AVX512BF16__)
#define MX_FEW_ROWS 4
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MX_FEW_ROWS 6
#else
#define MX_FEW_ROWS 0
#endif
#if MX_FEW_ROWS
void mx_block_few(const bf16 *const *x, int m, const mx_matrix *w, int64_t b, int64_t K, float *acc);
#endif
/* tiles.c: products of TILE_MIN_ROWS rows and more take the AMX tile unit (ds_tiles_usable), the AVX512-BF16 pair
 * products otherwise. tile_block_product is experts.c's block_product for rows at a stride over K's whole groups
 * of 32: acc [m][64] = x [m] (stride ldx) times block b of column-packed w [N, K], pairs [0, 16 (K / 32)) only;
 * experts.c adds the pairs past them. */
void tile_block_product(const bf16 *x, int64_t ldx, int64_t m, const bf16 *w, int64_t b, int64_t K, float *acc);
/* tiles.c: acc [m][64] = m <= TILE_MAX_ROWS rows x (stride ldx) times MX block b of w, decoded a group of 32 of K at
 * a time into buf (experts.c's decode scratch for K: two 4 KiB groups, one when K = 32) and multiplied there on the
 * tile unit. */
#define TILE_MAX_ROWS 32
void tile_mx_block(const bf16 *x, int64_t ldx, int64_t m, const mx_matrix *w, int64_t b, int64_t K, float *acc,
                   bf16 *buf);

#endif
