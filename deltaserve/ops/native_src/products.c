/* Products: few-row bf16 linears (one or several weights, or one per head), the fused MoE / MLP, RMSNorm. */
#include "kernels.h"

/* Linear products of M rows, one a task (contract.h linear_task): y [M, n] = x [M, K] @ W^T, rounded to bf16. The
 * work items are the tasks' blocks of BLOCK_ROWS outputs, all tasks' in one parallel loop. */
static int64_t task_blocks(const linear_task *task) { return (task->n + BLOCK_ROWS - 1) / BLOCK_ROWS; }

void ds_linear_bf16(int64_t M, int64_t K, int64_t ntasks, const linear_task *tasks, int nthreads) {
    int64_t nitems = 0;
    for (int64_t t = 0; t < ntasks; t++) nitems += task_blocks(tasks + t);
#pragma omp parallel num_threads(nthreads)
    {
        const bf16 **xrows = malloc(sizeof(bf16 *) * (size_t)M);
        float *dots = malloc(sizeof(float) * (size_t)(M * BLOCK_ROWS));
        int64_t xt = -1;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < nitems; item++) {
            int64_t t = 0, b = item;
            while (b >= task_blocks(tasks + t)) b -= task_blocks(tasks + t++);
            const linear_task *task = tasks + t;
            int64_t N = task->n, ldy = task->ldy;
            bf16 *y = task->y;
            if (t != xt) {
                for (int64_t i = 0; i < M; i++) xrows[i] = task->x + i * task->ldx;
                xt = t;
            }
            int64_t n0 = b * BLOCK_ROWS, n1 = n0 + BLOCK_ROWS < N ? n0 + BLOCK_ROWS : N;
            dot_block(xrows, M, task->w, task->ldw, N, n0, n1, K, dots);
            for (int64_t i = 0; i < M; i++)
                for (int64_t n = n0; n < n1; n++) y[i * ldy + n] = f32_to_bf16(dots[i * BLOCK_ROWS + n - n0]);
        }
        free(xrows);
        free(dots);
    }
}

/* ds_moe_bf16's dot-product form over row-major (packed 0) or pack_rows (packed 1) experts, after the grouping
 * (the arguments as moe_columns in experts.c): per (expert, block of 32 of I) the gate and up products and the
 * activation into h; then per block of 32 of D every expert's down product and the weighted sum. */
