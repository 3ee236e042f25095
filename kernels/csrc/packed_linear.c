/* y = x W^T (+ b) with W kept in its stored format (kernels/quant/weight.py): bf16 / f16
 * rows, int8 codes with group scales (on-load int8, GGUF Q8_0), 4-bit codes with group
 * scales and mins (on-load int4, GGUF Q4_0 / Q4_1), GGUF Q4_K and Q6_K super-blocks.
 *
 * Each W row is decoded once into an fp32 row buffer that stays in L1, then gemv.c's dot
 * loops run every row of x against it: memory sees only the stored bytes (0.56 B a weight
 * for 4-bit, against 4 for fp32), which is what a decode step is bound by, and x's rows
 * reuse the decoded row, so k + 1 verification rows cost little more than one. The decoders
 * are loops over a row the compiler vectorises for the host (-march=native), q4 and q8 with
 * AVX2 intrinsics where it has them (GCC left their plain loops scalar).
 *
 * packed_dequantize expands a run of rows to fp32 (packed_dequantize_bf16: to bf16, decoded
 * a row at a time in L1, so the tile is written once, at half the bytes) for the many-row
 * GEMM of prefill, which then runs at the BLAS's rate on a cache-sized tile;
 * packed_gather_rows serves embedding lookups from the same storage.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cadenza_kernels.h"
#include "gemv.c"

/* fp16 -> fp32 by bits, so loops vectorise (GCC's _Float16 goes through a libgcc call per
 * value on x86 without AVX512-FP16): exponent and mantissa shifted into place and rebased by
 * 2^112, which also handles subnormals; inf and NaN do not occur in weights or scales. */
static inline float fp16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h); /* one instruction where the CPU has it (every AVX2 one does) */
#endif
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

#if defined(__AVX2__) && defined(__FMA__)
#define VECTOR_DECODE 1
/* A block's 32 codes widened to fp32 in 4 registers of 8, in element order. */
static inline void q4_floats(const uint8_t *qb, __m256 q[4]) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qb), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

static inline void q8_floats(const int8_t *qb, __m256 q[4]) {
    const __m128i a = _mm_loadu_si128((const __m128i *)qb), b = _mm_loadu_si128((const __m128i *)(qb + 16));
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

#else
#define VECTOR_DECODE 0
#endif

/* 4-bit codes: each 32-element sub-block is 16 bytes, element j low nibble of byte j, j + 16 high.
 * The AVX2 form decoded 5x faster than the plain loop, which GCC does not vectorise. */
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
#if VECTOR_DECODE
        __m256 v[4];
        q4_floats(qb, v);
        for (int i = 0; i < 4; ++i)
            _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(v[i], _mm256_set1_ps(s), _mm256_set1_ps(m)));
#else
        for (int j = 0; j < 16; ++j) {
            o[j] = (float)(qb[j] & 15) * s + m;
            o[j + 16] = (float)(qb[j] >> 4) * s + m;
        }
#endif
    }
}

