/* MX weights as the column products read them, and MXFP8 quantisation of their input rows (docs/ops.md §7).
 *
 * Why: decode streams every weight once a token, so its speed follows the bytes read. An MX matrix is read as
 * stored (one byte a weight for MXFP8-E4M3, half a byte for MXFP4-E2M1, one E8M0 scale byte per 32) and decoded
 * into bf16 a chunk at a time into a per-thread scratch in L1 that the bf16 pair products of experts.c then read,
 * so no bf16 copy of a whole matrix ever exists.
 *
 * Layout (ops/native.py pack_mx_columns): pack_columns' order, per matrix blocks of COL_BLOCK output columns and
 * per block its pairs of k: MAT_E4M3 [K/2][64][2] codes (a byte each), MAT_E2M1 [K/2][64] bytes (element 2p in the
 * low nibble, 2p + 1 in the high one), then per block the scales [K/32][64]; columns past N have zero codes and
 * scale 0. K is a multiple of 32 (an MX block).
 *
 * Exactness: an E4M3 or E2M1 value times a power of two is a bf16 unless it leaves bf16's normal range. The decoder
 * builds the bf16 directly: the code's magnitude as a bf16 from a table, plus (scale - 127) in the exponent field,
 * plus the sign. That is exact while every non-zero element's exponent stays normal: scale bytes in [10, 246] for
 * E4M3 and [2, 252] for E2M1, and no NaN code (E4M3 0x7F / 0xFF). pack_mx_columns checks this; a matrix outside it
 * keeps the torch path. The products then sum the exact bf16 values in fp32, as the reference twin does. */
#include "kernels.h"

/* The bf16 bits of an E4M3 code's magnitude (code & 0x7F): subnormals m 2^-9, normals (1 + m/8) 2^(e-7); 0x7F is
 * NaN (excluded at pack time). */
static const bf16 E4M3_MAGNITUDE[128] = {
    0x0000, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60, 0x3c80, 0x3c90, 0x3ca0, 0x3cb0, 0x3cc0, 0x3cd0,
    0x3ce0, 0x3cf0, 0x3d00, 0x3d10, 0x3d20, 0x3d30, 0x3d40, 0x3d50, 0x3d60, 0x3d70, 0x3d80, 0x3d90, 0x3da0, 0x3db0,
    0x3dc0, 0x3dd0, 0x3de0, 0x3df0, 0x3e00, 0x3e10, 0x3e20, 0x3e30, 0x3e40, 0x3e50, 0x3e60, 0x3e70, 0x3e80, 0x3e90,
    0x3ea0, 0x3eb0, 0x3ec0, 0x3ed0, 0x3ee0, 0x3ef0, 0x3f00, 0x3f10, 0x3f20, 0x3f30, 0x3f40, 0x3f50, 0x3f60, 0x3f70,
    0x3f80, 0x3f90, 0x3fa0, 0x3fb0, 0x3fc0, 0x3fd0, 0x3fe0, 0x3ff0, 0x4000, 0x4010, 0x4020, 0x4030, 0x4040, 0x4050,
    0x4060, 0x4070, 0x4080, 0x4090, 0x40a0, 0x40b0, 0x40c0, 0x40d0, 0x40e0, 0x40f0, 0x4100, 0x4110, 0x4120, 0x4130,
    0x4140, 0x4150, 0x4160, 0x4170, 0x4180, 0x4190, 0x41a0, 0x41b0, 0x41c0, 0x41d0, 0x41e0, 0x41f0, 0x4200, 0x4210,
    0x4220, 0x4230, 0x4240, 0x4250, 0x4260, 0x4270, 0x4280, 0x4290, 0x42a0, 0x42b0, 0x42c0, 0x42d0, 0x42e0, 0x42f0,
    0x4300, 0x4310, 0x4320, 0x4330, 0x4340, 0x4350, 0x4360, 0x4370, 0x4380, 0x4390, 0x43a0, 0x43b0, 0x43c0, 0x43d0,
    0x43e0, 0x7fc0,
};
/* The bf16 bits of each E2M1 code (sign in bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, twice: a 16-bit
 * permute reads the low 5 bits of its index, and bit 4 of e2m1_index's words is another code's bit. */
static const bf16 E2M1_VALUE[32] = {
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
    0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0,
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
    0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0,
};
/* The bf16 bits of the E4M3 magnitudes whose exponent field is 0 (zero and the subnormals m 2^-9), at index
 * code & 31 (bit 3, the exponent's lowest, is 0 there); the rest unused. */
static const bf16 E4M3_LOW[32] = {0x0000, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};

/* The high byte of each E2M1 code's value as an fp16 (whose low byte is 0), a byte shuffle's 16-entry table: 0, 0.5,
 * 1, 1.5, 2, 3, 4, 6 and their negatives (sign in bit 3). */
static const uint8_t E2M1_HALF_HIGH[16] = {0x00, 0x38, 0x3c, 0x3e, 0x40, 0x42, 0x44, 0x46,
                                           0x80, 0xb8, 0xbc, 0xbe, 0xc0, 0xc2, 0xc4, 0xc6};

static inline int64_t blocks_of(int64_t N) { return (N + COL_BLOCK - 1) / COL_BLOCK; }

int64_t mx_data_bytes(int64_t format, int64_t N, int64_t K) {
    int64_t pairs = (K + 1) / 2;
    int64_t row = format == MAT_E4M3 ? 2 * COL_BLOCK : format == MAT_E2M1 ? COL_BLOCK : 2 * COL_BLOCK * 2;
    return blocks_of(N) * pairs * row;
}

int64_t mx_scale_bytes(int64_t format, int64_t N, int64_t K) {
    return format == MAT_BF16 ? 0 : blocks_of(N) * (K / 32) * COL_BLOCK;
}