static void moe_rows(const bf16 *const *xrows, const bf16 *const *hrows, const int64_t *order, const int64_t *start,
                     const int64_t *used, int64_t nused, int64_t T, int64_t D, int64_t k, const float *weights,
                     const bf16 *w1, const bf16 *w3, const bf16 *w2, int64_t I, int packed, const glu_act *act,
                     bf16 *h, bf16 *out, int nthreads) {
    /* per-expert matrix strides and row strides: row-major, or packed (row stride -1) */
    int64_t s13 = packed ? (I + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS * padded_k(D) : I * D;
    int64_t s2 = packed ? (D + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS * padded_k(I) : D * I;
    int64_t ld13 = packed ? -1 : D, ld2 = packed ? -1 : I, P = T * k;
    int64_t iblocks = (I + BLOCK_ROWS - 1) / BLOCK_ROWS, dblocks = (D + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel num_threads(nthreads)
    {
        float *g = malloc(sizeof(float) * (size_t)(P * BLOCK_ROWS));
        float *u = malloc(sizeof(float) * (size_t)(P * BLOCK_ROWS));
#pragma omp for schedule(dynamic, 1) /* experts differ in token count */
        for (int64_t item = 0; item < nused * iblocks; item++) {
            int64_t e = used[item / iblocks], n0 = (item % iblocks) * BLOCK_ROWS;
            int64_t n1 = n0 + BLOCK_ROWS < I ? n0 + BLOCK_ROWS : I, s0 = start[e], m = start[e + 1] - s0;
            dot_block(xrows + s0, m, w1 + e * s13, ld13, I, n0, n1, D, g);
            dot_block(xrows + s0, m, w3 + e * s13, ld13, I, n0, n1, D, u);
            for (int64_t i = 0; i < m; i++)
                glu_block(g + i * BLOCK_ROWS, u + i * BLOCK_ROWS, n1 - n0, act, h + order[s0 + i] * I + n0);
        }
        /* implicit barrier: every h row is complete */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < dblocks; item++) {
            int64_t n0 = item * BLOCK_ROWS, n1 = n0 + BLOCK_ROWS < D ? n0 + BLOCK_ROWS : D;
            float *y = g; /* [P][BLOCK_ROWS] expert outputs of this row block, in pair order */
            for (int64_t ue = 0; ue < nused; ue++) {
                int64_t e = used[ue], s0 = start[e], m = start[e + 1] - s0;
                dot_block(hrows + s0, m, w2 + e * s2, ld2, D, n0, n1, I, u);
                for (int64_t i = 0; i < m; i++)
                    for (int64_t n = n0; n < n1; n++)
                        y[order[s0 + i] * BLOCK_ROWS + n - n0] = round_bf16(u[i * BLOCK_ROWS + n - n0]);
            }
            for (int64_t t = 0; t < T; t++)
                for (int64_t n = n0; n < n1; n++) {
                    float acc = 0.f;
                    for (int64_t j = 0; j < k; j++) acc += weights[t * k + j] * y[(t * k + j) * BLOCK_ROWS + n - n0];
                    out[t * D + n] = f32_to_bf16(acc);
                }
        }
        free(g);
        free(u);
    }
}

/* Gated experts over a few tokens: out [T, D] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t]), where
 * expert_e(v) = W2[e] @ act(W1[e] v, W3[e] v) with act SiLU-GLU (act_kind 0) or SiTU (1: beta, lin_beta, NaN
 * for none; see glu_block). W1/W3 are [E, I, D], W2 is [E, D, I], contiguous (packed 0), or each expert's matrix
 * packed: pack_rows' layout (packed 1), or pack_columns' (packed 2: experts.c, the outer-product kernel).
 * Each expert runs once over the tokens that picked it. h [T*k, I] is scratch. Rounding as the reference:
 * gate, up, silu(gate), the GLU product and each expert's output are bf16; the combine is fp32, rounded once.
 * A dense MLP is the case E = 1, k = 1, weight 1. With IS > 0 (column-packed experts only) a shared expert of
 * width IS, column-packed s1/s3 [IS, D] and s2 [D, IS], runs over every token and out is bf16(routed + shared),
 * each rounded to bf16 first (the MoE block's sum), in the same pass over the weights (experts.c). With `tiles`,
 * column-packed experts of TILE_MIN_ROWS tokens or more run on the AMX tile unit where there is one (tiles.c).
 * Returns 0, -1 (nothing computed) for an id outside [0, E), or -2 for a shared expert without packed 2. */
int group_pairs(const int64_t *experts, int64_t T, int64_t k, int64_t E, const bf16 *x, int64_t D, pair_groups *g) {
    int64_t P = T * k;
    for (int64_t p = 0; p < P; p++)
        if (experts[p] < 0 || experts[p] >= E) return -1;
    g->start = calloc((size_t)(E + 1), sizeof(int64_t));
    g->order = malloc(sizeof(int64_t) * (size_t)P);
    int64_t *fill = malloc(sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t p = 0; p < P; p++) g->start[experts[p] + 1]++;
    for (int64_t e = 0; e < E; e++) g->start[e + 1] += g->start[e];
    memcpy(fill, g->start, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t p = 0; p < P; p++) g->order[fill[experts[p]]++] = p;
    free(fill);
    g->used = malloc(sizeof(int64_t) * (size_t)E);
    g->nused = 0;
    for (int64_t e = 0; e < E; e++)
        if (g->start[e + 1] > g->start[e]) g->used[g->nused++] = e;
    g->xrows = malloc(sizeof(bf16 *) * (size_t)P);
    for (int64_t s = 0; s < P; s++) g->xrows[s] = x + (g->order[s] / k) * D;
    return 0;
}

void free_groups(pair_groups *g) {
    free(g->start);
    free(g->order);
    free(g->used);
    free(g->xrows);
}

int ds_moe_bf16(const bf16 *x, int64_t T, int64_t D, const int64_t *experts, const float *weights, int64_t k,
                const bf16 *w1, const bf16 *w3, const bf16 *w2, int64_t E, int64_t I, int packed, int act_kind,
                float beta, float lin_beta, const bf16 *s1, const bf16 *s3, const bf16 *s2, int64_t IS, int tiles,
                bf16 *h, bf16 *out, int nthreads) {
    glu_act act = {act_kind, !isnan(lin_beta), beta, lin_beta};
    if (IS > 0 && packed != 2) return -2;
    pair_groups g;
    if (group_pairs(experts, T, k, E, x, D, &g)) return -1;
    if (packed == 2) {
        mx_matrix m1 = {w1, NULL, MAT_BF16, ACT_NONE}, m3 = {w3, NULL, MAT_BF16, ACT_NONE},
                  m2 = {w2, NULL, MAT_BF16, ACT_NONE};
        shared_expert shared = {{s1, NULL, MAT_BF16, ACT_NONE}, {s3, NULL, MAT_BF16, ACT_NONE},
                                {s2, NULL, MAT_BF16, ACT_NONE}, IS, x};
        moe_columns(g.xrows, g.order, g.start, g.used, g.nused, T, D, k, weights, &m1, &m3, &m2, I,
                    IS > 0 ? &shared : NULL, &act, tiles, h, out, nthreads);
    } else {
        /* moe_rows also takes the pairs' hidden rows (moe_columns lays out its own) */
        const bf16 **hrows = malloc(sizeof(bf16 *) * (size_t)(T * k));
        for (int64_t s = 0; s < T * k; s++) hrows[s] = h + g.order[s] * I;
        moe_rows(g.xrows, hrows, g.order, g.start, g.used, g.nused, T, D, k, weights, w1, w3, w2, I, packed, &act,
                 h, out, nthreads);
        free(hrows);
    }
    free_groups(&g);
    return 0;
}

/* RMSNorm of bf16 rows in the reference rounding order (docs/model.md §3): out = w * bf16(x * rsqrt(mean(x^2) + eps)),
 * statistics in fp32, the product with the bf16 weight rounded once. x [M, D] at row stride ldx; out [M, D]. */
void ds_rmsnorm_bf16(const bf16 *x, int64_t M, int64_t D, int64_t ldx, const bf16 *w, float eps, bf16 *out,
                     int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * D >= (1 << 16))
    for (int64_t i = 0; i < M; i++) {
        float *xf = malloc(sizeof(float) * (size_t)D);
        for (int64_t c = 0; c < D; c++) xf[c] = bf16_to_f32(x[i * ldx + c]);
        float r = 1.f / sqrtf(dotf(xf, xf, D) / (float)D + eps);
        for (int64_t c = 0; c < D; c++) out[i * D + c] = f32_to_bf16(round_bf16(xf[c] * r) * bf16_to_f32(w[c]));
        free(xf);
    }
}

/* Stable top-k of n values: the k largest, ties to the lower index (torch's stable descending sort, cut at k). */
static void stable_topk(const float *v, int64_t n, int64_t k, int64_t *idx, unsigned char *taken) {
    memset(taken, 0, (size_t)n);
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++)
            if (!taken[e] && (best < 0 || v[e] > v[best])) best = e;
        taken[best] = 1;
        idx[j] = best;
    }
}

