/* A stack of decoder layers for one token, fp32, in a single call: single-stream decode on the CPU.
 *
 * At one token a layer is ~60 small torch calls around four GEMVs; their dispatch cost
 * (~12 ms a token for SmolLM2's 30 layers, measured by stubbing the GEMVs out) rivals
 * streaming the weights. This runs the same steps as models/llama.py's DecoderLayer with the
 * same kernels (it includes their sources), so the only difference is the missing overhead:
 *   residual += x (or = x on the first layer); h = rms_norm(residual) * ln1
 *   q, k, v = h Wqkv^T + b; RoPE on q and k; k, v -> the cache slot; paged attention
 *   residual += attn Wo^T + b; h = rms_norm(residual) * ln2
 *   out = silu(h Wg^T) * (h Wu^T) Wd^T
 * decode_layers runs a whole pipeline stage's layers in one call, which also saves ~30 us of
 * ctypes and tensor bookkeeping a layer (about 1 ms a token for SmolLM2's 30).
 * The projections are struct packed_weight (packed_linear.c), so every weight format runs here;
 * tensor parallelism takes the ordinary path. Built with -DCADENZA_KV_F16 (decode_layer_f16),
 * the caches hold fp16: the new K/V rows are rounded into them, attention widens what it reads.
 */
#include <string.h>

#include "cadenza_kernels.h"
/* One translation unit with the kernels it calls, so the compiler may inline them here. */
#include "decode_attention.c"
#include "elementwise.c"
#include "packed_linear.c"

/* Scratch floats decode_layer needs for these dims. */
int64_t decode_layer_scratch(const int64_t *dims) {
    const int64_t q = dims[D_HEADS] * dims[D_HEAD_DIM], kv = dims[D_KV_HEADS] * dims[D_HEAD_DIM];
    return dims[D_HIDDEN] + (q + 2 * kv) + q + 3 * dims[D_INTER];
}

/* x [hidden] in; out [hidden] and res_out [hidden] written (res NULL on the first layer).
 * x may be out and res may be res_out: each is read before its alias is written.
 * Returns 0, or -1 if attention could not allocate its scores. */
static int decode_layer(const void *const *w, const int64_t *dims, float eps, float scale, const float *x,
                 const float *res, float *out, float *res_out, const float *cos_sin, kv_t *k_cache,
                 kv_t *v_cache, int64_t slot, const int64_t *block_table, int64_t seq_len,
                 float *scratch, int num_threads) {
    const int64_t hidden = dims[D_HIDDEN], heads = dims[D_HEADS], kv_heads = dims[D_KV_HEADS];
    const int64_t head_dim = dims[D_HEAD_DIM], inter = dims[D_INTER];
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    float *h = scratch, *qkv = h + hidden, *attn = qkv + q_size + 2 * kv_size, *gate_up = attn + q_size;
    float *act = gate_up + 2 * inter;

    if (res) {
        add_rms_norm(x, res, (const float *)w[W_LN1], h, res_out, 1, hidden, eps, 1);
    } else {
        memcpy(res_out, x, sizeof(float) * hidden);
        add_rms_norm(x, 0, (const float *)w[W_LN1], h, 0, 1, hidden, eps, 1);
    }
    packed_linear(w[W_QKV], h, w[B_QKV], qkv, 1, num_threads);
    float *q = qkv, *k = qkv + q_size, *v = k + kv_size;
    /* RoPE into the cache row and attn (as scratch for q), then attention reads q from there. */
    kv_t *k_row = k_cache + slot * kv_size, *v_row = v_cache + slot * kv_size;
#ifdef CADENZA_KV_F16
    rotary(k, kv_size, head_dim, cos_sin, attn, 1, kv_heads, head_dim / 2, 1); /* attn: q_size >= kv_size */
    narrow_to_half(attn, kv_size, k_row);
    narrow_to_half(v, kv_size, v_row);
#else
    rotary(k, kv_size, head_dim, cos_sin, k_row, 1, kv_heads, head_dim / 2, 1);
    memcpy(v_row, v, sizeof(float) * kv_size);
#endif
    rotary(q, q_size, head_dim, cos_sin, attn, 1, heads, head_dim / 2, 1);
    memcpy(q, attn, sizeof(float) * q_size);
    int64_t one_len = seq_len;
    if (paged_decode_attention(q, k_cache, v_cache, block_table, 0, &one_len, attn, 1, (int)heads,
                               (int)kv_heads, (int)head_dim, (int)dims[D_BLOCK_SIZE], scale, num_threads))
        return -1;
    packed_linear(w[W_O], attn, w[B_O], h, 1, num_threads);
    /* residual += o; h = rms_norm(residual) * ln2 (res_out holds the residual stream). */
    add_rms_norm(h, res_out, (const float *)w[W_LN2], h, res_out, 1, hidden, eps, 1);
    packed_linear(w[W_GATE_UP], h, 0, gate_up, 1, num_threads);
    silu_and_mul(gate_up, act, 1, inter, 1);
    packed_linear(w[W_DOWN], act, 0, out, 1, num_threads);
    return 0;
}

/* n_layers layers in a row: layer l's weights are w[l * NUM_WEIGHTS ...] and its cache
 * k_caches[l], v_caches[l]; each layer continues from the previous one's (out, res_out). */
int decode_layers(const void *const *w, int64_t n_layers, const int64_t *dims, float eps, float scale,
                  const float *x, const float *res, float *out, float *res_out, const float *cos_sin,
                  kv_t *const *k_caches, kv_t *const *v_caches, int64_t slot, const int64_t *block_table,
                  int64_t seq_len, float *scratch, int num_threads) {
    for (int64_t l = 0; l < n_layers; ++l) {
        const float *layer_x = l ? out : x, *layer_res = l ? res_out : res;
        if (decode_layer(w + l * NUM_WEIGHTS, dims, eps, scale, layer_x, layer_res, out, res_out, cos_sin,
                         k_caches[l], v_caches[l], slot, block_table, seq_len, scratch, num_threads))
            return -1;
    }
    return 0;
}