mx_matrix mx_at(const mx_matrix *w, int64_t e, int64_t N, int64_t K) {
    mx_matrix m = *w;
    m.data = (const uint8_t *)w->data + e * mx_data_bytes(w->format, N, K);
    if (w->scales) m.scales = w->scales + e * mx_scale_bytes(w->format, N, K);
    return m;
}

/* Where block b of a column-packed MX matrix of K (K a multiple of 32) keeps its codes and its scales. */
static inline const uint8_t *block_codes_of(const mx_matrix *w, int64_t b, int64_t K) {
    return (const uint8_t *)w->data + b * (K / 2) * (w->format == MAT_E2M1 ? COL_BLOCK : 2 * COL_BLOCK);
}

static inline const uint8_t *block_scales_of(const mx_matrix *w, int64_t b, int64_t K) {
    return w->scales + b * (K / 32) * COL_BLOCK;
}

/* The exponent-field offset of each of a group's 64 columns, as 16-bit lanes twice per column (both elements of a
 * pair): off[c][j] = (scale_c - 127) << 7. */
static inline void scale_offsets(const uint8_t *scales, int16_t off[COL_BLOCK][2]) {
    for (int c = 0; c < COL_BLOCK; c++) off[c][0] = off[c][1] = (int16_t)(((int)scales[c] - 127) * 128);
}

/* One E4M3 code as a bf16 at exponent offset off (the scalar form of the vector decoder below: the same integers) */
static inline bf16 e4m3_bf16(uint8_t code, int16_t off) {
    uint16_t mag = E4M3_MAGNITUDE[code & 0x7f];
    return (bf16)((code & 0x7f ? (uint16_t)(mag + off) : mag) | (uint16_t)(code & 0x80) << 8);
}

static inline bf16 e2m1_bf16(uint8_t code, int16_t off) {
    uint16_t v = E2M1_VALUE[code & 15];
    return (bf16)(code & 7 ? (uint16_t)(v + off) : v);
}

#if defined(__AVX512BW__)
/* 32 E4M3 codes (16 columns' pairs, even code first) as bf16 words times 2^off (off: per word, the exponent-field
 * offset (s - 127) << 7 of its column; base = off + 0x3c00). A normal code s eeee mmm is the bf16 s, eeee + 120,
 * mmm0000, times 2^off: the code sign-extended to 16 bits and shifted left by 4 puts the sign at 15 (bits 11-14,
 * copies of it, are masked off) and eeeemmm at 4-10, and adding base moves the exponent; it stays in bf16's normal
 * range, so nothing carries into the sign (mx_columns checks the scales). The codes with exponent field 0 (zero and
 * the subnormals, rare in weights) take the table E4M3_LOW, their offset, and their sign. */
static inline __attribute__((always_inline)) __m512i e4m3_words(const uint8_t *src, __m512i base, __m512i off,
                                                                __m512i low) {
    __m512i sx = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)src));
    __m512i v = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(sx, 4), _mm512_set1_epi16((short)0x87f0)), base);
    __mmask32 small = _mm512_testn_epi16_mask(sx, _mm512_set1_epi16(0x78));
    if (__builtin_expect(small != 0, 0)) {
        __m512i t = _mm512_permutexvar_epi16(sx, low);
        t = _mm512_mask_add_epi16(t, _mm512_test_epi16_mask(sx, _mm512_set1_epi16(7)), t, off);
        t = _mm512_ternarylogic_epi32(t, sx, _mm512_set1_epi16((short)0x8000), 0xF8); /* t | (sx & sign) */
        v = _mm512_mask_mov_epi16(v, small, t);
    }
    return v;
}

/* 16 bytes of E2M1 pairs (column c's in byte c, element 2p in the low nibble) as 32 permute indices: word 2c the
 * low nibble (bit 4 is the high one's bit 0: E2M1_VALUE repeats), word 2c + 1 the high nibble. */
static inline __attribute__((always_inline)) __m512i e2m1_index(const uint8_t *src) {
    __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
    return _mm512_or_si512(d, _mm512_slli_epi32(d, 12));
}

#if defined(__AVX512VBMI__)
/* The permute indices of e2m1_index for columns 4d + j (d = 0..15, the lanes) from one pair's 64 bytes d (column c's
 * in byte c), in one multishift: dword d holds columns 4d .. 4d + 3, and the permute reads only bits 0-4 of each
 * word, so the low word takes the 8 bits from 8j (the low nibble at the bottom) and the high word the 8 bits from
 * 8j + 4 (the high nibble). Why: e2m1_index's widening shuffle and the permute share one port, which bounds the
 * few-row E2M1 product; this takes one instruction where that takes three, and the sums' order is undone once a
 * block (columns_in_order). */
static inline __attribute__((always_inline)) __m512i e2m1_lane_index(__m512i d, int j) {
    const long long c = 8 * j;
    const long long ctrl = c | (c + 1) << 8 | (c + 4) << 16 | (c + 5) << 24 | (c + 32) << 32 | (c + 33) << 40 |
                           (c + 36) << 48 | (c + 37) << 56;
    return _mm512_multishift_epi64_epi8(_mm512_set1_epi64(ctrl), d);
}

