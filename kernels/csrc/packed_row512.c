/* One row of x against a q4 weight on AVX-512: the single-stream decode case of
 * packed_linear.c's two fused paths, included there after their AVX2 helpers.
 *
 * At one row the AVX2 paths spend most of their instructions widening codes 8 at a time
 * (four zero-extends, four conversions, four scalings a block). Here 16 lanes halve that:
 * - exact: a block's 32 codes widen in two 16-lane steps, the block's products sum in one
 *   register and take the block's scale with one FMA (the same fp32 function as the AVX2
 *   path, summed in another order);
 * - integer (int8_activations): two blocks' 64 codes and x's 64 int8 values go into one
 *   VNNI instruction (vpdpbusd; AVX512-BW's two-instruction form without VNNI), and one FMA
 *   scales both blocks by scale_w * scale_x (lanes 0-7 belong to the first block, 8-15 to the
 *   second). Integer sums are exact, so this is the AVX2 path's function too.
 * Built for the host by -march=native; hosts without AVX512-BW take the AVX2 forms.
 * Measured on a 2-core Sapphire Rapids Xeon (SmolLM2 Q4_1, 128 decode steps, three alternated
 * runs against the AVX2 forms): exact decode 1.33x, int8 x 1.12x. q8 stays on the AVX2 forms:
 * its 16-lane rows gained nothing measurable there (on-load int8, and the Q8_0 LM head).
 */
#if defined(__AVX512VNNI__)
#define VNNI512 1 /* q8 batches need it (dot_pair512_q8) */
#else
#define VNNI512 0
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ROW512 1

/* A block's 32 codes as two 16-lane float vectors, in element order (low nibbles hold
 * elements 0-15, high ones 16-31). */
static inline void q4_floats512(const uint8_t *qb, __m512 q[2]) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qb), mask = _mm_set1_epi8(15);
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
}

/* The exact path's row n against one row of x. Two accumulators alternate blocks: one is
 * bound by the FMA's latency. */
static float widened_row512(const struct packed_weight *w, int64_t n, const float *x, const float *xsum) {
    const int64_t cols = w->cols, blocks = cols / 32;
    float scale[blocks + 8], minimum[blocks + 8];
    block_scales(w, n, 1, scale, minimum);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < blocks; ++b) {
        __m512 q[2];
        q4_floats512((const uint8_t *)w->data + n * (cols / 2) + b * 16, q);
        __m512 t = _mm512_mul_ps(q[0], _mm512_loadu_ps(x + b * 32));
        t = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(x + b * 32 + 16), t);
        acc[b & 1] = _mm512_fmadd_ps(t, _mm512_set1_ps(scale[b]), acc[b & 1]);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + dot_floats(minimum, xsum, blocks);
}

/* Two q4 blocks' 64 codes (32 bytes) as 64 unsigned bytes in element order: the 128-bit
 * lanes [low b, low b+1, high b, high b+1] reordered to [low b, high b, low b+1, high b+1]. */
static inline __m512i q4_pair512(const uint8_t *qb) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)qb), mask = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(bytes, mask), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
}

/* 64 codes (0-15) times 64 signed int8 x, summed in 16 lanes of 4 products. */
static inline __m512i dot_pair512(__m512i w_unsigned, __m512i x_signed) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w_unsigned, x_signed);
#else /* pair sums cannot saturate: codes <= 15, |x| <= 127 */
    return _mm512_madd_epi16(_mm512_maddubs_epi16(w_unsigned, x_signed), _mm512_set1_epi16(1));
#endif
}

/* The integer path's row n against one row of x (quantized: codes xq, scales dx, rounded
 * block sums xsum). Blocks go two at a time; an odd last one takes the AVX2 form. */
static float integer_row512(const struct packed_weight *w, int64_t n, const int8_t *xq, const float *dx,
                            const float *xsum) {
    const int64_t cols = w->cols, blocks = cols / 32;
    float scale[blocks + 8], minimum[blocks + 8], both[blocks + 1];
    block_scales(w, n, 1, scale, minimum);
    for (int64_t b = 0; b < blocks; ++b) both[b] = scale[b] * dx[b];
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        const __m512i codes = q4_pair512((const uint8_t *)w->data + n * (cols / 2) + b * 16);
        const __m512i xv = _mm512_loadu_si512((const void *)(xq + b * 32));
        const __m128 pair = _mm_castpd_ps(_mm_load_sd((const double *)(both + b)));
        const __m512 sv = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(pair));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_pair512(codes, xv)), sv, acc);
    }
    float sum = _mm512_reduce_add_ps(acc);
    if (b < blocks) {
        const __m256i codes = q4_block((const uint8_t *)w->data + n * (cols / 2) + b * 16);
        sum += hsum256(dot_block(codes, _mm256_loadu_si256((const __m256i *)(xq + b * 32)))) * both[b];
    }
    return sum + dot_floats(minimum, xsum, blocks);
}
/* Per-block values spread over pairs of blocks, as the pair loops below read them: vector p's
 * lanes 0-7 hold v[2p] * k, lanes 8-15 v[2p + 1] * k (an odd last block pairs with 0). */
