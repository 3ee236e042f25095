/* Paged prefill/extend attention for the CPU, fp32, tiled flash-style; plus the 8-lane vector
 * helpers and the block-table walk that decode_attention.c (which includes this file, so the
 * two kernels are one library) shares.
 *
 * The torch path gathers each request's whole context out of the paged cache, every layer
 * and every chunk, and runs SDPA with a [T, L] mask. Here a work item is (request, KV head,
 * query tile): the tile's queries, all G heads of the group, are packed once transposed and
 * pre-scaled into Q^T [D][lanes] (lane = query token x head), then key tiles are read in
 * place through the block table. Everything runs with the lanes as the vector dimension:
 *   S^T [key][lane] = K Q^T      broadcast K[j][d] from the cache row against Q^T[d][lanes]
 *   online softmax per lane      running max / sum are vectors: no horizontal reductions
 *   O^T [d][lane] += V^T P^T     broadcast V[j][d] from the cache row against P^T[j][lanes]
 * so neither K nor V is ever copied or transposed, and both products are 6 x 16 register
 * blocks (12 accumulators): 12 FMAs per 8 loads. The causal mask is applied only on the key
 * tiles that cross the diagonal; no [T, T] scores exist. Scores are kept in the log2 domain
 * (q is pre-scaled by scale * log2(e)) so each probability is a single exp2. On this 2-core
 * host a 6144-token prompt's attention (chunks of 2048) runs at ~100-128 GFLOP/s, about the
 * torch.mm rate, against ~15 for the gather + SDPA path (benchmarks/attention_cpu.py).
 *
 * fp16 caches (-DCADENZA_KV_F16): each key tile's rows are widened to fp32 once, into the
 * thread's buffers, and the products run on those; the widening pass is the tile's burst load.
 *
 * Layouts (contiguous): q, out [tokens, H, D]; caches [num_blocks, block_size, KH, D];
 * block_tables [R, table_stride] int64. Request r's query tokens are
 * q[query_start[r] .. + query_lens[r]); token t sits at position seq_len - query_len + t and
 * sees keys 0 .. its position.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cadenza_kernels.h"

#define LOG2_E 1.44269504088896341f /* scores go to the log2 domain: exp(x) = 2^(x log2 e) */

/* ---- 8-lane vectors: AVX2 + FMA intrinsics, else GCC/Clang vector extensions ---------- */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vf8;

static inline vf8 vf8_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf8_store(float *p, vf8 x) { _mm256_storeu_ps(p, x); }
static inline vf8 vf8_set1(float x) { return _mm256_set1_ps(x); }
static inline vf8 vf8_fma(vf8 a, vf8 b, vf8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf8 vf8_max(vf8 a, vf8 b) { return _mm256_max_ps(a, b); }
static inline vf8 vf8_round(vf8 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

/* x * 2^n for integral n in [-126, 127] and x in [0.5, 2): added straight into the exponent. */
static inline vf8 vf8_ldexp(vf8 x, vf8 n) {
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(x), e));
}

/* x where x >= floor, else 0 (also 0 for -inf). */
static inline vf8 vf8_zero_below(vf8 x, vf8 value, float floor) {
    return _mm256_and_ps(x, _mm256_cmp_ps(value, _mm256_set1_ps(floor), _CMP_GE_OQ));
}

/* s, or -inf in the lanes where key > query (the causal mask). */
static inline vf8 vf8_mask_after(vf8 s, vf8 key, vf8 query) {
    return _mm256_blendv_ps(s, _mm256_set1_ps(-INFINITY), _mm256_cmp_ps(key, query, _CMP_GT_OQ));
}