/* acc [64] summed with lane d of quarter j holding column 4d + j (few_rows_n's E2M1 order), put in column order. */
static inline void columns_in_order(float *acc) {
    const __m512 p0 = _mm512_loadu_ps(acc), p1 = _mm512_loadu_ps(acc + 16), p2 = _mm512_loadu_ps(acc + 32),
                 p3 = _mm512_loadu_ps(acc + 48);
    const __m512d t0 = _mm512_castps_pd(_mm512_unpacklo_ps(p0, p1)), t1 = _mm512_castps_pd(_mm512_unpackhi_ps(p0, p1)),
                  t2 = _mm512_castps_pd(_mm512_unpacklo_ps(p2, p3)), t3 = _mm512_castps_pd(_mm512_unpackhi_ps(p2, p3));
    /* u[k], 128-bit lane L: columns 16 L + 4 k .. 16 L + 4 k + 3 */
    const __m512 u0 = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2)), u1 = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2)),
                 u2 = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3)), u3 = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    const __m512 v0 = _mm512_shuffle_f32x4(u0, u1, 0x44), v1 = _mm512_shuffle_f32x4(u0, u1, 0xee),
                 v2 = _mm512_shuffle_f32x4(u2, u3, 0x44), v3 = _mm512_shuffle_f32x4(u2, u3, 0xee);
    _mm512_storeu_ps(acc, _mm512_shuffle_f32x4(v0, v2, 0x88));
    _mm512_storeu_ps(acc + 16, _mm512_shuffle_f32x4(v0, v2, 0xdd));
    _mm512_storeu_ps(acc + 32, _mm512_shuffle_f32x4(v1, v3, 0x88));
    _mm512_storeu_ps(acc + 48, _mm512_shuffle_f32x4(v1, v3, 0xdd));
}
#endif

/* The exponent-field offsets (s - 127) << 7 of 16 columns' scales, each twice (both elements of a pair). */
static inline __m512i pair_offsets(const uint8_t *scales) {
    __m512i o = _mm512_slli_epi32(
        _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)scales)), _mm512_set1_epi32(127)), 7);
    return _mm512_or_si512(_mm512_and_si512(o, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(o, 16));
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
/* 16 words of E4M3 pairs (even code low) as fp16s of each code's value times 2^-8: the code's bits placed where an
 * fp16's go, the sign at 15 and eeeemmm at 7-13 (both formats' subnormals are their mantissa times the smallest
 * normal's ulp, so subnormal codes come out right too); the half-to-single conversion widens them exactly and
 * keeps subnormal halves whatever MXCSR says. */
static inline __attribute__((always_inline)) void e4m3_pairs_as_halves(__m256i word, __m256i *even, __m256i *odd) {
    const __m256i bits = _mm256_set1_epi16((short)0xbf80);
    /* code << 8 shifted right by one with its sign: sign at 15 (and 14, cleared) */
    *even = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(word, 8), 1), bits);
    *odd = _mm256_and_si256(_mm256_srai_epi16(word, 1), bits);
}

/* 16 bytes of E2M1 pairs (element 2p the low nibble) as fp16s of each code's value, even codes in *even (columns 0-7
 * in the low half), odd in *odd. */
static inline __attribute__((always_inline)) void e2m1_pairs_as_halves(__m128i byte, __m256i *even, __m256i *odd) {
    const __m128i table = _mm_loadu_si128((const __m128i *)E2M1_HALF_HIGH), nibble = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(byte, nibble));
    __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(byte, 4), nibble));
    *even = _mm256_set_m128i(_mm_unpackhi_epi8(_mm_setzero_si128(), lo), _mm_unpacklo_epi8(_mm_setzero_si128(), lo));
    *odd = _mm256_set_m128i(_mm_unpackhi_epi8(_mm_setzero_si128(), hi), _mm_unpacklo_epi8(_mm_setzero_si128(), hi));
}

/* Half h of v (0: the low 128 bits). */
static inline __m128i half_of(__m256i v, int h) {
    return h ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
}

/* Columns c .. c + 15 of pair p of a block's codes (block_codes_of) as fp16s, even elements in *even and odd ones in
 * *odd, columns c .. c + 7 in the low halves; E4M3's carry 2^-8 (column_scales gives it back). */
static inline __attribute__((always_inline)) void pair_halves(const uint8_t *src, int fp4, int64_t p, int c,
                                                              __m256i *even, __m256i *odd) {
    if (fp4)
        e2m1_pairs_as_halves(_mm_loadu_si128((const __m128i *)(src + p * COL_BLOCK + c)), even, odd);
    else
        e4m3_pairs_as_halves(_mm256_loadu_si256((const __m256i *)(src + p * 2 * COL_BLOCK + 2 * c)), even, odd);
}

/* The scales of 8 columns as fp32 multipliers of pair_halves' values: 2^(s - 127), for E4M3 2^8 more (fp32 bits
 * (s + shift) << 23; s = 0 only where every code is 0). */
static inline __m256 column_scales(const uint8_t *scale, int fp4) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)scale)), _mm256_set1_epi32(fp4 ? 0 : 8)),
        23));
}

/* 16 columns of one pair step (fp16s of even and odd elements, columns 0-7 in the low halves) as bf16 pair words:
 * widened, times each column's scale (sc[0] columns 0-7, sc[1] 8-15; exact: the result is a normal, mx_columns
 * checks that), then the even element's bf16 in the low word and the odd one's in the high word (the values have
 * at most 4 significant bits, so taking the high half of the fp32 is exact). */
static inline void store_pair_words(__m256i even, __m256i odd, const __m256 *sc, bf16 *out) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int h = 0; h < 2; h++) {
        __m256i ev = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtph_ps(half_of(even, h)), sc[h]));
        __m256i od = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtph_ps(half_of(odd, h)), sc[h]));
        _mm256_storeu_si256((__m256i *)(out + 16 * h), _mm256_or_si256(_mm256_srli_epi32(ev, 16),
                                                                       _mm256_and_si256(od, high)));
    }
}

