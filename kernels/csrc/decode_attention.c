/* Paged decode attention for the CPU, fp32: one query row per entry, K/V read in place.
 *
 * Decode reads each cached K/V row once per step and does little arithmetic with it, so the
 * aim is to run at memory bandwidth. What stood in the way at long contexts:
 * - Too few work items: one per (row, KV head) left SmolLM2's 3 KV heads at batch 1 to 2
 *   threads. Now each row's context is split into chunks (flash-decoding); a chunk computes a
 *   partial (max, sum, unnormalised output) per head with an online softmax, and a second
 *   pass combines a row's partials. Splits are capped so that there are about
 *   DEC_ITEMS_PER_THREAD items a thread: the partials' scratch is bounded by the batch and
 *   the thread count, not by the context.
 * - Memory access: an item takes every KV head of its keys, so it reads whole token rows
 *   (KH * D floats; a block's rows are contiguous) rather than 256 bytes of every 768; and
 *   an item's first tile of keys is loaded in one burst (touch_rows in prefill_attention.c),
 *   and each later one is asked for into L2 (prefetcht1) while the tile before it computes.
 * - Scalar loops: scores are 8 keys x 1 head at a time, 8 independent FMA chains finished by
 *   one transpose-add (vf8_sum8); probabilities are an 8-lane exp2; P V keeps up to 64 output
 *   dims in registers across a tile of keys. A KV head's G query heads use its K/V rows
 *   while they are in L1.
 * On a 2-core Zen 3 host (benchmarks/attention_cpu.py, SmolLM2, 6144 tokens, 30 layers' caches
 * cycled) a burst load of every tile read K/V at 12-14 GB/s, against ~2 GB/s before and
 * 23 GB/s for torch.sum over 1 GiB. On a 2-core Zen 4 (33 GB/s by torch.sum), fp16 caches:
 * the next tile's prefetches all issued before a tile's arithmetic read at 14.1 -> 16.6 GB/s;
 * the same prefetches spread out, a few lines after each 8-key step of the scores
 * (line_cursor), and no burst load of a tile already asked for, cut the kernel's time by
 * another 11-16% (6144 keys batch 1: 0.328 -> 0.274 ms a layer; 2048 keys batches 1 and 8:
 * 0.106 -> 0.094 and 0.864 -> 0.723 ms; alternated over 60 rounds in one process). Hot in
 * cache the same kernel takes ~0.17 ms a layer at 6144 keys: the arithmetic is half of it.
 *
 * fp16 caches (-DCADENZA_KV_F16) halve the bytes a step reads. The products widen K and V
 * as they load them (kv_load8: one F16C conversion a vector). 6144-token decode, SmolLM2,
 * 2 threads: 0.33 ms a layer (0.29 with heads3_step's shared loads), against 0.50 for fp32
 * caches; widening each tile (0.44) or each KV head's rows (0.43) into a buffer first measured
 * slower.
 *
 * Layouts (contiguous): q, out [R, H, D]; caches [num_blocks, block_size, KH, D];
 * block_tables [R, table_stride] int64; seq_lens [R] int64 (each >= 1: the row's own token).
 *
 * prefill_attention.c (included here: one library, one translation unit) holds the vector
 * helpers, the block-table walk and the tiled prefill/extend kernel.
 */
#include "prefill_attention.c"

/* DEC_TILE keys a step: their scores (H x DEC_TILE) and K/V rows (48 KB for SmolLM2) stay in
 * L1/L2; fp16 rows are half the bytes, so twice the keys (6144-token decode: from 0.70 to
 * 0.65 of the fp32 kernel's time). Splits are at least DEC_MIN_SPLIT keys and a whole number of tiles. */
#ifdef CADENZA_KV_F16
enum { DEC_TILE = 64 };
#else
enum { DEC_TILE = 32 };
#endif
enum { DEC_MIN_SPLIT = 128, DEC_ITEMS_PER_THREAD = 8, DEC_MAX_SPLITS = 64 };

