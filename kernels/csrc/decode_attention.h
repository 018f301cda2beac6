// Decode attention over the paged cache: each lane's one new query token against its sequence's blocks, read in place
// through the block table (online softmax, grouped KV heads, the keys split into ranges over the threads and merged).
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "decode_scratch.h"
#include "decode_types.h"
#include "thread_pool.h"
#include "vec_math.h"

static inline float dot(const float *a, const float *b, int n) {
#ifdef VEC_LANES
    vf acc = vzero();
    int i = 0;
    for (; i + VEC_LANES <= n; i += VEC_LANES) acc = vfma(vload(a + i), vload(b + i), acc);
    float s = vsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
#else
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
#endif
}

static inline void axpy(float *y, float a, const float *x, int n) {  // y += a x
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

typedef struct {
    const model *m;
    const layer *l;
    const int32_t *block_table;
    int64_t lo, hi;  // the keys attended: positions [lo, hi)
    int64_t splits, per_split;
    scratch *s;  // the lane's: its queries, partial sums and output
} attn_task;

#ifdef VEC_LANES
// VEC_LANES of a q8_0 / q4_0 block's values from the i-th (i a multiple of VEC_LANES), unscaled: q, or q4_0's q - 8
static inline vf block_vec(const uint8_t *b, int32_t type, int i) {
#if VEC_LANES == 16
    if (type == CACHE_Q8_0)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + i))));
    __m128i x = _mm_loadu_si128((const __m128i *)(b + 2));  // values 0-15 in the low nibbles, 16-31 in the high
    if (i) x = _mm_srli_epi16(x, 4);
    x = _mm_and_si128(x, _mm_set1_epi8(15));
    return _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x)), _mm512_set1_ps(8.0f));
#else
    if (type == CACHE_Q8_0)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + i))));
    __m128i x = _mm_loadl_epi64((const __m128i *)(b + 2 + (i & 15)));
    if (i >= 16) x = _mm_srli_epi16(x, 4);
    x = _mm_and_si128(x, _mm_set1_epi8(15));
    return _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)), _mm256_set1_ps(8.0f));
#endif
}
#endif

// q . key row of a q8_0 / q4_0 cache, in place: each block's 32 products with its quants, times its scale once
static inline float block_key_dot(const float *q, const void *cache, int32_t type, int64_t offset, int n) {
    const uint8_t *b = (const uint8_t *)cache + cache_bytes(type, offset);
    const int64_t bb = cache_bytes(type, 32);
#ifdef VEC_LANES
    vf total = vzero();
    for (int k = 0; k < n; k += 32, b += bb) {
        vf acc = vzero();
        for (int i = 0; i < 32; i += VEC_LANES) acc = vfma(vload(q + k + i), block_vec(b, type, i), acc);
        total = vfma(vset(block_scale(b)), acc, total);
    }
    return vsum(total);
#else
    float s = 0.0f;
    for (int k = 0; k < n; k += 32, b += bb) {
        float a = 0.0f;
        for (int i = 0; i < 32; i++) a += q[k + i] * (float)block_quant(b, type, i);
        s += a * block_scale(b);
    }
    return s;
#endif
}

// acc[g] += p[g] v for the `group` heads from a q8_0 / q4_0 value row in place: p[g] * d times each block's quants
static inline void block_value_axpy(float *acc, int64_t acc_stride, const float *p, int64_t p_stride, int group,
                                    const void *cache, int32_t type, int64_t offset, int n) {
    const uint8_t *b = (const uint8_t *)cache + cache_bytes(type, offset);
    const int64_t bb = cache_bytes(type, 32);
    for (int k = 0; k < n; k += 32, b += bb) {
        const float d = block_scale(b);
#ifdef VEC_LANES
        for (int i = 0; i < 32; i += VEC_LANES) {
            const vf v = block_vec(b, type, i);
            for (int g = 0; g < group; g++) {
                float *a = acc + g * acc_stride + k + i;
                vstore(a, vfma(vset(p[g * p_stride] * d), v, vload(a)));
            }
        }
#else
        for (int g = 0; g < group; g++) {
            const float c = p[g * p_stride] * d;
            for (int i = 0; i < 32; i++) acc[g * acc_stride + k + i] += c * (float)block_quant(b, type, i);
        }
#endif
    }
}