static void decode_q8(const struct packed_weight *w, int64_t row, float *out) {
    const int64_t cols = w->cols, group = w->group;
    const int8_t *q = (const int8_t *)w->data + row * cols;
    const float *scales = (const float *)w->scales + row * (cols / group);
    for (int64_t g = 0; g < cols / group; ++g) {
        const float s = scales[g];
        int64_t j = g * group;
#if VECTOR_DECODE
        for (; j + 32 <= (g + 1) * group; j += 32) {
            __m256 v[4];
            q8_floats(q + j, v);
            for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + j + 8 * i, _mm256_mul_ps(v[i], _mm256_set1_ps(s)));
        }
#endif
        for (; j < (g + 1) * group; ++j) out[j] = (float)q[j] * s;
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

/* With round_x set (the int8_activations setting) the q4 / q8 formats read x rounded to int8
 * per block of 32 (scale = the block's max / 127), as llama.cpp's CPU path does: the fused
 * AVX2 path then multiplies integers, and every other path (more rows, tiles for the BLAS,
 * hosts without AVX2, the torch reference) multiplies the same rounded values. Without it
 * (the default) every path computes x W^T exactly in fp32: weight-only quantization. */
static inline int rounds_activations(const struct packed_weight *w) {
    return w->round_x && (w->kind == WK_Q4 || w->kind == WK_Q8) && w->cols % 32 == 0;
}

static inline int fuses(const struct packed_weight *w) {
    return (w->kind == WK_Q4 || w->kind == WK_Q8) && w->cols % 32 == 0;
}

static inline float block_scale(const float *v) {
    float amax = 0.0f;
    /* a compare, not fmaxf: the same result (a NaN is skipped either way), but it vectorises,
     * where fmaxf stayed a libm call per element (1.6% of a batch step under perf) */
    for (int j = 0; j < 32; ++j) {
        const float a = fabsf(v[j]);
        amax = a > amax ? a : amax;
    }
    return amax / 127.0f;
}

/* Blocks of x rounded per thread (OpenMP's team, as torch sets it) once there are enough: a
 * serial pass left the other core spinning in the runtime (a prefill's x, a batch's). */
#define PARALLEL_ROUNDING 8192

void round_activations(const float *x, int64_t rows, int64_t cols, float *out) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_ROUNDING)
    for (int64_t i = 0; i < rows * cols / 32; ++i) {
        const float *v = x + i * 32;
        const float d = block_scale(v), inv = d > 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < 32; ++j) out[i * 32 + j] = (float)lrintf(v[j] * inv) * d;
    }
}

/* Any format, any rows: each row of W decoded to fp32 once (L1-resident), then dotted with every
 * row of x (with int8_activations, x rounded first, as the fused paths read it). */
static void decoded_rows_linear(const struct packed_weight *w, const float *x, const float *bias, float *y,
                                int64_t m_dim, int num_threads) {
    const int64_t k_dim = w->cols, n_dim = w->rows;
    float *rounded = 0;
    if (rounds_activations(w)) { /* as the fused path reads x (see rounds_activations) */
        rounded = malloc(sizeof(float) * m_dim * k_dim);
        if (rounded) { /* out of memory: x unrounded, a rounding's difference from the rest */
            round_activations(x, m_dim, k_dim, rounded);
            x = rounded;
        }
    }
#pragma omp parallel num_threads(num_threads)
    {
        float buf[k_dim]; /* the decoded row: L1-resident, one per thread */
#pragma omp for schedule(static)
        for (int64_t n = 0; n < n_dim; ++n) {
            row_against_rows(decode_row(w, n, buf), x, m_dim, k_dim, bias ? bias[n] : 0.0f, y + n, n_dim);
        }
    }
    free(rounded);
}

/* The fused paths of the two common formats (q4: on-load int4, GGUF Q4_0 / Q4_1; q8:
 * on-load int8, GGUF Q8_0) for up to FUSED_ROWS rows of x, with AVX2. The exact one is
 * widened_linear below. The integer one (int8_activations): as llama.cpp does,
 * each row of x is first quantized to int8 in blocks of 32 (scale = the block's max / 127),
 * so a 32-weight block is one integer
 * multiply-add (vpmaddubsw + vpmaddwd) and one fp32 FMA by scale_w * scale_x, about a third
 * of the instructions of widening the codes to floats (measured ~4.5 against ~12 G weights a
 * second on one core). The cost is x's rounding: ~0.2% of a block's largest value, which
 * moved SmolLM2's perplexity by under 0.1% (README "Formats"). */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FUSED_ROWS 8
