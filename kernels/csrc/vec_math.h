// The float32 vector layer beyond quant_x86.h's (vf: 8 or 16 lanes; vload, vfma, vsum): loads that widen f16 and
// bf16 rows, stores, maximum, rounding, exp, and the sums of four vectors at once. Used by the row dots
// (row_dots.h) and both attentions (decode_attention.h, prefill_attention.h); the scalar build has exp_inplace only.
#pragma once
#include <math.h>
#include <stdint.h>

#include "quant_dots.h"

#ifdef VEC_LANES
#if VEC_LANES == 16
static inline vf _vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vload_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#else
static inline vf _vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vload_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif
static inline vf vload_f32(const float *p) { return vload(p); }
#define VSTEP VEC_LANES
#endif

// exp(x) for x <= 0 of a score minus its maximum: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p a degree-6
// Taylor polynomial (relative error < 3e-7); below -87 (a masked key) exactly 0.
#ifdef VEC_LANES
#if VEC_LANES == 16
static inline void vstore(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vmaxv(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
static inline vf vzero_below(vf r, vf x, float bound) {  // r where x >= bound, else 0
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(bound), _CMP_GE_OQ), r);
}
#else
static inline void vstore(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vmaxv(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vzero_below(vf r, vf x, float bound) {
    return _mm256_and_ps(r, _mm256_cmp_ps(x, _mm256_set1_ps(bound), _CMP_GE_OQ));
}
static inline vf vpow2(vf p, vf n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif
static inline vf vexp(vf x) {
    vf in = x;
    x = vmaxv(x, vset(-87.0f));
    vf n = vround(vmul(x, vset(1.44269504088896341f)));
    vf r = vfma(n, vset(-0.693145751953125f), x);
    r = vfma(n, vset(-1.428606765330187045e-06f), r);
    vf p = vset(1.0f / 720);
    p = vfma(p, r, vset(1.0f / 120));
    p = vfma(p, r, vset(1.0f / 24));
    p = vfma(p, r, vset(1.0f / 6));
    p = vfma(p, r, vset(0.5f));
    p = vfma(p, r, vset(1.0f));
    p = vfma(p, r, vset(1.0f));
    return vzero_below(vpow2(p, n), in, -87.0f);
}
#endif

#ifdef VEC_LANES
// the sums of a, b, c and d's lanes, in that order: one reduction tree for four vectors (13 instructions on
// AVX-512 where four reductions of one vector each take 32)
static inline __m128 vsum4(vf a, vf b, vf c, vf d) {
#if VEC_LANES == 16
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)),
                 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d)),
                 y = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // per 128 bits: a b c d
    const __m256 z = _mm256_add_ps(_mm512_castps512_ps256(y),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1)));
#else
    const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b)),
                 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d)),
                 z = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
#endif
    return _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
}

static inline float vmax_all(vf a) {
#if VEC_LANES == 16
    return _mm512_reduce_max_ps(a);
#else
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#endif
}
#endif

static inline void exp_inplace(float *x, int n) {
    int i = 0;
#ifdef VEC_LANES
    for (; i + VEC_LANES <= n; i += VEC_LANES) vstore(x + i, vexp(vload(x + i)));
#endif
    for (; i < n; i++) x[i] = expf(x[i]);
}
