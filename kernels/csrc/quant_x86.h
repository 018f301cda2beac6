// AVX2 and AVX-512 kernels: the float32 vector layer (vf: 8 or 16 lanes) that row_dots.h's float rows use, and
// the integer row dots of every ggml block type with an activation vector quantized to int8 (quant_dots.h's
// `qvec`): the weights stay integers, 32 products at a time go through one AVX-512 VNNI `vpdpbusd` (u8 x s8,
// sums of 4 per int32 lane) or, without VNNI, AVX2's `vpmaddubsw` + `vpmaddwd`; each 32 products' int32 sums
// are then converted once and scaled by the weight's and x's float scales. Compiled only into the libraries
// built with the matching -m flags (kernels/native_libs.py).
#pragma once
#include <immintrin.h>

#include "quant_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VEC_LANES 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset(float v) { return _mm512_set1_ps(v); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC_LANES 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset(float v) { return _mm256_set1_ps(v); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#ifdef VEC_LANES
#define HAS_SIMD_DOTS 1

// ---- 256-bit integer building blocks (32 weights: one block of 32, or one sub-block) ----------------------

static inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 8 int32 lanes, each the sum of 4 products u[k] * s[k]: u unsigned bytes, s signed. The AVX2 form sums pairs
// in int16 first: exact while a pair stays within 32767 (weights up to 128 against |s| <= 127 do).
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

// 8 lanes, each the sum of 4 products u[k] * v[k] (an exact integer) of 32 unsigned weights u and x's v = 256 q + r
// from j on
static inline __m256 dot32(__m256i u, const qvec *x, int64_t j) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    __m256i hi = dot_u8s8(u, load32(x->q + j)), lo = dot_u8s8(u, load32(x->r + j));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(hi, 8), lo));
#else  // the pairs' int16 sums of q times 256 and of r times 1 in the widening adds: one shift fewer
    __m256i hi = _mm256_maddubs_epi16(u, load32(x->q + j)), lo = _mm256_maddubs_epi16(u, load32(x->r + j));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(hi, _mm256_set1_epi16(256)),
                                               _mm256_madd_epi16(lo, _mm256_set1_epi16(1))));
#endif
}

// the same for 32 signed weights w: |w| against v carrying w's sign
static inline __m256 dot32_signed(__m256i w, const qvec *x, int64_t j) {
    __m256i u = _mm256_sign_epi8(w, w);
    __m256i hi = dot_u8s8(u, _mm256_sign_epi8(load32(x->q + j), w));
    __m256i lo = dot_u8s8(u, _mm256_sign_epi8(load32(x->r + j), w));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(hi, 8), lo));
}

// 16 bytes of nibbles as 32 bytes: the low nibbles (weights 0..15), then the high ones (16..31)
static inline __m256i nibbles32(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

// 0x10 in byte j where bit j of `bits` is set: the fifth bits of Q5_0 / Q5_1 weights
static inline __m256i fifth_bits32(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(0x10));
#else
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(0x10));
#endif
}