struct decode_shape {
    const float *q;
    const kv_t *k_cache, *v_cache;
    float *out, *partials; /* partials: [split][H][2 + D] (max, sum, output), when any row splits */
    const int64_t *block_tables, *seq_lens;
    const int64_t *first_split, *split_len; /* [R + 1] each row's first split; [R] its keys a split */
    int64_t table_stride, token_stride;
    int num_heads, num_kv_heads, group, head_dim, block_size;
    float scale; /* scale * log2(e) */
};

/* s[0..8) = q . k[jj] for eight keys: one accumulator per key, reduced together at the end. */
static void scores8(const float *q, const kv_t *const *k, int head_dim, float *s) {
    vf8 acc[8];
    for (int jj = 0; jj < 8; ++jj) acc[jj] = vf8_zero();
    int d = 0;
    for (; d + 8 <= head_dim; d += 8) {
        const vf8 qd = vf8_load(q + d);
        for (int jj = 0; jj < 8; ++jj) acc[jj] = vf8_fma(qd, kv_load8(k[jj] + d), acc[jj]);
    }
    vf8_store(s, vf8_sum8(acc));
    for (; d < head_dim; ++d)
        for (int jj = 0; jj < 8; ++jj) s[jj] += q[d] * kv_get(k[jj] + d);
}

/* One head's online-softmax step over a tile of padded scores (multiple of 8; the padding is
 * -inf): s becomes 2^(s - new max); returns alpha = 2^(old max - new max) for the output. */
static float softmax_step(float *s, int padded, float *m, float *l) {
    vf8 peak = vf8_set1(*m), sum = vf8_zero();
    for (int j = 0; j < padded; j += 8) peak = vf8_max(peak, vf8_load(s + j));
    const float top = vf8_hmax(peak);
    const vf8 top8 = vf8_set1(top);
    for (int j = 0; j < padded; j += 8) {
        const vf8 e = vf8_exp2(vf8_load(s + j) - top8);
        vf8_store(s + j, e);
        sum = sum + e;
    }
    const float alpha = exp2f(*m - top);
    *l = *l * alpha + vf8_hsum(sum), *m = top;
    return alpha;
}

/* acc[0..D) = alpha * acc + sum_j p[j] v[j] over the tile's n keys: 64 (then 8, then 1)
 * output dims held in registers across all n keys, so acc is loaded and stored once a tile. */
static void values_step(const float *p, const kv_t *const *v, int n, int head_dim, float alpha, float *acc) {
    const vf8 a = vf8_set1(alpha);
    int d = 0;
    for (; d + 64 <= head_dim; d += 64) {
        vf8 o[8];
        for (int k = 0; k < 8; ++k) o[k] = vf8_load(acc + d + 8 * k) * a;
        for (int j = 0; j < n; ++j) {
            const vf8 pj = vf8_set1(p[j]);
            for (int k = 0; k < 8; ++k) o[k] = vf8_fma(pj, kv_load8(v[j] + d + 8 * k), o[k]);
        }
        for (int k = 0; k < 8; ++k) vf8_store(acc + d + 8 * k, o[k]);
    }
    for (; d + 8 <= head_dim; d += 8) {
        vf8 o = vf8_load(acc + d) * a;
        for (int j = 0; j < n; ++j) o = vf8_fma(vf8_set1(p[j]), kv_load8(v[j] + d), o);
        vf8_store(acc + d, o);
    }
    for (; d < head_dim; ++d) {
        float o = acc[d] * alpha;
        for (int j = 0; j < n; ++j) o += p[j] * kv_get(v[j] + d);
        acc[d] = o;
    }
}

/* The next tile's cache lines, a few asked for (into L2) between pieces of this tile's
 * arithmetic, so the memory system is kept busy while the core computes. */
struct line_cursor {
    const char *k, *v;
    const int64_t *rows;
    int n, j;
    int64_t b, bytes;
};

