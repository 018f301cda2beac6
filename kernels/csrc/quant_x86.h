// AVX2+FMA and AVX-512 dot products of one row of blocks with a float32 vector, for every type. The weights are widened to float32
// in registers (x stays float32: no int8 rounding of the activations); scales are applied per sub-block
// of 16 or 32 weights, and Q4_K's minimums through the per-32 sums of x (`xsum`), once per block.
// Compiled only into the library built with the matching -m flags (kernels/cpu_quant.py).
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
// 16 bytes (the low 16 of an __m128i) as float32 lanes
static inline vf vi8(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
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
// the low 8 bytes of an __m128i as float32 lanes
static inline vf vi8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
#endif

#ifdef VEC_LANES
#define HAS_SIMD_DOTS 1

// sum_j q[j] * x[j] for 16 signed bytes q: one or two vectors of lanes
static inline vf dot16(__m128i q, const float *x, vf acc) {
    acc = vfma(vi8(q), vload(x), acc);
#if VEC_LANES == 8
    acc = vfma(vi8(_mm_srli_si128(q, 8)), vload(x + 8), acc);
#endif
    return acc;
}

static float dot_q8_0(const uint8_t *row, const float *x, const float *xsum, int64_t nb) {
    (void)xsum;
    vf acc = vzero();
    for (int64_t i = 0; i < nb; i++, row += 34, x += 32) {
        vf p = dot16(_mm_loadu_si128((const __m128i *)(row + 2)), x, vzero());
        p = dot16(_mm_loadu_si128((const __m128i *)(row + 18)), x + 16, p);
        acc = vfma(vset(f16_to_f32(row)), p, acc);
    }
    return vsum(acc);
}

// Q4_K and Q5_K: 8 sub-blocks of 32 under 6-bit scales and minimums; Q5_K's fifth bits: bit i of qh[l]
// belongs to weight l of sub-block i.
static inline float dot_k_blocks(int type, const uint8_t *row, const float *x, const float *xsum, int64_t nb) {
    const int bytes = TYPES[type].bytes;
    const __m128i low4 = _mm_set1_epi8(0x0F), fifth = _mm_set1_epi8(0x10);
    vf acc = vzero();
    float mins = 0.0f;
    for (int64_t i = 0; i < nb; i++, row += bytes, x += QK_K, xsum += 8) {
        float d = f16_to_f32(row), dmin = f16_to_f32(row + 2);
        uint8_t sc[8], mn[8];
        k_scales(row + 4, sc, mn);
        const uint8_t *qs = row + (type == Q4_K ? 16 : 48), *qh = row + 16;
        __m128i ha = _mm_setzero_si128(), hb = ha;
        if (type == Q5_K) {
            ha = _mm_loadu_si128((const __m128i *)qh);
            hb = _mm_loadu_si128((const __m128i *)(qh + 16));
        }
        for (int c = 0; c < 4; c++, qs += 32) {  // sub-block 2c in the low nibbles of 32 bytes, 2c + 1 in the high
            __m128i a = _mm_loadu_si128((const __m128i *)qs), b = _mm_loadu_si128((const __m128i *)(qs + 16));
            __m128i a0 = _mm_and_si128(a, low4), b0 = _mm_and_si128(b, low4);
            __m128i a1 = _mm_and_si128(_mm_srli_epi16(a, 4), low4), b1 = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
            if (type == Q5_K) {  // bit 2c, then 2c + 1, of each qh byte moved to bit 4
                a0 = _mm_or_si128(a0, _mm_and_si128(_mm_slli_epi16(_mm_srli_epi16(ha, 2 * c), 4), fifth));
                b0 = _mm_or_si128(b0, _mm_and_si128(_mm_slli_epi16(_mm_srli_epi16(hb, 2 * c), 4), fifth));
                a1 = _mm_or_si128(a1, _mm_and_si128(_mm_slli_epi16(_mm_srli_epi16(ha, 2 * c + 1), 4), fifth));
                b1 = _mm_or_si128(b1, _mm_and_si128(_mm_slli_epi16(_mm_srli_epi16(hb, 2 * c + 1), 4), fifth));
            }
            const float *xc = x + 64 * c;
            vf lo = dot16(b0, xc + 16, dot16(a0, xc, vzero()));
            vf hi = dot16(b1, xc + 48, dot16(a1, xc + 32, vzero()));
            acc = vfma(vset(d * (float)sc[2 * c]), lo, acc);
            acc = vfma(vset(d * (float)sc[2 * c + 1]), hi, acc);
            mins += dmin * (float)mn[2 * c] * xsum[2 * c] + dmin * (float)mn[2 * c + 1] * xsum[2 * c + 1];
        }
    }
    return vsum(acc) - mins;
}
static float dot_q4_k(const uint8_t *r, const float *x, const float *s, int64_t nb) { return dot_k_blocks(Q4_K, r, x, s, nb); }
static float dot_q5_k(const uint8_t *r, const float *x, const float *s, int64_t nb) { return dot_k_blocks(Q5_K, r, x, s, nb); }

// 16 bytes, 0x10 where bit j of `bits` (16 bits) is set: the fifth bits of Q5_0 / Q5_1 weights
static inline __m128i fifth_bits(uint32_t bits) {
    const __m128i mask = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    __m128i v = _mm_shuffle_epi8(_mm_set1_epi16((short)bits), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(v, mask), mask), _mm_set1_epi8(0x10));
}

