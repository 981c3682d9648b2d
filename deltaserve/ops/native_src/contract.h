/* Generated from deltaserve/ops/native_contract.py by its write_header(); edit that module and run it again, not this
 * file. The constants, the records passed by address and the entry points' prototypes shared by the kernels and the
 * Python side (see that module's docstring). */
#ifndef DELTASERVE_NATIVE_CONTRACT_H
#define DELTASERVE_NATIVE_CONTRACT_H
#include "common.h"

/* Why each constant has its value: ops/native_contract.py. */
#define LINEAR_MAX_ROWS 4
#define MLP_MAX_ROWS 8
#define TILE_MIN_ROWS 4
#define MAX_MIX_SOURCES 64
#define SOP_KDA 1
#define SOP_MLA 2
#define SOP_DSA 3
#define SOP_FFN 4
#define SOP_MIX 5
#define ISA_AVX512F 1
#define ISA_AVX512BF16 2
#define ISA_AMX_BF16 4
#define ISA_AVX2 8
#define ISA_FMA 16
#define MAT_BF16 0
#define MAT_E4M3 1
#define KDA_MX_SLOTS 9
#define MLA_MX_SLOTS 3
#define DSA_MX_SLOTS 5
#define MOE_MX_SLOTS 8
#define MAT_E2M1 2
#define ACT_NONE 0
#define ACT_FLOOR 1
#define ACT_RCEIL 2
#define ACT_CEIL 3
#define ACT_EVEN 4

/* One product of ds_linear_bf16: y [M, n] (row stride ldy) = x [M, K] (row stride ldx) @ W^T for W [n, K] row-major
 * (row stride ldw) or packed by pack_rows (ldw -1); the tasks of a call may share x (several weights over one input)
 * or not (one weight per attention head). */
typedef struct {
    const bf16 *w;
    int64_t ldw; /* -1: packed */
    int64_t n;
    bf16 *y;
    int64_t ldy;
    const bf16 *x;
    int64_t ldx;
} linear_task;

/* A column-packed weight matrix [N, K] (or a stack of them, one per expert, one after another) as the column products
 * read it: bf16 (MAT_BF16, `pack_columns`; scales 0) or MX codes in that order (MAT_E4M3: two bytes a pair of k,
 * MAT_E2M1: one byte a pair, element 2p in the low nibble) with one E8M0 scale byte a column per 32 of K
 * (`pack_mx_columns`), and how the product quantises its input rows (ACT_*). */
typedef struct {
    const void *data;
    const uint8_t *scales; /* [blocks][K / 32][64]; 0 for bf16 */
    int64_t format; /* MAT_* */
    int64_t act; /* ACT_* */
} mx_matrix;

/* ds_kda_block: a KDA layer's attention block. The input projections are stacked q | k | v | f_a | b | g (g: g_a of
 * width head_dim, or the full-rank gate of width heads * head_dim when w_gb is 0); each weight row-packed (w_*) and
 * column-packed (c_*, read above LINEAR_MAX_ROWS rows). */
typedef struct {
    int64_t hidden; /* D */
    int64_t heads; /* H */
    int64_t head_dim; /* K */
    int64_t conv_width; /* W */
    int64_t in_width; /* the stacked input projections' outputs */
    const bf16 *norm_w; /* the block's RMSNorm weight */
    const bf16 *w_in;
    const bf16 *w_fb;
    const bf16 *w_gb; /* 0: the full-rank gate */
    const float *dt_bias;
    const float *a_log;
    const float *conv_w; /* [3 H K, W] */
    const float *onorm_w;
    const bf16 *w_o;
    const bf16 *c_in;
    const bf16 *c_fb;
    const bf16 *c_gb;
    const bf16 *c_o;
    float eps;
    float onorm_eps;
    float lower_bound; /* NaN: none */
    float scale;
    const mx_matrix *mx; /* [KDA_MX_SLOTS]; 0: bf16 packs */
} kda_block;