static inline void prefetch_lines(struct line_cursor *c, int lines) {
    for (; lines > 0 && c->j < c->n; --lines) {
        const int64_t at = c->rows[c->j] * (int64_t)sizeof(kv_t) + c->b;
        __builtin_prefetch(c->k + at, 0, 2), __builtin_prefetch(c->v + at, 0, 2);
        if ((c->b += 64) >= c->bytes) c->b = 0, ++c->j;
    }
}

/* Three query heads of one KV head at a time, each K and V load shared by all three (6144-token
 * decode, SmolLM2, 2 threads: fp16 caches 12-16% less time, fp32 4%). Their 24 accumulators
 * need AVX-512's 32 vector registers; with AVX2's 16 they would spill. */
#if defined(__AVX512VL__) && defined(__AVX2__) && defined(__FMA__)
#define SHARED_HEADS 1
#else
#define SHARED_HEADS 0
#endif
#if SHARED_HEADS
/* scores8 for heads h, h + 1, h + 2 (q: their consecutive rows; s rows DEC_TILE apart), and
 * values_step for the three, 16 lanes wide: AVX-512 is there (SHARED_HEADS), and a zmm FMA or
 * fp16 widening is one instruction for 16 values, half the 8-lane form's for the same FLOPs,
 * which is what bounds a tile once its K/V are in L2. head_dim % 64 == 0. */
static inline __m512 kv_load16(const kv_t *p) {
#ifdef CADENZA_KV_F16
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    return _mm512_loadu_ps(p);
#endif
}

static void scores8x3(const float *q, const kv_t *const *k, int head_dim, float *s) {
    __m512 acc[3][8];
    for (int g = 0; g < 3; ++g)
        for (int jj = 0; jj < 8; ++jj) acc[g][jj] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d += 16) {
        const __m512 q0 = _mm512_loadu_ps(q + d), q1 = _mm512_loadu_ps(q + head_dim + d);
        const __m512 q2 = _mm512_loadu_ps(q + 2 * head_dim + d);
        for (int jj = 0; jj < 8; ++jj) {
            const __m512 kd = kv_load16(k[jj] + d);
            acc[0][jj] = _mm512_fmadd_ps(q0, kd, acc[0][jj]);
            acc[1][jj] = _mm512_fmadd_ps(q1, kd, acc[1][jj]);
            acc[2][jj] = _mm512_fmadd_ps(q2, kd, acc[2][jj]);
        }
    }
    for (int g = 0; g < 3; ++g) {
        vf8 halves[8]; /* each key's 16 lanes folded to 8, then the eight finished together */
        for (int jj = 0; jj < 8; ++jj)
            halves[jj] = _mm256_add_ps(_mm512_castps512_ps256(acc[g][jj]), _mm512_extractf32x8_ps(acc[g][jj], 1));
        vf8_store(s + g * DEC_TILE, vf8_sum8(halves));
    }
}

static void values_step_x3(const float *p, const kv_t *const *v, int n, int head_dim, const float *alpha,
                           float *acc) {
    for (int d = 0; d < head_dim; d += 64) {
        __m512 o[3][4];
        for (int g = 0; g < 3; ++g)
            for (int x = 0; x < 4; ++x)
                o[g][x] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * head_dim + d + 16 * x), _mm512_set1_ps(alpha[g]));
        for (int j = 0; j < n; ++j) {
            const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[DEC_TILE + j]);
            const __m512 p2 = _mm512_set1_ps(p[2 * DEC_TILE + j]);
            for (int x = 0; x < 4; ++x) {
                const __m512 vd = kv_load16(v[j] + d + 16 * x);
                o[0][x] = _mm512_fmadd_ps(p0, vd, o[0][x]);
                o[1][x] = _mm512_fmadd_ps(p1, vd, o[1][x]);
                o[2][x] = _mm512_fmadd_ps(p2, vd, o[2][x]);
            }
        }
        for (int g = 0; g < 3; ++g)
            for (int x = 0; x < 4; ++x) _mm512_storeu_ps(acc + g * head_dim + d + 16 * x, o[g][x]);
    }
}