// q . key row, through a converted row (fp8 caches, rows of no whole vectors; block_scores has the vector path);
// q8_0 / q4_0 rows in place
static inline float key_dot(const float *q, const void *cache, int32_t type, int64_t offset, int n, float scale) {
    if (cache_is_blocks(type)) return block_key_dot(q, cache, type, offset, n);
    float row[MAX_HEAD_DIM];
    load_row(cache, type, offset, n, scale, row);
    return dot(q, row, n);
}

// acc[g] += p[g] v for the `group` heads, v widened from its cache row (caches of no whole vectors, fp8); q8_0 /
// q4_0 rows in place
static inline void value_axpy(float *acc, int64_t acc_stride, const float *p, int64_t p_stride, int group,
                              const void *cache, int32_t type, int64_t offset, int n, float scale) {
    if (cache_is_blocks(type)) {
        block_value_axpy(acc, acc_stride, p, p_stride, group, cache, type, offset, n);
        return;
    }
    float row[MAX_HEAD_DIM];
    load_row(cache, type, offset, n, scale, row);
    for (int g = 0; g < group; g++) axpy(acc + g * acc_stride, p[g * p_stride], row, n);
}

#ifdef VEC_LANES
// one vector of a bf16, f16 or f32 cache row from element o, as float32
static inline vf cache_vec(const void *cache, int32_t type, int64_t o) {
    return type == W_BF16  ? vload_bf16((const uint16_t *)cache + o)
           : type == W_F16 ? vload_f16((const uint16_t *)cache + o)
                           : vload((const float *)cache + o);
}

// A bf16 cache's vectors in pairs: PAIR values in one load, the even-numbered and the odd-numbered ones each widened
// by one operation (a shift, a mask) where vload_bf16 takes a widening load and a shift per VEC_LANES. The query
// and the output are kept in that order (`pair_order`), so the dots and the sums are the same products.
#define PAIR (2 * VEC_LANES)
static inline void bf16_pair(const void *cache, int64_t o, vf *even, vf *odd) {
    const uint16_t *p = (const uint16_t *)cache + o;
#if VEC_LANES == 16
    const __m512i x = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
#else
    const __m256i x = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
#endif
}

// Whether rows of a `type` cache of n values are read in pairs (bf16_pair)
static inline int paired(int32_t type, int n) { return type == W_BF16 && n % PAIR == 0; }

// x's n values (a multiple of PAIR) into pair order, each run of PAIR its even-numbered values then its odd ones;
// or (back) from it
static void pair_order(float *x, int n, int back) {
    float t[PAIR];
    for (int c = 0; c < n; c += PAIR) {
        memcpy(t, x + c, sizeof t);
        for (int i = 0; i < VEC_LANES; i++) {
            if (back)
                x[c + 2 * i] = t[i], x[c + 2 * i + 1] = t[VEC_LANES + i];
            else
                x[c + i] = t[2 * i], x[c + VEC_LANES + i] = t[2 * i + 1];
        }
    }
}

// CALL(ng, pairs) with both compile-time constants (ng: heads, 1-4; pairs: 0 or 1), so each pair is its own
// unrolled code
#define BY_HEADS(CALL, heads, pairs) \
    switch ((heads) * 2 + (pairs)) { \
    case 2: CALL(1, 0); break; \
    case 3: CALL(1, 1); break; \
    case 4: CALL(2, 0); break; \
    case 5: CALL(2, 1); break; \
    case 6: CALL(3, 0); break; \
    case 7: CALL(3, 1); break; \
    case 8: CALL(4, 0); break; \
    default: CALL(4, 1); \
    }

// Accumulator registers a values tile keeps: ng heads x nv vectors of their output, each an independent chain of
// FMAs over the block's keys (AVX2's 16 registers: 8, beside the value vectors; AVX-512's 32: 16)
#define ACC_REGS (VEC_LANES == 16 ? 16 : 8)