/* Where ds_kda_step also keeps the state after single rows (a verify step's drafts, docs/serving.md §9.3): per row of
 * the step, the index of a state slot of these pools (conv [slots, 3 H K, W-1], rec [slots, H, K, K] at the given slot
 * strides) that receives the sequence's state after that row, or -1. */
typedef struct {
    const int64_t *rows; /* [N] */
    float *conv;
    int64_t conv_stride;
    float *rec;
    int64_t rec_stride;
} kda_snapshots;

/* ds_moe_block: a layer's FFN block, routed experts (experts > 0, column-packed stacks; latent > 0: K3's latent form
 * around them) and/or a shared or dense gated MLP (shared_width > 0: row packs s*, column packs c_s*). */
typedef struct {
    int64_t hidden; /* D */
    const bf16 *norm_w;
    int64_t experts; /* E (0: no routed experts) */
    int64_t expert_width; /* I */
    int64_t topk; /* k */
    const float *router_w; /* [E, D] */
    const float *router_bias; /* [E] */
    int64_t softmax; /* 0: sigmoid scores */
    int64_t groups;
    int64_t topk_group;
    int64_t renorm;
    const bf16 *w1;
    const bf16 *w3;
    const bf16 *w2;
    int64_t shared_width; /* IS (0: no shared or dense MLP) */
    const bf16 *s1;
    const bf16 *s3;
    const bf16 *s2;
    int64_t situ; /* 0: SiLU-GLU, 1: SiTU */
    int64_t latent; /* L (0: plain MoE) */
    const bf16 *w_down;
    const bf16 *latent_norm_w; /* 0: none */
    const bf16 *w_up;
    const bf16 *c_s1;
    const bf16 *c_s3;
    const bf16 *c_s2;
    float eps;
    float routed_scale;
    float situ_beta;
    float situ_linear_beta; /* NaN: none */
    float latent_eps;
    const mx_matrix *mx; /* [MOE_MX_SLOTS]; 0: bf16 packs */
} moe_block;

/* ds_mla_block: Kimi's dense NoPE MLA block. W_UK^T and W_UV packed per head; each weight row-packed (w_*) and column-
 * packed (c_*, read above LINEAR_MAX_ROWS rows). */
typedef struct {
    int64_t hidden; /* D */
    int64_t heads; /* H */
    int64_t nope;
    int64_t rope;
    int64_t v_dim;
    int64_t rank; /* R, the latent width */
    const bf16 *norm_w;
    const bf16 *w_q;
    const bf16 *w_kva;
    const bf16 *kva_norm_w;
    const bf16 *w_uk;
    const bf16 *w_uv;
    const bf16 *w_o;
    const bf16 *c_q;
    const bf16 *c_kva;
    const bf16 *c_uk;
    const bf16 *c_uv;
    const bf16 *c_o;
    float eps;
    float kva_eps;
    float scale;
    const mx_matrix *mx; /* [MLA_MX_SLOTS]; 0: bf16 packs */
} mla_block;

/* ds_dsa_block: a DSA layer's block (query LoRA), its weights row-packed only. w_a stacks q_a (q_rank) | kv_a (rank +
 * rope) | gate (gate_width, or none) | index wk (index_dim) | index weights (index_heads); when q_a, kv_a and the gate
 * are stored MX (slots 0-2), w_a holds only the index wk | weights rows. */
