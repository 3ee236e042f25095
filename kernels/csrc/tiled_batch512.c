/* A batch of x (int8_activations: codes, a scale and a rounded sum per block of 32) against a
 * q4 or q8 weight on AVX-512, 16 weight rows to a register: included by packed_linear.c after
 * packed_row512.c (block_scales, ROW512, VNNI512).
 *
 * Why tiles: with a weight row's codes along a register (packed_row512.c's row kernels), every
 * VNNI dot of 64 codes leaves 16 partial sums of one row's two blocks, and each needs its own
 * conversion, a multiply by x's scales and an FMA: 4 vector instructions for 64 multiply-adds.
 * Here lane i of a register holds 4 codes of weight row i, so one dot against 4 of x's values
 * (broadcast) adds to 16 rows' sums at once and a block of 32 is 8 dots into integer sums that
 * take their scales once: 12 instructions for 512 multiply-adds. The weight's own row-major
 * layout is kept (every other path reads it); each call transposes its tiles once and uses
 * them for every row of x. Sums are exact integers, so the function is the row kernels' own: only
 * the fp32 order of the blocks' scaled sums differs.
 * Measured on a 2-core Ice Lake Xeon (best of 7 x 50 calls, 2 threads, alternated): see
 * packed_linear.c's INTEGER_ROWS note. */
#if ROW512
#define TILE_ROWS 16
#define X_CHUNK 256 /* 384 KB of x at 1536 columns */

/* x as quantize_rows leaves it: codes [m][cols], scales and rounded block sums [m][blocks]. */
struct int8_rows {
    const int8_t *xq;
    const float *dx, *xsum;
    int64_t cols;
};

/* 16 weight rows ready for tile_dots (lane i: row i). */
struct weight_tile {
    __m512i *codes;          /* [cols / 4]: row i's 4 codes at elements 4j .. 4j + 3 */
    __m512i *init;           /* [blocks]: q8's -128 times each lane's block code sum; q4: 0 */
    __m512 *scale, *minimum; /* [blocks]: each row's block scale, q4's block min */
};

/* out[j] for j < count (<= 16): lane i holds 32-bit word `word + j` of rows[i]. A 16 x 16
 * transpose in registers (64 shuffles): built with vpgatherdd instead, the gathers took ~40% of
 * the q8 head's time on the Ice Lake (head at 32 rows 10.7 ms against 8.7 this way). */