/* mx_decode_pairs for pairs [g0, g1) under one group of scales, into out [g1 - g0][64][2]. */
static inline void decode_group(const mx_matrix *w, int64_t b, int64_t g0, int64_t g1, int64_t K, bf16 *out) {
    const int fp4 = w->format == MAT_E2M1;
    const uint8_t *src = block_codes_of(w, b, K), *scales = block_scales_of(w, b, K) + g0 / 16 * COL_BLOCK;
    __m256 sc[COL_BLOCK / 8];
    for (int j = 0; j < COL_BLOCK / 8; j++) sc[j] = column_scales(scales + 8 * j, fp4);
    for (int64_t p = g0; p < g1; p++, out += 2 * COL_BLOCK) {
        ask_stream(src + p * (fp4 ? COL_BLOCK : 2 * COL_BLOCK));
        if (!fp4) ask_stream(src + p * 2 * COL_BLOCK + 64);
        for (int q = 0; q < COL_BLOCK; q += 16) {
            __m256i even, odd;
            pair_halves(src, fp4, p, q, &even, &odd);
            store_pair_words(even, odd, sc + q / 8, out + 2 * q);
        }
    }
}
#endif

#if defined(__AVX512BW__)
/* Pairs [g0, g1) of block b (within one group of 16, one scale per column), columns 16 j0 .. 16 j1 - 1, decoded with
 * their scales: out [g1 - g0][16 (j1 - j0)][2] at `stride` bf16 from one pair to the next. */
static inline __attribute__((always_inline)) void decode_run(const mx_matrix *w, int64_t b, int64_t g0, int64_t g1,
                                                              int64_t K, int j0, int j1, bf16 *out, int64_t stride) {
    const uint8_t *scales = block_scales_of(w, b, K) + g0 / 16 * COL_BLOCK;
    __m512i off[COL_BLOCK / 16];
    for (int j = j0; j < j1; j++) off[j] = pair_offsets(scales + 16 * j);
    if (w->format == MAT_E4M3) {
        const uint8_t *src = block_codes_of(w, b, K) + g0 * 2 * COL_BLOCK;
        const __m512i low = _mm512_loadu_si512(E4M3_LOW);
        __m512i base[COL_BLOCK / 16];
        for (int j = j0; j < j1; j++) base[j] = _mm512_add_epi16(off[j], _mm512_set1_epi16(0x3c00));
        for (int64_t p = g0; p < g1; p++, src += 2 * COL_BLOCK, out += stride) {
            ask_stream(src);
            ask_stream(src + 64);
            for (int j = j0; j < j1; j++)
                _mm512_storeu_si512(out + 32 * (j - j0), e4m3_words(src + 32 * j, base[j], off[j], low));
        }
    } else {
        const uint8_t *src = block_codes_of(w, b, K) + g0 * COL_BLOCK;
        const __m512i table = _mm512_loadu_si512(E2M1_VALUE);
        for (int64_t p = g0; p < g1; p++, src += COL_BLOCK, out += stride) {
            ask_stream(src);
            for (int j = j0; j < j1; j++) {
                __m512i idx = e2m1_index(src + 16 * j);
                __m512i v = _mm512_permutexvar_epi16(idx, table);
                /* the offset on non-zero codes only (a zero's exponent must stay 0) */
                v = _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(idx, _mm512_set1_epi16(7)), v, off[j]);
                _mm512_storeu_si512(out + 32 * (j - j0), v);
            }
        }
    }
}

void mx_decode_half(const mx_matrix *w, int64_t b, int64_t g, int64_t K, int half, bf16 *out) {
    if (half) /* constant column ranges, so each call's loops unroll */
        decode_run(w, b, 16 * g, 16 * g + 16, K, 2, 4, out, COL_BLOCK);
    else
        decode_run(w, b, 16 * g, 16 * g + 16, K, 0, 2, out, COL_BLOCK);
}
#endif

void mx_decode_pairs(const mx_matrix *w, int64_t b, int64_t p0, int64_t p1, int64_t K, bf16 *dst) {
    for (int64_t g0 = p0; g0 < p1;) { /* a run of pairs under one group of scales (16 pairs = 32 of K) */
        int64_t g1 = (g0 / 16 + 1) * 16 < p1 ? (g0 / 16 + 1) * 16 : p1;
#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512BW__)
        decode_group(w, b, g0, g1, K, dst + (g0 - p0) * 2 * COL_BLOCK);
#else
        bf16 *out = dst + (g0 - p0) * 2 * COL_BLOCK;
#if defined(__AVX512BW__)
        decode_run(w, b, g0, g1, K, 0, COL_BLOCK / 16, out, 2 * COL_BLOCK);
#else
        int16_t off[COL_BLOCK][2];
        scale_offsets(block_scales_of(w, b, K) + g0 / 16 * COL_BLOCK, off);
        if (w->format == MAT_E4M3) {
            const uint8_t *src = block_codes_of(w, b, K) + g0 * 2 * COL_BLOCK;
            for (int64_t p = g0; p < g1; p++, src += 2 * COL_BLOCK, out += 2 * COL_BLOCK)
                for (int c = 0; c < 2 * COL_BLOCK; c++) out[c] = e4m3_bf16(src[c], off[c / 2][c % 2]);
        } else {
            const uint8_t *src = block_codes_of(w, b, K) + g0 * COL_BLOCK;
            for (int64_t p = g0; p < g1; p++, src += COL_BLOCK, out += 2 * COL_BLOCK)
                for (int c = 0; c < COL_BLOCK; c++) {
                    out[2 * c] = e2m1_bf16(src[c] & 15, off[c][0]);
                    out[2 * c + 1] = e2m1_bf16(src[c] >> 4, off[c][1]);
                }
        }
#endif
#endif
        g0 = g1;
    }
}