/* With int8_activations, q4 on AVX-512 (VNNI or BW; q8 on VNNI) takes every batch in its
 * integer path, prefill included: tiled_batch512.c, 16 weight rows to a register. Measured on
 * a 2-core Ice Lake Xeon (AVX-512 VNNI, no bf16), best of 7 x 50 calls, 2 threads: a 1536 x 576
 * q4 projection at 32 rows 0.15-0.29 ms against 0.52 with one weight row's blocks along a
 * register (the kernel before it), 576 x 1536 0.19-0.28 against 0.43; at 128 and 512 rows
 * 1.5-2.2x faster than decoding fp32 tiles for the BLAS (whose x is rounded the same way).
 * packed_fused_rows tells kernels/linear/packed.py. */
#define INTEGER_ROWS ((int64_t)1 << 40) /* any batch, prefill included */
/* From 3 rows the tiles win over the row-by-row form (their transposition is per call): at 4
 * rows of a 1536 x 576 q4 projection 98 against 146-155 us, at 8 122 against 294-327; at 2
 * they tie (same host and measure). */
#define TILED_FROM_ROWS 3

/* x [m, cols] -> int8 codes, a scale and the rounded values' sum per block of 32 (q4's min
 * term: the sum of what the other paths multiply). */
static void quantize_rows(const float *x, int64_t m_dim, int64_t cols, int8_t *xq, float *dx, float *xsum,
                          int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m_dim * cols >= PARALLEL_ROUNDING)
    for (int64_t i = 0; i < m_dim * cols / 32; ++i) {
        const float *v = x + i * 32;
        const float d = block_scale(v), inv = d > 0.0f ? 1.0f / d : 0.0f;
        int total = 0;
        for (int j = 0; j < 32; ++j) total += xq[i * 32 + j] = (int8_t)lrintf(v[j] * inv);
        dx[i] = d;
        xsum[i] = (float)total * d;
    }
}

static inline float hsum256(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 32 unsigned codes times 32 signed int8 x, summed in 8 lanes. VNNI (AVX512-VNNI with VL, or
 * AVX-VNNI) does it in one instruction; AVX2 in two, whose 16-bit pair sums cannot saturate
 * here (|codes| <= 128, |x| <= 127). Built for the CPU at hand by -march=native. */
static inline __m256 dot_block(__m256i w_unsigned, __m256i x_signed) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w_unsigned, x_signed));
#elif defined(__AVXVNNI__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w_unsigned, x_signed));
#else
    const __m256i pairs = _mm256_maddubs_epi16(w_unsigned, x_signed);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* A q4 block's 32 codes (16 bytes) as 32 unsigned bytes in element order. */
static inline __m256i q4_block(const uint8_t *qb) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qb), mask = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
}

/* 8 fp16 values from p as fp32; past `count` (< 8 at a row's end) zeros, never read. The
 * short tail is a masked load where AVX512-BW/VL has one: a copy through the stack stalls the
 * vector load behind narrower stores (block_scales was 14% of a decode step that way). */
static inline __m256 fp16x8(const uint16_t *p, int64_t count) {
    if (count >= 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_cvtph_ps(_mm_maskz_loadu_epi16((__mmask8)((1u << count) - 1), p));
#else
    uint16_t v[8] = {0};
    for (int64_t i = 0; i < count; ++i) v[i] = p[i];
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)v));
#endif
}

/* Row n's scale (and, for q4, min) per block of 32, as fp32 (scale and minimum hold blocks + 8
 * floats): per-block scalar work (fp16 conversions, group lookups) out of the block loops,
 * and no division where a group is one block (every row of a head pays it otherwise). */
static inline __attribute__((always_inline)) void block_scales(const struct packed_weight *w, int64_t n, int q4,
                                                             float *scale, float *minimum) {
    const int64_t cols = w->cols, blocks = cols / 32, groups = cols / w->group, per_group = w->group / 32;
    const uint16_t *s16 = (const uint16_t *)w->scales + n * groups;
    const float *s32 = (const float *)w->scales + n * groups;
    const uint16_t *m16 = w->mins ? (const uint16_t *)w->mins + n * groups : 0;
    if (per_group == 1 && !q4) {
        memcpy(scale, s32, sizeof(float) * (size_t)blocks);
        return;
    }
    if (per_group == 1) {
        for (int64_t b = 0; b < blocks; b += 8) {
            const __m256 sv = fp16x8(s16 + b, blocks - b);
            _mm256_storeu_ps(scale + b, sv);
            _mm256_storeu_ps(minimum + b, m16 ? fp16x8(m16 + b, blocks - b) : _mm256_mul_ps(sv, _mm256_set1_ps(-8.0f)));
        }
        return;
    }
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t g = b / per_group;
        scale[b] = q4 ? fp16_to_f32(s16[g]) : s32[g];
        if (q4) minimum[b] = m16 ? fp16_to_f32(m16[g]) : -8.0f * scale[b];
    }
}