static inline float vf8_hsum(vf8 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float vf8_hmax(vf8 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* Lane k of the result is the sum of p[k]'s eight lanes: eight dot products finished at once
 * (a transpose by horizontal adds) instead of eight separate reductions. */
static inline vf8 vf8_sum8(const vf8 *p) {
    const __m256 t0 = _mm256_hadd_ps(p[0], p[1]), t1 = _mm256_hadd_ps(p[2], p[3]);
    const __m256 t2 = _mm256_hadd_ps(p[4], p[5]), t3 = _mm256_hadd_ps(p[6], p[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#else /* portable: the compiler maps these onto whatever SIMD the target has */
#if defined(__GNUC__) && !defined(__clang__)
/* Every vf8 function is static inline: no vector ever crosses a real call, so the ABI note
 * GCC gives for 32-byte vectors on a target without them does not apply. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float vf8 __attribute__((vector_size(32)));

static inline vf8 vf8_load(const float *p) {
    vf8 x;
    memcpy(&x, p, sizeof x);
    return x;
}
static inline void vf8_store(float *p, vf8 x) { memcpy(p, &x, sizeof x); }
static inline vf8 vf8_set1(float x) { return (vf8){x, x, x, x, x, x, x, x}; }
static inline vf8 vf8_fma(vf8 a, vf8 b, vf8 c) { return a * b + c; }
static inline vf8 vf8_max(vf8 a, vf8 b) {
    for (int i = 0; i < 8; ++i) a[i] = a[i] > b[i] ? a[i] : b[i];
    return a;
}
static inline vf8 vf8_round(vf8 x) {
    for (int i = 0; i < 8; ++i) x[i] = nearbyintf(x[i]);
    return x;
}
static inline vf8 vf8_ldexp(vf8 x, vf8 n) {
    for (int i = 0; i < 8; ++i) x[i] = ldexpf(x[i], (int)n[i]);
    return x;
}
static inline vf8 vf8_zero_below(vf8 x, vf8 value, float floor) {
    for (int i = 0; i < 8; ++i) x[i] = value[i] >= floor ? x[i] : 0.0f;
    return x;
}
static inline vf8 vf8_mask_after(vf8 s, vf8 key, vf8 query) {
    for (int i = 0; i < 8; ++i) s[i] = key[i] > query[i] ? -INFINITY : s[i];
    return s;
}
static inline float vf8_hsum(vf8 x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }
static inline float vf8_hmax(vf8 x) {
    float m = x[0];
    for (int i = 1; i < 8; ++i) m = x[i] > m ? x[i] : m;
    return m;
}
static inline vf8 vf8_sum8(const vf8 *p) {
    vf8 s;
    for (int k = 0; k < 8; ++k) s[k] = vf8_hsum(p[k]);
    return s;
}
#endif

static inline vf8 vf8_zero(void) { return vf8_set1(0.0f); }

/* 2^x for x <= 127: 2^n * 2^r with n = round(x), |r| <= 1/2, and 2^r = e^(r ln 2) by its
 * Taylor series to degree 7 (truncation under 6e-9, below float rounding). Results under
 * 2^-126 are flushed to 0, so -inf (a masked score) gives exactly 0. */
static const float EXP2_TAYLOR[8] = { /* (ln 2)^k / k!, k = 7 .. 0: Horner's order */
    1.5252733804059838e-05f, 1.5403530393381606e-04f, 1.3333558146428441e-03f, 9.6181291076284770e-03f,
    5.5504108664821576e-02f, 2.4022650695910071e-01f, 6.9314718055994531e-01f, 1.0f,
};

static inline vf8 vf8_exp2(vf8 x) {
    const vf8 clamped = vf8_max(x, vf8_set1(-126.0f));
    const vf8 n = vf8_round(clamped), r = clamped - n;
    vf8 p = vf8_set1(EXP2_TAYLOR[0]);
    for (int k = 1; k < 8; ++k) p = vf8_fma(p, r, vf8_set1(EXP2_TAYLOR[k]));
    return vf8_zero_below(vf8_ldexp(p, n), x, -126.0f);
}

/* ---- the block table ------------------------------------------------------------------ */

/* Offsets (in floats, from the cache base) of the rows of positions [pos, pos + n) of the KV
 * head at head_offset: one division for the run, then a walk along the table (a division per
 * position would cost as much as the row's arithmetic in decode). */
static void kv_rows(const int64_t *table, int block_size, int64_t pos, int n, int64_t token_stride,
                    int64_t head_offset, int64_t *rows) {
    int64_t block = pos / block_size, within = pos % block_size;
    for (int j = 0; j < n; ++j) {
        rows[j] = (table[block] * block_size + within) * token_stride + head_offset;
        if (++within == block_size) within = 0, ++block;
    }
}

/* Loads every cache line of rows [0, n) of both caches (`floats` each, at + rows[j]) once, in
 * address order, and returns a value to keep (so the loads are not removed). The compute
 * loops' own loads keep only a few misses in flight at a time; a burst of independent loads
 * first brings a tile from memory at close to streaming bandwidth, then the arithmetic runs
 * on it from L1/L2 (6144-token decode, SmolLM2, 2 threads: 9 -> 12 GB/s; one thread 5 -> 7).
 * Software prefetches of the next tile, any distance or hint, measured slower on this host. */
#ifdef CADENZA_KV_F16
/* fp16 rows: one integer load a cache line (as floats, fp16 bit pairs could be denormals,
 * which some CPUs add slowly). */
static vf8 touch_rows(const kv_t *k_cache, const kv_t *v_cache, const int64_t *rows, int n, int64_t count) {
    uint32_t sum = 0;
    for (int j = 0; j < n; ++j) {
        const unsigned char *k = (const unsigned char *)(k_cache + rows[j]), *v = (const unsigned char *)(v_cache + rows[j]);
        const int64_t last = count * (int64_t)sizeof(kv_t) - 4; /* rows hold >= 2 values */
        for (int64_t b = 0; b <= last; b += 64) {
            uint32_t x, y;
            memcpy(&x, k + b, sizeof x), memcpy(&y, v + b, sizeof y);
            sum ^= x ^ y;
        }
        uint32_t x, y; /* a row need not start on a line: its last bytes may be on one more */
        memcpy(&x, k + last, sizeof x), memcpy(&y, v + last, sizeof y);
        sum ^= x ^ y;
    }
    return vf8_set1((float)(sum & 1));
}
#else
static vf8 touch_rows(const float *k_cache, const float *v_cache, const int64_t *rows, int n, int64_t floats) {
    vf8 a = vf8_zero(), b = vf8_zero(), c = vf8_zero(), d = vf8_zero(); /* 4 chains: adds never wait */
    for (int j = 0; j < n; ++j) {
        const float *k = k_cache + rows[j], *v = v_cache + rows[j];
        int64_t f = 0;
        for (; f + 24 <= floats; f += 32) {
            a += vf8_load(k + f), b += vf8_load(v + f);
            c += vf8_load(k + f + 16), d += vf8_load(v + f + 16);
        }
        for (; f + 8 <= floats; f += 16) a += vf8_load(k + f), b += vf8_load(v + f);
        c += vf8_set1(k[floats - 1]), d += vf8_set1(v[floats - 1]); /* a row need not start on a line */
    }
    return (a + b) + (c + d);
}
#endif

/* ---- the cache's element type ------------------------------------------------------------ */

#ifdef CADENZA_KV_F16
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float half_to_float(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}

/* n values from fp16 bits to fp32: 8 at a time by F16C where the CPU has it. */
static void widen_half(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

/* n fp32 values to fp16 bits, rounded to nearest even. */
static inline void narrow_to_half(const float *src, int64_t n, uint16_t *dst) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; ++i) {
        const _Float16 x = (_Float16)src[i];
        memcpy(dst + i, &x, sizeof x);
    }
}
#endif

#ifdef CADENZA_KV_F16
/* 8 cached values as fp32 (decode reads fp16 K/V in place, widening as it loads). */
static inline vf8 kv_load8(const kv_t *p) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf8 x;
    for (int i = 0; i < 8; ++i) x[i] = half_to_float(p[i]);
    return x;
#endif
}
static inline float kv_get(const kv_t *p) { return half_to_float(*p); }
#else
static inline vf8 kv_load8(const kv_t *p) { return vf8_load(p); }
static inline float kv_get(const kv_t *p) { return *p; }
#endif

/* Where the products read a tile's n K/V rows (`floats` each, at cache + rows[j]) as fp32:
 * *k, *v and offsets[j]. An fp32 cache is read in place, first loaded in a burst
 * (touch_rows); an fp16 one is widened into buf (2 n floats rows), which is that burst.
 * Returns what the loads summed (kept, so they are not removed). */
static vf8 tile_rows(const kv_t *k_cache, const kv_t *v_cache, const int64_t *rows, int n, int64_t floats,
                     float *buf, const float **k, const float **v, int64_t *offsets) {
#ifdef CADENZA_KV_F16
    float *kt = buf, *vt = buf + (size_t)n * floats;
    for (int j = 0; j < n; ++j) {
        widen_half(k_cache + rows[j], floats, kt + j * floats);
        widen_half(v_cache + rows[j], floats, vt + j * floats);
        offsets[j] = j * floats;
    }
    *k = kt, *v = vt;
    return vf8_zero();
#else
    (void)buf;
    memcpy(offsets, rows, sizeof(int64_t) * n);
    *k = k_cache, *v = v_cache;
    return touch_rows(k_cache, v_cache, rows, n, floats);
#endif
}

/* ---- prefill ---------------------------------------------------------------------------- */

/* PF_KEYS x 16 lanes for S^T and PF_DIMS x 16 lanes for O^T: 12 accumulators of the 16 ymm
 * registers, with room for the two lane loads and a broadcast. Key tiles are a multiple of
 * PF_KEYS. PF_ROWS is the lane count a query tile aims at (SmolLM2: 32 tokens x 3 heads): K
 * and V are streamed once per query tile, so wider tiles need less bandwidth a FLOP (one core,
 * a 6144-token prompt: 48 lanes 55, 96 lanes 61 GFLOP/s) while Q^T, O^T (24 KB each) and S^T
 * stay in L2. */
enum { PF_LANES = 16, PF_KEYS = 6, PF_DIMS = 6, PF_KEY_TILE = 48, PF_ROWS = 96 };

struct prefill_shape {
    const float *q;
    const kv_t *k_cache, *v_cache;
    float *out;
    const int64_t *block_tables, *query_start, *query_lens, *seq_lens;
    int64_t table_stride, token_stride; /* token_stride: KH * D floats between cache rows */
    int num_heads, group, head_dim, block_size;
    int tile_tokens, lanes; /* query tokens per tile; lanes = tile_tokens * group rounded to 16 */
    float scale;            /* scale * log2(e): scores in the log2 domain */
    int bf16;               /* the products in bf16 (prefill_bf16.h) */
};

/* One thread's buffers, reused by every item it runs. */
struct prefill_scratch {
    float *qt, *st, *ot;           /* Q^T [D][lanes], S^T / P^T [PF_KEY_TILE][lanes], O^T [D][lanes] */
    float *m, *l, *alpha, *qpos;   /* [lanes]: running max, running sum, rescale, query position */
    float *kv;                     /* fp16 caches: a key tile's K and V rows widened [2][PF_KEY_TILE][D] */
    const float *k, *v;            /* the current tile's K / V rows as fp32: k + rows[j] */
    int64_t rows[PF_KEY_TILE];
};

static int gcd(int a, int b) { return b ? gcd(b, a % b) : a; }

/* Query tokens per tile: about PF_ROWS lanes, and a whole number of 16-lane blocks, so a full
 * tile has no padded lanes (G = 3: 32 tokens; G = 1: 96; G = 8: 12). */
static int prefill_tile_tokens(int group) {
    const int step = PF_LANES / gcd(PF_LANES, group), wanted = (PF_ROWS + group - 1) / group;
    return (wanted + step - 1) / step * step;
}

static struct prefill_scratch *prefill_scratch_new(int head_dim, int lanes) {
    const size_t floats = (size_t)lanes * (2 * head_dim + PF_KEY_TILE + 4) + 2 * PF_KEY_TILE * (size_t)head_dim;
    struct prefill_scratch *w = malloc(sizeof *w);
    float *data = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    if (!w || !data) {
        free(w);
        free(data);
        return 0;
    }
    w->qt = data, w->st = w->qt + (size_t)head_dim * lanes, w->ot = w->st + (size_t)PF_KEY_TILE * lanes;
    w->m = w->ot + (size_t)head_dim * lanes, w->l = w->m + lanes, w->alpha = w->l + lanes, w->qpos = w->alpha + lanes;
    w->kv = w->qpos + lanes;
    return w;
}

static void prefill_scratch_free(struct prefill_scratch *w) {
    if (w) free(w->qt);
    free(w);
}

#include "prefill_bf16.h"

/* Q^T of tokens [t0, t0 + nq) of request r, KV head kh, pre-scaled; padded lanes are zero and
 * sit at the last token's position (finite scores, discarded). Resets the running state. */
static void pack_queries(const struct prefill_shape *s, int r, int kh, int t0, int nq, struct prefill_scratch *w) {
    const int lanes = s->lanes, group = s->group, head_dim = s->head_dim;
    const int64_t first = s->seq_lens[r] - s->query_lens[r] + t0;
    memset(w->qt, 0, sizeof(float) * (size_t)head_dim * lanes);
    memset(w->ot, 0, sizeof(float) * (size_t)head_dim * lanes);
    for (int t = 0; t < nq; ++t) {
        const float *src = s->q + ((s->query_start[r] + t0 + t) * s->num_heads + (int64_t)kh * group) * head_dim;
        for (int g = 0; g < group; ++g)
            for (int d = 0; d < head_dim; ++d) w->qt[d * lanes + t * group + g] = src[g * head_dim + d] * s->scale;
    }
    for (int i = 0; i < lanes; ++i) {
        const int t = i / group < nq ? i / group : nq - 1;
        w->qpos[i] = (float)(first + t), w->m[i] = -FLT_MAX, w->l[i] = 0.0f;
    }
}

/* st[r][0..16) = sum_d k[r][d] * qt[d][0..16) for r < nk: an nk x 2-vector register block
 * (nk is a constant at every call, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void qk_block(int nk, const float *const *k, const float *qt, int lanes,
                                                           int head_dim, float *st) {
    vf8 acc[PF_KEYS][2];
    for (int r = 0; r < nk; ++r) acc[r][0] = acc[r][1] = vf8_zero();
    for (int d = 0; d < head_dim; ++d) {
        const vf8 q0 = vf8_load(qt + d * lanes), q1 = vf8_load(qt + d * lanes + 8);
        for (int r = 0; r < nk; ++r) {
            const vf8 kd = vf8_set1(k[r][d]);
            acc[r][0] = vf8_fma(kd, q0, acc[r][0]);
            acc[r][1] = vf8_fma(kd, q1, acc[r][1]);
        }
    }
    for (int r = 0; r < nk; ++r) vf8_store(st + r * lanes, acc[r][0]), vf8_store(st + r * lanes + 8, acc[r][1]);
}

/* S^T for keys [0, padded) of the tile; keys past the tile's real ones repeat its last row. */
static void tile_scores(const struct prefill_shape *s, const struct prefill_scratch *w, int padded) {
    const float *k[PF_KEY_TILE];
    for (int j = 0; j < padded; ++j) k[j] = w->k + w->rows[j];
    for (int j0 = 0; j0 < padded; j0 += PF_KEYS)
        for (int i0 = 0; i0 < s->lanes; i0 += PF_LANES)
            qk_block(PF_KEYS, k + j0, w->qt + i0, s->lanes, s->head_dim, w->st + j0 * s->lanes + i0);
}

/* -inf where key key0 + j is after the lane's query: only on tiles that cross the diagonal.
 * Positions compare as floats, exact below 2^24. */
static void mask_future(const struct prefill_shape *s, struct prefill_scratch *w, int64_t key0, int n) {
    for (int j = 0; j < n; ++j) {
        const vf8 key = vf8_set1((float)(key0 + j));
        float *row = w->st + j * s->lanes;
        for (int i = 0; i < s->lanes; i += 8)
            vf8_store(row + i, vf8_mask_after(vf8_load(row + i), key, vf8_load(w->qpos + i)));
    }
}

/* The online softmax step, per lane: the running max takes the tile's, alpha = 2^(old - new)
 * is what the sums so far must be scaled by, and S^T becomes P^T = 2^(s - new). A lane whose
 * keys are all masked here keeps its max: every lane saw key 0 in the first tile.
 * With AVX-512 the same arithmetic, lane for lane, runs 16 lanes at a time (at 8 this loop
 * was a third of the bf16 kernel's time). */
#if !defined(__AVX512F__)
static void tile_softmax(const struct prefill_shape *s, struct prefill_scratch *w, int n) {
    for (int i = 0; i < s->lanes; i += 8) {
        const vf8 old = vf8_load(w->m + i);
        vf8 peak = old, sum = vf8_zero();
        for (int j = 0; j < n; ++j) peak = vf8_max(peak, vf8_load(w->st + j * s->lanes + i));
        for (int j = 0; j < n; ++j) {
            float *p = w->st + j * s->lanes + i;
            const vf8 e = vf8_exp2(vf8_load(p) - peak);
            vf8_store(p, e);
            sum = sum + e;
        }
        const vf8 alpha = vf8_exp2(old - peak);
        vf8_store(w->alpha + i, alpha);
        vf8_store(w->l + i, vf8_fma(vf8_load(w->l + i), alpha, sum));
        vf8_store(w->m + i, peak);
    }
}
#else
/* vf8_exp2 at 16 lanes: the same steps, so the same results. */
static inline __m512 v16_exp2(__m512 x) {
    const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(clamped, n);
    __m512 p = _mm512_set1_ps(EXP2_TAYLOR[0]);
    for (int k = 1; k < 8; ++k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP2_TAYLOR[k]));
    const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
    const __m512 y = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ), y);
}

