/* Fused residual blocks for decode: a whole pre-norm sub-block r + f(rmsnorm(x)) of a decoder layer in one call (r
 * = x for a plain residual layer; K3's AttnRes layers give the mixed x and the block's partial sum r, or none),
 * composed of the library's kernels in the order the layer modules call them (so the results are the modules'
 * bit for bit), for the few-row steps where the Python and torch glue between ~10 kernel calls a layer cost
 * about as much as the products (kimi-linear-small, batch 1: ~9 of ~20 ms a step).
 *
 * Each block is described by a vector of int64 (dimensions and the addresses of the packed weights, built once
 * per layer by layers/fused_blocks.py) and one of floats (epsilons, scales); scratch is allocated per call. */
#include "kernels.h"

enum { KB_D, KB_H, KB_K, KB_W, KB_NIN, KB_NORM_W, KB_W_IN, KB_W_FB, KB_W_GB, KB_DT_BIAS, KB_A_LOG, KB_CONV_W,
       KB_ONORM_W, KB_W_O };
enum { KBF_EPS, KBF_ONORM_EPS, KBF_LOWER_BOUND, KBF_SCALE };

/* out = bf16(r + a), or out = a when there is no r. */
static void residual_add(const bf16 *r, const bf16 *a, int64_t n, bf16 *out) {
    if (r == NULL) {
        if (out != a) memcpy(out, a, sizeof(bf16) * (size_t)n);
        return;
    }
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(r[i]) + bf16_to_f32(a[i]));
}

/* out = r + KDA(rmsnorm(x)) for N decode tokens, one per sequence, states in place in their slots
 * (layers/kda.py for the math and roundings). The input projections are stacked q | k | v | f_a | b | g
 * (g: g_a of width K, or the full-rank gate of width H K when desc[KB_W_GB] is 0), packed; f_b and g_b are
 * K -> H K, o_proj H K -> D, all packed. conv [slots, 3 H K, W-1] and rec [slots, H, K, K] at the given slot
 * strides; slots [N] (< 0: padding, no state touched). x, r (NULL: none) and out [N, D] bf16 contiguous. */
void ds_kda_block(const int64_t *desc, const float *fdesc, const bf16 *xin, const bf16 *r, int64_t N,
                  const int64_t *slots, float *conv, int64_t conv_stride, float *rec, int64_t rec_stride, bf16 *out,
                  int nthreads) {
    int64_t D = desc[KB_D], H = desc[KB_H], K = desc[KB_K], W = desc[KB_W], NIN = desc[KB_NIN], P = H * K;
    int full_rank = desc[KB_W_GB] == 0;
    bf16 *x = malloc(sizeof(bf16) * (size_t)(N * (D + NIN + 3 * P + D)));
    bf16 *y = x + N * D, *u = y + N * NIN, *gate = u + N * P, *o = gate + N * P, *a = o + N * P;
    float *g = malloc(sizeof(float) * (size_t)(N * (2 * P + H))), *core = g + N * P, *beta = core + N * P;
    int64_t *cu = malloc(sizeof(int64_t) * (size_t)(N + 1));
    for (int64_t i = 0; i <= N; i++) cu[i] = i;

    ds_rmsnorm_bf16(xin, N, D, D, (const bf16 *)desc[KB_NORM_W], fdesc[KBF_EPS], x, nthreads);
    int64_t in_task[7] = {desc[KB_W_IN], -1, NIN, (int64_t)y, NIN, (int64_t)x, D};
    ds_linear_bf16(N, D, 1, in_task, nthreads);
    const bf16 *f_a = y + 3 * P, *b = f_a + K, *g_in = b + H;
    int64_t gate_tasks[14] = {desc[KB_W_FB], -1, P, (int64_t)u, P, (int64_t)f_a, NIN,
                              desc[KB_W_GB], -1, P, (int64_t)gate, P, (int64_t)g_in, NIN};
    ds_linear_bf16(N, K, full_rank ? 1 : 2, gate_tasks, nthreads);
    if (full_rank) /* the gate's rows, contiguous for the per-head norm */
        for (int64_t i = 0; i < N; i++) memcpy(gate + i * P, g_in + i * NIN, sizeof(bf16) * (size_t)P);
    ds_kda_gate(u, P, b, NIN, N, H, K, (const float *)desc[KB_DT_BIAS], (const float *)desc[KB_A_LOG],
                fdesc[KBF_LOWER_BOUND], g, beta, nthreads);
    ds_kda_step(N, cu, H, K, y, NIN, 1, (const float *)desc[KB_CONV_W], W, conv, conv_stride, g, beta,
                fdesc[KBF_SCALE], rec, rec_stride, slots, core, nthreads);
    ds_gated_rmsnorm_bf16(core, N * H, K, gate, K, (const float *)desc[KB_ONORM_W], fdesc[KBF_ONORM_EPS], o,
                          nthreads);
    int64_t o_task[7] = {desc[KB_W_O], -1, D, (int64_t)a, D, (int64_t)o, P};
    ds_linear_bf16(N, P, 1, o_task, nthreads);
    residual_add(r, a, N * D, out);
    free(x);
    free(g);
    free(cu);
}

