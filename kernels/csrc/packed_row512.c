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
#define VNNI512 1 /* q8 batches need it (tiled_batch512.c) */
#else
#define VNNI512 0
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ROW512 1
#define ROW_PREFETCH 8 /* rows */

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
    /* rows ahead (a prefetch never faults past the end): each matrix of a decode step is a
     * short stream, which the hardware prefetchers pick up late */
    for (int64_t line = 0; line < cols / 2; line += 64)
        _mm_prefetch((const char *)w->data + (n + ROW_PREFETCH) * (cols / 2) + line, _MM_HINT_T0);
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