static void tile_softmax(const struct prefill_shape *s, struct prefill_scratch *w, int n) {
    for (int i = 0; i < s->lanes; i += 16) {
        const __m512 old = _mm512_loadu_ps(w->m + i);
        __m512 peak = old, sum = _mm512_setzero_ps();
        for (int j = 0; j < n; ++j) peak = _mm512_max_ps(peak, _mm512_loadu_ps(w->st + j * s->lanes + i));
        for (int j = 0; j < n; ++j) {
            float *p = w->st + j * s->lanes + i;
            const __m512 e = v16_exp2(_mm512_sub_ps(_mm512_loadu_ps(p), peak));
            _mm512_storeu_ps(p, e);
            sum = _mm512_add_ps(sum, e);
        }
        const __m512 alpha = v16_exp2(_mm512_sub_ps(old, peak));
        _mm512_storeu_ps(w->alpha + i, alpha);
        _mm512_storeu_ps(w->l + i, _mm512_fmadd_ps(_mm512_loadu_ps(w->l + i), alpha, sum));
        _mm512_storeu_ps(w->m + i, peak);
    }
}
#endif

/* ot[d0 + r][0..16) = alpha * ot[d0 + r][..] + sum_j v[j][d0 + r] * pt[j][0..16) for r < nd. */
static inline __attribute__((always_inline)) void pv_block(int nd, const float *const *v, int d0, const float *pt,
                                                           int n, int lanes, const float *alpha, float *ot) {
    vf8 acc[PF_DIMS][2];
    const vf8 a0 = vf8_load(alpha), a1 = vf8_load(alpha + 8);
    for (int r = 0; r < nd; ++r) {
        acc[r][0] = vf8_load(ot + (d0 + r) * lanes) * a0;
        acc[r][1] = vf8_load(ot + (d0 + r) * lanes + 8) * a1;
    }
    for (int j = 0; j < n; ++j) {
        const vf8 p0 = vf8_load(pt + j * lanes), p1 = vf8_load(pt + j * lanes + 8);
        const float *vj = v[j] + d0;
        for (int r = 0; r < nd; ++r) {
            const vf8 vd = vf8_set1(vj[r]);
            acc[r][0] = vf8_fma(vd, p0, acc[r][0]);
            acc[r][1] = vf8_fma(vd, p1, acc[r][1]);
        }
    }
    for (int r = 0; r < nd; ++r) {
        vf8_store(ot + (d0 + r) * lanes, acc[r][0]);
        vf8_store(ot + (d0 + r) * lanes + 8, acc[r][1]);
    }
}