// quant_dots.h's quantize_x of one block of 32, the same float32 steps 8 lanes at a time
static inline void quantize_block_x(const float *x, int8_t *q, int8_t *r, int32_t sum[2], float *step) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) m = _mm256_max_ps(m, _mm256_and_ps(v[j] = _mm256_loadu_ps(x + 8 * j), abs));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    *step = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(*step != 0.0f ? 1.0f / *step : 0.0f);
    const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    __m256i iq[4], ir[4];
    __m256 s[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int j = 0; j < 4; j++) {
        const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m256 t = _mm256_mul_ps(v[j], inv), tq = _mm256_round_ps(t, mode);
        __m256 tr = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(t, tq), _mm256_set1_ps(256.0f)), mode);
        tr = _mm256_max_ps(_mm256_min_ps(tr, lim), nlim);
        s[j / 2] = _mm256_add_ps(s[j / 2], _mm256_add_ps(_mm256_mul_ps(tq, _mm256_set1_ps(256.0f)), tr));  // exact
        iq[j] = _mm256_cvttps_epi32(tq);
        ir[j] = _mm256_cvttps_epi32(tr);
    }
    // packs work per 128-bit lane: bytes come out in the order of the 4-byte groups 0 4 1 5 2 6 3 7
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i pq = _mm256_packs_epi16(_mm256_packs_epi32(iq[0], iq[1]), _mm256_packs_epi32(iq[2], iq[3]));
    __m256i pr = _mm256_packs_epi16(_mm256_packs_epi32(ir[0], ir[1]), _mm256_packs_epi32(ir[2], ir[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(pq, order));
    _mm256_storeu_si256((__m256i *)r, _mm256_permutevar8x32_epi32(pr, order));
    sum[0] = (int32_t)hsum8(s[0]);
    sum[1] = (int32_t)hsum8(s[1]);
}

// ---- the row dots -----------------------------------------------------------------------------------------

static float dot_q8_0(const uint8_t *row, const qvec *x, int64_t nb) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2, row += 68) {  // two blocks, two sums in flight
        __m256 p0 = dot32_signed(load32(row + 2), x, 32 * i), p1 = dot32_signed(load32(row + 36), x, 32 * i + 32);
        acc0 = _mm256_fmadd_ps(p0, _mm256_set1_ps(f16_to_f32(row) * x->d[i]), acc0);
        acc1 = _mm256_fmadd_ps(p1, _mm256_set1_ps(f16_to_f32(row + 34) * x->d[i + 1]), acc1);
    }
    if (i < nb) acc0 = _mm256_fmadd_ps(dot32_signed(load32(row + 2), x, 32 * i), _mm256_set1_ps(f16_to_f32(row) * x->d[i]), acc0);
    return hsum8(_mm256_add_ps(acc0, acc1));
}

#if defined(__AVX512VNNI__)
// 16 lanes: dot32 for 64 weights, lanes 0..7 the first 32
static inline __m512 dot64(__m512i u, const qvec *x, int64_t j) {
    __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(x->q + j));
    __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(x->r + j));
    return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
}

// two f16 at a and b as floats (lanes 0, 1)
static inline __m128 f16_pair(const uint8_t *a, const uint8_t *b) {
    uint16_t ha, hb;
    memcpy(&ha, a, 2);
    memcpy(&hb, b, 2);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)ha | (uint32_t)hb << 16)));
}
#endif

// Q4_0, Q4_1, Q5_0, Q5_1: 32 unsigned weights q a block (nibbles, optional fifth bits). Without a minimum the
// weight is d (q - offset): sum d dx (q . v) less offset d sum(x); with one it is d q + m: plus m sum(x).
static inline float dot_32_blocks(int type, const uint8_t *row, const qvec *x, int64_t nb) {
    const int has_min = type == Q4_1 || type == Q5_1, has_high = type == Q5_0 || type == Q5_1;
    const int bytes = TYPES[type].bytes, qs_at = 2 + 2 * has_min + 4 * has_high;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    float sums = 0.0f;  // sum over blocks of (d or m) * sum(x)
    int64_t i = 0;
#if defined(__AVX512VNNI__)
    {  // two blocks a step in 512 bits
        const __m512i low4 = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
        const __m512i mix = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);  // lo0 hi0 lo1 hi1
        const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        __m512 acc = _mm512_setzero_ps();
        __m128 sum2 = _mm_setzero_ps();
        for (; i + 2 <= nb; i += 2, row += 2 * bytes) {
            const uint8_t *next = row + bytes;
            __m256i qs = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(next + qs_at)),
                                          _mm_loadu_si128((const __m128i *)(row + qs_at)));
            __m512i lo = _mm512_castsi256_si512(qs), hi = _mm512_castsi256_si512(_mm256_srli_epi16(qs, 4));
            __m512i u = _mm512_and_si512(_mm512_permutex2var_epi64(lo, mix, hi), low4);
            if (has_high) {
                uint32_t h0, h1;
                memcpy(&h0, row + 2 + 2 * has_min, 4);
                memcpy(&h1, next + 2 + 2 * has_min, 4);
                u = _mm512_mask_add_epi8(u, (__mmask64)((uint64_t)h1 << 32 | h0), u, fifth);
            }
            __m128 d = f16_pair(row, next), xd = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(x->d + i)));
            __m128 xs = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(x->s + i)));
            __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(d, xd)));
            acc = _mm512_fmadd_ps(dot64(u, x, 32 * i), scale, acc);
            sum2 = _mm_fmadd_ps(has_min ? f16_pair(row + 2, next + 2) : d, xs, sum2);
        }
        acc0 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
        sums = _mm_cvtss_f32(_mm_add_ss(sum2, _mm_movehdup_ps(sum2)));
    }