#if defined(__AVX512BF16__)
/* mx_block_few for NT rows (a compile-time constant at each call): per group of 16 pairs (32 of K, one scale per
 * column) the element values without their scale, decoded in registers, go straight into the bf16 pair products;
 * each group's fp32 sums are then scaled by the columns' 2^(scale - 127) (exact: a power of two) and added to acc.
 * Against the scratch path this skips the exponent add on every weight and the round trip through L1. */
static inline __attribute__((always_inline)) void few_rows_n(const bf16 *const *x, const int NT, const mx_matrix *w,
                                                             int64_t b, int64_t K, float *acc) {
    const int64_t groups = K / 32;
    const uint8_t *scales = block_scales_of(w, b, K), *src = block_codes_of(w, b, K);
    const int fp4 = w->format == MAT_E2M1;
    const __m512i table = _mm512_loadu_si512(fp4 ? E2M1_VALUE : E4M3_LOW);
    const __m512i base = _mm512_set1_epi16(0x3c00), none = _mm512_setzero_si512();
    for (int64_t g = 0; g < groups; g++) {
        __m512 part[MX_FEW_ROWS][4];
        for (int i = 0; i < NT; i++)
            for (int j = 0; j < 4; j++) part[i][j] = _mm512_setzero_ps();
        for (int64_t p = g * 16; p < g * 16 + 16; p++) {
            __m512i v[4];
            if (fp4) { /* 64 bytes: column c's pair in byte c (element 2p low nibble) */
                ask_stream(src + (p + 8) * COL_BLOCK);
#if defined(__AVX512VBMI__) /* lane d of v[j]: column 4d + j, put in order at the end */
                const __m512i d = _mm512_loadu_si512(src + p * COL_BLOCK);
                for (int j = 0; j < 4; j++) v[j] = _mm512_permutexvar_epi16(e2m1_lane_index(d, j), table);
#else
                for (int j = 0; j < 4; j++)
                    v[j] = _mm512_permutexvar_epi16(e2m1_index(src + p * COL_BLOCK + 16 * j), table);
#endif
            } else { /* 128 codes: column c's pair in bytes 2c, 2c + 1 */
                const uint8_t *at = src + p * 2 * COL_BLOCK;
                ask_stream(at + 16 * 2 * COL_BLOCK);
                ask_stream(at + 16 * 2 * COL_BLOCK + 64);
                for (int j = 0; j < 4; j++) v[j] = e4m3_words(at + 32 * j, base, none, table);
            }
            for (int i = 0; i < NT; i++) {
                __m512bh xb = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x[i] + 2 * p));
                for (int j = 0; j < 4; j++) part[i][j] = _mm512_dpbf16_ps(part[i][j], xb, (__m512bh)v[j]);
            }
        }
        const uint8_t *gs = scales + g * COL_BLOCK;
        for (int j = 0; j < 4; j++) { /* 2^(s - 127) as fp32 bits s << 23 (s = 0 only where every code is 0) */
#if defined(__AVX512VBMI__) /* the E2M1 sums' order: lane d, column 4d + j */
            __m512i s = fp4 ? _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(gs), 8 * j),
                                               _mm512_set1_epi32(0xff))
                            : _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(gs + 16 * j)));
#else
            __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(gs + 16 * j)));
#endif
            __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(s, 23));
            for (int i = 0; i < NT; i++) {
                float *a = acc + i * COL_BLOCK + 16 * j;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(part[i][j], scale, _mm512_loadu_ps(a)));
            }
        }
    }
#if defined(__AVX512VBMI__)
    if (fp4)
        for (int i = 0; i < NT; i++) columns_in_order(acc + i * COL_BLOCK);
#endif
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

/* few_rows_n for AVX2 + FMA + F16C: the codes become fp16s (pair_halves) that the half-to-single conversion widens
 * exactly. Per group of 16 pairs (32 of K, one scale per column) the rows' inputs are widened to fp32 once; VW
 * vectors of 8 columns per row at a time (experts.c's outer tile says why), each column's pair giving an even and an
 * odd vector that the row's two inputs multiply; the group's sums are then scaled into acc, as above. */
static inline __attribute__((always_inline)) void few_rows_n(const bf16 *const *x, const int NT, const mx_matrix *w,
                                                             int64_t b, int64_t K, float *acc) {
    const int64_t groups = K / 32;
    const uint8_t *scales = block_scales_of(w, b, K), *src = block_codes_of(w, b, K);
    const int fp4 = w->format == MAT_E2M1;
    const int VW = NT <= 2 ? 4 : 2; /* as in experts.c's outer tile */
    for (int64_t g = 0; g < groups; g++) {
        float xf[MX_FEW_ROWS][32];
        for (int i = 0; i < NT; i++)
            for (int j = 0; j < 4; j++)
                _mm256_storeu_ps(xf[i] + 8 * j, _mm256_castsi256_ps(_mm256_slli_epi32(
                                                     _mm256_cvtepu16_epi32(_mm_loadu_si128(
                                                         (const __m128i *)(x[i] + 32 * g + 8 * j))),
                                                     16)));
        for (int q = 0; q < COL_BLOCK; q += 8 * VW) {
            __m256 part[MX_FEW_ROWS][8];
            for (int i = 0; i < NT; i++)
                for (int v = 0; v < VW; v++) part[i][v] = _mm256_setzero_ps();
            for (int k = 0; k < 16; k++) {
                const int64_t p = g * 16 + k;
                for (int c = q; c < q + 8 * VW; c += 16) {
                    __m256i even, odd;
                    if (c == 0 && fp4) /* the stream 8 (E2M1) or 16 (E4M3) pairs ahead: 512 B, 2 KiB */
                        ask_stream(src + (p + 8) * COL_BLOCK);
                    else if (c == 0) {
                        ask_stream(src + (p + 16) * 2 * COL_BLOCK);
                        ask_stream(src + (p + 16) * 2 * COL_BLOCK + 64);
                    }
                    pair_halves(src, fp4, p, c, &even, &odd);
                    for (int h = 0; h < 2; h++) {
                        const int v = (c - q) / 8 + h;
                        __m256 ev = _mm256_cvtph_ps(half_of(even, h)), od = _mm256_cvtph_ps(half_of(odd, h));
                        for (int i = 0; i < NT; i++) {
                            part[i][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xf[i] + 2 * k), ev, part[i][v]);
                            part[i][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xf[i] + 2 * k + 1), od, part[i][v]);
                        }
                    }
                }
            }
            for (int v = 0; v < VW; v++) {
                __m256 scale = column_scales(scales + g * COL_BLOCK + q + 8 * v, fp4);
                for (int i = 0; i < NT; i++) {
                    float *a = acc + i * COL_BLOCK + q + 8 * v;
                    _mm256_storeu_ps(a, _mm256_fmadd_ps(part[i][v], scale, _mm256_loadu_ps(a)));
                }
            }
        }
    }
}
#endif