#define ROUTER_TOKENS 4  /* tokens per logits tile */
#define ROUTER_EXPERTS 2 /* experts per logits tile: 4 x 2 pairs of accumulators, 16 zmm */

/* s[t][e] = dotf(x[t], w[e], D) for the n <= ROUTER_TOKENS fp32 rows x and all E experts of w [E, D] (s rows of
 * E floats), summed exactly as dotf sums (the same two accumulators over alternating 16-lane blocks, the same
 * reduction and tail: equal bit for bit). Why: dotf loads two vectors per FMA, and a core that loads one 512-bit
 * vector a cycle is then bound by its loads; the tile loads 12 per 16 FMAs (each token's inputs once for two
 * experts, each expert's row once for four tokens). */
static void router_logits(const float *const *x, int n, const float *w, int64_t E, int64_t D, float *const *s) {
    int64_t e = 0;
#if defined(__AVX512F__)
    for (; n == ROUTER_TOKENS && e + ROUTER_EXPERTS <= E; e += ROUTER_EXPERTS) {
        __m512 a0[ROUTER_TOKENS][ROUTER_EXPERTS], a1[ROUTER_TOKENS][ROUTER_EXPERTS];
        for (int t = 0; t < ROUTER_TOKENS; t++)
            for (int j = 0; j < ROUTER_EXPERTS; j++) a0[t][j] = a1[t][j] = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 32 <= D; i += 32) {
            __m512 x0[ROUTER_TOKENS], x1[ROUTER_TOKENS];
            for (int t = 0; t < ROUTER_TOKENS; t++) {
                x0[t] = _mm512_loadu_ps(x[t] + i);
                x1[t] = _mm512_loadu_ps(x[t] + i + 16);
                __asm__("" : "+v"(x0[t]), "+v"(x1[t])); /* in registers: the compiler reloaded them per expert */
            }
            for (int j = 0; j < ROUTER_EXPERTS; j++) {
                __m512 w0 = _mm512_loadu_ps(w + (e + j) * D + i), w1 = _mm512_loadu_ps(w + (e + j) * D + i + 16);
                __asm__("" : "+v"(w0), "+v"(w1)); /* one load each for the four tokens */
                for (int t = 0; t < ROUTER_TOKENS; t++) {
                    a0[t][j] = _mm512_fmadd_ps(x0[t], w0, a0[t][j]);
                    a1[t][j] = _mm512_fmadd_ps(x1[t], w1, a1[t][j]);
                }
            }
        }
        for (int t = 0; t < ROUTER_TOKENS; t++)
            for (int j = 0; j < ROUTER_EXPERTS; j++) {
                int64_t r = i;
                const float *wr = w + (e + j) * D;
                for (; r + 16 <= D; r += 16)
                    a0[t][j] = _mm512_fmadd_ps(_mm512_loadu_ps(x[t] + r), _mm512_loadu_ps(wr + r), a0[t][j]);
                float v = _mm512_reduce_add_ps(_mm512_add_ps(a0[t][j], a1[t][j]));
                for (; r < D; r++) v += x[t][r] * wr[r];
                s[t][e + j] = v;
            }
    }
