/* Paged decode attention for the CPU, fp32: one query row per entry, K/V read in place.
 *
 * The torch reference gathers every request's blocks into a padded [B, L, K, D] copy and
 * runs batched matmuls over it; at batch 64 that copying is most of a step. Here each
 * (row, KV head) pair walks its block table once for K and once for V, for all G query
 * heads of the group at a time, so K/V are read exactly once and nothing is padded.
 *
 * Layouts (contiguous): q, out [R, H, D]; caches [num_blocks, block_size, KH, D];
 * block_tables [R, table_stride] int64; seq_lens [R] int64.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cadenza_kernels.h"

static void attend_group(const float *q, const float *k_cache, const float *v_cache,
                         const int64_t *table, int64_t seq_len, float *out,
                         int kh, int num_kv_heads, int group, int head_dim,
                         int block_size, float scale, float *scores) {
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    for (int64_t pos = 0; pos < seq_len; ++pos) {
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        const float *k = k_cache + slot * token_stride + (int64_t)kh * head_dim;
        for (int g = 0; g < group; ++g) {
            const float *qg = q + (int64_t)g * head_dim;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; ++d) dot += qg[d] * k[d];
            scores[g * seq_len + pos] = dot * scale;
        }
    }
    for (int g = 0; g < group; ++g) {
        float *s = scores + g * seq_len;
        float peak = s[0], total = 0.0f;  /* seq_len >= 1: the row's own token */
        for (int64_t pos = 1; pos < seq_len; ++pos) peak = s[pos] > peak ? s[pos] : peak;
        for (int64_t pos = 0; pos < seq_len; ++pos) total += (s[pos] = expf(s[pos] - peak));
        const float inv = 1.0f / total;
        for (int64_t pos = 0; pos < seq_len; ++pos) s[pos] *= inv;
        for (int d = 0; d < head_dim; ++d) out[(int64_t)g * head_dim + d] = 0.0f;
    }
    for (int64_t pos = 0; pos < seq_len; ++pos) {
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        const float *v = v_cache + slot * token_stride + (int64_t)kh * head_dim;
        for (int g = 0; g < group; ++g) {
            const float p = scores[g * seq_len + pos];
            float *o = out + (int64_t)g * head_dim;
            for (int d = 0; d < head_dim; ++d) o[d] += p * v[d];
        }
    }
}

/* Returns 0, or -1 when a scratch allocation failed (the caller raises). */
int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                           const int64_t *block_tables, int64_t table_stride,
                           const int64_t *seq_lens, float *out, int num_rows, int num_heads,
                           int num_kv_heads, int head_dim, int block_size, float scale,
                           int num_threads) {
    const int group = num_heads / num_kv_heads;
    int64_t longest = 1;
    for (int r = 0; r < num_rows; ++r) longest = seq_lens[r] > longest ? seq_lens[r] : longest;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * group * longest);
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < (int64_t)num_rows * num_kv_heads; ++item) {
            if (!scores) continue;
            const int r = (int)(item / num_kv_heads), kh = (int)(item % num_kv_heads);
            const int64_t head = (int64_t)r * num_heads + (int64_t)kh * group;
            attend_group(q + head * head_dim, k_cache, v_cache, block_tables + r * table_stride,
                         seq_lens[r], out + head * head_dim, kh, num_kv_heads, group, head_dim,
                         block_size, scale, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