enum { MB_D, MB_NORM_W, MB_E, MB_I, MB_K, MB_ROUTER_W, MB_BIAS, MB_SOFTMAX, MB_GROUPS, MB_TOPK_GROUP, MB_RENORM,
       MB_W1, MB_W3, MB_W2, MB_SHARED_I, MB_S1, MB_S3, MB_S2, MB_ACT, MB_LATENT, MB_W_DOWN, MB_LATENT_NORM_W, MB_W_UP };
enum { MBF_EPS, MBF_SCALE, MBF_BETA, MBF_LIN_BETA, MBF_LATENT_EPS };

static void linear_1(const bf16 *x, int64_t M, int64_t K, const bf16 *packed, int64_t N, bf16 *y, int nthreads) {
    int64_t task[7] = {(int64_t)packed, -1, N, (int64_t)y, N, (int64_t)x, K};
    ds_linear_bf16(M, K, 1, task, nthreads);
}

/* out = r + FFN(rmsnorm(x)) for T tokens, where FFN is routed experts (E > 0: the router on the normed x, then the
 * fused expert kernel over the packed stacks; with a latent width L > 0, K3's latent form: the experts run on
 * down(x) [T, L], their output optionally RMS-normed, then up to D) plus a shared or dense gated MLP (shared
 * width > 0: the expert kernel with one expert of weight 1), the two outputs each rounded to bf16 and summed in
 * bf16 (layers/moe.py, layers/mlp.py). x, r (NULL: none) and out [T, D] bf16 contiguous. Returns 0, or -1
 * (nothing written) when the router rejects its shape. */