#endif
    for (; e < E; e++)
        for (int t = 0; t < n; t++) s[t][e] = dotf(x[t], w + e * D, D);
}

/* One token's expert choice from its logits (see ds_router); s, choice [E] and gscore [G], gkeep [G] and taken
 * [max(E, G)] are scratch. */
static void route_token(const float *logits, const float *bias, int64_t E, int softmax, int64_t G, int64_t topk_group,
                        int64_t k, int renorm, float scale, float *s, float *choice, float *gscore, int64_t *gkeep,
                        unsigned char *taken, int64_t *idx, float *weights) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t e = 0; e < E; e++) {
        s[e] = logits[e];
        mx = s[e] > mx ? s[e] : mx;
    }
    for (int64_t e = 0; e < E; e++) {
        s[e] = softmax ? expf(s[e] - mx) : 1.f / (1.f + expf(-s[e]));
        sum += s[e];
    }
    for (int64_t e = 0; e < E; e++) {
        if (softmax) s[e] /= sum;
        choice[e] = s[e] + bias[e];
    }
    if (G > 1) {
        int64_t n = E / G;
        for (int64_t g = 0; g < G; g++) {
            float a = -INFINITY, b = -INFINITY; /* the two largest of the group */
            for (int64_t e = g * n; e < (g + 1) * n; e++) {
                if (choice[e] > a) {
                    b = a;
                    a = choice[e];
                } else if (choice[e] > b) {
                    b = choice[e];
                }
            }
            gscore[g] = a + b;
        }
        stable_topk(gscore, G, topk_group, gkeep, taken);
        memset(taken, 0, (size_t)G);
        for (int64_t j = 0; j < topk_group; j++) taken[gkeep[j]] = 1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e / n]) choice[e] = -INFINITY;
    }
    stable_topk(choice, E, k, idx, taken);
    float wsum = 0.f;
    for (int64_t j = 0; j < k; j++) wsum += s[idx[j]];
    for (int64_t j = 0; j < k; j++) weights[j] = (renorm ? s[idx[j]] / (wsum + 1e-20f) : s[idx[j]]) * scale;
}