#if MX_FEW_ROWS
void mx_block_few(const bf16 *const *x, int m, const mx_matrix *w, int64_t b, int64_t K, float *acc) {
    memset(acc, 0, sizeof(float) * (size_t)(m * COL_BLOCK));
    switch (m) {
    case 1: few_rows_n(x, 1, w, b, K, acc); break;
    case 2: few_rows_n(x, 2, w, b, K, acc); break;
    case 3: few_rows_n(x, 3, w, b, K, acc); break;
#if MX_FEW_ROWS > 4
    case 4: few_rows_n(x, 4, w, b, K, acc); break;
    case 5: few_rows_n(x, 5, w, b, K, acc); break;
    default: few_rows_n(x, 6, w, b, K, acc); break;
#else
    default: few_rows_n(x, 4, w, b, K, acc); break;
#endif
    }
}
#endif

/* Every pair of block b of w, decoded: out [K/2][64][2] bf16 (tests/test_native_mx.py holds it to dequantize_mx). */
void ds_mx_unpack_block(const mx_matrix *w, int64_t K, int64_t b, bf16 *out) {
    if (w->format == MAT_BF16)
        memcpy(out, (const bf16 *)w->data + b * COL_BLOCK * 2 * ((K + 1) / 2),
               sizeof(bf16) * (size_t)(COL_BLOCK * 2 * ((K + 1) / 2)));
    else
        mx_decode_pairs(w, b, 0, (K + 1) / 2, K, out);
}

/* a (|a| <= 448) rounded to the nearest E4M3 value, ties to even: normals keep 3 mantissa bits (fp32 bit 20 up),
 * subnormals are multiples of 2^-9. */
static inline float round_e4m3(float a) {
    if (fabsf(a) < 0x1p-6f) return nearbyintf(a * 512.f) / 512.f;
    uint32_t u;
    memcpy(&u, &a, 4);
    u = (u + 0x7ffffu + ((u >> 20) & 1u)) & ~0xfffffu;
    memcpy(&a, &u, 4);
    return a;
}

/* The E8M0 block exponent of a block whose largest magnitude is amax (finite, >= 0), by rule act (ops/mx.py
 * block_scales for E4M3: emax 8, 448, 3 mantissa bits). */
static inline int block_exponent(float amax, int act) {
    if (!(amax > 0.f)) return -127;
    uint32_t bits;
    memcpy(&bits, &amax, 4);
    int biased = (int)(bits >> 23), ex, e;
    if (biased > 0 && (act == ACT_FLOOR || act == ACT_CEIL)) {
        /* a normal amax: floor or ceil of its log2 from the exponent field, no libm call */
        e = biased - 127 + (act == ACT_CEIL && (bits & 0x7fffffu) != 0) - 8;
    } else if (act == ACT_FLOOR) {
        frexpf(amax, &ex);
        e = ex - 1 - 8;
    } else if (act == ACT_CEIL) {
        float mant = frexpf(amax, &ex);
        e = ex - (mant == 0.5f) - 8;
    } else if (act == ACT_EVEN) {
        uint32_t u;
        memcpy(&u, &amax, 4);
        e = (int)(((u + (1u << 19)) >> 23) & 0xff) - 127 - 8;
    } else { /* ACT_RCEIL: ceil(log2) of the fp32 quotient, from its exponent field when it is a normal */
        float q = amax / 448.f;
        uint32_t qbits;
        memcpy(&qbits, &q, 4);
        if (qbits >> 23) {
            e = (int)(qbits >> 23) - 127 + ((qbits & 0x7fffffu) != 0);
        } else {
            float mant = frexpf(q, &ex);
            e = ex - (mant == 0.5f);
        }
    }
    return e < -127 ? -127 : e > 127 ? 127 : e;
}