static void pair_spread(const float *v, int64_t blocks, float k, __m512 *out) {
    for (int64_t p = 0; p < (blocks + 1) / 2; ++p) {
        const float hi = 2 * p + 1 < blocks ? v[2 * p + 1] * k : 0.0f;
        out[p] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(v[2 * p] * k), _mm512_set1_ps(hi));
    }
}

/* A batch's x for integer_batch512: codes (xq), per row and pair of blocks the spread scales
 * (dxv), and the block sums transposed, [blocks][m_pad] with m_pad a multiple of 16, for the
 * min term (q4's offset times each block's sum of x). */
struct int8_batch {
    const int8_t *xq;
    const __m512 *dxv;
    const float *xsum_t;
    int64_t pairs, m_pad;
};

/* 64 of x (made unsigned: x + 128) times 64 signed q8 codes, summed in 16 lanes of 4 products
 * on top of `init`, which holds -128 times each lane's 4 codes: the exact signed sum in one
 * VNNI instruction (AVX512-BW's two-instruction form would saturate at these magnitudes). */
static inline __m512i dot_pair512_q8(__m512i init, __m512i x_unsigned, __m512i w_signed) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(init, x_unsigned, w_signed);
#else
    (void)x_unsigned, (void)w_signed;
    return init; /* not reached: packed_fused_rows offers q8 batches on VNNI hosts only */
#endif
}

/* Weight rows n .. n + nw - 1 (nw 1-2) against rows m .. m + rows - 1 of the batch (rows 1-4;
 * nw, rows and q8 constants once inlined): per pair of blocks each x vector and its scales are
 * loaded once for both weight rows, and 8 accumulator chains are in flight (one alone is
 * bound by the FMA's latency). codes, init and sv hold each weight row's pairs one after the
 * other; init is read for q8 only. */
static inline __attribute__((always_inline)) void integer_rows_batch512(const __m512i *codes, const __m512i *init,
                                                                      const __m512 *sv, const int nw, const int q8,
                                                                      const struct int8_batch *x, int64_t cols,
                                                                      int64_t m, const int rows, float sums[2][4]) {
    const int64_t pairs = x->pairs;
    __m512 acc[2][4];
    for (int v = 0; v < nw; ++v)
        for (int r = 0; r < rows; ++r) acc[v][r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        for (int r = 0; r < rows; ++r) {
            const __m512i xv = _mm512_loadu_si512((const void *)(x->xq + (m + r) * cols + p * 64));
            const __m512 dxv = x->dxv[(m + r) * pairs + p];
            for (int v = 0; v < nw; ++v) {
                const int64_t i = v * pairs + p;
                const __m512i sum = q8 ? dot_pair512_q8(init[i], xv, codes[i]) : dot_pair512(codes[i], xv);
                acc[v][r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), dxv), sv[i], acc[v][r]);
            }
        }
    }
    for (int v = 0; v < nw; ++v)
        for (int r = 0; r < rows; ++r) sums[v][r] = _mm512_reduce_add_ps(acc[v][r]);
}

/* sum_b minimum[b] * xsum[m][b] for every row m of the batch (out: m_pad values), 16 rows a
 * vector and up to 4 vectors in flight: the min term once per weight row, not per pair. */
static void min_terms(const float *minimum, int64_t blocks, const struct int8_batch *x, float *out) {
    for (int64_t m0 = 0; m0 < x->m_pad; m0 += 64) {
        const int64_t chunks = (x->m_pad - m0) / 16 < 4 ? (x->m_pad - m0) / 16 : 4;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t b = 0; b < blocks; ++b) {
            const __m512 mb = _mm512_set1_ps(minimum[b]);
            for (int64_t c = 0; c < chunks; ++c)
                acc[c] = _mm512_fmadd_ps(mb, _mm512_load_ps(x->xsum_t + b * x->m_pad + m0 + 16 * c), acc[c]);
        }
        for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + m0 + 16 * c, acc[c]);
    }
}

/* The batch's rows in groups of 4 against weight rows n .. n + nw - 1 (nw 1-2), whose codes,
 * spread scales and min terms (zero for q8) are ready; bias starts at row n, or is NULL. */
static inline __attribute__((always_inline)) void integer_rows_all512(const __m512i *codes, const __m512i *init,
                                                                    const __m512 *sv, const float *mins,
                                                                    const int nw, const int q8,
                                                                    const struct int8_batch *x, int64_t cols,
                                                                    int64_t m_dim, const float *bias, float *y,
                                                                    int64_t y_stride) {
    float sums[2][4];
    for (int64_t m = 0; m < m_dim; m += 4) {
        const int64_t rows = m_dim - m < 4 ? m_dim - m : 4;
        switch (rows) {
        case 4: integer_rows_batch512(codes, init, sv, nw, q8, x, cols, m, 4, sums); break;
        case 3: integer_rows_batch512(codes, init, sv, nw, q8, x, cols, m, 3, sums); break;
        case 2: integer_rows_batch512(codes, init, sv, nw, q8, x, cols, m, 2, sums); break;
        default: integer_rows_batch512(codes, init, sv, nw, q8, x, cols, m, 1, sums); break;
        }
        for (int v = 0; v < nw; ++v)
            for (int64_t r = 0; r < rows; ++r)
                y[(m + r) * y_stride + v] = sums[v][r] + mins[v * x->m_pad + m + r] + (bias ? bias[v] : 0.0f);
    }
}

