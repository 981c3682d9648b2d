/* AMX tile products over column-packed weights: the block product of experts.c on the matrix units.
 *
 * Why: on CPUs with AMX-BF16 (Sapphire Rapids and later) one TDPBF16PS multiplies a 16 x 32 bf16 tile
 * of inputs by a 32 x 16 tile of weights into 16 x 16 fp32 sums, 16x the multiply rate of the AVX512-BF16 pair
 * products the outer-product kernel runs; prefill and batched decode are compute-bound there.
 *
 * Layout: pack_columns' blocks are [ceil(K/2)][64][2], so 16 consecutive pairs of one block's 16 columns are a
 * 16-row tile at a row stride of 256 bytes: the weights load as B tiles in place, no repacking. Inputs are rows at
 * a stride (A tiles: 16 rows x 32 bf16 of K). K past its last whole group of 32 is left to the caller (experts.c
 * runs those pairs on the AVX512 pair products).
 *
 * Each call sets its own tile configuration, loading it only where the current one differs; oneDNN's AMX kernels,
 * which share these threads, configure lazily the same way (reading the current one back with sttilecfg and
 * comparing), so neither runs on the other's.
 *
 * Rounding: the tile unit sums each 16 x 32 group in its own order (not the pair-by-pair order of the AVX512
 * kernel), so results agree with it to fp32 accumulation accuracy, not bit for bit; tests/test_native.py holds
 * both to the exact product. A product takes one form or the other by its row count alone (TILE_MIN_ROWS).
 */
#include "kernels.h"

#include <sys/syscall.h>
#include <unistd.h>

#define TILE_PAIRS 16   /* k pairs of an A / B tile: 32 bf16 of K */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The kernel hands out the 8 KiB tile state only on request, once per process (Linux 5.16+). The answer is a fact
 * of the process, cached here: 1 granted, -1 refused, 0 not asked yet. */
static int tile_permission;

int ds_tiles_usable(void) {
    int state = __atomic_load_n(&tile_permission, __ATOMIC_ACQUIRE);
    if (state == 0) {
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&tile_permission, state, __ATOMIC_RELEASE);
    }
    return state > 0;
}

/* LDTILECFG's 64-byte record: the palette, then per tile its bytes a row and its rows. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* LDTILECFG with the whole 64-byte record as its memory operand: gcc 12's _tile_loadconfig names only its first 8
 * bytes, so at -O2 the compiler may drop the stores of the rest (a #GP at run time). */
static inline void load_config(const tile_config *cfg) { __asm__ volatile("ldtilecfg %0" ::"m"(*cfg)); }
static inline void store_config(tile_config *cfg) { __asm__ volatile("sttilecfg %0" : "=m"(*cfg)); }

/* The tile loads and stores are asm statements without memory operands: this orders them against plain C
 * accesses of the same memory (the sums the tail reads, the rows other code wrote). */
static inline void memory_barrier(void) { __asm__ volatile("" ::: "memory"); }

/* Load the palette-1 configuration with rows[t] rows of 64 bytes in tile t (0 rows: unused), unless it is the
 * current one: reading the configuration back is much cheaper than loading one (which also zeroes the tiles), and a
 * 128-token prefill makes ~1,500 block products a MoE layer, a linear's blocks, an expert's gate and up and its down
 * blocks each running at the configuration the one before left. */
static void set_tiles(const uint8_t rows[8]) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    tile_config now;
    store_config(&now);
    if (memcmp(&now, &cfg, sizeof cfg) != 0) load_config(&cfg);
}

/* One row tile: sums 0-3 (`rows` rows x 64 columns), inputs 4, weights 5 and 6 (16 pairs x 16 columns). */
static void configure(int rows) {
    const uint8_t r = (uint8_t)rows, t[8] = {r, r, r, r, r, TILE_PAIRS, TILE_PAIRS, 0};
    set_tiles(t);
}

/* Two row tiles over 32 columns: sums 0 and 1 (rows 0-15; columns 0-15 and 16-31), 2 and 3 (the next rows1 rows),
 * inputs 4 (rows 0-15) and 5 (the rest), weights 6 and 7. */
static void configure_two(int rows1) {
    const uint8_t r = (uint8_t)rows1, t[8] = {16, 16, r, r, 16, r, TILE_PAIRS, TILE_PAIRS};
    set_tiles(t);
}

