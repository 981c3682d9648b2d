/* Fused residual blocks for decode: a whole pre-norm sub-block r + f(rmsnorm(x)) of a decoder layer in one call (r
 * = x for a plain residual layer; K3's AttnRes layers give the mixed x and the block's partial sum r, or none),
 * composed of the library's kernels in the order the layer modules call them (so the results are the modules'
 * bit for bit; the DSA block's LayerNorm and sigmoid to fp32 rounding), for the few-row steps where the Python
 * and torch glue between ~10 kernel calls a layer costs about as much as the products.
 *
 * Each block is described by its struct of contract.h (dimensions, the addresses of the packed weights, epsilons
 * and scales; ops/native_contract.py, built once per layer by backends/native/blocks.py); scratch is allocated per
 * call. */
#include "kernels.h"

/* y [M, N] (contiguous) = rows of x [M, K] at stride ldx @ W^T for one weight W [N, K] given in both native packs,
 * as the linears' own `native_product` picks them by row count (backends/packs.py): the row-packed dot tiles
 * (`rows`) up to LINEAR_MAX_ROWS rows, the column pack (`cols`, on the tile unit where there is one) above. The
 * two forms sum in other fp32 orders, so a block takes the form its module would. A block that runs only a few
 * rows (the DSA block, K3's latent projections) passes no column pack (NULL): the dot tiles at any count. A weight
 * stored MX (mx not NULL) takes the MX product at every count, as its module does (backends/native/modules.py
 * NativeMXLinear). */
static void product(const bf16 *x, int64_t M, int64_t ldx, int64_t K, const bf16 *rows, const bf16 *cols,
                    const mx_matrix *mx, int64_t N, bf16 *y, int nthreads) {
    if (mx) {
        mx_product(x, M, ldx, K, mx, N, y, N, 1, nthreads);
    } else if (M <= LINEAR_MAX_ROWS || cols == NULL) {
        linear_task task = {.w = rows, .ldw = -1, .n = N, .y = y, .ldy = N, .x = x, .ldx = ldx};
        ds_linear_bf16(M, K, 1, &task, nthreads);
    } else {
        ds_linear_columns(x, M, ldx, K, cols, N, y, 1, nthreads);
    }
}

/* Slot i of a block's MX weights (native_contract.py KDA_MX_SLOTS...), or NULL when that weight is a bf16 pack. */
static inline const mx_matrix *mx_slot(const mx_matrix *mx, int i) { return mx && mx[i].data ? &mx[i] : NULL; }

/* out = bf16(r + a), or out = a when there is no r; 16 lanes at a time, over the threads when there are more than
 * 4,096 elements (a prefill chunk's rows). */
static void residual_add(const bf16 *r, const bf16 *a, int64_t n, bf16 *out, int nthreads) {
    if (r == NULL) {
        if (out != a) memcpy(out, a, sizeof(bf16) * (size_t)n);
        return;
    }
    int64_t chunks = (n + 4095) / 4096;
#pragma omp parallel for num_threads(chunks > 1 ? nthreads : 1) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t i = c * 4096, len = n - i < 4096 ? n - i : 4096;
        add_bf16(r + i, a + i, len, out + i);
    }
}

/* out = r + KDA(rmsnorm(x)) for N tokens of nseq sequences, sequence b's rows cu[b] .. cu[b+1] (cu NULL: a decode
 * step, one token per sequence, nseq = N), states in place in their slots (layers/kda.py for the math and
 * roundings: its decode and varlen calls are this one ds_kda_step). The input projections are stacked
 * q | k | v | f_a | b | g (g: g_a of width K, or the full-rank gate of width H K when d->w_gb is NULL); f_b and
 * g_b are K -> H K, o_proj H K -> D; each weight row-packed (d->w_*) and column-packed (d->c_*, read above
 * LINEAR_MAX_ROWS rows). conv [slots, 3 H K, W-1] and rec [slots, H, K, K] at the given slot strides; slots [nseq]
 * (< 0: padding, no state touched); `snaps` (NULL: none): states also kept after single rows, as ds_kda_step.
 * x, r (NULL: none) and out [N, D] bf16 contiguous. */