/* A q8 row's pair of blocks p: its 64 signed codes, and -128 times each lane's 4 of them
 * (what x's +128 adds to the unsigned-by-signed dot). */
static inline __m512i q8_pair512(const struct packed_weight *w, int64_t n, int64_t p, __m512i *init) {
    const __m512i codes = _mm512_loadu_si512((const void *)((const int8_t *)w->data + n * w->cols + p * 64));
#if defined(__AVX512VNNI__)
    const __m512i lane_sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), codes);
    *init = _mm512_mullo_epi32(lane_sums, _mm512_set1_epi32(-128));
#else
    *init = _mm512_setzero_si512();
#endif
    return codes;
}

/* The integer path's weight rows n .. n + nw - 1 (nw 1-2) against every row of a batch (q4 or
 * q8, blocks in pairs: cols % 64 == 0; q8's x made unsigned). Per weight row the codes are
 * read, the scales spread and q4's min terms summed once; then per row of x and pair of
 * blocks one VNNI dot, a conversion, a multiply by x's scales and an FMA with the weight's,
 * each x vector serving both weight rows. */
static void integer_batch512(const struct packed_weight *w, int64_t n, const int nw, const struct int8_batch *x,
                             int64_t m_dim, const float *bias, float *y, int64_t y_stride) {
    const int64_t cols = w->cols, blocks = cols / 32, pairs = x->pairs;
    const int q8 = w->kind == WK_Q8;
    float scale[blocks + 8], minimum[blocks + 8];
    float mins[2 * x->m_pad];
    __m512i codes[2 * pairs], init[2 * pairs];
    __m512 sv[2 * pairs];
    for (int v = 0; v < nw; ++v) {
        block_scales(w, n + v, !q8, scale, minimum);
        pair_spread(scale, blocks, 1.0f, sv + v * pairs);
        if (q8)
            memset(mins + v * x->m_pad, 0, sizeof(float) * (size_t)x->m_pad);
        else
            min_terms(minimum, blocks, x, mins + v * x->m_pad);
        for (int64_t p = 0; p < pairs; ++p)
            codes[v * pairs + p] = q8 ? q8_pair512(w, n + v, p, init + v * pairs + p)
                                      : q4_pair512((const uint8_t *)w->data + (n + v) * (cols / 2) + p * 32);
    }
    if (q8 && nw == 2) integer_rows_all512(codes, init, sv, mins, 2, 1, x, cols, m_dim, bias, y + n, y_stride);
    else if (q8) integer_rows_all512(codes, init, sv, mins, 1, 1, x, cols, m_dim, bias, y + n, y_stride);
    else if (nw == 2) integer_rows_all512(codes, init, sv, mins, 2, 0, x, cols, m_dim, bias, y + n, y_stride);
    else integer_rows_all512(codes, init, sv, mins, 1, 0, x, cols, m_dim, bias, y + n, y_stride);
}

/* integer_batch512's x: the spread vectors of quantize_rows' scales ([m_dim][pairs]), then the
 * block sums transposed ([blocks][m_pad], zero past m_dim), in one 64-byte-aligned buffer. */
static __m512 *spread_batch(const float *dx, const float *xsum, int64_t m_dim, int64_t blocks, int64_t pairs,
                            int64_t m_pad) {
    const size_t spread = sizeof(__m512) * (size_t)(m_dim * pairs), sums = sizeof(float) * (size_t)(blocks * m_pad);
    __m512 *v = aligned_alloc(64, spread + (sums + 63) / 64 * 64);
    if (!v) return 0;
    for (int64_t m = 0; m < m_dim; ++m) pair_spread(dx + m * blocks, blocks, 1.0f, v + m * pairs);
    float *t = (float *)(v + m_dim * pairs);
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t m = 0; m < m_pad; ++m) t[b * m_pad + m] = m < m_dim ? xsum[m * blocks + b] : 0.0f;
    return v;
}
#else
#define ROW512 0
static float widened_row512(const struct packed_weight *w, int64_t n, const float *x, const float *xsum) {
    (void)w, (void)n, (void)x, (void)xsum;
    return 0.0f;
}
static float integer_row512(const struct packed_weight *w, int64_t n, const int8_t *xq, const float *dx,
                            const float *xsum) {
    (void)w, (void)n, (void)xq, (void)dx, (void)xsum;
    return 0.0f;
}
#endif