#ifndef TILE_PREFETCH
#define TILE_PREFETCH 8192
#endif
#define GROUP_BYTES (TILE_PAIRS * 2 * 64 * (int)sizeof(bf16)) /* one group of a block: 4 KiB */
/* The prefetches for quarter q of a group (16 of its 64 lines), issued before the quarter's product: the weights
 * TILE_PREFETCH bytes ahead into L2 on the block's first pass (`stream`, from DRAM), the next group into L1 on
 * every pass (the weight tiles' loads otherwise wait on L2). Issued a quarter at a time between the products, not
 * all 128 at the top of the group, where they stall on the full fill buffers and hold the products back (a
 * profile of that form has its time on the instructions after the two prefetch loops); spread out, they overlap
 * the multiplies. */
static inline __attribute__((always_inline)) void ask_ahead(const bf16 *wg, int q, int stream) {
    const char *line = (const char *)wg + 64 * 16 * q;
    if (TILE_PREFETCH && stream)
        for (int l = 0; l < 16; l++) _mm_prefetch(line + TILE_PREFETCH + 64 * l, _MM_HINT_T1);
    for (int l = 0; l < 16; l++) _mm_prefetch(line + GROUP_BYTES + 64 * l, _MM_HINT_T0);
}

/* Tiles 0-3, the sums, to zero; and stored as acc [rows][64] (tile t: columns 16 t .. 16 t + 15). */
static inline void zero_sums(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static inline void store_sums(float *acc) {
    _tile_stored(0, acc, 64 * sizeof(float));
    _tile_stored(1, acc + 16, 64 * sizeof(float));
    _tile_stored(2, acc + 32, 64 * sizeof(float));
    _tile_stored(3, acc + 48, 64 * sizeof(float));
    memory_barrier();
}

/* Sums 0-3 += inputs (32 of K from column 32 g of rows at stride ldx) times group wg ([16][64][2] bf16, 256 bytes a
 * pair). `ask`: wg is a weight stream, so ask_ahead between the products (`stream` on its first pass); 0 for a
 * group decoded into L1. */
static inline __attribute__((always_inline)) void group_product(const bf16 *x, int64_t ldx, int64_t g, const bf16 *wg,
                                                                int ask, int stream) {
    memory_barrier();
    if (ask) ask_ahead(wg, 0, stream);
    _tile_loadd(4, x + g * 2 * TILE_PAIRS, ldx * (int64_t)sizeof(bf16));
    _tile_loadd(5, wg, 256);
    _tile_dpbf16ps(0, 4, 5);
    if (ask) ask_ahead(wg, 1, stream);
    _tile_loadd(6, wg + 32, 256);
    _tile_dpbf16ps(1, 4, 6);
    if (ask) ask_ahead(wg, 2, stream);
    _tile_loadd(5, wg + 64, 256);
    _tile_dpbf16ps(2, 4, 5);
    if (ask) ask_ahead(wg, 3, stream);
    _tile_loadd(6, wg + 96, 256);
    _tile_dpbf16ps(3, 4, 6);
    memory_barrier();
}

/* acc [rows][64] = x rows [rows] (stride ldx) times the block's pairs [0, 16 * groups), rows <= 16; `stream`: the
 * block's first pass (ask_ahead). */
static inline void tile_rows(const bf16 *x, int64_t ldx, int64_t groups, const bf16 *wb, int stream, float *acc) {
    zero_sums();
    for (int64_t g = 0; g < groups; g++) group_product(x, ldx, g, wb + g * TILE_PAIRS * 2 * 64, 1, stream);
    store_sums(acc);
}

void tile_block_product(const bf16 *x, int64_t ldx, int64_t m, const bf16 *w, int64_t b, int64_t K, float *acc) {
    int64_t groups = K / (2 * TILE_PAIRS);
    const bf16 *wb = w + b * 64 * 2 * ((K + 1) / 2);
    int configured = 0;
    memory_barrier();
    for (int64_t i0 = 0; i0 < m; i0 += 16) {
        int rows = m - i0 < 16 ? (int)(m - i0) : 16;
        if (rows != configured) {
            configure(rows);
            configured = rows;
        }
        tile_rows(x + i0 * ldx, ldx, groups, wb, i0 == 0, acc + i0 * 64);
    }
}
/* tile_mx_block for 17 to 32 rows: eight tiles hold the sums of two row tiles over 32 columns, so each half of the
 * block's columns is one pass over K (a group's half decoded into buf, [16][32][2]) and every decoded weight serves
 * all rows once, as at 16 rows and fewer. */
static void mx_block_two(const bf16 *x, int64_t ldx, int64_t m, const mx_matrix *w, int64_t b, int64_t K, float *acc,
                         bf16 *buf) {
    const int64_t groups = K / (2 * TILE_PAIRS), size = TILE_PAIRS * 2 * 32;
    const int64_t stride = ldx * (int64_t)sizeof(bf16);
    memory_barrier();
    configure_two((int)m - 16);
    for (int half = 0; half < 2; half++) {
        zero_sums();
        mx_decode_half(w, b, 0, K, half, buf);
        for (int64_t g = 0; g < groups; g++) {
            if (g + 1 < groups) mx_decode_half(w, b, g + 1, K, half, buf + (g + 1) % 2 * size);
            const bf16 *wg = buf + g % 2 * size;
            memory_barrier();
            _tile_loadd(4, x + g * 2 * TILE_PAIRS, stride);
            _tile_loadd(5, x + 16 * ldx + g * 2 * TILE_PAIRS, stride);
            _tile_loadd(6, wg, 128);
            _tile_loadd(7, wg + 32, 128);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            memory_barrier();
        }
        float *a = acc + 32 * half;
        _tile_stored(0, a, 64 * sizeof(float));
        _tile_stored(1, a + 16, 64 * sizeof(float));
        _tile_stored(2, a + 16 * 64, 64 * sizeof(float));
        _tile_stored(3, a + 16 * 64 + 16, 64 * sizeof(float));
        memory_barrier();
    }
}

/* acc [m][64] = m <= TILE_MAX_ROWS rows x (stride ldx) times block b of the MX matrix w (mx.c; K a multiple of 32):
 * each group of 16 pairs (32 of K) is decoded with its scales into a [16][64][2] bf16 buffer (4 KiB, in L1) and
 * multiplied on the tile unit, the sums staying in the tiles over the whole K. Why: from TILE_MIN_ROWS rows the
 * pair products' multiply rate, not the decoding, bounds an MX block (mx_block_few, below that, decodes in
 * registers and wins there); the tile unit takes every row of a group in a few instructions, and the block
 * streams once. Two buffers alternate, and group g + 1 is decoded before group g's products: the tile
 * loads cannot take data from stores still in flight, so they would wait for the decoder's last stores, and the
 * decoder would wait for the products; staggered, each overlaps the other. buf holds 2 groups (1 when K = 32). */
void tile_mx_block(const bf16 *x, int64_t ldx, int64_t m, const mx_matrix *w, int64_t b, int64_t K, float *acc,
                   bf16 *buf) {
    if (m > 16) {
        mx_block_two(x, ldx, m, w, b, K, acc, buf);
        return;
    }
    const int64_t groups = K / (2 * TILE_PAIRS), size = TILE_PAIRS * 2 * 64; /* bf16 of one decoded group */
    memory_barrier();
    configure((int)m);
    zero_sums();
    mx_decode_pairs(w, b, 0, TILE_PAIRS, K, buf);
    for (int64_t g = 0; g < groups; g++) {
        if (g + 1 < groups) mx_decode_pairs(w, b, (g + 1) * TILE_PAIRS, (g + 2) * TILE_PAIRS, K, buf + (g + 1) % 2 * size);
        group_product(x, ldx, g, buf + g % 2 * size, 0, 0);
    }
    store_sums(acc);
}
#else
int ds_tiles_usable(void) { return 0; }

void tile_mx_block(const bf16 *x, int64_t ldx, int64_t m, const mx_matrix *w, int64_t b, int64_t K, float *acc,
                   bf16 *buf) {
    (void)x, (void)ldx, (void)m, (void)w, (void)b, (void)K, (void)acc, (void)buf;
    abort(); /* callers ask ds_tiles_usable() first */
}

void tile_block_product(const bf16 *x, int64_t ldx, int64_t m, const bf16 *w, int64_t b, int64_t K, float *acc) {
    (void)x, (void)ldx, (void)m, (void)w, (void)b, (void)K, (void)acc;
    abort(); /* callers ask ds_tiles_usable() first */
}
#endif