static inline float dot_floats(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float sum = hsum256(acc);
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

/* Output row n against `rows` rows of x; always inlined with constant rows and kind, so each
 * pair compiles to its own loop with its accumulators in registers. Per block: the codes
 * once, then per row one integer dot and one FMA by scale_w * scale_x (formed 8 blocks at a
 * time); q4's min term is min . (x's block sums), one dot a row. */
static inline __attribute__((always_inline)) void integer_row(const struct packed_weight *w, int64_t n,
                                                            const int8_t *xq, const float *dx, const float *xsum,
                                                            const int rows, const int q4, float bias, float *y,
                                                            int64_t y_stride) {
    const int64_t cols = w->cols, blocks = cols / 32;
    float scale[blocks + 8], minimum[blocks + 8], both[4][8];
    block_scales(w, n, q4, scale, minimum);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
        const int chunk = blocks - b0 < 8 ? (int)(blocks - b0) : 8;
        for (int m = 0; m < rows; ++m)
            for (int j = 0; j < chunk; ++j) both[m][j] = scale[b0 + j] * dx[m * blocks + b0 + j];
        for (int j = 0; j < chunk; ++j) {
            const int64_t b = b0 + j;
            __m256i codes, sign = _mm256_setzero_si256();
            if (q4) {
                codes = q4_block((const uint8_t *)w->data + n * (cols / 2) + b * 16);
            } else { /* signed codes: |w| times x with w's sign (vpmaddubsw wants one side unsigned) */
                sign = _mm256_loadu_si256((const __m256i *)((const int8_t *)w->data + n * cols + b * 32));
                codes = _mm256_sign_epi8(sign, sign);
            }
            for (int m = 0; m < rows; ++m) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (m * blocks + b) * 32));
                if (!q4) xv = _mm256_sign_epi8(xv, sign);
                acc[m] = _mm256_fmadd_ps(dot_block(codes, xv), _mm256_set1_ps(both[m][j]), acc[m]);
            }
        }
    }
    for (int m = 0; m < rows; ++m) {
        const float offset = q4 ? dot_floats(minimum, xsum + m * blocks, blocks) : 0.0f;
        y[m * y_stride] = hsum256(acc[m]) + offset + bias;
    }
}

static inline __attribute__((always_inline)) void integer_rows(const struct packed_weight *w, int64_t n,
                                                             const int8_t *xq, const float *dx, const float *xsum,
                                                             int rows, const int q4, float bias, float *y,
                                                             int64_t stride) {
    switch (rows) {
    case 1: integer_row(w, n, xq, dx, xsum, 1, q4, bias, y, stride); break;
    case 2: integer_row(w, n, xq, dx, xsum, 2, q4, bias, y, stride); break;
    case 3: integer_row(w, n, xq, dx, xsum, 3, q4, bias, y, stride); break;
    default: integer_row(w, n, xq, dx, xsum, 4, q4, bias, y, stride); break;
    }
}

#include "packed_row512.c"

#include "tiled_batch512.c"

/* A q4 (or, on VNNI hosts, q8) batch through tiled_batch512; 0 (nothing done) when its
 * buffers cannot be had or the host cannot take the kind. */