/* O^T = alpha * O^T + V^T P^T over the tile's n keys; the last D % PF_DIMS dims by a smaller
 * block (each size a constant, so each stays in registers). */
static void tile_values(const struct prefill_shape *s, struct prefill_scratch *w, int n) {
    const float *v[PF_KEY_TILE];
    const int lanes = s->lanes, head_dim = s->head_dim, full = head_dim - head_dim % PF_DIMS;
    for (int j = 0; j < n; ++j) v[j] = w->v + w->rows[j];
    for (int i0 = 0; i0 < lanes; i0 += PF_LANES) {
        const float *pt = w->st + i0, *alpha = w->alpha + i0;
        float *ot = w->ot + i0;
        for (int d0 = 0; d0 < full; d0 += PF_DIMS) pv_block(PF_DIMS, v, d0, pt, n, lanes, alpha, ot);
        switch (head_dim - full) {
            case 5: pv_block(5, v, full, pt, n, lanes, alpha, ot); break;
            case 4: pv_block(4, v, full, pt, n, lanes, alpha, ot); break;
            case 3: pv_block(3, v, full, pt, n, lanes, alpha, ot); break;
            case 2: pv_block(2, v, full, pt, n, lanes, alpha, ot); break;
            case 1: pv_block(1, v, full, pt, n, lanes, alpha, ot); break;
            default: break;
        }
    }
}

