/* y = x W^T (+ b) with W kept in its stored format (kernels/quant/weight.py): bf16 / f16
 * rows, int8 codes with group scales (on-load int8, GGUF Q8_0), 4-bit codes with group
 * scales and mins (on-load int4, GGUF Q4_0 / Q4_1), GGUF Q4_K and Q6_K super-blocks.
 *
 * Each W row is decoded once into an fp32 row buffer that stays in L1, then gemv.c's dot
 * loops run every row of x against it: memory sees only the stored bytes (0.56 B a weight
 * for 4-bit, against 4 for fp32), which is what a decode step is bound by, and x's rows
 * reuse the decoded row, so k + 1 verification rows cost little more than one. The decoders
 * are plain loops over a row the compiler vectorises for the host (-march=native).
 *
 * packed_dequantize expands a run of rows to fp32 for the many-row GEMM of prefill, which
 * then runs at the BLAS's rate on a cache-sized tile; packed_gather_rows serves embedding
 * lookups from the same storage.
 */
#include <string.h>

#include "cadenza_kernels.h"
#include "gemv.c"

/* fp16 -> fp32 by bits, so loops vectorise (GCC's _Float16 goes through a libgcc call per
 * value on x86 without AVX512-FP16): exponent and mantissa shifted into place and rebased by
 * 2^112, which also handles subnormals; inf and NaN do not occur in weights or scales. */
static inline float fp16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)(h & 0x7fff) << 13;
    float f;
    memcpy(&f, &bits, sizeof f);
    f *= 0x1p112f;
    return (h & 0x8000) ? -f : f;
}

static inline float bf16_to_f32(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 4-bit codes: each 32-element sub-block is 16 bytes, element j low nibble of byte j, j + 16 high. */
static void decode_q4(const struct packed_weight *w, int64_t row, float *out) {
    const int64_t cols = w->cols, groups = cols / w->group;
    const uint8_t *q = (const uint8_t *)w->data + row * (cols / 2);
    const uint16_t *scales = (const uint16_t *)w->scales + row * groups;
    const uint16_t *mins = w->mins ? (const uint16_t *)w->mins + row * groups : 0;
    for (int64_t b = 0; b < cols / 32; ++b) {
        const int64_t g = b * 32 / w->group;
        const float s = fp16_to_f32(scales[g]), m = mins ? fp16_to_f32(mins[g]) : -8.0f * s;
        const uint8_t *qb = q + b * 16;
        float *o = out + b * 32;
        for (int j = 0; j < 16; ++j) {
            o[j] = (float)(qb[j] & 15) * s + m;
            o[j + 16] = (float)(qb[j] >> 4) * s + m;
        }
    }
}

static void decode_q8(const struct packed_weight *w, int64_t row, float *out) {
    const int64_t cols = w->cols, group = w->group;
    const int8_t *q = (const int8_t *)w->data + row * cols;
    const float *scales = (const float *)w->scales + row * (cols / group);
    for (int64_t g = 0; g < cols / group; ++g) {
        const float s = scales[g];
        for (int64_t j = g * group; j < (g + 1) * group; ++j) out[j] = (float)q[j] * s;
    }
}

/* Q4_K super-block (144 bytes, 256 weights): fp16 d and dmin, 12 bytes packing 8 six-bit
 * scales and mins, 128 bytes of codes (per 64 weights: the first 32 in low nibbles, the
 * next 32 in high); w = d * scale * q - dmin * min. */
static void decode_q4_k(const uint8_t *b, float *out) {
    const float d = fp16_to_f32((uint16_t)(b[0] | b[1] << 8)), dmin = fp16_to_f32((uint16_t)(b[2] | b[3] << 8));
    const uint8_t *s = b + 4, *qs = b + 16;
    for (int sub = 0; sub < 8; ++sub) {
        int sc, mn;
        if (sub < 4) {
            sc = s[sub] & 63, mn = s[sub + 4] & 63;
        } else {
            sc = (s[sub + 4] & 15) | ((s[sub - 4] >> 6) << 4);
            mn = (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4);
        }
        const float scale = d * (float)sc, minimum = dmin * (float)mn;
        const uint8_t *q = qs + (sub / 2) * 32;
        const int shift = (sub & 1) * 4;
        for (int j = 0; j < 32; ++j) out[sub * 32 + j] = (float)((q[j] >> shift) & 15) * scale - minimum;
    }
}

/* Q6_K super-block (210 bytes, 256 weights): 128 bytes of low nibbles, 64 of high bit pairs,
 * 16 int8 scales (one per 16 weights), fp16 d; w = d * scale * (q - 32). Weight
 * 128 h + 32 t + e: nibble t / 2 of ql[64 h + 32 (t % 2) + e], bits 2t of qh[32 h + e]. */
static void decode_q6_k(const uint8_t *b, float *out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = fp16_to_f32((uint16_t)(b[208] | b[209] << 8));
    for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 4; ++t) {
            const uint8_t *low = ql + 64 * h + 32 * (t % 2), *high = qh + 32 * h;
            const int base = 128 * h + 32 * t, shift = (t / 2) * 4;
            for (int e = 0; e < 32; ++e) {
                const int q = ((low[e] >> shift) & 15) | (((high[e] >> (2 * t)) & 3) << 4);
                out[base + e] = d * (float)scales[(base + e) / 16] * (float)(q - 32);
            }
        }
}