// acc[h][i, i + nv vectors) += sum_j p[h][j] v_j[...] for ng heads (both compile-time constants where inlined): the
// value vectors loaded (and converted) once for all ng heads, ng * nv sums in registers across the block's keys
static inline __attribute__((always_inline)) void values_tile(float *acc, int64_t acc_stride, const float *p,
                                                              const void *cache, int32_t type, int64_t offset,
                                                              int64_t stride, int cnt, int i, const int ng,
                                                              const int nv, const int pairs) {
    vf a[4][8], x[8];
#pragma GCC unroll 4
    for (int g = 0; g < ng; g++)
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++) a[g][v] = vload(acc + g * acc_stride + i + v * VEC_LANES);
    for (int j = 0; j < cnt; j++) {
        const int64_t o = offset + j * stride + i;
        if (pairs && nv % 2 == 0)
#pragma GCC unroll 4
            for (int v = 0; v < nv; v += 2) bf16_pair(cache, o + v * VEC_LANES, &x[v], &x[v + 1]);
        else
#pragma GCC unroll 8
            for (int v = 0; v < nv; v++) x[v] = cache_vec(cache, type, o + v * VEC_LANES);
#pragma GCC unroll 4
        for (int g = 0; g < ng; g++) {
            const vf pg = vset(p[g * 64 + j]);
#pragma GCC unroll 8
            for (int v = 0; v < nv; v++) a[g][v] = vfma(pg, x[v], a[g][v]);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < ng; g++)
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++) vstore(acc + g * acc_stride + i + v * VEC_LANES, a[g][v]);
}

// acc[h] += sum_j p[h][j] v_j for ng (1-4, a constant where it is inlined) heads: p: [ng][64], acc rows acc_stride
// apart. The output is summed in registers across the block's values, as many independent chains as ACC_REGS
// allows: one chain per head (a vector at a time) waited on each FMA's latency, and with one head per KV head (the
// 1.7b shape) that wait was most of a long context's attention.
static inline __attribute__((always_inline)) void values_heads(float *acc, int64_t acc_stride, const float *p,
                                                               const void *cache, int32_t type, int64_t offset,
                                                               int64_t stride, int cnt, int n, const int ng,
                                                               const int pairs) {
    const int most = ACC_REGS / ng;  // vectors of each head's output a tile holds (pairs: n a multiple of two)
    int i = 0;
    if (most >= 8)
        for (; i + 8 * VEC_LANES <= n; i += 8 * VEC_LANES)
            values_tile(acc, acc_stride, p, cache, type, offset, stride, cnt, i, ng, 8, pairs);
    if (most >= 4)
        for (; i + 4 * VEC_LANES <= n; i += 4 * VEC_LANES)
            values_tile(acc, acc_stride, p, cache, type, offset, stride, cnt, i, ng, 4, pairs);
    for (; i + 2 * VEC_LANES <= n; i += 2 * VEC_LANES)
        values_tile(acc, acc_stride, p, cache, type, offset, stride, cnt, i, ng, 2, pairs);
    for (; i < n; i += VEC_LANES) values_tile(acc, acc_stride, p, cache, type, offset, stride, cnt, i, ng, 1, 0);
}
#else
static inline int paired(int32_t type, int n) { return (void)type, (void)n, 0; }
static void pair_order(float *x, int n, int back) { (void)x, (void)n, (void)back; }
#endif

// acc[g] += sum_j p[g][j] v_j over a block's `cnt` values (v_j at offset + j * stride), p: [group][64], four heads
// at a time; vec: 0 row by row (value_axpy), 1 in vectors, 2 in pairs of vectors (acc in pair order)
static inline void block_values(float *acc, int64_t acc_stride, const float *p, int group, const void *cache,
                                int32_t type, int vec, int64_t offset, int64_t stride, int cnt, int n, float scale) {
#ifdef VEC_LANES
    if (vec) {
        for (int g0 = 0; g0 < group; g0 += 4) {
            float *a = acc + g0 * acc_stride;
            const float *pg = p + g0 * 64;
#define VALUES(ng, pairs) values_heads(a, acc_stride, pg, cache, type, offset, stride, cnt, n, ng, pairs)
            const int heads = group - g0 < 4 ? group - g0 : 4;
            BY_HEADS(VALUES, heads, vec == 2);
#undef VALUES
        }
        return;
    }
#endif
    for (int j = 0; j < cnt; j++)
        value_axpy(acc, acc_stride, p + j, 64, group, cache, type, offset + j * stride, n, scale);
}