int ds_moe_block(const int64_t *desc, const float *fdesc, const bf16 *xin, const bf16 *r, int64_t T, bf16 *out,
                 int nthreads) {
    int64_t D = desc[MB_D], E = desc[MB_E], I = desc[MB_I], k = desc[MB_K], IS = desc[MB_SHARED_I];
    int64_t L = desc[MB_LATENT], DE = L > 0 ? L : D; /* the experts' input and output width */
    int act = (int)desc[MB_ACT];
    int64_t hrows = (E > 0 ? T * k * I : 0) + T * IS;
    bf16 *x = malloc(sizeof(bf16) * (size_t)(3 * T * D + 3 * T * DE + hrows)), *routed = x + T * D;
    bf16 *shared = routed + T * D, *xe = shared + T * D, *ye = xe + T * DE, *yn = ye + T * DE, *hbuf = yn + T * DE;
    int64_t *experts = malloc(sizeof(int64_t) * (size_t)(T * (k > 1 ? k : 1)));
    float *weights = malloc(sizeof(float) * (size_t)(T * (k > 1 ? k : 1)));
    int bad = 0;
    ds_rmsnorm_bf16(xin, T, D, D, (const bf16 *)desc[MB_NORM_W], fdesc[MBF_EPS], x, nthreads);
    if (E > 0) {
        bad = ds_router(x, T, D, D, (const float *)desc[MB_ROUTER_W], (const float *)desc[MB_BIAS], E,
                        (int)desc[MB_SOFTMAX], desc[MB_GROUPS], desc[MB_TOPK_GROUP], k, (int)desc[MB_RENORM],
                        fdesc[MBF_SCALE], experts, weights, nthreads);
        if (L > 0)
            linear_1(x, T, D, (const bf16 *)desc[MB_W_DOWN], L, xe, nthreads);
        if (!bad)
            bad = ds_moe_bf16(L > 0 ? xe : x, T, DE, experts, weights, k, (const bf16 *)desc[MB_W1],
                              (const bf16 *)desc[MB_W3], (const bf16 *)desc[MB_W2], E, I, 1, act, fdesc[MBF_BETA],
                              fdesc[MBF_LIN_BETA], hbuf, L > 0 ? ye : routed, nthreads);
        if (!bad && L > 0) {
            const bf16 *latent_out = ye;
            if (desc[MB_LATENT_NORM_W]) {
                ds_rmsnorm_bf16(ye, T, L, L, (const bf16 *)desc[MB_LATENT_NORM_W], fdesc[MBF_LATENT_EPS], yn,
                                nthreads);
                latent_out = yn;
            }
            linear_1(latent_out, T, L, (const bf16 *)desc[MB_W_UP], D, routed, nthreads);
        }
    }
    if (!bad && IS > 0) {
        for (int64_t t = 0; t < T; t++) {
            experts[t] = 0;
            weights[t] = 1.f;
        }
        ds_moe_bf16(x, T, D, experts, weights, 1, (const bf16 *)desc[MB_S1], (const bf16 *)desc[MB_S3],
                    (const bf16 *)desc[MB_S2], 1, IS, 1, act, fdesc[MBF_BETA], fdesc[MBF_LIN_BETA],
                    hbuf + (E > 0 ? T * k * I : 0), shared, nthreads);
        if (E > 0)
            residual_add(routed, shared, T * D, routed);
        else
            memcpy(routed, shared, sizeof(bf16) * (size_t)(T * D));
    }
    if (!bad) residual_add(r, routed, T * D, out);
    free(x);
    free(experts);
    free(weights);
    return bad;
}

enum { AB_D, AB_H, AB_N, AB_RHO, AB_V, AB_R, AB_NORM_W, AB_W_Q, AB_W_KVA, AB_KVA_NORM_W, AB_W_UK, AB_W_UV,
       AB_W_O };
enum { ABF_EPS, ABF_KVA_EPS, ABF_SCALE };

/* out = r + MLA(rmsnorm(x)) for N decode tokens of Kimi's dense NoPE MLA (layers/mla.py: q_proj, kv_a_proj and
 * its norm, the cache row [c | k_pe] written at write_rows[i] (< 0: not written), the query absorbed per head by
 * W_UK, QSFA over the rows selected[i, :] (up to the first -1; every row of the sequence so far), W_UV per head,
 * o_proj). pages [nrows, R + RHO] at row stride ld, bf16 (pages_bf16) or fp32. W_UK^T [H, R, N] and W_UV
 * [H, V, R] packed per head. x, r (NULL: none) and out [N, D] bf16 contiguous. Returns 0, or -1 (nothing
 * computed) when a selected or written row is not below nrows. */