/* Heads h .. h + 2 over the tile: scores, each head's softmax step, then the shared P V. */
static void heads3_step(const float *qs, const kv_t *const *k, const kv_t *const *v, int n, int padded,
                        int head_dim, int h, float *sc, float *m, float *l, float *acc, struct line_cursor *c, int per) {
    for (int j = 0; j < padded; j += 8) {
        scores8x3(qs + h * head_dim, k + j, head_dim, sc + h * DEC_TILE + j);
        prefetch_lines(c, per);
    }
    float alpha[3];
    for (int g = 0; g < 3; ++g) {
        float *sh = sc + (h + g) * DEC_TILE;
        for (int j = n; j < padded; ++j) sh[j] = -INFINITY;
        alpha[g] = softmax_step(sh, padded, m + h + g, l + h + g);
    }
    values_step_x3(sc + h * DEC_TILE, v, n, head_dim, alpha, acc + (size_t)h * head_dim);
}
#endif

/* Scratch floats a thread needs: every head's scaled query and one tile of scores, and the
 * state (m [H], l [H], acc [H][D]) of an item whose output needs no combining. */
static size_t decode_scratch_floats(int num_heads, int head_dim) {
    return (size_t)num_heads * (head_dim + DEC_TILE) + (size_t)num_heads * (2 + head_dim);
}

/* One tile of n keys (rows[j]: the cache offsets of their token rows) against every head:
 * each KV head's K rows for its G query heads (scores, softmax step), then its V rows. The
 * next tile's n_next rows (next) are asked for into L2 a few lines after each 8-key step. */
static void decode_tile(const struct decode_shape *s, const float *qs, const int64_t *rows, int n,
                       const int64_t *next, int n_next, float *sc, float *m, float *l, float *acc) {
    const int padded = (n + 7) / 8 * 8, head_dim = s->head_dim, group = s->group;
    const int64_t bytes = s->token_stride * (int64_t)sizeof(kv_t), steps = (int64_t)s->num_kv_heads * (padded / 8);
    struct line_cursor c = {(const char *)s->k_cache, (const char *)s->v_cache, next, n_next, 0, 0, bytes};
    const int per = (int)((n_next * ((bytes + 63) / 64) + steps - 1) / steps); /* lines per 8-key step */
    const kv_t *k[DEC_TILE], *v[DEC_TILE];
    for (int kh = 0; kh < s->num_kv_heads; ++kh) {
        for (int j = 0; j < padded; ++j) {
            const int64_t row = rows[j < n ? j : n - 1] + (int64_t)kh * head_dim; /* padding: read, unused */
            k[j] = s->k_cache + row, v[j] = s->v_cache + row;
        }
        int h = kh * group;
#if SHARED_HEADS
        for (; h + 3 <= (kh + 1) * group && head_dim % 64 == 0; h += 3) heads3_step(qs, k, v, n, padded, head_dim, h, sc, m, l, acc, &c, per);
#endif
        for (; h < (kh + 1) * group; ++h) {
            float *sh = sc + h * DEC_TILE;
            for (int j = 0; j < padded; j += 8) {
                scores8(qs + h * head_dim, k + j, head_dim, sh + j);
                if (h == kh * group) prefetch_lines(&c, per);
            }
            for (int j = n; j < padded; ++j) sh[j] = -INFINITY;
            const float alpha = softmax_step(sh, padded, m + h, l + h);
            values_step(sh, v, n, head_dim, alpha, acc + (size_t)h * head_dim);
        }
    }
    prefetch_lines(&c, INT32_MAX); /* what is left (a last, shorter tile's steps ask fewer) */
}