static int integer_batch(const struct packed_weight *w, int8_t *xq, const float *dx, const float *xsum,
                         const float *bias, float *y, int64_t m_dim, int num_threads) {
#if ROW512
    const int q8 = w->kind == WK_Q8;
    if (q8 && !VNNI512) return 0;
    if (q8) flip_sign_bits(xq, m_dim * w->cols); /* x + 128, VNNI's unsigned operand (tile_dots) */
    const struct int8_rows x = {xq, dx, xsum, w->cols};
    const int done = tiled_batch512(w, &x, m_dim, bias, y, num_threads);
    if (q8 && !done) flip_sign_bits(xq, m_dim * w->cols); /* x again, for the fallback */
    return done;
#else
    (void)w, (void)xq, (void)dx, (void)xsum, (void)bias, (void)y, (void)m_dim, (void)num_threads;
    return 0;
#endif
}

static void integer_linear(const struct packed_weight *w, const float *x, const float *bias, float *y, int64_t m_dim,
                           int num_threads) {
    const int64_t cols = w->cols, n_dim = w->rows, blocks = cols / 32;
    const int q4 = w->kind == WK_Q4;
    /* x's codes, scales and block sums: on the heap, as a batch's can outgrow a thread's stack */
    int8_t *xq = malloc((size_t)(m_dim * cols));
    float *dx = malloc(sizeof(float) * (size_t)(m_dim * blocks)), *xsum = malloc(sizeof(float) * (size_t)(m_dim * blocks));
    if (!xq || !dx || !xsum) { /* out of memory: the decode-row path reads the same rounded x */
        free(xq), free(dx), free(xsum);
        decoded_rows_linear(w, x, bias, y, m_dim, num_threads);
        return;
    }
    quantize_rows(x, m_dim, cols, xq, dx, xsum, num_threads);
    if (ROW512 && q4 && m_dim == 1) { /* single-stream q4 decode: the AVX-512 form */
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t n = 0; n < n_dim; ++n) y[n] = integer_row512(w, n, xq, dx, xsum) + (bias ? bias[n] : 0.0f);
    } else if (m_dim >= TILED_FROM_ROWS && integer_batch(w, xq, dx, xsum, bias, y, m_dim, num_threads)) {
        /* a q4 or q8 batch on AVX-512 (packed_fused_rows): done */
    } else {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t n = 0; n < n_dim; ++n) {
            const float b = bias ? bias[n] : 0.0f;
            for (int64_t m = 0; m < m_dim; m += 4) {
                const int rows = m_dim - m < 4 ? (int)(m_dim - m) : 4;
                const int8_t *xm = xq + m * cols;
                const float *dm = dx + m * blocks, *sm = xsum + m * blocks;
                if (q4)
                    integer_rows(w, n, xm, dm, sm, rows, 1, b, y + m * n_dim + n, n_dim);
                else
                    integer_rows(w, n, xm, dm, sm, rows, 0, b, y + m * n_dim + n, n_dim);
            }
        }
    }
    free(xq), free(dx), free(xsum);
}

/* The exact fused path (the default): a block's 32 codes widened to floats in registers and
 * scaled, then one FMA per 8 weights and row into independent chains (4 for one row, 2 per
 * row for more; one chain measured latency-bound), q4's min term as min . (x's block sums).
 * Measured ~2x decoding the row first, and ~0.45x the integer path's rate. */
/* x's sum over each block of 32, per row, for q4's min term: xsum [m, blocks]. */
static void block_sums(const float *x, int64_t m_dim, int64_t cols, float *xsum) {
    for (int64_t i = 0; i < m_dim * cols / 32; ++i) {
        float total = 0.0f;
        for (int j = 0; j < 32; ++j) total += x[i * 32 + j];
        xsum[i] = total;
    }
}