void ds_kda_block(const kda_block *d, const bf16 *xin, const bf16 *r, int64_t N, int64_t nseq,
                  const int64_t *cu_rows, const int64_t *slots, float *conv, int64_t conv_stride, float *rec,
                  int64_t rec_stride, const kda_snapshots *snaps, bf16 *out, int nthreads) {
    int64_t D = d->hidden, H = d->heads, K = d->head_dim, W = d->conv_width, NIN = d->in_width, P = H * K;
    int full_rank = d->w_gb == NULL && mx_slot(d->mx, 7) == NULL;
    /* one allocation a buffer: a prefill chunk's scratch in one piece (~50 MiB at 2,048 rows) would pass glibc's
     * largest mmap threshold (32 MiB) and be mapped, and faulted in, afresh on every call (engine/heap.py) */
    bf16 *x = malloc(sizeof(bf16) * (size_t)(N * D)), *y = malloc(sizeof(bf16) * (size_t)(N * NIN));
    bf16 *u = malloc(sizeof(bf16) * (size_t)(N * P)), *gate = malloc(sizeof(bf16) * (size_t)(N * P));
    bf16 *o = malloc(sizeof(bf16) * (size_t)(N * P)), *a = malloc(sizeof(bf16) * (size_t)(N * D));
    float *g = malloc(sizeof(float) * (size_t)(N * P)), *core = malloc(sizeof(float) * (size_t)(N * P));
    float *beta = malloc(sizeof(float) * (size_t)(N * H));
    int64_t *cu = malloc(sizeof(int64_t) * (size_t)(nseq + 1));
    for (int64_t i = 0; i <= nseq; i++) cu[i] = cu_rows ? cu_rows[i] : i;

    ds_rmsnorm_bf16(xin, N, D, D, d->norm_w, d->eps, x, nthreads);
    if (mx_slot(d->mx, 0)) { /* MX input projections, each column as its module's product, into the stacked columns */
        int64_t widths[6] = {P, P, P, K, H, NIN - 3 * P - K - H};
        mx_products(x, N, D, D, d->mx, widths, 6, y, NIN, 1, nthreads);
    } else {
        product(x, N, D, D, d->w_in, d->c_in, NULL, NIN, y, nthreads);
    }
    const bf16 *f_a = y + 3 * P, *b = f_a + K, *g_in = b + H;
    const mx_matrix *fb_mx = mx_slot(d->mx, 6), *gb_mx = mx_slot(d->mx, 7);
    if (fb_mx || gb_mx) {
        product(f_a, N, NIN, K, d->w_fb, d->c_fb, fb_mx, P, u, nthreads);
        if (!full_rank) product(g_in, N, NIN, K, d->w_gb, d->c_gb, gb_mx, P, gate, nthreads);
    } else if (N <= LINEAR_MAX_ROWS) { /* both gate products in one call */
        linear_task gate_tasks[2] = {{.w = d->w_fb, .ldw = -1, .n = P, .y = u, .ldy = P, .x = f_a, .ldx = NIN},
                                     {.w = d->w_gb, .ldw = -1, .n = P, .y = gate, .ldy = P, .x = g_in, .ldx = NIN}};
        ds_linear_bf16(N, K, full_rank ? 1 : 2, gate_tasks, nthreads);
    } else {
        product(f_a, N, NIN, K, d->w_fb, d->c_fb, NULL, P, u, nthreads);
        if (!full_rank) product(g_in, N, NIN, K, d->w_gb, d->c_gb, NULL, P, gate, nthreads);
    }
    if (full_rank) /* the gate's rows, contiguous for the per-head norm */
        for (int64_t i = 0; i < N; i++) memcpy(gate + i * P, g_in + i * NIN, sizeof(bf16) * (size_t)P);
    ds_kda_gate(u, P, b, NIN, N, H, K, d->dt_bias, d->a_log, d->lower_bound, g, beta, nthreads);
    ds_kda_step(nseq, cu, H, K, y, NIN, 1, d->conv_w, W, conv, conv_stride, g, beta, d->scale, rec, rec_stride,
                slots, snaps, core, nthreads);
    ds_gated_rmsnorm_bf16(core, N * H, K, gate, K, d->onorm_w, d->onorm_eps, o, nthreads);
    product(o, N, P, P, d->w_o, d->c_o, mx_slot(d->mx, 8), D, a, nthreads);
    residual_add(r, a, N * D, out, nthreads);
    void *buffers[] = {x, y, u, gate, o, a, g, core, beta, cu};
    for (size_t i = 0; i < sizeof buffers / sizeof *buffers; i++) free(buffers[i]);
}