// Q4_0, Q4_1, Q5_0, Q5_1: 32 weights a block, nibbles (weight j low, j + 16 high), optional fifth bits,
// then d * (q - offset) or d * q + m; the minimums through the per-32 sums of x.
static inline float dot_32_blocks(int type, const uint8_t *row, const float *x, const float *xsum, int64_t nb) {
    const int has_min = type == Q4_1 || type == Q5_1, has_high = type == Q5_0 || type == Q5_1;
    const int bytes = TYPES[type].bytes, qs_at = 2 + 2 * has_min + 4 * has_high;
    const __m128i low4 = _mm_set1_epi8(0x0F), offset = _mm_set1_epi8(has_high ? 16 : 8);
    vf acc = vzero();
    float mins = 0.0f;
    for (int64_t i = 0; i < nb; i++, row += bytes, x += 32) {
        __m128i qs = _mm_loadu_si128((const __m128i *)(row + qs_at));
        __m128i lo = _mm_and_si128(qs, low4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
        if (has_high) {
            uint32_t qh;
            memcpy(&qh, row + 2 + 2 * has_min, 4);
            lo = _mm_or_si128(lo, fifth_bits(qh & 0xFFFF));
            hi = _mm_or_si128(hi, fifth_bits(qh >> 16));
        }
        if (!has_min) {
            lo = _mm_sub_epi8(lo, offset);
            hi = _mm_sub_epi8(hi, offset);
        }
        vf p = dot16(hi, x + 16, dot16(lo, x, vzero()));
        acc = vfma(vset(f16_to_f32(row)), p, acc);
        if (has_min) mins += f16_to_f32(row + 2) * xsum[i];
    }
    return vsum(acc) + mins;
}
static float dot_q4_0(const uint8_t *r, const float *x, const float *s, int64_t nb) { return dot_32_blocks(Q4_0, r, x, s, nb); }
static float dot_q4_1(const uint8_t *r, const float *x, const float *s, int64_t nb) { return dot_32_blocks(Q4_1, r, x, s, nb); }
static float dot_q5_0(const uint8_t *r, const float *x, const float *s, int64_t nb) { return dot_32_blocks(Q5_0, r, x, s, nb); }
static float dot_q5_1(const uint8_t *r, const float *x, const float *s, int64_t nb) { return dot_32_blocks(Q5_1, r, x, s, nb); }

static float dot_q6_k(const uint8_t *row, const float *x, const float *xsum, int64_t nb) {
    (void)xsum;
    const __m128i low4 = _mm_set1_epi8(0x0F), bits45 = _mm_set1_epi8(0x30), bias = _mm_set1_epi8(32);
    vf acc = vzero();
    for (int64_t i = 0; i < nb; i++, row += 210) {
        float d = f16_to_f32(row + 208);
        const int8_t *sc = (const int8_t *)(row + 192);
        for (int half = 0; half < 2; half++, x += 128) {
            const uint8_t *ql = row + 64 * half, *qh = row + 128 + 32 * half;
            const int8_t *s = sc + 8 * half;
            for (int l = 0; l < 32; l += 16) {  // weights l.. of the four runs of 32, each 16 under one scale
                __m128i a = _mm_loadu_si128((const __m128i *)(ql + l));
                __m128i b = _mm_loadu_si128((const __m128i *)(ql + 32 + l));
                __m128i h = _mm_loadu_si128((const __m128i *)(qh + l));
                __m128i q[4] = {
                    _mm_or_si128(_mm_and_si128(a, low4), _mm_and_si128(_mm_slli_epi16(h, 4), bits45)),
                    _mm_or_si128(_mm_and_si128(b, low4), _mm_and_si128(_mm_slli_epi16(h, 2), bits45)),
                    _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), low4), _mm_and_si128(h, bits45)),
                    _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b, 4), low4),
                                 _mm_and_si128(_mm_srli_epi16(h, 2), bits45)),
                };
                for (int r = 0; r < 4; r++) {
                    vf p = dot16(_mm_sub_epi8(q[r], bias), x + 32 * r + l, vzero());
                    acc = vfma(vset(d * (float)s[2 * r + l / 16]), p, acc);
                }
            }
        }
    }
    return vsum(acc);
}
#endif