#ifdef VEC_LANES
// sc[h][j0, j0 + nk) = q_h . key_j for ng heads of one KV head (q_h n apart, sc: [ng][64]) and nk keys (both
// compile-time constants where inlined): each key vector loaded (and converted) once for all ng heads, each query
// vector once for all nk keys, ng * nk independent sums
static inline __attribute__((always_inline)) void scores_tile(float *sc, const float *q, const void *cache,
                                                              int32_t type, int64_t offset, int64_t stride, int j0,
                                                              int n, const int ng, const int nk, const int pairs) {
    vf a[4][8], k[8], k2[8];
#pragma GCC unroll 4
    for (int g = 0; g < ng; g++)
#pragma GCC unroll 8
        for (int t = 0; t < nk; t++) a[g][t] = vzero();
    const int64_t o = offset + (int64_t)j0 * stride;
    for (int i = 0; i < n; i += pairs ? PAIR : VEC_LANES) {
        if (pairs)
#pragma GCC unroll 8
            for (int t = 0; t < nk; t++) bf16_pair(cache, o + t * stride + i, &k[t], &k2[t]);
        else
#pragma GCC unroll 8
            for (int t = 0; t < nk; t++) k[t] = cache_vec(cache, type, o + t * stride + i);
#pragma GCC unroll 4
        for (int g = 0; g < ng; g++) {
            const vf qg = vload(q + (int64_t)g * n + i);
#pragma GCC unroll 8
            for (int t = 0; t < nk; t++) a[g][t] = vfma(qg, k[t], a[g][t]);
            if (pairs) {
                const vf q2 = vload(q + (int64_t)g * n + i + VEC_LANES);
#pragma GCC unroll 8
                for (int t = 0; t < nk; t++) a[g][t] = vfma(q2, k2[t], a[g][t]);
            }
        }
    }
    if (ng == 1 && nk % 4 == 0) {  // four keys' sums in one reduction
#pragma GCC unroll 2
        for (int t = 0; t < nk; t += 4) _mm_storeu_ps(sc + j0 + t, vsum4(a[0][t], a[0][t + 1], a[0][t + 2], a[0][t + 3]));
        return;
    }
    if (ng == 1) {
#pragma GCC unroll 8
        for (int t = 0; t < nk; t++) sc[j0 + t] = vsum(a[0][t]);
        return;
    }
#pragma GCC unroll 8
    for (int t = 0; t < nk; t++) {  // a key's sums of the heads in one reduction
        float four[4];
        _mm_storeu_ps(four, vsum4(a[0][t], a[1][t], ng > 2 ? a[2][t] : vzero(), ng > 3 ? a[3][t] : vzero()));
#pragma GCC unroll 4
        for (int g = 0; g < ng; g++) sc[g * 64 + j0 + t] = four[g];
    }
}

// sc[h][j] = q_h . key_j for ng (1-4, a constant where it is inlined) heads over a block's cnt keys, as many keys
// at a time as ACC_REGS sums allow (one chain per head or per key waited on each FMA's latency)
static inline __attribute__((always_inline)) void scores_heads(float *sc, const float *q, const void *cache,
                                                               int32_t type, int64_t offset, int64_t stride, int cnt,
                                                               int n, const int ng, const int pairs) {
    const int most = ACC_REGS / ng;  // keys a tile takes
    int j = 0;
    if (most >= 8)
        for (; j + 8 <= cnt; j += 8) scores_tile(sc, q, cache, type, offset, stride, j, n, ng, 8, pairs);
    if (most >= 4)
        for (; j + 4 <= cnt; j += 4) scores_tile(sc, q, cache, type, offset, stride, j, n, ng, 4, pairs);
    if (most >= 2)
        for (; j + 2 <= cnt; j += 2) scores_tile(sc, q, cache, type, offset, stride, j, n, ng, 2, pairs);
    for (; j < cnt; j++) scores_tile(sc, q, cache, type, offset, stride, j, n, ng, 1, pairs);
}
#endif

// sc[g][j] = q_g . key_j for the `group` query heads of a KV head over a block's `cnt` keys (key_j at offset +
// j * stride), sc: [group][64], four heads at a time; vec 2: in pairs of vectors (q in pair order)
static inline void block_scores(float *sc, const float *q, int group, const void *cache, int32_t type,
                                int64_t offset, int64_t stride, int cnt, int n, int vec) {
#ifdef VEC_LANES
    for (int g0 = 0; g0 < group; g0 += 4) {
        const float *qg = q + (int64_t)g0 * n;
        float *sg = sc + g0 * 64;
#define SCORES(ng, pairs) scores_heads(sg, qg, cache, type, offset, stride, cnt, n, ng, pairs)
        const int heads = group - g0 < 4 ? group - g0 : 4;
        BY_HEADS(SCORES, heads, vec == 2);
#undef SCORES
    }
#else
    (void)q, (void)group, (void)cache, (void)type, (void)offset, (void)stride, (void)cnt, (void)n, (void)sc, (void)vec;
#endif
}

