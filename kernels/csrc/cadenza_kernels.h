/* Every function the C kernels export, as kernels/cpu/bindings.py calls them through ctypes.
 *
 * Each .c file includes this header, so a definition that drifts from its declaration fails
 * the build (-Wall -Werror) instead of being called with the wrong arguments. The parameter
 * names here are the names bindings.py passes by keyword (tests/kernels check they agree).
 * All tensors are fp32 and contiguous unless a stride argument says otherwise; KV caches
 * are kv_t.
 */
#ifndef CADENZA_KERNELS_H
#define CADENZA_KERNELS_H

#include <stdint.h>

/* The KV cache's element: fp32, or fp16 bits where the library is built with -DCADENZA_KV_F16
 * (the decode_attention_f16 and decode_layer_f16 libraries, build.py's VARIANTS). */
#ifdef CADENZA_KV_F16
typedef uint16_t kv_t;
#else
typedef float kv_t;
#endif

/* decode_attention.c: one query row per entry, K/V read in place through the block tables,
 * each row's context split over the threads (flash-decoding). Returns 0, or -1 when a
 * scratch allocation failed. */
int paged_decode_attention(const float *q, const kv_t *k_cache, const kv_t *v_cache,
                           const int64_t *block_tables, int64_t table_stride,
                           const int64_t *seq_lens, float *out, int num_rows, int num_heads,
                           int num_kv_heads, int head_dim, int block_size, float scale,
                           int num_threads);

/* prefill_attention.c (built into the decode_attention library): the query tokens of
 * num_reqs requests, request r's query_lens[r] tokens starting at row query_start[r] of q and
 * out [tokens, H, D], causal over its seq_lens[r] keys, tiled flash-style over the paged cache.
 * Only those rows of out are written. bf16: QK^T and PV on bf16-rounded inputs with fp32 sums
 * where the CPU has AVX512-BF16 and head_dim % 16 == 0 (prefill_bf16.h); elsewhere ignored.
 * Returns 0, or -1 when a scratch allocation failed. */
int paged_prefill_attention(const float *q, const kv_t *k_cache, const kv_t *v_cache,
                            const int64_t *block_tables, int64_t table_stride, const int64_t *query_start,
                            const int64_t *query_lens, const int64_t *seq_lens, float *out, int num_reqs,
                            int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                            int bf16, int num_threads);

/* elementwise.c: the per-token ops between the GEMMs. */
void add_rms_norm(const float *x, const float *res, const float *w, float *out, float *res_out,
                  int64_t rows, int64_t cols, float eps, int num_threads);
void rotary(const float *x, int64_t stride_t, int64_t stride_h, const float *cos_sin, float *out,
            int64_t tokens, int64_t heads, int64_t half, int num_threads);
void silu_and_mul(const float *x, float *out, int64_t rows, int64_t inter, int num_threads);

/* gemv.c: y [m, n] = x [m, k] W^T (+ b), W [n, k] row-major. */
void gemv_rows(const float *x, const float *w, const float *bias, float *y, int64_t m_dim,
               int64_t k_dim, int64_t n_dim, int num_threads);

/* packed_linear.c: W in its stored format (kernels/quant/weight.py); kind is an enum
 * weight_kind, in KINDS' order there. group: elements per scale (q8, q4). */
enum weight_kind { WK_F32, WK_BF16, WK_F16, WK_Q8, WK_Q4, WK_Q4_K, WK_Q6_K };
struct packed_weight {
    int64_t kind, rows, cols, group;
    int64_t round_x; /* q4 / q8: read x rounded to int8 per block of 32 (packed_linear.c) */
    const void *data, *scales, *mins;
};
/* y [m, rows] = x [m, cols] W^T (+ b). */
void packed_linear(const struct packed_weight *w, const float *x, const float *bias, float *y, int64_t m_dim,
                   int num_threads);
/* The most rows of x packed_linear's fused kernels take for W in one pass (past them it
 * decodes W's rows first); kernels/linear/packed.py sends the C kernel at least its few-row
 * bound, and this many where it is larger. */
int64_t packed_fused_rows(const struct packed_weight *w);
/* x [rows, cols] rounded as the q4 / q8 formats read it: to int8 per block of 32 (cols % 32 == 0). */
void round_activations(const float *x, int64_t rows, int64_t cols, float *out);
/* Rows [start, end) of W as fp32 into out [end - start, cols]. */
void packed_dequantize(const struct packed_weight *w, int64_t start, int64_t end, float *out, int num_threads);
/* The same rows as bf16 (fp32 rounded to nearest even, as torch rounds) into out [end - start, cols]. */
void packed_dequantize_bf16(const struct packed_weight *w, int64_t start, int64_t end, uint16_t *out,
                            int num_threads);
/* Rows ids[0..n_ids) of W as fp32 into out [n_ids, cols] (embedding lookups). */
void packed_gather_rows(const struct packed_weight *w, const int64_t *ids, int64_t n_ids, float *out,
                        int num_threads);

/* decode_layer.c: a stack of decoder layers for one token. Layer l's weights are
 * w[l * NUM_WEIGHTS + DECODE_WEIGHT]: the projections' (W_QKV, W_O, W_GATE_UP, W_DOWN) point at
 * a struct packed_weight, the norms' and biases' at fp32 vectors; dims[DECODE_DIM] describes
 * the model. */
enum decode_weight { W_LN1, W_LN2, W_QKV, B_QKV, W_O, B_O, W_GATE_UP, W_DOWN, NUM_WEIGHTS };
enum decode_dim { D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_BLOCK_SIZE, NUM_DIMS };

int64_t decode_layer_scratch(const int64_t *dims);
int decode_layers(const void *const *w, int64_t n_layers, const int64_t *dims, float eps, float scale,
                  const float *x, const float *res, float *out, float *res_out, const float *cos_sin,
                  kv_t *const *k_caches, kv_t *const *v_caches, int64_t slot, const int64_t *block_table,
                  int64_t seq_len, float *scratch, int num_threads);

#endif /* CADENZA_KERNELS_H */