/* Keys in the tile that starts `remaining` keys before the end: DEC_TILE, or the rest. */
static inline int tile_keys(int64_t remaining) { return (int)(remaining < DEC_TILE ? remaining : DEC_TILE); }

/* Keys [p0, p1) of row r for every head: state m [H], l [H] and the unnormalised output
 * acc [H][D], which start at (-FLT_MAX, 0, 0). */
static void decode_range(const struct decode_shape *s, int64_t r, int64_t p0, int64_t p1, float *scratch, float *m,
                         float *l, float *acc) {
    const int num_heads = s->num_heads, head_dim = s->head_dim;
    const float *q = s->q + r * num_heads * head_dim;
    const int64_t *table = s->block_tables + r * s->table_stride;
    float *qs = scratch, *sc = scratch + (size_t)num_heads * head_dim;
    for (int i = 0; i < num_heads * head_dim; ++i) qs[i] = q[i] * s->scale;
    for (int h = 0; h < num_heads; ++h) m[h] = -FLT_MAX, l[h] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)num_heads * head_dim);
    int64_t tiles[2][DEC_TILE], *rows = tiles[0], *next = tiles[1];
    kv_rows(table, s->block_size, p0, tile_keys(p1 - p0), s->token_stride, 0, rows);
    vf8 touched = touch_rows(s->k_cache, s->v_cache, rows, tile_keys(p1 - p0), s->token_stride);
    for (int64_t pos = p0; pos < p1; pos += DEC_TILE) {
        const int64_t ahead = p1 - pos - DEC_TILE; /* keys after this tile */
        const int n_next = ahead > 0 ? tile_keys(ahead) : 0;
        if (n_next) kv_rows(table, s->block_size, pos + DEC_TILE, n_next, s->token_stride, 0, next);
        decode_tile(s, qs, rows, tile_keys(p1 - pos), next, n_next, sc, m, l, acc);
        int64_t *done = rows;
        rows = next, next = done;
    }
    volatile float keep = vf8_hsum(touched); /* a volatile store: the touching loads must happen */
    (void)keep;
}

/* Where split `split` (numbered across rows) keeps its (m [H], l [H], acc [H][D]). */
static float *partial_of(const struct decode_shape *s, int64_t split) {
    return s->partials + split * (size_t)s->num_heads * (2 + s->head_dim);
}