static inline __attribute__((always_inline)) void widened_row(const struct packed_weight *w, int64_t n,
                                                              const float *x, const float *xsum, const int rows,
                                                              const int q4, float bias, float *y, int64_t y_stride) {
    const int64_t cols = w->cols, blocks = cols / 32;
    const int chains = rows == 1 ? 4 : 2;
    float scale[blocks + 8], minimum[blocks + 8];
    block_scales(w, n, q4, scale, minimum);
    __m256 acc[4][4];
    for (int m = 0; m < rows; ++m)
        for (int c = 0; c < chains; ++c) acc[m][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m256 q[4];
        if (q4)
            q4_floats((const uint8_t *)w->data + n * (cols / 2) + b * 16, q);
        else
            q8_floats((const int8_t *)w->data + n * cols + b * 32, q);
        const __m256 sv = _mm256_set1_ps(scale[b]);
        for (int i = 0; i < 4; ++i) q[i] = _mm256_mul_ps(q[i], sv);
        for (int m = 0; m < rows; ++m) {
            const float *xb = x + m * cols + b * 32;
            for (int i = 0; i < 4; ++i)
                acc[m][i % chains] = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(xb + 8 * i), acc[m][i % chains]);
        }
    }
    for (int m = 0; m < rows; ++m) {
        __m256 total = acc[m][0];
        for (int c = 1; c < chains; ++c) total = _mm256_add_ps(total, acc[m][c]);
        const float offset = q4 ? dot_floats(minimum, xsum + m * blocks, blocks) : 0.0f;
        y[m * y_stride] = hsum256(total) + offset + bias;
    }
}

static inline __attribute__((always_inline)) void widened_rows(const struct packed_weight *w, int64_t n,
                                                               const float *x, const float *xsum, int rows,
                                                               const int q4, float bias, float *y, int64_t stride) {
    switch (rows) {
    case 1: widened_row(w, n, x, xsum, 1, q4, bias, y, stride); break;
    case 2: widened_row(w, n, x, xsum, 2, q4, bias, y, stride); break;
    case 3: widened_row(w, n, x, xsum, 3, q4, bias, y, stride); break;
    default: widened_row(w, n, x, xsum, 4, q4, bias, y, stride); break;
    }
}

static void widened_linear(const struct packed_weight *w, const float *x, const float *bias, float *y, int64_t m_dim,
                           int num_threads) {
    const int64_t cols = w->cols, n_dim = w->rows, blocks = cols / 32;
    const int q4 = w->kind == WK_Q4;
    float xsum[m_dim * blocks];
    block_sums(x, m_dim, cols, xsum);
    if (ROW512 && q4 && m_dim == 1) { /* single-stream q4 decode: the AVX-512 form */
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t n = 0; n < n_dim; ++n) y[n] = widened_row512(w, n, x, xsum) + (bias ? bias[n] : 0.0f);
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < n_dim; ++n) {
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m = 0; m < m_dim; m += 4) {
            const int rows = m_dim - m < 4 ? (int)(m_dim - m) : 4;
            const float *xm = x + m * cols, *sm = xsum + m * blocks;
            if (q4)
                widened_rows(w, n, xm, sm, rows, 1, b, y + m * n_dim + n, n_dim);
            else
                widened_rows(w, n, xm, sm, rows, 0, b, y + m * n_dim + n, n_dim);
        }
    }
}

static void fused_linear(const struct packed_weight *w, const float *x, const float *bias, float *y, int64_t m_dim,
                         int num_threads) {
    if (rounds_activations(w))
        integer_linear(w, x, bias, y, m_dim, num_threads);
    else
        widened_linear(w, x, bias, y, m_dim, num_threads);
}

/* bf16 rows against up to 4 rows of x: 8 weights widened to fp32 by a shift, one FMA per row;
 * two chains for one row (one chain is FMA-latency bound). */