// The cache lines of [p, p + bytes) on their way into the core's L2: a block's keys and values lie together (all
// KV heads of a block), but the next block is anywhere, where the hardware prefetcher cannot follow. Into L2, not
// L1: a block's lines at once filled L1's few miss buffers, and the prefetches themselves stalled (docs/kernels.md,
// "Attention, decode").
static inline void prefetch_range(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 2);
}

// [k, k + bytes) and [v, v + bytes) loaded in memory order (the values discarded). A step's keys are then read a KV
// head at a time, rows strided by the other heads' (360m shape: 128 of every 640 bytes); from memory that pattern
// streams well below the rate of a sequential one, from L1 it costs nothing (docs/kernels.md, "Attention, decode").
static inline void load_in_order(const void *k, const void *v, int64_t bytes) {
    const char *a = k, *b = v;
#if defined(VEC_LANES) && VEC_LANES == 16
    __m512i x = _mm512_setzero_si512();
    for (int64_t i = 0; i + 64 <= bytes; i += 64)
        x = _mm512_or_si512(x, _mm512_or_si512(_mm512_loadu_si512(a + i), _mm512_loadu_si512(b + i)));
    __asm__ volatile("" : : "v"(x));
#elif defined(VEC_LANES)
    __m256i x = _mm256_setzero_si256();
    for (int64_t i = 0; i + 32 <= bytes; i += 64)
        x = _mm256_or_si256(x, _mm256_or_si256(_mm256_loadu_si256((const __m256i *)(a + i)),
                                               _mm256_loadu_si256((const __m256i *)(b + i))));
    __asm__ volatile("" : : "x"(x));
#else
    (void)a, (void)b, (void)bytes;
#endif
}

// One head's scores of a block's `cnt` keys (sc: room for 64) into their weights exp(score - max), and its running
// maximum, sum and weighted values p = [max, sum, acc[hd]] brought up to date. Vector builds take whole vectors,
// the keys past cnt at -inf (weight 0): the maximum and the sum were scalar chains, one add waiting on the last.
static inline void block_softmax(float *sc, int cnt, const model *m, float *p, int hd) {
    if (m->attn_softcap > 0.0f)
        for (int j = 0; j < cnt; j++) sc[j] = tanhf(sc[j] * m->attn_scale / m->attn_softcap) * m->attn_softcap;
    else
        for (int j = 0; j < cnt; j++) sc[j] *= m->attn_scale;
    float top = p[0], sum = 0.0f;
#ifdef VEC_LANES
    const int whole = (cnt + VEC_LANES - 1) / VEC_LANES * VEC_LANES;
    for (int j = cnt; j < whole; j++) sc[j] = -INFINITY;
    vf vt = vset(-INFINITY);
    for (int j = 0; j < whole; j += VEC_LANES) vt = vmaxv(vt, vload(sc + j));
    const float block_top = vmax_all(vt);
    top = block_top > top ? block_top : top;
#else
    for (int j = 0; j < cnt; j++) top = sc[j] > top ? sc[j] : top;
#endif
    if (top > p[0]) {  // a new maximum: rescale what was summed so far
        float c = expf(p[0] - top);
        p[1] *= c;
        for (int i = 0; i < hd; i++) p[2 + i] *= c;
        p[0] = top;
    }
#ifdef VEC_LANES
    vf vs = vzero();
    const vf neg_top = vset(-top);
    for (int j = 0; j < whole; j += VEC_LANES) {
        const vf e = vexp(_vadd(vload(sc + j), neg_top));  // exp(-inf) = 0
        vstore(sc + j, e);
        vs = _vadd(vs, e);
    }
    sum = vsum(vs);
#else
    for (int j = 0; j < cnt; j++) sc[j] -= top;
    exp_inplace(sc, cnt);
    for (int j = 0; j < cnt; j++) sum += sc[j];
#endif
    p[1] += sum;
}