#endif
    for (; i < nb; i++, row += bytes) {
        __m256i q = nibbles32(row + qs_at);
        if (has_high) {
            uint32_t qh;
            memcpy(&qh, row + 2 + 2 * has_min, 4);
            q = _mm256_or_si256(q, fifth_bits32(qh));
        }
        __m256 p = dot32(q, x, 32 * i);
        float d = f16_to_f32(row);
        if (i & 1)
            acc1 = _mm256_fmadd_ps(p, _mm256_set1_ps(d * x->d[i]), acc1);
        else
            acc0 = _mm256_fmadd_ps(p, _mm256_set1_ps(d * x->d[i]), acc0);
        sums += (has_min ? f16_to_f32(row + 2) : d) * x->s[i];
    }
    float dots = hsum8(_mm256_add_ps(acc0, acc1));
    return has_min ? dots + sums : dots - (has_high ? 16.0f : 8.0f) * sums;
}
static float dot_q4_0(const uint8_t *r, const qvec *x, int64_t nb) { return dot_32_blocks(Q4_0, r, x, nb); }
static float dot_q4_1(const uint8_t *r, const qvec *x, int64_t nb) { return dot_32_blocks(Q4_1, r, x, nb); }
static float dot_q5_0(const uint8_t *r, const qvec *x, int64_t nb) { return dot_32_blocks(Q5_0, r, x, nb); }
static float dot_q5_1(const uint8_t *r, const qvec *x, int64_t nb) { return dot_32_blocks(Q5_1, r, x, nb); }

// MXFP4: the 32 codes looked up as signed weights (MXFP4_VALUES, |w| <= 12) in one byte shuffle, then as Q8_0's
static float dot_mxfp4(const uint8_t *row, const qvec *x, int64_t nb) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXFP4_VALUES));
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (int64_t i = 0; i < nb; i++, row += 17) {
        __m256 p = dot32_signed(_mm256_shuffle_epi8(table, nibbles32(row + 1)), x, 32 * i);
        if (i & 1)
            acc1 = _mm256_fmadd_ps(p, _mm256_set1_ps(mxfp4_scale(row[0]) * x->d[i]), acc1);
        else
            acc0 = _mm256_fmadd_ps(p, _mm256_set1_ps(mxfp4_scale(row[0]) * x->d[i]), acc0);
    }
    return hsum8(_mm256_add_ps(acc0, acc1));
}

// The 8 six-bit scales (bytes 0..7) and minimums (8..15) of a Q4_K / Q5_K super-block, as k_scales unpacks them,
// four at a time in 32-bit words.
static inline __m128i k_scales16(const uint8_t *s) {
    uint32_t u[4];
    memcpy(u, s, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4);
    uint32_t mins = u[1] & low6;
    u[1] = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);
    u[2] = mins;
    u[0] &= low6;
    return _mm_loadu_si128((const __m128i *)u);
}