/* out rows of the tile's nq tokens: O^T transposed back and divided by each lane's sum. */
static void store_outputs(const struct prefill_shape *s, const struct prefill_scratch *w, int r, int kh, int t0,
                          int nq) {
    const int lanes = s->lanes, group = s->group, head_dim = s->head_dim;
    for (int t = 0; t < nq; ++t) {
        float *dst = s->out + ((s->query_start[r] + t0 + t) * s->num_heads + (int64_t)kh * group) * head_dim;
        for (int g = 0; g < group; ++g) {
            const int lane = t * group + g;
            const float inv = 1.0f / w->l[lane];
            for (int d = 0; d < head_dim; ++d) dst[g * head_dim + d] = w->ot[d * lanes + lane] * inv;
        }
    }
}

/* One work item: query tile `tile` of request r against KV head kh, every key it may see.
 * b: the bf16 buffers where the products run in bf16, else NULL. */
static void prefill_item(const struct prefill_shape *s, struct prefill_scratch *w, void *b, int r, int kh, int tile) {
    const int t0 = tile * s->tile_tokens;
    const int nq = (int)(s->query_lens[r] - t0 < s->tile_tokens ? s->query_lens[r] - t0 : s->tile_tokens);
    const int64_t first = s->seq_lens[r] - s->query_lens[r] + t0, end = first + nq; /* keys [0, end) */
    const int64_t *table = s->block_tables + r * s->table_stride;
    pack_queries(s, r, kh, t0, nq, w);
#if PREFILL_BF16
    const int key_block = b ? BF_KEYS : PF_KEYS;
    if (b) pair_queries(s, w->qt, b);
#else
    const int key_block = PF_KEYS;
#endif
    vf8 touched = vf8_zero();
    for (int64_t key0 = 0; key0 < end; key0 += PF_KEY_TILE) {
        const int n = (int)(end - key0 < PF_KEY_TILE ? end - key0 : PF_KEY_TILE);
        const int padded = (n + key_block - 1) / key_block * key_block;
        int64_t rows[PF_KEY_TILE];
        kv_rows(table, s->block_size, key0, n, s->token_stride, (int64_t)kh * s->head_dim, rows);
        /* K/V come from L3 or memory once per query tile (one core, 6144-token prompt: 47 -> 54 GFLOP/s) */
        touched += tile_rows(s->k_cache, s->v_cache, rows, n, s->head_dim, w->kv, &w->k, &w->v, w->rows);
        for (int j = n; j < padded; ++j) w->rows[j] = w->rows[n - 1];
#if PREFILL_BF16
        if (b) tile_scores_bf16(s, w, b, n, padded);
        else
#endif
            tile_scores(s, w, padded);
        if (key0 + n - 1 > first) mask_future(s, w, key0, n);
        tile_softmax(s, w, n);
#if PREFILL_BF16
        if (b) tile_values_bf16(s, w, b, n);
        else
#endif
            tile_values(s, w, n);
    }
    store_outputs(s, w, r, kh, t0, nq);
    volatile float keep = vf8_hsum(touched); /* a volatile store: the touching loads must happen */
    (void)keep;
}