// One unit = one split of the keys, for every head: the running maximum, sum and weighted values of each query
// head (flash decoding), a cache block of keys at a time; merged afterwards. All KV heads of a block are read
// together, so the cache is one sequential stream (a head at a time, its rows strided by the other heads',
// read it at a fraction of the bandwidth), and the next block is prefetched while this one is summed.
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 65536
#endif
static void attn_chunk(void *ctx, int64_t begin, int64_t end) {
    attn_task *t = ctx;
    const model *m = t->m;
    const int hd = m->head_dim, kvh = m->num_kv_heads, group = m->num_heads / kvh, bs = m->block_size;
    const int32_t type = m->cache_type, vtype = m->v_cache_type;  // K's and V's
#ifdef VEC_LANES
    // the float caches' vector paths, bf16 rows in pairs of vectors (q8_0 / q4_0 rows go through key_dot /
    // value_axpy, in place)
    const int vec = paired(type, hd) ? 2 : hd % VEC_LANES == 0 && type != CACHE_FP8 && !cache_is_blocks(type),
              vec_v = paired(vtype, hd) ? 2 : hd % VEC_LANES == 0 && vtype != CACHE_FP8 && !cache_is_blocks(vtype);
#else
    const int vec = 0, vec_v = 0;
#endif
    // blocks prefetched ahead: two while their keys and values take a small part of L2 (more were no faster), else
    // one (large blocks, such as the 1.7b shape's of 32 KV heads: 128 KiB with the values); docs/kernels.md
    const int64_t row_k = cache_bytes(type, hd), row_v = cache_bytes(vtype, hd);  // one token's row of one KV head
    const int64_t block_bytes = (int64_t)bs * kvh * (row_k > row_v ? row_k : row_v);
    int64_t ahead = PREFETCH_BYTES / (2 * block_bytes);
    if (ahead > 2) ahead = 2;
    if (ahead < 1) ahead = 1;
    float scores[MAX_GROUP * 64];  // [group][keys of a block]: blocks are read 64 tokens at most at a time
    for (int64_t split = begin; split < end; split++) {
        int64_t t0 = t->lo + split * t->per_split, t1 = t0 + t->per_split < t->hi ? t0 + t->per_split : t->hi;
        float *parts = t->s->part + split * m->num_heads * (hd + 2);  // per head: max, sum, acc
        for (int h = 0; h < m->num_heads; h++) {
            parts[h * (hd + 2)] = -INFINITY;
            parts[h * (hd + 2) + 1] = 0.0f;
            memset(parts + h * (hd + 2) + 2, 0, (size_t)hd * 4);
        }
        for (int64_t pos = t0; pos < t1;) {
            int off = (int)(pos % bs), cnt = bs - off;
            if (cnt > t1 - pos) cnt = (int)(t1 - pos);
            if (cnt > 64) cnt = 64;
            const int64_t slot = (int64_t)t->block_table[pos / bs] * bs + off;
            // `ahead` blocks on: at a split's start all of them at once, after that the one `ahead` blocks on, a KV
            // head's share at each head (all at once stalled on the core's outstanding misses)
            const char *pk = NULL, *pv = NULL;
            int64_t share = 0, share_v = 0;
            for (int64_t b = pos / bs + 1; b <= pos / bs + ahead && b * bs < t1; b++) {
                if (pos != t0 && b < pos / bs + ahead) continue;
                const int64_t at = (int64_t)t->block_table[b] * bs * kvh,  // in rows
                              rows = (b * bs + bs < t1 ? bs : t1 - b * bs) * kvh;
                pk = (const char *)t->l->k_cache + at * row_k, pv = (const char *)t->l->v_cache + at * row_v;
                share = pos == t0 ? 0 : (rows * row_k / kvh + 63) & ~(int64_t)63;
                share_v = pos == t0 ? 0 : (rows * row_v / kvh + 63) & ~(int64_t)63;
                if (!share) {
                    prefetch_range(pk, rows * row_k);
                    prefetch_range(pv, rows * row_v);
                }
            }
            const int64_t rows = (int64_t)cnt * kvh;
            if (row_k == row_v)
                load_in_order((const char *)t->l->k_cache + slot * kvh * row_k,
                              (const char *)t->l->v_cache + slot * kvh * row_v, rows * row_k);
            for (int kh = 0; kh < kvh; kh++) {
                if (share) {
                    prefetch_range(pk + kh * share, share);
                    prefetch_range(pv + kh * share_v, share_v);
                }
                const int64_t first = slot * kvh + kh;  // in rows of head_dim; the next token's is kvh rows on
                float *part = parts + (int64_t)kh * group * (hd + 2);
                const float *qh = t->s->qkv + (int64_t)kh * group * hd;
                if (vec)
                    block_scores(scores, qh, group, t->l->k_cache, type, first * hd, (int64_t)kvh * hd, cnt, hd, vec);
                else
                    for (int g = 0; g < group; g++)
                        for (int j = 0; j < cnt; j++)
                            scores[g * 64 + j] = key_dot(qh + (int64_t)g * hd, t->l->k_cache, type,
                                                         (first + (int64_t)j * kvh) * hd, hd, t->l->k_scale);
                for (int g = 0; g < group; g++) block_softmax(scores + g * 64, cnt, m, part + g * (hd + 2), hd);
                block_values(part + 2, hd + 2, scores, group, t->l->v_cache, vtype, vec_v, first * hd,
                             (int64_t)kvh * hd, cnt, hd, t->l->v_scale);
            }
            pos += cnt;
        }
    }
}