/* 2^k for k in [-127, 127] (exact; 2^-127 is an fp32 subnormal) */
static inline float pow2f(int k) {
    if (k < -126) return ldexpf(1.f, k);
    uint32_t bits = (uint32_t)(k + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* One block of 32 of mx_quantize_row, in scalar code. */
static void quantize_block(bf16 *x, int act) {
    float v[32], amax = 0.f;
    int finite = 1;
    for (int i = 0; i < 32; i++) {
        v[i] = bf16_to_f32(x[i]);
        if (!isfinite(v[i])) finite = 0;
        else if (fabsf(v[i]) > amax) amax = fabsf(v[i]);
    }
    if (!finite) {
        for (int i = 0; i < 32; i++) x[i] = 0x7fc0;
        return;
    }
    int e = block_exponent(amax, act);
    float inv = pow2f(-e), scale = pow2f(e);
    for (int i = 0; i < 32; i++) {
        float s = v[i] * inv;
        s = s > 448.f ? 448.f : s < -448.f ? -448.f : s;
        x[i] = f32_to_bf16(round_e4m3(s) * scale);
    }
}

#if defined(__AVX512BW__)
/* The largest magnitude of each of 16 blocks of 32 bf16 as bf16 bits, block j in 32-bit lane j; a[j] is block j
 * with its sign bits cleared, so that magnitudes order as unsigned integers (NaN and ±Inf above every finite).
 * A reduction tree over all 16 at once: each level folds two vectors' halves into one, so the 16 blocks take 15
 * folds where one block at a time takes a 5-step horizontal reduction each. */
static inline __m512i blocks_amax16(const __m512i a[16]) {
    __m512i c[8], e[4], g[2];
    for (int i = 0; i < 8; i++) /* 256-bit halves: block 2i in c's low half, 2i + 1 in its high half */
        c[i] = _mm512_max_epu16(_mm512_shuffle_i64x2(a[2 * i], a[2 * i + 1], 0x44),
                                _mm512_shuffle_i64x2(a[2 * i], a[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++) /* 128-bit quarters: block 4i + q in quarter q */
        e[i] = _mm512_max_epu16(_mm512_shuffle_i64x2(c[2 * i], c[2 * i + 1], 0x88),
                                _mm512_shuffle_i64x2(c[2 * i], c[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++) /* 64-bit halves of quarter q: block 8i + q low, 8i + 4 + q high */
        g[i] = _mm512_max_epu16(_mm512_unpacklo_epi64(e[2 * i], e[2 * i + 1]),
                                _mm512_unpackhi_epi64(e[2 * i], e[2 * i + 1]));
    const __m512 g0 = _mm512_castsi512_ps(g[0]), g1 = _mm512_castsi512_ps(g[1]);
    /* 32-bit lane 4q + t: block 4t + q, two candidates each */
    __m512i h = _mm512_max_epu16(_mm512_castps_si512(_mm512_shuffle_ps(g0, g1, _MM_SHUFFLE(2, 0, 2, 0))),
                                 _mm512_castps_si512(_mm512_shuffle_ps(g0, g1, _MM_SHUFFLE(3, 1, 3, 1))));
    h = _mm512_max_epu32(_mm512_and_si512(h, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(h, 16));
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), h);
}

/* block_exponent of 16 blocks from their amax bits m (blocks_amax16; finite), by the same integer reading of the
 * exponent field; the lanes whose amax (or RCEIL quotient) is an fp32 subnormal, rare, in scalar code. */
static inline __m512i block_exponents16(__m512i m, int act) {
    const __m512i u = _mm512_slli_epi32(m, 16), one = _mm512_set1_epi32(1), frac = _mm512_set1_epi32(0x7fffff);
    __m512i bits = u, e;
    if (act == ACT_RCEIL) bits = _mm512_castps_si512(_mm512_div_ps(_mm512_castsi512_ps(u), _mm512_set1_ps(448.f)));
    const __m512i biased = _mm512_srli_epi32(bits, 23);
    if (act == ACT_EVEN) {
        e = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(1 << 19)), 23),
                                              _mm512_set1_epi32(0xff)),
                             _mm512_set1_epi32(127 + 8));
    } else {
        e = _mm512_sub_epi32(biased, _mm512_set1_epi32(act == ACT_RCEIL ? 127 : 127 + 8));
        if (act != ACT_FLOOR) e = _mm512_mask_add_epi32(e, _mm512_test_epi32_mask(bits, frac), e, one);
    }
    e = _mm512_min_epi32(_mm512_max_epi32(e, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    e = _mm512_mask_mov_epi32(e, _mm512_cmpeq_epi32_mask(m, _mm512_setzero_si512()), _mm512_set1_epi32(-127));
    __mmask16 tiny = act == ACT_EVEN ? 0
                                     : _mm512_cmpeq_epi32_mask(biased, _mm512_setzero_si512()) &
                                           _mm512_cmpneq_epi32_mask(m, _mm512_setzero_si512());
    if (tiny) {
        int32_t lanes[16];
        float amax[16];
        _mm512_storeu_si512(lanes, e);
        _mm512_storeu_ps(amax, _mm512_castsi512_ps(u));
        for (int j = 0; j < 16; j++)
            if (tiny >> j & 1) lanes[j] = block_exponent(amax[j], act);
        e = _mm512_loadu_si512(lanes);
    }
    return e;
}

/* 2^k for 16 k in [-127, 127], exact (2^-127: the subnormal's bits, as pow2f) */
static inline __m512 pow2_16(__m512i k) {
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(k, _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(k, _mm512_set1_epi32(-127)),
                                                     _mm512_set1_epi32(0x400000)));
}

/* mx_quantize_row of nb <= 16 blocks at x: amax and exponents of all of them at once, then each block's 32 elements
 * as fp32 in two vectors (words interleaved per 128-bit lane by the unpacking, put back in order by the final
 * permute). An element's E4M3 rounding is one fp32 addition, on the input itself: scaled by 2^-e it would lie on
 * E4M3's grid, whose step at floor(log2 |v|) = E is 2^(E - e - 3) (2^-9 below E - e = -6, the subnormals), so in
 * v's terms the step is 2^(E' - 3) with E' = max(E, e - 6); v + 1.5 * 2^(E' + 20) lies in the binade with that
 * step, the sum rounds v to nearest-even on the grid and subtracting the constant back is exact. Scaling by a power
 * of two and back is exact, so this is round_e4m3(v * 2^-e) * 2^e (an element so far below the grid that the
 * scaled value would be an fp32 subnormal rounds to zero either way). v's sign goes back on the result, whose zeros
 * the subtraction makes positive. The result is a bf16: where the grid is coarser than bf16's subnormal step 2^-133
 * it has at most 4 significant bits over a multiple of that step, where finer the bf16 input already lies on it;
 * so its fp32 bits' high half is the bf16. A block with e > 99, whose constant would overflow, is rounded as
 * v * 2^-64 with e - 64 and multiplied back. */
static void quantize_blocks16(bf16 *x, int nb, int act) {
    __m512i raw[16], a[16];
    const __m512i magnitude = _mm512_set1_epi16(0x7fff), zero = _mm512_setzero_si512();
    for (int j = 0; j < 16; j++) {
        raw[j] = j < nb ? _mm512_loadu_si512(x + 32 * j) : zero;
        a[j] = _mm512_and_si512(raw[j], magnitude);
    }
    const __m512i m = blocks_amax16(a);
    const __mmask16 bad = _mm512_cmpge_epu32_mask(m, _mm512_set1_epi32(0x7f80));
    const __m512i e_all = block_exponents16(m, act);
    const __mmask16 huge = _mm512_cmpgt_epi32_mask(e_all, _mm512_set1_epi32(99));
    const __m512i e = _mm512_mask_sub_epi32(e_all, huge, e_all, _mm512_set1_epi32(64));
    float floor_exp[16], lim[16];
    _mm512_storeu_ps(floor_exp, _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(6))));
    _mm512_storeu_ps(lim, _mm512_mul_ps(pow2_16(e), _mm512_set1_ps(448.f)));
    const __m512 magic = _mm512_set1_ps(0x1.8p20f), down = _mm512_set1_ps(0x1p-64f), up = _mm512_set1_ps(0x1p64f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    /* word 8k + i of the block: the high word of dword 4k + i of the low unpacking (i < 4), else of the high one */
    const __m512i order = _mm512_set_epi16(63, 61, 59, 57, 31, 29, 27, 25, 55, 53, 51, 49, 23, 21, 19, 17, 47, 45, 43,
                                           41, 15, 13, 11, 9, 39, 37, 35, 33, 7, 5, 3, 1);
    for (int j = 0; j < nb; j++) {
        if (bad >> j & 1) {
            _mm512_storeu_si512(x + 32 * j, _mm512_set1_epi16(0x7fc0));
            continue;
        }
        const __m512 low = _mm512_set1_ps(floor_exp[j]), hi = _mm512_set1_ps(lim[j]);
        __m512i y[2] = {_mm512_unpacklo_epi16(zero, raw[j]), _mm512_unpackhi_epi16(zero, raw[j])};
        for (int h = 0; h < 2; h++) {
            __m512 v = _mm512_castsi512_ps(y[h]);
            if (huge >> j & 1) v = _mm512_mul_ps(v, down);
            /* FLOOR's and EVEN's scales let |v| pass 448 * 2^e; CEIL's keep it below 256 * 2^e, and RCEIL's at
             * most 448 * 2^e: a bf16 amax is either 448 * 2^k or 2^-8 of itself away, so amax / 448 cannot round
             * onto the power of two below it */
            if (act == ACT_FLOOR || act == ACT_EVEN)
                v = _mm512_min_ps(_mm512_max_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), hi)), hi);
            __m512 c = _mm512_scalef_ps(magic, _mm512_max_ps(_mm512_getexp_ps(v), low));
            __m512 q = _mm512_castsi512_ps(_mm512_ternarylogic_epi32( /* q | (v & sign) */
                _mm512_castps_si512(_mm512_sub_ps(_mm512_add_ps(v, c), c)), _mm512_castps_si512(v), sign, 0xf8));
            y[h] = _mm512_castps_si512(huge >> j & 1 ? _mm512_mul_ps(q, up) : q);
        }
        _mm512_storeu_si512(x + 32 * j, _mm512_permutex2var_epi16(y[0], order, y[1]));
    }
}
#endif