static void decode_superblocks(const struct packed_weight *w, int64_t row, float *out, int64_t block_bytes,
                               void (*decode)(const uint8_t *, float *)) {
    const int64_t blocks = w->cols / 256;
    const uint8_t *b = (const uint8_t *)w->data + row * blocks * block_bytes;
    for (int64_t i = 0; i < blocks; ++i) decode(b + i * block_bytes, out + i * 256);
}

/* Row `row` of W as fp32 in out [cols]; for f32 the row itself is returned and out unused. */
static const float *decode_row(const struct packed_weight *w, int64_t row, float *out) {
    const int64_t cols = w->cols;
    switch (w->kind) {
    case WK_F32:
        return (const float *)w->data + row * cols;
    case WK_BF16:
        for (int64_t j = 0; j < cols; ++j) out[j] = bf16_to_f32(((const uint16_t *)w->data)[row * cols + j]);
        return out;
    case WK_F16:
        for (int64_t j = 0; j < cols; ++j) out[j] = fp16_to_f32(((const uint16_t *)w->data)[row * cols + j]);
        return out;
    case WK_Q8:
        decode_q8(w, row, out);
        return out;
    case WK_Q4:
        decode_q4(w, row, out);
        return out;
    case WK_Q4_K:
        decode_superblocks(w, row, out, 144, decode_q4_k);
        return out;
    default:
        decode_superblocks(w, row, out, 210, decode_q6_k);
        return out;
    }
}

/* The fused paths of the two common formats (q4: on-load int4, GGUF Q4_0 / Q4_1; q8:
 * on-load int8, GGUF Q8_0) for up to 4 rows of x at once, with AVX2 + FMA: a 32-weight
 * sub-block's codes are widened to floats in registers, dotted with each row's 32 values,
 * and the group's scale applied to that partial sum (q4's min term is min * sum(x) over
 * the group, precomputed per row). The generic vector-extension version of this loop
 * measured slower than decoding the row first; these intrinsics measured ~3x faster. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FUSED_ROWS 8

/* The 32 codes of a q4 sub-block (16 bytes) as four vectors: elements 0-7, 8-15, 16-23, 24-31. */
static inline void q4_codes(const uint8_t *qb, __m256 q[4]) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qb), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

static inline void q8_codes(const int8_t *qb, __m256 q[4]) {
    const __m128i a = _mm_loadu_si128((const __m128i *)qb), b = _mm_loadu_si128((const __m128i *)(qb + 16));
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

static inline float hsum256(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Sums of each row's x over each scale group, for q4's min (or -8) term: xsum [m, groups]. */
static void group_sums(const float *x, int64_t m_dim, int64_t cols, int64_t group, float *xsum) {
    for (int64_t m = 0; m < m_dim; ++m)
        for (int64_t g = 0; g < cols / group; ++g) {
            float s = 0.0f;
            for (int64_t j = g * group; j < (g + 1) * group; ++j) s += x[m * cols + j];
            xsum[m * (cols / group) + g] = s;
        }
}

/* Output row n against `rows` rows of x; always inlined with constant rows and kind, so each
 * (kind, rows) pair compiles to its own loop with its accumulators in registers. The codes
 * are scaled in registers and accumulated in independent chains (4 for one row, 2 per row
 * for more): one chain per row measured latency-bound at ~1.6 weights a cycle. */
static inline __attribute__((always_inline)) void fused_row(const struct packed_weight *w, int64_t n,
                                                            const float *x, const float *xsum, const int rows,
                                                            const int q4, float bias, float *y, int64_t y_stride) {
    const int64_t cols = w->cols, groups = cols / w->group, per_group = w->group / 32;
    const int chains = rows == 1 ? 4 : 2;
    __m256 acc[4][4];
    for (int m = 0; m < rows; ++m)
        for (int c = 0; c < chains; ++c) acc[m][c] = _mm256_setzero_ps();
    float offset[4] = {0};
    const uint16_t *scales16 = (const uint16_t *)w->scales + n * groups;
    const float *scales32 = (const float *)w->scales + n * groups;
    const uint16_t *mins = w->mins ? (const uint16_t *)w->mins + n * groups : 0;
    for (int64_t g = 0; g < groups; ++g) {
        const float s = q4 ? fp16_to_f32(scales16[g]) : scales32[g];
        const __m256 sv = _mm256_set1_ps(s);
        for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
            __m256 q[4];
            if (q4)
                q4_codes((const uint8_t *)w->data + n * (cols / 2) + b * 16, q);
            else
                q8_codes((const int8_t *)w->data + n * cols + b * 32, q);
            for (int i = 0; i < 4; ++i) q[i] = _mm256_mul_ps(q[i], sv);
            for (int m = 0; m < rows; ++m) {
                const float *xb = x + m * cols + b * 32;
                for (int i = 0; i < 4; ++i)
                    acc[m][i % chains] = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(xb + 8 * i), acc[m][i % chains]);
            }
        }
        if (q4) {
            const float mn = mins ? fp16_to_f32(mins[g]) : -8.0f * s;
            for (int m = 0; m < rows; ++m) offset[m] += mn * xsum[m * groups + g];
        }
    }
    for (int m = 0; m < rows; ++m) {
        __m256 total = acc[m][0];
        for (int c = 1; c < chains; ++c) total = _mm256_add_ps(total, acc[m][c]);
        y[m * y_stride] = hsum256(total) + offset[m] + bias;
    }
}