int ds_mla_block(const int64_t *desc, const float *fdesc, const bf16 *xin, const bf16 *r, int64_t N,
                 const int64_t *selected, int64_t nsel, const int64_t *write_rows, void *pages, int64_t ld,
                 int64_t nrows, int pages_bf16, bf16 *out, int nthreads) {
    int64_t D = desc[AB_D], H = desc[AB_H], NOPE = desc[AB_N], RHO = desc[AB_RHO], V = desc[AB_V], R = desc[AB_R];
    int64_t QW = H * (NOPE + RHO), CW = R + RHO;
    for (int64_t i = 0; i < N; i++) {
        if (write_rows[i] >= nrows) return -1;
        for (int64_t j = 0; j < nsel && selected[i * nsel + j] >= 0; j++)
            if (selected[i * nsel + j] >= nrows) return -1;
    }
    bf16 *x = malloc(sizeof(bf16) * (size_t)(N * (D + QW + CW + R + 2 * H * R + H * V + D)));
    bf16 *q = x + N * D, *ckv = q + N * QW, *cn = ckv + N * CW, *qlat = cn + N * R, *olat = qlat + N * H * R;
    bf16 *vals = olat + N * H * R, *a = vals + N * H * V;
    float *qlat_f = malloc(sizeof(float) * (size_t)(N * H * (2 * R + RHO + 1))), *qpe_f = qlat_f + N * H * R;
    float *olat_f = qpe_f + N * H * RHO, *lse = olat_f + N * H * R;
    int64_t *tasks = malloc(sizeof(int64_t) * (size_t)(7 * H));
    int bad = 0;

    ds_rmsnorm_bf16(xin, N, D, D, (const bf16 *)desc[AB_NORM_W], fdesc[ABF_EPS], x, nthreads);
    int64_t proj[14] = {desc[AB_W_Q], -1, QW, (int64_t)q, QW, (int64_t)x, D,
                        desc[AB_W_KVA], -1, CW, (int64_t)ckv, CW, (int64_t)x, D};
    ds_linear_bf16(N, D, 2, proj, nthreads);
    ds_rmsnorm_bf16(ckv, N, R, CW, (const bf16 *)desc[AB_KVA_NORM_W], fdesc[ABF_KVA_EPS], cn, nthreads);
    for (int64_t i = 0; i < N; i++) { /* the cache row [c | k_pe] into the pages */
        if (write_rows[i] < 0) continue;
        for (int64_t c = 0; c < CW; c++) {
            bf16 v = c < R ? cn[i * R + c] : ckv[i * CW + c];
            if (pages_bf16)
                ((bf16 *)pages)[write_rows[i] * ld + c] = v;
            else
                ((float *)pages)[write_rows[i] * ld + c] = bf16_to_f32(v);
        }
    }
    for (int64_t h = 0; h < H; h++) { /* q_lat[:, h] = q_nope[:, h] W_UK[h] */
        int64_t *t = tasks + 7 * h;
        t[0] = desc[AB_W_UK] + 2 * h * ((R + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS * padded_k(NOPE));
        t[1] = -1, t[2] = R, t[3] = (int64_t)(qlat + h * R), t[4] = H * R;
        t[5] = (int64_t)(q + h * (NOPE + RHO)), t[6] = QW;
    }
    ds_linear_bf16(N, NOPE, H, tasks, nthreads);
    for (int64_t i = 0; i < N * H; i++) {
        for (int64_t c = 0; c < R; c++) qlat_f[i * R + c] = bf16_to_f32(qlat[i * R + c]);
        for (int64_t c = 0; c < RHO; c++) qpe_f[i * RHO + c] = bf16_to_f32(q[i * (NOPE + RHO) + NOPE + c]);
    }
    bad = ds_qsfa(N, H, R, RHO, qlat_f, qpe_f, pages, ld, nrows, pages_bf16, selected, nsel, fdesc[ABF_SCALE],
                  olat_f, lse, nthreads);
    if (!bad) {
        for (int64_t i = 0; i < N * H * R; i++) olat[i] = f32_to_bf16(olat_f[i]);
        for (int64_t h = 0; h < H; h++) { /* vals[:, h] = out_lat[:, h] W_UV[h]^T */
            int64_t *t = tasks + 7 * h;
            t[0] = desc[AB_W_UV] + 2 * h * ((V + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS * padded_k(R));
            t[1] = -1, t[2] = V, t[3] = (int64_t)(vals + h * V), t[4] = H * V;
            t[5] = (int64_t)(olat + h * R), t[6] = H * R;
        }
        ds_linear_bf16(N, R, H, tasks, nthreads);
        int64_t o_task[7] = {desc[AB_W_O], -1, D, (int64_t)a, D, (int64_t)vals, H * V};
        ds_linear_bf16(N, H * V, 1, o_task, nthreads);
        residual_add(r, a, N * D, out);
    }
    free(x);
    free(qlat_f);
    free(tasks);
    return bad;
}