// Q4_K and Q5_K against x's K form (one scale per 256): 8 sub-blocks of 32 under 6-bit scales and minimums,
// sum_j d sc_j kd (q . k)_j - dmin kd sum_j mn_j sum(k)_j. The scale of a sub-block multiplies its int16 pair sums
// in the widening add, so a super-block's products stay integers until one conversion. Q5_K's fifth bits: bit j
// of qh[l] belongs to weight l of sub-block j.
static inline float dot_k_blocks(int type, const uint8_t *row, const qvec *x, int64_t nb) {
    const int bytes = TYPES[type].bytes;
    const __m256i low4 = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
    __m256 acc = _mm256_setzero_ps();
    __m128 mins = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++, row += bytes) {
        const __m128i sm = k_scales16(row + 4);  // bytes 0..7 the scales, 8..15 the minimums (< 64)
        const float kd = x->kd[i];
        // the minimums against k's sums per 32: pairs of its sums per 16
        const __m256i ks = _mm256_loadu_si256((const __m256i *)(x->ksum + 16 * i));
        const __m128i k32 = _mm_hadd_epi16(_mm256_castsi256_si128(ks), _mm256_extracti128_si256(ks, 1));
        const __m128i mprod = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_srli_si128(sm, 8)), k32);
        mins = _mm_fmadd_ps(_mm_set1_ps(f16_to_f32(row + 2) * kd), _mm_cvtepi32_ps(mprod), mins);
        const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));  // 8 int16 scales, both halves
        const uint8_t *qs = row + (type == Q4_K ? 16 : 48);
        const int8_t *k = x->k + QK_K * i;
        __m256i h = type == Q5_K ? load32(row + 16) : _mm256_setzero_si256(), sumi = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {  // sub-block 2c in the low nibbles of 32 bytes, 2c + 1 in the high
            __m256i q = load32(qs + 32 * c);
            __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            if (type == Q5_K) {  // bits 2c and 2c + 1 of each qh byte, moved to bit 4
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h, 4), fifth));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(h, 3), fifth));
                h = _mm256_srli_epi16(h, 2);
            }
            // int16 scale 2c (bytes 4c, 4c + 1) and 2c + 1 in every lane
            const __m256i s_lo = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)((4 * c + 1) << 8 | 4 * c)));
            const __m256i s_hi = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)((4 * c + 3) << 8 | (4 * c + 2))));
            // pairs of u (< 32) times k (|k| <= 127) stay within int16; times a scale below 64 within int32
            __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(k + 64 * c)), s_lo);
            __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(k + 64 * c + 32)), s_hi);
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p_lo, p_hi));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_to_f32(row) * kd), _mm256_cvtepi32_ps(sumi), acc);
    }
    __m128 m = _mm_add_ps(mins, _mm_movehl_ps(mins, mins));
    return hsum8(acc) - _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
static float dot_q4_k(const uint8_t *r, const qvec *x, int64_t nb) { return dot_k_blocks(Q4_K, r, x, nb); }
static float dot_q5_k(const uint8_t *r, const qvec *x, int64_t nb) { return dot_k_blocks(Q5_K, r, x, nb); }

// Q6_K against x's K form: 16 sub-blocks of 16 under signed 8-bit scales, weights d s_g (q - 32) with q 6 bits (4 in
// ql, 2 in qh): d kd (sum_g s_g (q . k)_g - 32 sum_g s_g sum(k)_g), every sum an integer.
static float dot_q6_k(const uint8_t *row, const qvec *x, int64_t nb) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++, row += 210) {
        const int8_t *k = x->k + QK_K * i;
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + 192)));  // 16 scales
        // the offsets: 32 sum_g s_g sum(k)_g
        __m256i sumi = _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i *)(x->ksum + 16 * i)));
        sumi = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), sumi), 5);
        // each half's 8 scales in both lanes
        const __m256i halves[2] = {_mm256_permute4x64_epi64(s16, 0x44), _mm256_permute4x64_epi64(s16, 0xEE)};
        for (int half = 0; half < 2; half++) {  // 128 weights: ql[64], qh[32], scales[8]
            const uint8_t *ql = row + 64 * half, *qh = row + 128 + 32 * half;
            const __m256i sc = halves[half];
            __m256i a = load32(ql), b = load32(ql + 32), h = load32(qh);
            __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), bits45)),
                _mm256_or_si256(_mm256_and_si256(b, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), bits45)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4), _mm256_and_si256(h, bits45)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low4),
                                _mm256_and_si256(_mm256_srli_epi16(h, 2), bits45)),
            };
            for (int r = 0; r < 4; r++) {  // weights 32r.. of the 128: bytes 0..15 sub-block 2r, 16..31 2r + 1
                // int16 scale 2r in the low lane, 2r + 1 in the high (bytes 4r.. and 4r + 2..)
                const __m256i pick = _mm256_setr_epi8(
                    4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r,
                    4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3,
                    4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, 4 * r + 2,
                    4 * r + 3, 4 * r + 2, 4 * r + 3);
                // pairs of q (< 64) times k within int16; times |s| <= 128 within int32
                __m256i p = _mm256_maddubs_epi16(q[r], load32(k + 128 * half + 32 * r));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_shuffle_epi8(sc, pick)));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_to_f32(row + 208) * x->kd[i]), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum8(acc);
}
#endif