static inline void transposed_words(const uint8_t *const rows[TILE_ROWS], int64_t word, int count, __m512i out[16]) {
    const __mmask16 keep = (__mmask16)((1u << count) - 1);
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_epi32(keep, rows[i] + 4 * word);
    for (int i = 0; i < 16; i += 2) /* per 128-bit lane: rows i, i + 1 interleaved */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    for (int q = 0; q < 16; q += 4) /* r[q + e], lane L: rows q .. q + 3, word 4L + e */
        for (int h = 0; h < 2; ++h) {
            r[q + 2 * h] = _mm512_unpacklo_epi64(t[q + h], t[q + h + 2]);
            r[q + 2 * h + 1] = _mm512_unpackhi_epi64(t[q + h], t[q + h + 2]);
        }
    for (int e = 0; e < 4; ++e) { /* word 4L + e: lane L of r[e], r[4 + e], r[8 + e], r[12 + e] */
        const __m512i s0 = _mm512_shuffle_i32x4(r[e], r[4 + e], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i s1 = _mm512_shuffle_i32x4(r[e], r[4 + e], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i s2 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i s3 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], _MM_SHUFFLE(3, 2, 3, 2));
        out[e] = _mm512_shuffle_i32x4(s0, s2, _MM_SHUFFLE(2, 0, 2, 0));
        out[4 + e] = _mm512_shuffle_i32x4(s0, s2, _MM_SHUFFLE(3, 1, 3, 1));
        out[8 + e] = _mm512_shuffle_i32x4(s1, s3, _MM_SHUFFLE(2, 0, 2, 0));
        out[12 + e] = _mm512_shuffle_i32x4(s1, s3, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* A row-major array of 32-bit words (`words` a row) as vectors out[0 .. words - 1] whose lane i
 * holds rows[i]'s word. */
static void transposed_rows(const uint8_t *const rows[TILE_ROWS], int64_t words, __m512i *out) {
    for (int64_t w = 0; w < words; w += 16) {
        __m512i v[16];
        const int count = words - w < 16 ? (int)(words - w) : 16;
        transposed_words(rows, w, count, v);
        memcpy(out + w, v, sizeof(__m512i) * (size_t)count);
    }
}

/* Weight rows first .. first + valid - 1 as a tile; lanes past `valid` repeat the last row
 * (their sums are computed and never stored). */
static void build_tile(const struct packed_weight *w, int64_t first, int64_t valid, int q8, struct weight_tile *t) {
    const int64_t cols = w->cols, blocks = cols / 32, stride = q8 ? cols : cols / 2, floats = blocks + 8;
    float scale[TILE_ROWS * floats], minimum[TILE_ROWS * floats];
    const uint8_t *codes[TILE_ROWS], *scales[TILE_ROWS], *mins[TILE_ROWS];
    for (int i = 0; i < TILE_ROWS; ++i) {
        const int64_t row = i < valid ? i : valid - 1;
        block_scales(w, first + row, !q8, scale + i * floats, minimum + i * floats);
        codes[i] = (const uint8_t *)w->data + (first + row) * stride;
        scales[i] = (const uint8_t *)(scale + i * floats), mins[i] = (const uint8_t *)(minimum + i * floats);
    }
    transposed_rows(scales, blocks, (__m512i *)t->scale);
    if (!q8) transposed_rows(mins, blocks, (__m512i *)t->minimum);
    /* q8: the codes as stored (4 bytes, 4 elements); q4: a block's 16 bytes hold elements 0-15
     * in their low nibbles and 16-31 in their high ones */
    transposed_rows(codes, stride / 4, q8 ? t->codes : t->codes + cols / 8);
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < blocks; ++b) {
        t->init[b] = _mm512_setzero_si512();
        for (int k = 0; q8 && VNNI512 && k < 8; ++k)
            t->init[b] = _mm512_dpbusd_epi32(t->init[b], _mm512_set1_epi8(1), t->codes[8 * b + k]);
        t->init[b] = _mm512_mullo_epi32(t->init[b], _mm512_set1_epi32(-128));
        for (int k = 0; !q8 && k < 4; ++k) { /* packed word 4b + k, read from the upper half */
            const __m512i packed = t->codes[cols / 8 + 4 * b + k];
            t->codes[8 * b + k] = _mm512_and_si512(packed, low);
            t->codes[8 * b + 4 + k] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        }
    }
}

/* int8 codes to codes + 128 as unsigned bytes, and back: the same flip of the top bit. */
static void flip_sign_bits(int8_t *codes, int64_t count) {
    for (int64_t i = 0; i < count; ++i) ((uint8_t *)codes)[i] ^= 0x80;
}

/* sum += the 4-products of unsigned a and signed b in each lane (no saturation here: q4's codes
 * are <= 15, and q8 takes this path on VNNI hosts only). */
static inline __m512i dot_add512(__m512i sum, __m512i a_unsigned, __m512i b_signed) {
#if VNNI512
    return _mm512_dpbusd_epi32(sum, a_unsigned, b_signed);
#else
    const __m512i pairs = _mm512_maddubs_epi16(a_unsigned, b_signed);
    return _mm512_add_epi32(sum, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}

/* Two tiles against rows m .. m + rows - 1 of x (rows 1-4, a constant once inlined): per block
 * 8 dots per tile and row into integer sums, then the block's scales and (q4) its min term. */
static inline __attribute__((always_inline)) void tile_dots(const struct weight_tile t[2], const int q8,
                                                          const struct int8_rows *x, int64_t m, const int rows,
                                                          __m512 acc[2][4]) {
    const int64_t cols = x->cols, blocks = cols / 32;
    for (int g = 0; g < 2; ++g)
        for (int r = 0; r < rows; ++r) acc[g][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m512i s[2][4];
        for (int g = 0; g < 2; ++g)
            for (int r = 0; r < rows; ++r) s[g][r] = t[g].init[b];
        for (int k = 0; k < 8; ++k) {
            const __m512i w0 = t[0].codes[8 * b + k], w1 = t[1].codes[8 * b + k];
            for (int r = 0; r < rows; ++r) {
                int32_t word;
                memcpy(&word, x->xq + (m + r) * cols + 32 * b + 4 * k, sizeof word);
                const __m512i xb = _mm512_set1_epi32(word);
                s[0][r] = q8 ? dot_add512(s[0][r], xb, w0) : dot_add512(s[0][r], w0, xb);
                s[1][r] = q8 ? dot_add512(s[1][r], xb, w1) : dot_add512(s[1][r], w1, xb);
            }
        }
        for (int r = 0; r < rows; ++r) {
            const __m512 dx = _mm512_set1_ps(x->dx[(m + r) * blocks + b]);
            const __m512 xsum = _mm512_set1_ps(q8 ? 0.0f : x->xsum[(m + r) * blocks + b]);
            for (int g = 0; g < 2; ++g) {
                const __m512 both = _mm512_mul_ps(t[g].scale[b], dx);
                acc[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[g][r]), both, acc[g][r]);
                if (!q8) acc[g][r] = _mm512_fmadd_ps(t[g].minimum[b], xsum, acc[g][r]);
            }
        }
    }
}

/* Weight rows n .. n + 31 (fewer at the end: masked) against every row of x, y [m][n_dim]. */
static void tile_pair_rows(const struct packed_weight *w, int64_t n, struct weight_tile t[2], const struct int8_rows *x,
                           int64_t m_dim, const float *bias, float *y) {
    const int64_t n_dim = w->rows;
    const int q8 = w->kind == WK_Q8;
    __mmask16 keep[2];
    for (int g = 0; g < 2; ++g) {
        const int64_t first = n + g * TILE_ROWS, valid = n_dim - first < TILE_ROWS ? n_dim - first : TILE_ROWS;
        build_tile(w, valid > 0 ? first : n_dim - 1, valid > 0 ? valid : 1, q8, &t[g]);
        keep[g] = valid > 0 ? (__mmask16)((1u << valid) - 1) : 0;
    }
    __m512 acc[2][4];
    for (int64_t m = 0; m < m_dim; m += 4) {
        const int rows = m_dim - m < 4 ? (int)(m_dim - m) : 4;
        switch (rows * 2 + q8) { /* each case its own inlined loop */
        case 8: tile_dots(t, 0, x, m, 4, acc); break;
        case 9: tile_dots(t, 1, x, m, 4, acc); break;
        case 6: tile_dots(t, 0, x, m, 3, acc); break;
        case 7: tile_dots(t, 1, x, m, 3, acc); break;
        case 4: tile_dots(t, 0, x, m, 2, acc); break;
        case 5: tile_dots(t, 1, x, m, 2, acc); break;
        case 2: tile_dots(t, 0, x, m, 1, acc); break;
        default: tile_dots(t, 1, x, m, 1, acc); break;
        }
        for (int g = 0; g < 2; ++g) {
            const int64_t col = n + g * TILE_ROWS;
            const __m512 b = bias ? _mm512_maskz_loadu_ps(keep[g], bias + col) : _mm512_setzero_ps();
            for (int r = 0; r < rows; ++r)
                _mm512_mask_storeu_ps(y + (m + r) * n_dim + col, keep[g], _mm512_add_ps(acc[g][r], b));
        }
    }
}

/* The whole batch: 32 weight rows per work item, each thread's tiles in one buffer of its own
 * (a large layer's would not fit a thread's stack), x in chunks of X_CHUNK rows (a prefill's
 * x would not stay in L2 while every tile reads it). 0 when the buffers cannot be had. */
static int tiled_batch512(const struct packed_weight *w, const struct int8_rows *x, int64_t m_dim, const float *bias,
                          float *y, int num_threads) {
    const int64_t blocks = w->cols / 32, per_tile = w->cols / 4 + 3 * blocks; /* vectors */
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        __m512i *buffer = aligned_alloc(64, sizeof(__m512i) * (size_t)(2 * per_tile));
        struct weight_tile t[2];
        for (int g = 0; buffer && g < 2; ++g) {
            __m512i *v = buffer + g * per_tile;
            t[g] = (struct weight_tile){v, v + w->cols / 4, (__m512 *)(v + w->cols / 4 + blocks),
                                        (__m512 *)(v + w->cols / 4 + 2 * blocks)};
        }
        if (!buffer) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        for (int64_t m = 0; !failed && m < m_dim; m += X_CHUNK) {
            const struct int8_rows part = {x->xq + m * w->cols, x->dx + m * blocks, x->xsum + m * blocks, w->cols};
            const int64_t rows = m_dim - m < X_CHUNK ? m_dim - m : X_CHUNK;
#pragma omp for schedule(static)
            for (int64_t n = 0; n < w->rows; n += 2 * TILE_ROWS)
                tile_pair_rows(w, n, t, &part, rows, bias, y + m * w->rows);
        }
        free(buffer);
    }
    return !failed;
}
#endif
