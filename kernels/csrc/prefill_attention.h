// Chunked prefill attention over the paged cache (attention_prefill, for kernels/cpu_attention.py).
// A chunk of n new queries (their K/V already written) attends causally to the cache, read in place through the
// block table: no gathered copy of the context, no dense mask, no scores matrix. Units are (KV head, tile of
// queries); a unit keeps the running maximum, sum and output of each (query, head) of its tile and goes through
// its keys a step of at most 16 (within one cache block) at a time, online softmax.
// The vector kernels are prefill_lanes.h and prefill_bf16.h, included at the end.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "decode_types.h"
#include "thread_pool.h"
#include "vec_math.h"

#define PF_STATES 64  // (query, head) pairs per unit
#define PF_KEYS 16    // keys per step

typedef struct {
    const void *query;
    int32_t q_type, cache_type, out_type, v_type;  // cache_type: K's
    int64_t n, start;
    const void *k_cache, *v_cache;
    float k_scale, v_scale, scale, softcap;
    const int32_t *block_table;
    int num_heads, num_kv_heads, head_dim, block_size, window, tile;
    int64_t num_tiles;
    void *out;
    const float *sinks;  // [num_heads] or NULL: gpt-oss's attention sinks, a logit per head in every softmax
} prefill_task;

static void store_scalar(void *p, int32_t type, int64_t i, float v) {
    switch (type) {
    case W_F16: ((uint16_t *)p)[i] = f32_f16(v); break;
    case W_BF16: ((uint16_t *)p)[i] = f32_to_bf16(v); break;
    default: ((float *)p)[i] = v;
    }
}

// What a unit reads: KV head kh's queries [t0, t1) of the chunk (states: (query, head) pairs, state i being query
// t0 + i / group and head kh * group + i % group) and the keys at positions [lo, last_q].
typedef struct {
    int kh, states;
    int64_t t0, t1, lo, last_q;
} prefill_unit;

static inline prefill_unit unit_of(const prefill_task *t, int64_t unit) {
    prefill_unit u;
    u.kh = (int)(unit / t->num_tiles);
    u.t0 = (unit % t->num_tiles) * t->tile, u.t1 = u.t0 + t->tile < t->n ? u.t0 + t->tile : t->n;
    u.states = (int)(u.t1 - u.t0) * (t->num_heads / t->num_kv_heads);
    const int64_t first_q = t->start + u.t0;
    u.last_q = t->start + u.t1 - 1;
    u.lo = t->window > 0 && first_q + 1 > t->window ? first_q + 1 - t->window : 0;
    return u;
}

// Offset (in elements) of state i's row in the queries and the output
static inline int64_t state_row(const prefill_task *t, const prefill_unit *u, int i) {
    const int group = t->num_heads / t->num_kv_heads;
    return ((u->t0 + i / group) * t->num_heads + u->kh * group + i % group) * t->head_dim;
}

// The keys of the step from pos: within its cache block, at most `most`, none past last_q; *first is the cache row
// (in rows of head_dim) of the first one's KV head, the next ones num_kv_heads rows apart.
static inline int step_keys(const prefill_task *t, const prefill_unit *u, int64_t pos, int most, int64_t *first) {
    const int bs = t->block_size;
    int cnt = bs - (int)(pos % bs);
    if (cnt > most) cnt = most;
    if (cnt > u->last_q + 1 - pos) cnt = (int)(u->last_q + 1 - pos);
    *first = ((int64_t)t->block_table[pos / bs] * bs + pos % bs) * t->num_kv_heads + u->kh;
    return cnt;
}