// The keys each lane attends, split so that all lanes' splits together keep every thread busy (none under 32
// keys), and one parallel call over all of them: a batched step has as many attentions per layer as lanes.
typedef struct {
    attn_task *lane;  // [lanes]
    int64_t first[MAX_LANES + 1];  // lane b's splits are units [first[b], first[b + 1])
    int lanes;
} attn_batch;

static void attn_units(void *ctx, int64_t begin, int64_t end) {
    attn_batch *t = ctx;
    int b = 0;
    for (int64_t u = begin; u < end; u++) {
        while (u >= t->first[b + 1]) b++;
        attn_chunk(&t->lane[b], u - t->first[b], u - t->first[b] + 1);
    }
}

static void attention(const model *m, const layer *l, int lanes, const int32_t *const *block_tables,
                      const int64_t *positions) {
    const int hd = m->head_dim;
    attn_task task[MAX_LANES];
    attn_batch batch = {task, {0}, lanes};
    const int64_t share = (2 * pool.num_threads + lanes - 1) / lanes;  // splits a lane needs to fill the threads
    if (paired(m->cache_type, hd))  // the keys are read in pairs: the queries in their order
        for (int b = 0; b < lanes; b++)
            for (int h = 0; h < m->num_heads; h++) pair_order(LANES[b].qkv + (int64_t)h * hd, hd, 0);
    for (int b = 0; b < lanes; b++) {
        attn_task *t = &task[b];
        *t = (attn_task){m, l, block_tables[b], 0, positions[b] + 1, 1, 0, &LANES[b]};
        if (l->window > 0 && positions[b] + 1 > l->window) t->lo = positions[b] + 1 - l->window;
        int64_t n = t->hi - t->lo, want = share;
        if (n / 256 > want) want = n / 256;
        if (want > n / 32) want = n / 32;
        if (want > MAX_SPLITS) want = MAX_SPLITS;
        if (want < 1) want = 1;
        t->per_split = (n + want - 1) / want;
        t->splits = (n + t->per_split - 1) / t->per_split;
        batch.first[b + 1] = batch.first[b] + t->splits;
    }
    parallel(attn_units, &batch, batch.first[lanes], 1);
    for (int b = 0; b < lanes; b++) {
        const scratch *s = &LANES[b];
        for (int h = 0; h < m->num_heads; h++) {  // merge the splits of each head
            float top = -INFINITY, total = 0.0f, *out = s->attn + (int64_t)h * hd;
            for (int64_t k = 0; k < task[b].splits; k++) {
                float mx = s->part[(k * m->num_heads + h) * (hd + 2)];
                if (mx > top) top = mx;
            }
            if (l->sinks) {  // gpt-oss: the head's sink joins the softmax as a score with no value
                if (l->sinks[h] > top) top = l->sinks[h];
                total = expf(l->sinks[h] - top);
            }
            memset(out, 0, (size_t)hd * 4);
            for (int64_t k = 0; k < task[b].splits; k++) {
                const float *p = s->part + (k * m->num_heads + h) * (hd + 2);
                if (p[1] == 0.0f) continue;
                float c = expf(p[0] - top);
                total += p[1] * c;
                axpy(out, c, p + 2, hd);
            }
            for (int i = 0; i < hd; i++) out[i] /= total;
            if (paired(m->v_cache_type, hd)) pair_order(out, hd, 1);  // summed in pair order
        }
    }
}
