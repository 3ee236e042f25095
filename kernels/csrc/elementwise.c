/* The per-token ops between the GEMMs, fp32: fused residual-add + RMSNorm, rotary embedding,
 * SiLU-and-mul. In torch each is 3-8 small ops (5-10 us apiece at one token); here each is one
 * call. Rows run in parallel only when there are enough of them to pay for waking threads.
 * The arithmetic follows the torch references in norm.py, rotary.py and activation.py.
 */
#include <math.h>
#include <stdint.h>

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

/* x [rows, 2 * inter] = [gate | up] -> out [rows, inter] = silu(gate) * up. */
void silu_and_mul(const float *x, float *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = x + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; ++i) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}
