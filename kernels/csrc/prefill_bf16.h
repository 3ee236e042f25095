/* prefill_attention.c's two products with bf16 inputs and fp32 sums, where the CPU has
 * AVX512-BF16: vdpbf16ps adds two bf16 products into each of 16 fp32 lanes, 64 FLOPs an
 * instruction against an fp32 FMA's 16 (ymm) or 32 (zmm). Included by prefill_attention.c
 * (after its tile structures), used when the caller asks for bf16 products (the engine's
 * cpu_gemm_dtype: the products round as the GEMMs around them do) and D % 16 == 0.
 *
 * Same lanes as the fp32 path (lane = query token x head), but every operand is a pair along
 * the product's reduction dimension, packed in 32 bits (low half the even index):
 *   S^T [key][lane] = sum over d pairs   Kp[key][d/2]  x  Qp[d/2][lane]
 *   O^T [d][lane]  += sum over key pairs Vp[j/2][d]    x  Pp[j/2][lane]
 * Kp is just K's row rounded to bf16 (its pairs are adjacent); Vp interleaves two V rows; Qp
 * and Pp two rows of Q^T and P^T. The broadcast operand (Kp, Vp) is one 32-bit pair, so a
 * 12 keys x 16 lanes (16 dims x 16 lanes) register block is 12 (16) accumulators of 32 zmm.
 * The softmax stays fp32 on S^T; P is rounded only as PV's input (its sum l is of fp32 P).
 */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PREFILL_BF16 1

enum { BF_LANES = 16, BF_KEYS = 12, BF_DIMS = 16 };

/* 16 pairs (lo[i], hi[i]) of fp32 rounded to nearest-even bf16, lo in the low half. */
static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
    const __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
    const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
    return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

/* row [n] rounded to bf16 in order (n % 16 == 0): as 32-bit words, the pairs (row[2p], row[2p + 1]). */
static void round_row_bf16(const float *row, int n, uint32_t *dst) {
    for (int i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + i)));
}

/* dst[i] = pair(lo[i], hi[i]) for i < n (n % 16 == 0); hi NULL: zeros. */
static void pair_rows(const float *lo, const float *hi, int n, uint32_t *dst) {
    for (int i = 0; i < n; i += 16) {
        const __m512 h = hi ? _mm512_loadu_ps(hi + i) : _mm512_setzero_ps();
        _mm512_storeu_si512(dst + i, bf16_pairs(_mm512_loadu_ps(lo + i), h));
    }
}

/* The bf16 buffers of one thread: Qp [D/2][lanes], Kp [key tile][D/2], Vp [key tile/2][D],
 * Pp [key tile/2][lanes], 32-bit pairs each. */
struct bf16_scratch {
    uint32_t *qp, *kp, *vp, *pp;
};

static int bf16_scratch_new(struct bf16_scratch *b, int head_dim, int lanes) {
    const size_t words = (size_t)head_dim / 2 * lanes + (size_t)PF_KEY_TILE * head_dim / 2 +
                         (size_t)PF_KEY_TILE / 2 * head_dim + (size_t)PF_KEY_TILE / 2 * lanes;
    b->qp = aligned_alloc(64, (words * sizeof(uint32_t) + 63) / 64 * 64);
    if (!b->qp) return -1;
    b->kp = b->qp + (size_t)head_dim / 2 * lanes;
    b->vp = b->kp + (size_t)PF_KEY_TILE * head_dim / 2;
    b->pp = b->vp + (size_t)PF_KEY_TILE / 2 * head_dim;
    return 0;
}

/* Qp from the packed, pre-scaled Q^T (rows 2p and 2p + 1 make pair row p). */
static void pair_queries(const struct prefill_shape *s, const float *qt, struct bf16_scratch *b) {
    for (int p = 0; p < s->head_dim / 2; ++p)
        pair_rows(qt + (size_t)2 * p * s->lanes, qt + (size_t)(2 * p + 1) * s->lanes, s->lanes, b->qp + (size_t)p * s->lanes);
}