/* out = r + FFN(rmsnorm(x)) for T tokens, where FFN is routed experts (E > 0: the router on the normed x, then the
 * fused expert kernel over the column-packed stacks, experts.c; with a latent width L > 0, K3's latent form: the
 * experts run on down(x) [T, L], their output optionally RMS-normed, then up to D) plus a shared or dense gated MLP
 * (shared width > 0: the expert kernel with one expert of weight 1, on its row packs d->s* up to MLP_MAX_ROWS tokens
 * and its column packs d->c_s* above, as layers/mlp.py; above MLP_MAX_ROWS a plain MoE's shared MLP runs in the
 * routed pass), the two outputs each rounded to bf16 and summed in bf16 (layers/moe.py, layers/mlp.py). x, r
 * (NULL: none) and out [T, D] bf16 contiguous. Returns 0, or -1 (nothing written) when the router rejects its
 * shape. */
int ds_moe_block(const moe_block *d, const bf16 *xin, const bf16 *r, int64_t T, bf16 *out, int nthreads) {
    int64_t D = d->hidden, E = d->experts, I = d->expert_width, k = d->topk, IS = d->shared_width;
    int64_t L = d->latent, DE = L > 0 ? L : D; /* the experts' input and output width */
    int act = (int)d->situ;
    int64_t hrows = (E > 0 ? T * k * I : 0) + T * IS;
    /* one allocation a buffer, as ds_kda_block's */
    bf16 *x = malloc(sizeof(bf16) * (size_t)(T * D)), *routed = malloc(sizeof(bf16) * (size_t)(T * D));
    bf16 *shared = malloc(sizeof(bf16) * (size_t)(T * D));
    bf16 *hbuf = malloc(sizeof(bf16) * (size_t)(hrows > 0 ? hrows : 1));
    bf16 *xe = NULL, *ye = NULL, *yn = NULL;
    if (L > 0) {
        xe = malloc(sizeof(bf16) * (size_t)(T * DE));
        ye = malloc(sizeof(bf16) * (size_t)(T * DE));
        yn = malloc(sizeof(bf16) * (size_t)(T * DE));
    }
    int64_t *experts = malloc(sizeof(int64_t) * (size_t)(T * (k > 1 ? k : 1)));
    float *weights = malloc(sizeof(float) * (size_t)(T * (k > 1 ? k : 1)));
    /* above MLP_MAX_ROWS a plain MoE's shared MLP runs in the routed experts' pass, as layers/moe.py does: its
     * compute-bound products overlap the experts' weight stream, where a separate call would run them after it.
     * MX routed experts take it at every count, and bf16 ones never take an MX one (as NativeMoE does). */
    const mx_matrix *routed_mx = mx_slot(d->mx, 0), *shared_mx = mx_slot(d->mx, 3);
    int bad = 0, in_pass = E > 0 && L == 0 && IS > 0 && (routed_mx ? 1 : !shared_mx && T > MLP_MAX_ROWS);
    ds_rmsnorm_bf16(xin, T, D, D, d->norm_w, d->eps, x, nthreads);
    if (E > 0) {
        bad = ds_router(x, T, D, D, d->router_w, d->router_bias, E, (int)d->softmax, d->groups, d->topk_group, k,
                        (int)d->renorm, d->routed_scale, experts, weights, nthreads);
        if (L > 0)
            product(x, T, D, D, d->w_down, NULL, mx_slot(d->mx, 6), L, xe, nthreads);
        if (!bad && routed_mx) {
            mx_matrix sh[3];
            for (int j = 0; j < 3; j++) /* the shared MLP as the expert kernel reads it: MX, or its column packs */
                sh[j] = shared_mx ? d->mx[3 + j]
                                  : (mx_matrix){j == 0 ? d->c_s1 : j == 1 ? d->c_s3 : d->c_s2, NULL, MAT_BF16, ACT_NONE};
            bad = ds_mx_moe(L > 0 ? xe : x, T, DE, experts, weights, k, &d->mx[0], &d->mx[1], &d->mx[2], E, I, act,
                            d->situ_beta, d->situ_linear_beta, &sh[0], &sh[1], &sh[2], in_pass ? IS : 0, 1,
                            L > 0 ? ye : routed, nthreads);
        } else if (!bad) {
            bad = ds_moe_bf16(L > 0 ? xe : x, T, DE, experts, weights, k, d->w1, d->w3, d->w2, E, I, 2, act,
                              d->situ_beta, d->situ_linear_beta, d->c_s1, d->c_s3, d->c_s2, in_pass ? IS : 0, 1,
                              hbuf, L > 0 ? ye : routed, nthreads);
        }
        if (!bad && L > 0) {
            const bf16 *latent_out = ye;
            if (d->latent_norm_w) {
                ds_rmsnorm_bf16(ye, T, L, L, d->latent_norm_w, d->latent_eps, yn, nthreads);
                latent_out = yn;
            }
            product(latent_out, T, L, L, d->w_up, NULL, mx_slot(d->mx, 7), D, routed, nthreads);
        }
    }
    if (!bad && IS > 0 && !in_pass) {
        for (int64_t t = 0; t < T; t++) {
            experts[t] = 0;
            weights[t] = 1.f;
        }
        int cols = T > MLP_MAX_ROWS;
        if (shared_mx)
            ds_mx_moe(x, T, D, experts, weights, 1, &d->mx[3], &d->mx[4], &d->mx[5], 1, IS, act, d->situ_beta,
                      d->situ_linear_beta, NULL, NULL, NULL, 0, 1, shared, nthreads);
        else
            ds_moe_bf16(x, T, D, experts, weights, 1, cols ? d->c_s1 : d->s1, cols ? d->c_s3 : d->s3,
                        cols ? d->c_s2 : d->s2, 1, IS, cols ? 2 : 1, act, d->situ_beta, d->situ_linear_beta, NULL,
                        NULL, NULL, 0, 1, hbuf + (E > 0 ? T * k * I : 0), shared, nthreads);
        if (E > 0)
            residual_add(routed, shared, T * D, routed, nthreads);
        else
            memcpy(routed, shared, sizeof(bf16) * (size_t)(T * D));
    }
    if (!bad) residual_add(r, routed, T * D, out, nthreads);
    void *buffers[] = {x, routed, shared, hbuf, xe, ye, yn, experts, weights};
    for (size_t i = 0; i < sizeof buffers / sizeof *buffers; i++) free(buffers[i]);
    return bad;
}