typedef struct {
    int64_t hidden; /* D */
    int64_t heads; /* H */
    int64_t nope;
    int64_t rope;
    int64_t v_dim;
    int64_t rank; /* R, the latent width */
    int64_t q_rank;
    int64_t a_width; /* w_a's outputs */
    int64_t gate_width; /* 0: no output gate */
    int64_t index_dim;
    int64_t index_rope;
    int64_t index_heads;
    int64_t index_topk;
    const bf16 *norm_w;
    const bf16 *w_a;
    const bf16 *qa_norm_w;
    const bf16 *w_qb;
    const bf16 *kva_norm_w;
    const bf16 *ik_norm_w;
    const bf16 *ik_norm_b;
    const bf16 *w_uk;
    const bf16 *w_uv;
    const bf16 *w_o;
    const bf16 *w_iq; /* the index queries' wq_b */
    float eps;
    float q_eps;
    float kv_eps;
    float index_eps;
    float scale;
    float index_weight_scale; /* index_heads^-1/2 */
    float index_dim_scale; /* index_dim^-1/2 */
    const mx_matrix *mx; /* [DSA_MX_SLOTS]; 0: bf16 packs */
} dsa_block;

/* One op of a native program: a fused block (its descriptor and its layer's cache) or an AttnRes mix, over registers
 * (indices into the register file; -1: none). Each kind reads its own fields only. */
typedef struct {
    int64_t kind; /* SOP_* */
    int64_t x;
    int64_t residual;
    int64_t out;
    const void *descriptor; /* the block's *_block */
    float *conv; /* KDA: the conv state pool */
    int64_t conv_stride;
    float *rec; /* KDA: the recurrent state pool */
    int64_t rec_stride;
    float *draft_conv; /* KDA: the draft states' conv pool (0: none) */
    int64_t draft_conv_stride;
    float *draft_rec; /* KDA: the draft states' recurrent pool */
    int64_t draft_rec_stride;
    void *pages; /* MLA, DSA: the latent rows */
    int64_t ld;
    int64_t nrows;
    int64_t pages_bf16;
    void *keys; /* DSA: the index-key rows */
    int64_t ldk;
    int64_t keys_bf16;
    const bf16 *query; /* mix: the query weight */
    const bf16 *norm_w;
    float eps;
    int64_t nsources;
    int64_t sources[MAX_MIX_SOURCES]; /* registers */
} stack_op;

/* A step's own inputs, shared by every op of the program (0: not used by its blocks). */
typedef struct {
    int64_t nseq; /* the step's sequences */
    const int64_t *cu; /* KDA: the sequences' row offsets [nseq + 1], 0: one row each */
    const int64_t *slots; /* the KDA state slots [nseq] */
    const int64_t *rows; /* the sequences' cache rows [N, width] */
    int64_t width;
    const int64_t *write_rows; /* the new tokens' cache rows [N] */
    const float *cos_sin; /* DeepSeek-V3.2's rotation at the tokens' positions [2, N, rope / 2] */
    const int64_t *draft_rows; /* KDA: the draft state taking the state after each row [N], -1: none (0: no drafts) */
} stack_step;

void ds_linear_bf16(int64_t M, int64_t K, int64_t ntasks, const linear_task *tasks, int nthreads);
int ds_moe_bf16(const bf16 *x, int64_t T, int64_t D, const int64_t *experts, const float *weights, int64_t k,
    const bf16 *w1, const bf16 *w3, const bf16 *w2, int64_t E, int64_t I, int packed, int act_kind, float beta,
    float lin_beta, const bf16 *s1, const bf16 *s3, const bf16 *s2, int64_t IS, int tiles, bf16 *h, bf16 *out,
    int nthreads);
void ds_linear_columns(const bf16 *x, int64_t M, int64_t ldx, int64_t K, const bf16 *w, int64_t N, bf16 *out,
    int tiles, int nthreads);
void ds_heads_columns(const bf16 *x, int64_t M, int64_t ldx, int64_t hx, int64_t H, int64_t K, const bf16 *w,
    int64_t N, bf16 *out, int tiles, int nthreads);
int ds_mx_linear(const bf16 *x, int64_t M, int64_t ldx, int64_t K, const mx_matrix *w, int64_t N, bf16 *out,
    int tiles, int nthreads);
