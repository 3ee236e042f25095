/* The per-token ops between the GEMMs, fp32: fused residual-add + RMSNorm, rotary embedding,
 * SiLU-and-mul. In torch each is 3-8 small ops (5-10 us apiece at one token); here each is one
 * call. Rows run in parallel only when there are enough of them to pay for waking threads.
 * The arithmetic follows the torch references in norm.py, rotary.py and activation.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cadenza_kernels.h"

#define PARALLEL_ROWS 16

/* out = rms_norm(x + res) * w, res_out = x + res; res may be NULL (then res_out is unused). */
void add_rms_norm(const float *x, const float *res, const float *w, float *out, float *res_out,
                  int64_t rows, int64_t cols, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * cols;
        float *sum_row = res ? res_out + r * cols : 0;
        float squares = 0.0f;
        for (int64_t c = 0; c < cols; ++c) {
            const float v = res ? (sum_row[c] = xr[c] + res[r * cols + c]) : xr[c];
            squares += v * v;
        }
        const float inv = 1.0f / sqrtf(squares / (float)cols + eps);
        const float *src = res ? sum_row : xr;
        float *o = out + r * cols;
        for (int64_t c = 0; c < cols; ++c) o[c] = w[c] * (src[c] * inv);
    }
}

/* out [T, H, 2 * half] contiguous from x rows at (t * stride_t + h * stride_h); cos_sin [T, 2 * half]. */
void rotary(const float *x, int64_t stride_t, int64_t stride_h, const float *cos_sin, float *out,
            int64_t tokens, int64_t heads, int64_t half, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (tokens >= PARALLEL_ROWS)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *cos = cos_sin + t * 2 * half, *sin = cos + half;
        for (int64_t h = 0; h < heads; ++h) {
            const float *x1 = x + t * stride_t + h * stride_h, *x2 = x1 + half;
            float *o1 = out + (t * heads + h) * 2 * half, *o2 = o1 + half;
            for (int64_t i = 0; i < half; ++i) {
                o1[i] = x1[i] * cos[i] - x2[i] * sin[i];
                o2[i] = x2[i] * cos[i] + x1[i] * sin[i];
            }
        }
    }
}

/* e^x for the loops below: libm's expf is a call per value that the compiler cannot vectorise
 * (SiLU ran at ~3.5 ns an element, 5x slower than torch's). Here e^x = 2^n e^r with
 * n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by its Taylor series to r^7 (relative error
 * under 1e-8, below fp32's), 2^n built in the exponent bits; plain arithmetic, so a loop of
 * it vectorises for the host. x is clamped where e^x leaves fp32's normal range. */
static inline float exp_vec(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* round by floor (one vroundps): the 1.5 * 2^23 trick folds away under -fassociative-math */
    const float n = floorf(x * 1.44269504f + 0.5f);
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln 2 in two parts: exact n * hi */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* One row of silu(gate) * up, kept out of line with restrict pointers: written inside the
 * loop over rows (with `omp simd`, or without), gcc 12's code for it ran at ~4 ns an element,
 * scalar speed, though gcc reports the loop vectorised: 3.3 ms against 0.34 ms for SmolLM2's
 * 512 x 1536 on one Xeon core, and at one row too. */
__attribute__((noinline)) static void silu_row(const float *restrict gate, const float *restrict up,
                                               float *restrict o, int64_t inter) {
    for (int64_t i = 0; i < inter; ++i) o[i] = gate[i] / (1.0f + exp_vec(-gate[i])) * up[i];
}

/* x [rows, 2 * inter] = [gate | up] -> out [rows, inter] = silu(gate) * up. */
void silu_and_mul(const float *x, float *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) silu_row(x + r * 2 * inter, x + (r * 2 + 1) * inter, out + r * inter, inter);
}