static inline __attribute__((always_inline)) void fused_rows(const struct packed_weight *w, int64_t n,
                                                             const float *x, const float *xsum, int rows,
                                                             const int q4, float bias, float *y, int64_t stride) {
    switch (rows) {
    case 1: fused_row(w, n, x, xsum, 1, q4, bias, y, stride); break;
    case 2: fused_row(w, n, x, xsum, 2, q4, bias, y, stride); break;
    case 3: fused_row(w, n, x, xsum, 3, q4, bias, y, stride); break;
    default: fused_row(w, n, x, xsum, 4, q4, bias, y, stride); break;
    }
}

static void fused_linear(const struct packed_weight *w, const float *x, const float *bias, float *y, int64_t m_dim,
                         int num_threads) {
    const int64_t cols = w->cols, n_dim = w->rows, groups = cols / w->group;
    const int q4 = w->kind == WK_Q4;
    float xsum[m_dim * groups];
    if (q4) group_sums(x, m_dim, cols, w->group, xsum);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < n_dim; ++n) {
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m = 0; m < m_dim; m += 4) {
            const int rows = m_dim - m < 4 ? (int)(m_dim - m) : 4;
            if (q4)
                fused_rows(w, n, x + m * cols, xsum + m * groups, rows, 1, b, y + m * n_dim + n, n_dim);
            else
                fused_rows(w, n, x + m * cols, xsum + m * groups, rows, 0, b, y + m * n_dim + n, n_dim);
        }
    }
}
#else
#define FUSED_ROWS 0 /* no AVX2: every format decodes its rows first */
static void fused_linear(const struct packed_weight *w, const float *x, const float *bias, float *y, int64_t m_dim,
                         int num_threads) {
    (void)w, (void)x, (void)bias, (void)y, (void)m_dim, (void)num_threads;
}
#endif

void packed_linear(const struct packed_weight *w, const float *x, const float *bias, float *y, int64_t m_dim,
                   int num_threads) {
    const int64_t k_dim = w->cols, n_dim = w->rows;
    if ((w->kind == WK_Q4 || w->kind == WK_Q8) && m_dim <= FUSED_ROWS) {
        fused_linear(w, x, bias, y, m_dim, num_threads);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    {
        float buf[k_dim]; /* the decoded row: L1-resident, one per thread */
#pragma omp for schedule(static)
        for (int64_t n = 0; n < n_dim; ++n) {
            const float *row = decode_row(w, n, buf), b = bias ? bias[n] : 0.0f;
            int64_t m = 0;
            for (; m + 4 <= m_dim; m += 4) dot4(row, x + m * k_dim, k_dim, b, y + m * n_dim + n, n_dim);
            for (; m < m_dim; ++m) y[m * n_dim + n] = dot(row, x + m * k_dim, k_dim) + b;
        }
    }
}

void packed_dequantize(const struct packed_weight *w, int64_t start, int64_t end, float *out, int num_threads) {
    const int64_t cols = w->cols;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = start; n < end; ++n) {
        float *o = out + (n - start) * cols;
        const float *row = decode_row(w, n, o);
        if (row != o) memcpy(o, row, sizeof(float) * cols);
    }
}

void packed_gather_rows(const struct packed_weight *w, const int64_t *ids, int64_t n_ids, float *out,
                        int num_threads) {
    const int64_t cols = w->cols;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < n_ids; ++i) {
        float *o = out + i * cols;
        const float *row = decode_row(w, ids[i], o);
        if (row != o) memcpy(o, row, sizeof(float) * cols);
    }
}