static inline __attribute__((always_inline)) void bf16_row(const uint16_t *wrow, int64_t cols, const float *x,
                                                           const int rows, float bias, float *y, int64_t y_stride) {
    __m256 acc[4][2];
    for (int m = 0; m < 4; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= cols; k += 16)
        for (int h = 0; h < 2; ++h) {
            const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(wrow + k + 8 * h)));
            const __m256 wv = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
            for (int m = 0; m < rows; ++m)
                acc[m][h] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * cols + k + 8 * h), acc[m][h]);
        }
    for (int m = 0; m < rows; ++m) {
        float sum = hsum256(_mm256_add_ps(acc[m][0], acc[m][1]));
        for (int64_t j = k; j < cols; ++j) sum += bf16_to_f32(wrow[j]) * x[m * cols + j];
        y[m * y_stride] = sum + bias;
    }
}

static void bf16_linear(const struct packed_weight *w, const float *x, const float *bias, float *y, int64_t m_dim,
                        int num_threads) {
    const int64_t cols = w->cols, n_dim = w->rows;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < n_dim; ++n) {
        const uint16_t *wrow = (const uint16_t *)w->data + n * cols;
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m = 0; m < m_dim; m += 4) {
            const int rows = m_dim - m < 4 ? (int)(m_dim - m) : 4;
            float *out = y + m * n_dim + n;
            switch (rows) {
            case 1: bf16_row(wrow, cols, x + m * cols, 1, b, out, n_dim); break;
            case 2: bf16_row(wrow, cols, x + m * cols, 2, b, out, n_dim); break;
            case 3: bf16_row(wrow, cols, x + m * cols, 3, b, out, n_dim); break;
            default: bf16_row(wrow, cols, x + m * cols, 4, b, out, n_dim); break;
            }
        }
    }
}
#else
#define FUSED_ROWS 0 /* no AVX2: every format decodes its rows first */
#define INTEGER_ROWS 0
#define ROW512 0
static void fused_linear(const struct packed_weight *w, const float *x, const float *bias, float *y, int64_t m_dim,
                         int num_threads) {
    (void)w, (void)x, (void)bias, (void)y, (void)m_dim, (void)num_threads;
}
static void bf16_linear(const struct packed_weight *w, const float *x, const float *bias, float *y, int64_t m_dim,
                        int num_threads) {
    (void)w, (void)x, (void)bias, (void)y, (void)m_dim, (void)num_threads;
}
#endif

int64_t packed_fused_rows(const struct packed_weight *w) {
    if (ROW512 && rounds_activations(w) && (w->kind == WK_Q4 || (VNNI512 && w->kind == WK_Q8)))
        return INTEGER_ROWS;
    return fuses(w) || w->kind == WK_BF16 ? FUSED_ROWS : 0;
}

void packed_linear(const struct packed_weight *w, const float *x, const float *bias, float *y, int64_t m_dim,
                   int num_threads) {
    if (fuses(w) && m_dim <= packed_fused_rows(w)) {
        fused_linear(w, x, bias, y, m_dim, num_threads);
        return;
    }
    if (w->kind == WK_BF16 && m_dim <= FUSED_ROWS) {
        bf16_linear(w, x, bias, y, m_dim, num_threads);
        return;
    }
    decoded_rows_linear(w, x, bias, y, m_dim, num_threads);
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

/* fp32 -> bf16 rounded to nearest, ties to even, as torch's .to(torch.bfloat16) (weights hold no NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void row_to_bf16(const float *row, uint16_t *out, int64_t cols) {
    int64_t j = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    for (; j + 16 <= cols; j += 16) /* vcvtneps2bf16 rounds to nearest even too */
        _mm256_storeu_si256((__m256i *)(out + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + j)));
#endif
    for (; j < cols; ++j) out[j] = f32_to_bf16(row[j]);
}

void packed_dequantize_bf16(const struct packed_weight *w, int64_t start, int64_t end, uint16_t *out,
                            int num_threads) {
    const int64_t cols = w->cols;
#pragma omp parallel num_threads(num_threads)
    {
        float buf[cols]; /* the row in fp32, L1-resident: only the bf16 tile goes to memory */
#pragma omp for schedule(static)
        for (int64_t n = start; n < end; ++n) {
            const float *row = decode_row(w, n, buf);
            row_to_bf16(row, out + (n - start) * cols, cols);
        }
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