/* fake_quantize_mx(x, E4M3, rule act) of n bf16 values (n a multiple of 32), in place, equal bit for bit: per 32,
 * the scale from the block's amax, each element scaled by 2^-e in fp32, saturated to ±448, rounded to E4M3 and
 * multiplied back by 2^e in fp32 then rounded to bf16, as torch does it; a block holding NaN or ±Inf becomes NaN.
 * With AVX-512 BW 16 blocks at a time (quantize_blocks16): the quantiser runs on every input row of every W8A8
 * and W4A8 product. */
void mx_quantize_row(bf16 *x, int64_t n, int act) {
    int64_t b = 0;
#if defined(__AVX512BW__)
    for (; b < n; b += 16 * 32) quantize_blocks16(x + b, n - b >= 16 * 32 ? 16 : (int)((n - b) / 32), act);
#endif
    for (; b < n; b += 32) quantize_block(x + b, act);
}

void mx_quantize_copy(const bf16 *x, int64_t n, int act, bf16 *out) {
    memcpy(out, x, sizeof(bf16) * (size_t)n);
    if (act != ACT_NONE) mx_quantize_row(out, n, act);
}

/* out [M, K] = mx_quantize_row of each row of x [M, K] (row stride ldx) under rule act (ACT_NONE: a copy). */
void ds_mx_quantize_rows(const bf16 *x, int64_t M, int64_t K, int64_t ldx, int act, bf16 *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= (1 << 15))
    for (int64_t i = 0; i < M; i++) mx_quantize_copy(x + i * ldx, K, act, out + i * K);
}