/* The row holding split `split` (first_split[] holds each row's first). */
static int64_t row_of(const struct decode_shape *s, int64_t num_rows, int64_t split) {
    int64_t lo = 0, hi = num_rows - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (s->first_split[mid] <= split) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* One work item, split `split` of its row: a lone split writes the row's output itself. */
static void decode_item(const struct decode_shape *s, int64_t num_rows, int64_t split, float *scratch) {
    const int num_heads = s->num_heads, head_dim = s->head_dim;
    const int64_t r = row_of(s, num_rows, split), index = split - s->first_split[r];
    const int64_t p0 = index * s->split_len[r], end = p0 + s->split_len[r];
    const int64_t p1 = end < s->seq_lens[r] ? end : s->seq_lens[r];
    const int alone = s->first_split[r + 1] - s->first_split[r] == 1;
    float *m = alone ? scratch + (size_t)num_heads * (head_dim + DEC_TILE) : partial_of(s, split);
    float *l = m + num_heads, *acc = l + num_heads;
    decode_range(s, r, p0, p1, scratch, m, l, acc);
    if (!alone) return;
    float *o = s->out + r * num_heads * head_dim;
    for (int h = 0; h < num_heads; ++h)
        for (int d = 0; d < head_dim; ++d) o[h * head_dim + d] = acc[h * head_dim + d] / l[h];
}

/* Row r's output for head h from its splits' partials, each rescaled to the common max. */
static void combine_splits(const struct decode_shape *s, int64_t r, int h) {
    const int64_t first = s->first_split[r], count = s->first_split[r + 1] - first;
    const int num_heads = s->num_heads, head_dim = s->head_dim;
    if (count == 1) return;
    float top = -FLT_MAX, total = 0.0f;
    for (int64_t i = 0; i < count; ++i) top = fmaxf(top, partial_of(s, first + i)[h]);
    float *o = s->out + (r * num_heads + h) * head_dim;
    memset(o, 0, sizeof(float) * head_dim);
    for (int64_t i = 0; i < count; ++i) {
        const float *part = partial_of(s, first + i);
        const float weight = exp2f(part[h] - top), *acc = part + 2 * num_heads + (size_t)h * head_dim;
        total += weight * part[num_heads + h];
        for (int d = 0; d < head_dim; ++d) o[d] += weight * acc[d];
    }
    const float inv = 1.0f / total;
    for (int d = 0; d < head_dim; ++d) o[d] *= inv;
}

/* Splits for each row into first_split [R + 1] and split_len [R]; returns the total. Enough
 * for every thread to have DEC_ITEMS_PER_THREAD items, none under DEC_MIN_SPLIT keys. */
static int64_t plan_splits(const int64_t *seq_lens, int num_rows, int num_threads, int64_t *first_split,
                           int64_t *split_len) {
    const int64_t wanted = (int64_t)num_threads * DEC_ITEMS_PER_THREAD;
    int64_t cap = (wanted + num_rows - 1) / num_rows;
    cap = cap < 1 ? 1 : cap > DEC_MAX_SPLITS ? DEC_MAX_SPLITS : cap;
    first_split[0] = 0;
    for (int r = 0; r < num_rows; ++r) {
        const int64_t len = seq_lens[r] > 1 ? seq_lens[r] : 1;
        int64_t splits = (len + DEC_MIN_SPLIT - 1) / DEC_MIN_SPLIT;
        splits = splits < cap ? splits : cap;
        const int64_t chunk = (len + splits - 1) / splits;
        split_len[r] = (chunk + DEC_TILE - 1) / DEC_TILE * DEC_TILE;
        first_split[r + 1] = first_split[r] + (len + split_len[r] - 1) / split_len[r];
    }
    return first_split[num_rows];
}

/* Returns 0, or -1 when a scratch allocation failed (the caller raises). */
int paged_decode_attention(const float *q, const kv_t *k_cache, const kv_t *v_cache,
                           const int64_t *block_tables, int64_t table_stride,
                           const int64_t *seq_lens, float *out, int num_rows, int num_heads,
                           int num_kv_heads, int head_dim, int block_size, float scale,
                           int num_threads) {
    int64_t *plan = malloc(sizeof(int64_t) * (2 * (size_t)num_rows + 1));
    if (!plan) return -1;
    const int64_t splits = plan_splits(seq_lens, num_rows, num_threads, plan, plan + num_rows + 1);
    float *partials = 0;
    if (splits > num_rows && !(partials = malloc(sizeof(float) * splits * num_heads * (2 + (size_t)head_dim)))) {
        free(plan);
        return -1;
    }
    const struct decode_shape shape = {
        q, k_cache, v_cache, out, partials, block_tables, seq_lens, plan, plan + num_rows + 1, table_stride,
        (int64_t)num_kv_heads * head_dim, num_heads, num_kv_heads, num_heads / num_kv_heads, head_dim, block_size,
        scale * LOG2_E,
    };
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = malloc(sizeof(float) * decode_scratch_floats(num_heads, head_dim));
        if (!scratch) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t split = 0; split < splits; ++split)
            if (scratch) decode_item(&shape, num_rows, split, scratch);
        /* the loop's barrier: every partial is written before any row combines them */
        if (splits > num_rows) {
#pragma omp for schedule(static)
            for (int64_t pair = 0; pair < (int64_t)num_rows * num_heads; ++pair)
                combine_splits(&shape, pair / num_heads, (int)(pair % num_heads));
        }
        free(scratch);
    }
    free(plan);
    free(partials);
    return failed ? -1 : 0;
}
