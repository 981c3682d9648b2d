/* The library's entry points (called through ctypes by ops/native.py and ops/kda_native.py, and composed by
 * blocks.c); each is documented where it is defined. */
#ifndef DELTASERVE_NATIVE_KERNELS_H
#define DELTASERVE_NATIVE_KERNELS_H
#include "common.h"

void ds_linear_bf16(int64_t M, int64_t K, int64_t ntasks, const int64_t *desc, int nthreads);
int ds_moe_bf16(const bf16 *x, int64_t T, int64_t D, const int64_t *experts, const float *weights, int64_t k,
                const bf16 *w1, const bf16 *w3, const bf16 *w2, int64_t E, int64_t I, int packed, int act_kind,
                float beta, float lin_beta, const bf16 *s1, const bf16 *s3, const bf16 *s2, int64_t IS, int tiles,
                bf16 *h, bf16 *out, int nthreads);
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
/* experts.c: a plain product over a column-packed weight (ops/native.py linear_columns). */
void ds_linear_columns(const bf16 *x, int64_t M, int64_t ldx, int64_t K, const bf16 *w, int64_t N, bf16 *out,
                       int tiles, int nthreads);
void ds_heads_columns(const bf16 *x, int64_t M, int64_t ldx, int64_t hx, int64_t H, int64_t K, const bf16 *w,
                      int64_t N, bf16 *out, int tiles, int nthreads);
/* The row counts up to which plain linears take the row-packed dot tiles (ds_linear_bf16; above: the column pack)
 * and dense MLPs the expert kernel on their row packs (above: their column packs), as ops/native.py LINEAR_MAX_ROWS
 * and layers/native_path.py MLP_MAX_ROWS; the fused blocks follow them to give their modules' results. */
#define LINEAR_MAX_ROWS 4
#define MLP_MAX_ROWS 8
/* tiles.c: products of TILE_MIN_ROWS rows and more take the AMX tile unit where the CPU and the OS give it (the
 * callers' `tiles` argument 1), the AVX512-BF16 pair products otherwise. tile_block_product is experts.c's
 * block_product for rows at a stride over K's whole groups of 32: acc [m][64] = x [m] (stride ldx) times block b
 * of column-packed w [N, K], pairs [0, 16 (K / 32)) only; experts.c adds the pairs past them. */
#define TILE_MIN_ROWS 4
int ds_tiles_usable(void);
void tile_block_product(const bf16 *x, int64_t ldx, int64_t m, const bf16 *w, int64_t b, int64_t K, float *acc);
void ds_rmsnorm_bf16(const bf16 *x, int64_t M, int64_t D, int64_t ldx, const bf16 *w, float eps, bf16 *out,
                     int nthreads);
void ds_kda_step(int64_t nseq, const int64_t *cu, int64_t H, int64_t K, const void *x, int64_t ldx, int x_bf16,
                 const float *conv_w, int64_t W, float *conv, int64_t conv_slot_stride, const float *g,
                 const float *beta, float scale, float *rec, int64_t rec_slot_stride, const int64_t *slots,
                 float *out, int nthreads);
int ds_qsfa(int64_t T, int64_t H, int64_t r, int64_t rho, const float *q_lat, const float *q_pe, const void *lat,
            int64_t ld, int64_t nrows, int lat_bf16, const int64_t *selected, int64_t nsel, float scale, float *out,
            float *lse, int nthreads);
void ds_gated_rmsnorm_bf16(const float *core, int64_t R, int64_t K, const bf16 *gate, int64_t ldg, const float *w,
                           float eps, bf16 *out, int nthreads);
void ds_kda_gate(const bf16 *u, int64_t ldu, const bf16 *b, int64_t ldb, int64_t T, int64_t H, int64_t K,
                 const float *dt_bias, const float *A_log, float lower_bound, float *g, float *beta, int nthreads);
int ds_router(const bf16 *x, int64_t T, int64_t D, int64_t ldx, const float *w, const float *bias, int64_t E,
              int softmax, int64_t ngroups, int64_t topk_group, int64_t k, int renorm, float scale,
              int64_t *experts, float *weights, int nthreads);
void ds_attn_res_mix(const int64_t *src, int64_t S, int64_t N, int64_t D, const bf16 *norm_w, const bf16 *query,
                     float eps, bf16 *out, int nthreads);

/* blocks.c: the fused decode blocks; stack.c: a decode step of a whole decoder stack. */
void ds_kda_block(const int64_t *desc, const float *fdesc, const bf16 *xin, const bf16 *r, int64_t N, int64_t nseq,
                  const int64_t *cu_rows, const int64_t *slots, float *conv, int64_t conv_stride, float *rec,
                  int64_t rec_stride, bf16 *out, int nthreads);
int ds_moe_block(const int64_t *desc, const float *fdesc, const bf16 *xin, const bf16 *r, int64_t T, bf16 *out,
                 int nthreads);
int ds_mla_block(const int64_t *desc, const float *fdesc, const bf16 *xin, const bf16 *r, int64_t N,
                 const int64_t *selected, int64_t nsel, const int64_t *write_rows, void *pages, int64_t ld,
                 int64_t nrows, int pages_bf16, bf16 *out, int nthreads);
int ds_dsa_block(const int64_t *desc, const float *fdesc, const bf16 *xin, const bf16 *r, int64_t N,
                 const int64_t *selected, int64_t nsel, const int64_t *write_rows, void *pages, int64_t ld,
                 int64_t nrows, int pages_bf16, void *keys, int64_t ldk, int keys_bf16, const float *cos_sin,
                 bf16 *out, int nthreads);
void ds_index_select(const bf16 *q, const float *w, int64_t HI, int64_t DI, const int64_t *rows, int64_t n,
                     const void *keys, int64_t ldk, int keys_bf16, int64_t topk, int64_t *selected, int nthreads);
/* sampling.c: the greedy pick. */
void ds_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out, int nthreads);
int64_t ds_decode_stack(const int64_t *program, int64_t nops, int64_t N, int64_t D, bf16 *regs, const int64_t *step,
                        int nthreads);

#endif