/* y[:, h] = x[:, h] W_h^T for each of H heads: x rows at stride ldx with head h at column h * hx, W_h [n_out, K]
 * packed per head (one packed matrix after another: row-packed up to LINEAR_MAX_ROWS rows, column-packed above, as
 * layers/mla.py's absorptions), y [N, H * n_out]. */
static void heads_linear(const bf16 *x, int64_t N, int64_t ldx, int64_t hx, int64_t H, int64_t K,
                         const bf16 *packed, int64_t n_out, bf16 *y, int nthreads) {
    if (N > LINEAR_MAX_ROWS) { /* `packed` is then pack_columns of the heads [H, n_out, K] (layers/mla.py) */
        ds_heads_columns(x, N, ldx, hx, H, K, packed, n_out, y, 1, nthreads);
        return;
    }
    linear_task *tasks = malloc(sizeof(linear_task) * (size_t)H);
    for (int64_t h = 0; h < H; h++)
        tasks[h] = (linear_task){.w = packed + h * ((n_out + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS * padded_k(K)),
                                 .ldw = -1, .n = n_out, .y = y + h * n_out, .ldy = H * n_out, .x = x + h * hx,
                                 .ldx = ldx};
    ds_linear_bf16(N, K, H, tasks, nthreads);
    free(tasks);
}

/* The absorbed attention of MLA over cache rows (layers/mla.py): q [N, H (NOPE + RHO)] bf16 -> q_lat = q_nope W_UK
 * per head, QSFA over rows selected[i, :] (up to the first -1) of pages [nrows, R + RHO] (stride ld), the latent
 * output rounded to bf16, vals [N, H V] = out_lat W_UV^T per head. Returns ds_qsfa's status. */
static int attend_absorbed(const bf16 *q, int64_t N, int64_t H, int64_t NOPE, int64_t RHO, int64_t R, int64_t V,
                           const bf16 *w_uk, const bf16 *w_uv, const int64_t *selected, int64_t nsel, const void *pages,
                           int64_t ld, int64_t nrows, int pages_bf16, float scale, bf16 *vals, int nthreads) {
    int64_t QW = H * (NOPE + RHO);
    bf16 *qlat = malloc(sizeof(bf16) * (size_t)(2 * N * H * R)), *olat = qlat + N * H * R;
    float *qlat_f = malloc(sizeof(float) * (size_t)(N * H * (2 * R + RHO + 1))), *qpe_f = qlat_f + N * H * R;
    float *olat_f = qpe_f + N * H * RHO, *lse = olat_f + N * H * R;
    heads_linear(q, N, QW, NOPE + RHO, H, NOPE, w_uk, R, qlat, nthreads);
    for (int64_t i = 0; i < N * H; i++) {
        for (int64_t c = 0; c < R; c++) qlat_f[i * R + c] = bf16_to_f32(qlat[i * R + c]);
        for (int64_t c = 0; c < RHO; c++) qpe_f[i * RHO + c] = bf16_to_f32(q[i * (NOPE + RHO) + NOPE + c]);
    }
    int bad = ds_qsfa(N, H, R, RHO, qlat_f, qpe_f, pages, ld, nrows, pages_bf16, selected, nsel, scale, olat_f, lse,
                      nthreads);
    if (!bad) {
        for (int64_t i = 0; i < N * H * R; i++) olat[i] = f32_to_bf16(olat_f[i]);
        heads_linear(olat, N, H * R, R, H, R, w_uv, V, vals, nthreads);
    }
    free(qlat);
    free(qlat_f);
    return bad;
}

/* Store bf16 row v [width] at row `row` of pages (stride ld), bf16 or fp32. */
static void store_row(void *pages, int pages_bf16, int64_t ld, int64_t row, const bf16 *v, int64_t width) {
    for (int64_t c = 0; c < width; c++) {
        if (pages_bf16)
            ((bf16 *)pages)[row * ld + c] = v[c];
        else
            ((float *)pages)[row * ld + c] = bf16_to_f32(v[c]);
    }
}

/* Every written and selected row lies below nrows. */
static int rows_in_range(const int64_t *write_rows, const int64_t *selected, int64_t N, int64_t nsel,
                         int64_t nrows) {
    for (int64_t i = 0; i < N; i++) {
        if (write_rows[i] >= nrows) return 0;
        for (int64_t j = 0; j < nsel && selected[i * nsel + j] >= 0; j++)
            if (selected[i * nsel + j] >= nrows) return 0;
    }
    return 1;
}

/* out = r + MLA(rmsnorm(x)) for N decode tokens of Kimi's dense NoPE MLA (layers/mla.py: q_proj, kv_a_proj and
 * its norm, the cache row [c | k_pe] written at write_rows[i] (< 0: not written), then `attend_absorbed` over every
 * row of the sequence so far, o_proj). pages [nrows, R + RHO] at row stride ld, bf16 (pages_bf16) or fp32. W_UK^T
 * [H, R, N] and W_UV [H, V, R] packed per head; every weight row-packed (d->w_*) and column-packed (d->c_*, read
 * above LINEAR_MAX_ROWS rows). x, r (NULL: none) and out [N, D] bf16 contiguous. Returns 0, or
 * -1 (nothing written) when a selected or written row is not below nrows. */
int ds_mla_block(const mla_block *d, const bf16 *xin, const bf16 *r, int64_t N, const int64_t *selected,
                 int64_t nsel, const int64_t *write_rows, void *pages, int64_t ld, int64_t nrows, int pages_bf16,
                 bf16 *out, int nthreads) {
    int64_t D = d->hidden, H = d->heads, NOPE = d->nope, RHO = d->rope, V = d->v_dim, R = d->rank;
    int64_t QW = H * (NOPE + RHO), CW = R + RHO;
    if (!rows_in_range(write_rows, selected, N, nsel, nrows)) return -1;
    bf16 *x = malloc(sizeof(bf16) * (size_t)(N * (D + QW + 2 * CW + H * V + D)));
    bf16 *q = x + N * D, *ckv = q + N * QW, *row = ckv + N * CW, *vals = row + N * CW, *a = vals + N * H * V;

    ds_rmsnorm_bf16(xin, N, D, D, d->norm_w, d->eps, x, nthreads);
    if (mx_slot(d->mx, 0) && mx_slot(d->mx, 1)) { /* one pass over both, into [q | ckv] of each row */
        int64_t widths[2] = {QW, CW};
        bf16 *qc = malloc(sizeof(bf16) * (size_t)(N * (QW + CW)));
        mx_products(x, N, D, D, d->mx, widths, 2, qc, QW + CW, 1, nthreads);
        for (int64_t i = 0; i < N; i++) {
            memcpy(q + i * QW, qc + i * (QW + CW), sizeof(bf16) * (size_t)QW);
            memcpy(ckv + i * CW, qc + i * (QW + CW) + QW, sizeof(bf16) * (size_t)CW);
        }
        free(qc);
    } else if (mx_slot(d->mx, 0) || mx_slot(d->mx, 1)) {
        product(x, N, D, D, d->w_q, d->c_q, mx_slot(d->mx, 0), QW, q, nthreads);
        product(x, N, D, D, d->w_kva, d->c_kva, mx_slot(d->mx, 1), CW, ckv, nthreads);
    } else if (N <= LINEAR_MAX_ROWS) { /* q_proj and kv_a_proj in one call */
        linear_task proj[2] = {{.w = d->w_q, .ldw = -1, .n = QW, .y = q, .ldy = QW, .x = x, .ldx = D},
                               {.w = d->w_kva, .ldw = -1, .n = CW, .y = ckv, .ldy = CW, .x = x, .ldx = D}};
        ds_linear_bf16(N, D, 2, proj, nthreads);
    } else {
        product(x, N, D, D, d->w_q, d->c_q, NULL, QW, q, nthreads);
        product(x, N, D, D, d->w_kva, d->c_kva, NULL, CW, ckv, nthreads);
    }
    ds_rmsnorm_bf16(ckv, N, R, CW, d->kva_norm_w, d->kva_eps, row, nthreads);
    for (int64_t i = N - 1; i >= 0; i--) { /* rows [c | k_pe]: c came out packed [N, R], spread it from the back */
        memmove(row + i * CW, row + i * R, sizeof(bf16) * (size_t)R);
        memcpy(row + i * CW + R, ckv + i * CW + R, sizeof(bf16) * (size_t)RHO);
    }
    for (int64_t i = 0; i < N; i++)
        if (write_rows[i] >= 0) store_row(pages, pages_bf16, ld, write_rows[i], row + i * CW, CW);
    int wide = N > LINEAR_MAX_ROWS;
    int bad = attend_absorbed(q, N, H, NOPE, RHO, R, V, wide ? d->c_uk : d->w_uk, wide ? d->c_uv : d->w_uv,
                              selected, nsel, pages, ld, nrows, pages_bf16, d->scale, vals, nthreads);
    if (!bad) {
        product(vals, N, H * V, H * V, d->w_o, d->c_o, mx_slot(d->mx, 2), D, a, nthreads);
        residual_add(r, a, N * D, out, nthreads);
    }
    free(x);
    return bad;
}

/* RoPE on bf16 x in place with cos/sin [half] fp32, each product and sum rounded as torch's separate ops
 * (layers/rope.py): interleaved pairs (2j, 2j+1), laid out [rotated evens | rotated odds]; or half-split pairs
 * (j, j + half). */
static void rope_bf16(bf16 *x, const float *c, const float *s, int64_t half, int interleaved) {
    float a[256], b[256];
    for (int64_t j = 0; j < half; j++) {
        a[j] = bf16_to_f32(x[interleaved ? 2 * j : j]);
        b[j] = bf16_to_f32(x[interleaved ? 2 * j + 1 : half + j]);
    }
    for (int64_t j = 0; j < half; j++) {
        float ac = a[j] * c[j], bs = b[j] * s[j], bc = b[j] * c[j], as = a[j] * s[j];
        x[j] = f32_to_bf16(ac - bs);
        x[half + j] = f32_to_bf16(bc + as);
    }
}

/* The indexer's choice for N decode tokens whose contexts may pass the top-k (ds_index_select per token): the
 * index queries wq_b(c_q) (their first IROPE dims rotated half-split, as ops/mlapo.py) against the cached keys,
 * with head weights bf16(w_raw) * HI^-1/2 * DI^-1/2. selected [N, nsel] holds each token's context rows in
 * position order, -1 padded. Returns [N, TOPK] rows (malloc'd), -1 padded. */
static int64_t *index_select(const dsa_block *d, const bf16 *cq, const bf16 *A, const float *cos_sin,
                             const int64_t *selected, int64_t nsel, int64_t N, const void *keys, int64_t ldk,
                             int keys_bf16, int nthreads) {
    int64_t HI = d->index_heads, DI = d->index_dim, TOPK = d->index_topk, NA = d->a_width, IROPE = d->index_rope;
    int64_t W0 = d->q_rank + d->rank + d->rope + d->gate_width + DI, RHO = d->rope;
    bf16 *iq = malloc(sizeof(bf16) * (size_t)(N * HI * DI));
    float *w = malloc(sizeof(float) * (size_t)HI);
    int64_t *chosen = malloc(sizeof(int64_t) * (size_t)(N * TOPK));
    product(cq, N, d->q_rank, d->q_rank, d->w_iq, NULL, NULL, HI * DI, iq, nthreads);
    for (int64_t i = 0; i < N; i++) {
        if (cos_sin != NULL && IROPE > 0)
            for (int64_t h = 0; h < HI; h++)
                rope_bf16(iq + (i * HI + h) * DI, cos_sin + i * (RHO / 2), cos_sin + (N + i) * (RHO / 2), IROPE / 2, 0);
        for (int64_t h = 0; h < HI; h++)
            w[h] = bf16_to_f32(A[i * NA + W0 + h]) * d->index_weight_scale * d->index_dim_scale;
        int64_t n = 0;
        while (n < nsel && selected[i * nsel + n] >= 0) n++;
        ds_index_select(iq + i * HI * DI, w, HI, DI, selected + i * nsel, n, keys, ldk, keys_bf16, TOPK,
                        chosen + i * TOPK, nthreads);
    }
    free(iq);
    free(w);
    return chosen;
}

/* out = r + DSA(rmsnorm(x)) for N decode tokens of a DSA layer (query LoRA). selected [N, nsel] holds each token's
 * context rows in position order (-1 padded); when a context is within the indexer's top-k the indexer would
 * select it all (ops/qli.py), otherwise `index_select` scores and picks TOPK rows (native_src/indexer.c).
 * layers/mla.py + ops/mlapo.py: one product on the stacked w_a [q_a (RQ) | kv_a (R + RHO) | gate (G, or none) |
 * index wk (DI) | index weights (H_I)] (NA outputs), q_a's RMSNorm and q_b, kv_a's RMSNorm, the index key's
 * LayerNorm (fp32 statistics, bf16 weight and bias); the latent row [c | k_pe] and the key written at write_rows[i]
 * (< 0: not written) into pages [nrows, R + RHO] (stride ld) and keys [nrows, DI] (stride ldk), bf16 or fp32 each;
 * `attend_absorbed` over selected; the heads' values gated by sigmoid(gate) (G > 0); o_proj. x, r (NULL: none) and
 * out [N, D] bf16 contiguous. Equal to the modules up to fp32 rounding (the LayerNorm statistics, the sigmoid
 * and the index scores are computed in another order; a near-tie at the top-k cut may select another row). With
 * cos_sin ([2][N][RHO / 2] fp32: DeepSeek-V3.2's RoPE at the tokens' positions; NULL for K3's NoPE) q_pe and k_pe
 * are rotated interleaved and the index key's (and index queries') first IROPE dims half-split, as ops/mlapo.py
 * does. Under MX schemes (d->mx) q_a, kv_a and the gate take one MX pass (slots 0-2; w_a then holds the index
 * rows only), q_b and o_proj each their MX product where their slot is set: each column as the modules' products.
 * Without an indexer (index_dim 0: K3's MLA layers, query LoRA and output gate, no index key; keys unused) every
 * selected row is attended.
 * Returns 0, or -1 (nothing written) when a row is not below nrows or a rotation is wider than 512. */
int ds_dsa_block(const dsa_block *d, const bf16 *xin, const bf16 *r, int64_t N, const int64_t *selected,
                 int64_t nsel, const int64_t *write_rows, void *pages, int64_t ld, int64_t nrows, int pages_bf16,
                 void *keys, int64_t ldk, int keys_bf16, const float *cos_sin, bf16 *out, int nthreads) {
    int64_t D = d->hidden, H = d->heads, NOPE = d->nope, RHO = d->rope, V = d->v_dim, R = d->rank;
    int64_t RQ = d->q_rank, NA = d->a_width, G = d->gate_width, DI = d->index_dim;
    int64_t QW = H * (NOPE + RHO), CW = R + RHO, KV0 = RQ, G0 = RQ + CW, K0 = G0 + G, IROPE = d->index_rope;
    if (!rows_in_range(write_rows, selected, N, nsel, nrows) || RHO > 512 || IROPE > 512) return -1;
    bf16 *x = malloc(sizeof(bf16) * (size_t)(N * (D + NA + RQ + QW + CW + DI + 2 * H * V + D)));
    bf16 *A = x + N * D, *cq = A + N * NA, *q = cq + N * RQ, *row = q + N * QW, *ik = row + N * CW;
    bf16 *vals = ik + N * DI, *gated = vals + N * H * V, *a = gated + N * H * V;

    ds_rmsnorm_bf16(xin, N, D, D, d->norm_w, d->eps, x, nthreads);
    if (mx_slot(d->mx, 0)) { /* q_a | kv_a | gate stored MX in one pass, then the index wk | weights rows of w_a */
        int64_t widths[3] = {RQ, CW, G};
        mx_products(x, N, D, D, d->mx, widths, G > 0 ? 3 : 2, A, NA, 1, nthreads);
        linear_task tail = {.w = d->w_a, .ldw = -1, .n = NA - K0, .y = A + K0, .ldy = NA, .x = x, .ldx = D};
        if (NA > K0) ds_linear_bf16(N, D, 1, &tail, nthreads);
    } else {
        product(x, N, D, D, d->w_a, NULL, NULL, NA, A, nthreads);
    }
    ds_rmsnorm_bf16(A, N, RQ, NA, d->qa_norm_w, d->q_eps, cq, nthreads);
    product(cq, N, RQ, RQ, d->w_qb, NULL, mx_slot(d->mx, 3), QW, q, nthreads);
    ds_rmsnorm_bf16(A + KV0, N, R, NA, d->kva_norm_w, d->kv_eps, row, nthreads);
    for (int64_t i = N - 1; i >= 0; i--) { /* rows [c | k_pe], as in ds_mla_block */
        memmove(row + i * CW, row + i * R, sizeof(bf16) * (size_t)R);
        memcpy(row + i * CW + R, A + i * NA + KV0 + R, sizeof(bf16) * (size_t)RHO);
    }
    const bf16 *kw = d->ik_norm_w, *kb = d->ik_norm_b;
    for (int64_t i = 0; DI > 0 && i < N; i++) { /* the index key: LayerNorm with fp32 statistics */
        const bf16 *k = A + i * NA + K0;
        float mean = 0.f, var = 0.f;
        for (int64_t c = 0; c < DI; c++) mean += bf16_to_f32(k[c]);
        mean /= (float)DI;
        for (int64_t c = 0; c < DI; c++) var += (bf16_to_f32(k[c]) - mean) * (bf16_to_f32(k[c]) - mean);
        float rstd = 1.f / sqrtf(var / (float)DI + d->index_eps);
        for (int64_t c = 0; c < DI; c++)
            ik[i * DI + c] = f32_to_bf16((bf16_to_f32(k[c]) - mean) * rstd * bf16_to_f32(kw[c]) + bf16_to_f32(kb[c]));
    }
    for (int64_t i = 0; cos_sin != NULL && i < N; i++) { /* RoPE at token i's position */
        const float *c = cos_sin + i * (RHO / 2), *sn = cos_sin + (N + i) * (RHO / 2);
        for (int64_t h = 0; h < H; h++) rope_bf16(q + i * QW + h * (NOPE + RHO) + NOPE, c, sn, RHO / 2, 1);
        rope_bf16(row + i * CW + R, c, sn, RHO / 2, 1);
        if (IROPE > 0) rope_bf16(ik + i * DI, c, sn, IROPE / 2, 0);
    }
    for (int64_t i = 0; i < N; i++) {
        if (write_rows[i] < 0) continue;
        store_row(pages, pages_bf16, ld, write_rows[i], row + i * CW, CW);
        if (DI > 0) store_row(keys, keys_bf16, ldk, write_rows[i], ik + i * DI, DI);
    }
    int64_t *chosen = DI > 0 && nsel > d->index_topk
                          ? index_select(d, cq, A, cos_sin, selected, nsel, N, keys, ldk, keys_bf16, nthreads)
                          : NULL;
    int bad = attend_absorbed(q, N, H, NOPE, RHO, R, V, d->w_uk, d->w_uv, chosen ? chosen : selected,
                              chosen ? d->index_topk : nsel, pages, ld, nrows, pages_bf16, d->scale, vals, nthreads);
    free(chosen);
    if (!bad) {
        const bf16 *o = vals;
        if (G > 0) { /* bf16(vals * sigmoid(gate)) in fp32 */
            for (int64_t i = 0; i < N; i++)
                for (int64_t c = 0; c < H * V; c++) {
                    float g = bf16_to_f32(A[i * NA + G0 + c]);
                    gated[i * H * V + c] = f32_to_bf16(bf16_to_f32(vals[i * H * V + c]) * (1.f / (1.f + expf(-g))));
                }
            o = gated;
        }
        product(o, N, H * V, H * V, d->w_o, NULL, mx_slot(d->mx, 4), D, a, nthreads);
        residual_add(r, a, N * D, out, nthreads);
    }
    free(x);
    return bad;
}