/* The MoE router of docs/model.md §10 for T bf16 rows x (row stride ldx): fp32 logits against the fp32 weight
 * w [E, D], scores sigmoid (softmax != 0: softmax), choice = scores + bias; with ngroups > 1 only the topk_group
 * groups of highest top-2 choice sum stay eligible; the k experts of highest choice (ties to the lower id), their
 * scores renormalised to sum 1 (renorm != 0, + 1e-20) and times scale. experts int64 [T, k], weights fp32 [T, k].
 * Twin: layers/moe.py Router (fp32 logits summed in another order: equal to fp32 rounding). Returns 0, or -1
 * when k > E or the groups do not divide E.
 * The logits' work items are (tile of ROUTER_TOKENS tokens, share of the experts): a decode step's one tile is
 * split among the threads by experts, so every core streams a share of the weight rather than one core all of it
 * (the weight is fp32: 512 KiB a layer at 128 experts of 1,024); each logit is the same sum either way. */
int ds_router(const bf16 *x, int64_t T, int64_t D, int64_t ldx, const float *w, const float *bias, int64_t E,
              int softmax, int64_t ngroups, int64_t topk_group, int64_t k, int renorm, float scale,
              int64_t *experts, float *weights, int nthreads) {
    int64_t G = ngroups > 1 ? ngroups : 1;
    if (k > E || E % G != 0 || topk_group > G) return -1;
    int64_t tiles = (T + ROUTER_TOKENS - 1) / ROUTER_TOKENS;
    /* experts per item: all of them, or (tiles fewer than threads) an even share in whole logits tiles */
    int64_t shares = tiles < nthreads ? nthreads : 1;
    int64_t per_share = (E + shares - 1) / shares;
    per_share = (per_share + ROUTER_EXPERTS - 1) / ROUTER_EXPERTS * ROUTER_EXPERTS;
    float *logits = malloc(sizeof(float) * (size_t)(T * E));
#pragma omp parallel num_threads(nthreads) if (T * E * D >= (1 << 16))
    {
        /* the tile's fp32 rows, then one token's scores, choices and group scores */
        float *xf = malloc(sizeof(float) * (size_t)(ROUTER_TOKENS * D + 2 * E + G));
        float *s = xf + ROUTER_TOKENS * D, *choice = s + E, *gscore = choice + E;
        int64_t *gkeep = malloc(sizeof(int64_t) * (size_t)G);
        unsigned char *taken = malloc((size_t)(E > G ? E : G));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < tiles * shares; item++) {
            int64_t t0 = item / shares * ROUTER_TOKENS, e0 = item % shares * per_share;
            int64_t e1 = e0 + per_share < E ? e0 + per_share : E;
            int nt = T - t0 < ROUTER_TOKENS ? (int)(T - t0) : ROUTER_TOKENS;
            const float *rows[ROUTER_TOKENS];
            float *outs[ROUTER_TOKENS];
            for (int i = 0; i < nt; i++) {
                for (int64_t c = 0; c < D; c++) xf[i * D + c] = bf16_to_f32(x[(t0 + i) * ldx + c]);
                rows[i] = xf + i * D;
                outs[i] = logits + (t0 + i) * E + e0;
            }
            if (e1 > e0) router_logits(rows, nt, w + e0 * D, e1 - e0, D, outs);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            route_token(logits + t * E, bias, E, softmax, G, topk_group, k, renorm, scale, s, choice, gscore, gkeep,
                        taken, experts + t * k, weights + t * k);
        free(xf);
        free(gkeep);
        free(taken);
    }
    free(logits);
    return 0;
}
