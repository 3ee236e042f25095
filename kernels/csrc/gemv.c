/* y = x W^T (+ b) for one or a few rows x, fp32, W [N, K] row-major: the decode GEMV.
 *
 * One row costs a pass over the weights, so this is all about streaming them: each thread
 * reads one contiguous run of rows, four at a time (four independent sums keep the FMA units
 * busy while the loads stream in; -fassociative-math lets the compiler vectorise each sum).
 * MKL's x @ W_t reads the same bytes at 13-22 GB/s on this host's two cores; this reaches
 * ~28 GB/s, about what a 2-thread sum over 1 GB reads (/tmp microbenchmark in the issue note;
 * hand-written AVX2 intrinsics measured no faster).
 */
#include <stdint.h>

static float dot(const float *row, const float *x, int64_t k_dim) {
    float sum = 0.0f;
    for (int64_t k = 0; k < k_dim; ++k) sum += row[k] * x[k];
    return sum;
}

/* y [m, n] = x [m, k] W^T (+ b) for a few rows x: each group of four W rows is read from
 * memory once and reused from L1 for every row of x, so up to a handful of rows (k + 1
 * speculative verification, small decode batches) cost about what one row does. */
void gemv_rows(const float *x, const float *w, const float *bias, float *y, int64_t m_dim,
               int64_t k_dim, int64_t n_dim, int num_threads) {
    const int64_t quads = n_dim / 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t quad = 0; quad < quads; ++quad) {
        const int64_t n = quad * 4;
        const float *r0 = w + n * k_dim, *r1 = r0 + k_dim, *r2 = r1 + k_dim, *r3 = r2 + k_dim;
        for (int64_t m = 0; m < m_dim; ++m) {
            const float *xm = x + m * k_dim;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
            for (int64_t k = 0; k < k_dim; ++k) {
                const float xk = xm[k];
                a0 += r0[k] * xk;
                a1 += r1[k] * xk;
                a2 += r2[k] * xk;
                a3 += r3[k] * xk;
            }
            float *ym = y + m * n_dim + n;
            ym[0] = a0, ym[1] = a1, ym[2] = a2, ym[3] = a3;
        }
    }
    for (int64_t m = 0; m < m_dim; ++m) {
        for (int64_t n = quads * 4; n < n_dim; ++n) y[m * n_dim + n] = dot(w + n * k_dim, x + m * k_dim, k_dim);
        if (bias)
            for (int64_t n = 0; n < n_dim; ++n) y[m * n_dim + n] += bias[n];
    }
}