/* The request holding query tile `index` (tiles numbered across requests; first[] their starts). */
static int request_of(const int64_t *first, int num_reqs, int64_t index) {
    int lo = 0, hi = num_reqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first[mid] <= index) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Returns 0, or -1 when a scratch allocation failed (the caller raises). */
int paged_prefill_attention(const float *q, const kv_t *k_cache, const kv_t *v_cache,
                            const int64_t *block_tables, int64_t table_stride, const int64_t *query_start,
                            const int64_t *query_lens, const int64_t *seq_lens, float *out, int num_reqs,
                            int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                            int bf16, int num_threads) {
    const int group = num_heads / num_kv_heads, tile_tokens = prefill_tile_tokens(group);
    bf16 = PREFILL_BF16 && bf16 && head_dim % 16 == 0; /* else fp32: the pairs fill whole 16-wide rows */
    const struct prefill_shape shape = {
        q, k_cache, v_cache, out, block_tables, query_start, query_lens, seq_lens, table_stride,
        (int64_t)num_kv_heads * head_dim, num_heads, group, head_dim, block_size, tile_tokens,
        (tile_tokens * group + PF_LANES - 1) / PF_LANES * PF_LANES, scale * LOG2_E, bf16,
    };
    int64_t *first = malloc(sizeof(int64_t) * (num_reqs + 1));
    if (!first) return -1;
    first[0] = 0;
    for (int r = 0; r < num_reqs; ++r) first[r + 1] = first[r] + (query_lens[r] + tile_tokens - 1) / tile_tokens;
    const int64_t items = first[num_reqs] * num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        struct prefill_scratch *w = prefill_scratch_new(head_dim, shape.lanes);
        void *b = 0;
#if PREFILL_BF16
        struct bf16_scratch bf = {0};
        if (bf16 && bf16_scratch_new(&bf, head_dim, shape.lanes) == 0) b = &bf;
        if (bf16 && !b) failed = 1;
#endif
        if (!w) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            if (!w || (bf16 && !b)) continue;
            /* KV head by KV head: threads running side by side read the same K/V tiles, which
             * the shared cache then serves once. A request's last tiles see the most keys:
             * they go first, and the short ones fill in. */
            const int64_t index = item % first[num_reqs];
            const int r = request_of(first, num_reqs, index);
            prefill_item(&shape, w, b, r, (int)(item / first[num_reqs]), (int)(first[r + 1] - 1 - index));
        }
        prefill_scratch_free(w);
#if PREFILL_BF16
        free(bf.qp);
#endif
    }
    free(first);
    return failed ? -1 : 0;
}