int ds_mx_moe(const bf16 *x, int64_t T, int64_t D, const int64_t *experts, const float *weights, int64_t k,
    const mx_matrix *w1, const mx_matrix *w3, const mx_matrix *w2, int64_t E, int64_t I, int act_kind, float beta,
    float lin_beta, const mx_matrix *s1, const mx_matrix *s3, const mx_matrix *s2, int64_t IS, int tiles, bf16 *out,
    int nthreads);
void ds_mx_quantize_rows(const bf16 *x, int64_t M, int64_t K, int64_t ldx, int act, bf16 *out, int nthreads);
void ds_mx_unpack_block(const mx_matrix *w, int64_t K, int64_t b, bf16 *out);
int ds_tiles_usable(void);
int ds_vector_isa(void);
void ds_rmsnorm_bf16(const bf16 *x, int64_t M, int64_t D, int64_t ldx, const bf16 *w, float eps, bf16 *out,
    int nthreads);
void ds_kda_step(int64_t nseq, const int64_t *cu, int64_t H, int64_t K, const void *x, int64_t ldx, int x_bf16,
    const float *conv_w, int64_t W, float *conv, int64_t conv_slot_stride, const float *g, const float *beta,
    float scale, float *rec, int64_t rec_slot_stride, const int64_t *slots, const kda_snapshots *snaps, float *out,
    int nthreads);
int ds_qsfa(int64_t T, int64_t H, int64_t r, int64_t rho, const float *q_lat, const float *q_pe, const void *lat,
    int64_t ld, int64_t nrows, int lat_bf16, const int64_t *selected, int64_t nsel, float scale, float *out,
    float *lse, int nthreads);
void ds_gated_rmsnorm_bf16(const float *core, int64_t R, int64_t K, const bf16 *gate, int64_t ldg, const float *w,
    float eps, bf16 *out, int nthreads);
void ds_kda_gate(const bf16 *u, int64_t ldu, const bf16 *b, int64_t ldb, int64_t T, int64_t H, int64_t K,
    const float *dt_bias, const float *A_log, float lower_bound, float *g, float *beta, int nthreads);
int ds_router(const bf16 *x, int64_t T, int64_t D, int64_t ldx, const float *w, const float *bias, int64_t E,
    int softmax, int64_t ngroups, int64_t topk_group, int64_t k, int renorm, float scale, int64_t *experts,
    float *weights, int nthreads);
void ds_attn_res_mix(const int64_t *src, int64_t S, int64_t N, int64_t D, const bf16 *norm_w, const bf16 *query,
    float eps, bf16 *out, int nthreads);
void ds_kda_block(const kda_block *d, const bf16 *xin, const bf16 *r, int64_t N, int64_t nseq,
    const int64_t *cu_rows, const int64_t *slots, float *conv, int64_t conv_stride, float *rec, int64_t rec_stride,
    const kda_snapshots *snaps, bf16 *out, int nthreads);
int ds_moe_block(const moe_block *d, const bf16 *xin, const bf16 *r, int64_t T, bf16 *out, int nthreads);
int ds_mla_block(const mla_block *d, const bf16 *xin, const bf16 *r, int64_t N, const int64_t *selected,
    int64_t nsel, const int64_t *write_rows, void *pages, int64_t ld, int64_t nrows, int pages_bf16, bf16 *out,
    int nthreads);
int ds_dsa_block(const dsa_block *d, const bf16 *xin, const bf16 *r, int64_t N, const int64_t *selected,
    int64_t nsel, const int64_t *write_rows, void *pages, int64_t ld, int64_t nrows, int pages_bf16, void *keys,
    int64_t ldk, int keys_bf16, const float *cos_sin, bf16 *out, int nthreads);
void ds_index_select(const bf16 *q, const float *w, int64_t HI, int64_t DI, const int64_t *rows, int64_t n,
    const void *keys, int64_t ldk, int keys_bf16, int64_t topk, int64_t *selected, int nthreads);
void ds_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out, int nthreads);
int64_t ds_run_program(const stack_op *program, int64_t nops, int64_t N, int64_t D, bf16 *regs,
    const stack_step *step, int nthreads);

#endif