/* st[r][0..16) = sum over pairs p of kp[r][p] . qp[p][0..16), r < BF_KEYS. */
static inline void qk_block_bf16(const uint32_t *const *k, const uint32_t *qp, int lanes, int pairs, float *st) {
    __m512 acc[BF_KEYS];
    for (int r = 0; r < BF_KEYS; ++r) acc[r] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; ++p) {
        const __m512bh q = (__m512bh)_mm512_loadu_si512(qp + (size_t)p * lanes);
        for (int r = 0; r < BF_KEYS; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)k[r][p]), q);
    }
    for (int r = 0; r < BF_KEYS; ++r) _mm512_storeu_ps(st + (size_t)r * lanes, acc[r]);
}

/* S^T for keys [0, padded) of the tile (padded % BF_KEYS == 0; keys past n repeat key n - 1). */
static void tile_scores_bf16(const struct prefill_shape *s, const struct prefill_scratch *w, struct bf16_scratch *b,
                             int n, int padded) {
    const int half = s->head_dim / 2;
    const uint32_t *k[PF_KEY_TILE];
    for (int j = 0; j < n; ++j) round_row_bf16(w->k + w->rows[j], s->head_dim, b->kp + (size_t)j * half);
    for (int j = 0; j < padded; ++j) k[j] = b->kp + (size_t)(j < n ? j : n - 1) * half;
    for (int j0 = 0; j0 < padded; j0 += BF_KEYS)
        for (int i0 = 0; i0 < s->lanes; i0 += BF_LANES)
            qk_block_bf16(k + j0, b->qp + i0, s->lanes, half, w->st + (size_t)j0 * s->lanes + i0);
}

/* ot[d0 + r][0..16) = alpha * ot[..] + sum over pairs p of vp[p][d0 + r] . pp[p][0..16), r < BF_DIMS. */
static inline void pv_block_bf16(const uint32_t *vp, int d0, const uint32_t *pp, int pairs, int lanes, int head_dim,
                                 __m512 alpha, float *ot) {
    __m512 acc[BF_DIMS];
    for (int r = 0; r < BF_DIMS; ++r) acc[r] = _mm512_mul_ps(_mm512_loadu_ps(ot + (size_t)(d0 + r) * lanes), alpha);
    for (int p = 0; p < pairs; ++p) {
        const __m512bh pv = (__m512bh)_mm512_loadu_si512(pp + (size_t)p * lanes);
        const uint32_t *v = vp + (size_t)p * head_dim + d0;
        for (int r = 0; r < BF_DIMS; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)v[r]), pv);
    }
    for (int r = 0; r < BF_DIMS; ++r) _mm512_storeu_ps(ot + (size_t)(d0 + r) * lanes, acc[r]);
}

/* O^T = alpha * O^T + V^T P^T over the tile's n keys (an odd last key pairs with zeros). */
static void tile_values_bf16(const struct prefill_shape *s, struct prefill_scratch *w, struct bf16_scratch *b, int n) {
    const int lanes = s->lanes, head_dim = s->head_dim, pairs = (n + 1) / 2;
    for (int p = 0; p < pairs; ++p) {
        const int j = 2 * p, odd = j + 1 < n;
        pair_rows(w->v + w->rows[j], odd ? w->v + w->rows[j + 1] : 0, head_dim, b->vp + (size_t)p * head_dim);
        pair_rows(w->st + (size_t)j * lanes, odd ? w->st + (size_t)(j + 1) * lanes : 0, lanes, b->pp + (size_t)p * lanes);
    }
    for (int i0 = 0; i0 < lanes; i0 += BF_LANES) {
        const __m512 alpha = _mm512_loadu_ps(w->alpha + i0);
        for (int d0 = 0; d0 < head_dim; d0 += BF_DIMS)
            pv_block_bf16(b->vp, d0, b->pp + i0, pairs, lanes, head_dim, alpha, w->ot + i0);
    }
}
#else
#define PREFILL_BF16 0
#endif