// The portable kernel: the scalar build's, and past 2^24 positions (which float32 lanes cannot hold exactly).
// Vector builds run prefill_lanes.h (and prefill_bf16.h where AVX512-BF16 is).
static void prefill_chunk(void *ctx, int64_t begin, int64_t end) {
    prefill_task *t = ctx;
    const int hd = t->head_dim, kvh = t->num_kv_heads, group = t->num_heads / kvh;
    // on the thread's stack (at most 320 KiB): a call allocates nothing but its output
    float q[PF_STATES * MAX_HEAD_DIM], acc[PF_STATES * MAX_HEAD_DIM], kt[MAX_HEAD_DIM * PF_KEYS];
    float vrows[PF_KEYS][MAX_HEAD_DIM], m[PF_STATES], l[PF_STATES], s[PF_STATES][PF_KEYS];
    for (int64_t unit = begin; unit < end; unit++) {
        const prefill_unit u = unit_of(t, unit);
        const int states = u.states;
        for (int i = 0; i < states; i++) {
            const int64_t row = state_row(t, &u, i);
            for (int d = 0; d < hd; d++) q[i * hd + d] = load_scalar(t->query, t->q_type, row + d) * t->scale;
            // a sink joins the softmax as one more score that adds no value: the running max and sum start from it
            m[i] = t->sinks ? t->sinks[u.kh * group + i % group] : -INFINITY, l[i] = t->sinks ? 1.0f : 0.0f;
            memset(acc + i * hd, 0, (size_t)hd * 4);
        }
        for (int64_t pos = u.lo; pos <= u.last_q;) {
            int64_t first;
            const int cnt = step_keys(t, &u, pos, PF_KEYS, &first);
            for (int j = 0; j < PF_KEYS; j++) {  // K transposed: kt[d][j]; V rows as float32
                if (j < cnt) {
                    float krow[MAX_HEAD_DIM];
                    load_row(t->k_cache, t->cache_type, (first + (int64_t)j * kvh) * hd, hd, t->k_scale, krow);
                    load_row(t->v_cache, t->v_type, (first + (int64_t)j * kvh) * hd, hd, t->v_scale, vrows[j]);
                    for (int d = 0; d < hd; d++) kt[d * PF_KEYS + j] = krow[d];
                } else {
                    for (int d = 0; d < hd; d++) kt[d * PF_KEYS + j] = 0.0f;
                }
            }
            for (int i = 0; i < states; i++) {
                const int64_t qp = t->start + u.t0 + i / group;
                if (pos > qp) continue;  // every key of the step is after this query
                const float *qi = q + i * hd;
                float *si = s[i];
                for (int j = 0; j < PF_KEYS; j++) {
                    float x = 0.0f;
                    for (int d = 0; d < hd; d++) x += qi[d] * kt[d * PF_KEYS + j];
                    si[j] = x;
                }
                // the keys of this step the query sees: causal, and within its window
                const int jhi = qp - pos + 1 < cnt ? (int)(qp - pos + 1) : cnt;
                int jlo = 0;
                if (t->window > 0 && qp - t->window + 1 > pos) jlo = (int)(qp - t->window + 1 - pos);
                if (jlo >= jhi) {
                    for (int j = 0; j < PF_KEYS; j++) si[j] = 0.0f;
                    continue;
                }
                float top = -INFINITY;
                for (int j = jlo; j < jhi; j++) {
                    if (t->softcap > 0.0f) si[j] = tanhf(si[j] / t->softcap) * t->softcap;
                    top = si[j] > top ? si[j] : top;
                }
                if (top > m[i]) {
                    float c = expf(m[i] - top);
                    l[i] *= c;
                    for (int d = 0; d < hd; d++) acc[i * hd + d] *= c;
                    m[i] = top;
                }
                for (int j = 0; j < PF_KEYS; j++) si[j] = j >= jlo && j < jhi ? si[j] - m[i] : -200.0f;
                exp_inplace(si, PF_KEYS);  // exp(-200) is 0: keys it does not see weigh nothing
                for (int j = jlo; j < jhi; j++) l[i] += si[j];
            }
            for (int i = 0; i < states; i++) {  // acc += p V
                if (pos > t->start + u.t0 + i / group) continue;
                float *ai = acc + i * hd;
                const float *pi = s[i];
                for (int d = 0; d < hd; d++)
                    for (int j = 0; j < cnt; j++) ai[d] += pi[j] * vrows[j][d];
            }
            pos += cnt;
        }
        for (int i = 0; i < states; i++) {
            const int64_t row = state_row(t, &u, i);
            float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
            for (int d = 0; d < hd; d++) store_scalar(t->out, t->out_type, row + d, acc[i * hd + d] * inv);
        }
    }
}

#include "prefill_lanes.h"
#include "prefill_bf16.h"

// out [n, num_heads, head_dim] (out_type) for queries [n, num_heads, head_dim] (q_type) at positions start.. of
// one sequence, against its cache through block_table (softcap 0: none; window 0: the whole context). cache_type
// is K's, v_type V's; q8_0 / q4_0 rows are widened a step's keys at a time (load_row), never the whole cache.
// sinks: float32 [num_heads] or NULL; given, the portable kernel runs (the vector ones have no sinks yet).
int attention_prefill(const void *query, int32_t q_type, int64_t n, int64_t start, const void *k_cache,
                      const void *v_cache, int32_t cache_type, int32_t v_type, float k_scale, float v_scale,
                      const int32_t *block_table,
                      int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale,
                      float softcap, int32_t window, void *out, int32_t out_type, const float *sinks) {
    if (head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads) return -1;
    if ((cache_is_blocks(cache_type) || cache_is_blocks(v_type)) && head_dim % 32) return -1;
    const int group = num_heads / num_kv_heads;
    if (group > PF_STATES) return -1;
    task_fn chunk = prefill_chunk;
    int states = PF_STATES;
#ifdef VEC_LANES
    if (start + n < (1 << 24) && sinks == NULL) chunk = prefill_chunk_lanes;  // positions exact as float32 lanes
#endif
#if defined(__AVX512BF16__)
    if (q_type == W_BF16 && (cache_type == W_BF16 || cache_type == CACHE_FP8) && v_type == cache_type &&
        softcap == 0.0f && sinks == NULL &&
        head_dim % 16 == 0 && group <= PB_STATES)
        chunk = prefill_chunk_bf16, states = PB_STATES;
#endif
    prefill_task t = {query, q_type, cache_type, out_type, v_type, n, start, k_cache, v_cache, k_scale, v_scale, scale,
                      softcap, block_table, num_heads, num_kv_heads, head_dim, block_size, window, states / group, 0,
                      out, sinks};
    // smaller tiles when there are too few units for the threads
    while (t.tile > 1 && num_kv_heads * ((n + t.tile - 1) / t.tile) < 4 * pool.num_threads) t.tile /= 2;
    t.num_tiles = (n + t.tile - 1) / t.tile;
    pthread_mutex_lock(&CALLS);
    parallel(chunk, &t, num_kv_heads * t.num_tiles, 1);
    pthread_mutex_unlock(&CALLS);
    return 0;
}
