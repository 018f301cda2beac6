// The row dot product of each ggml block type with an activation vector quantized once to integers (`qvec`):
// integer products, then the weight's and x's float scales. The types of 32 (Q8_0, Q4_x, Q5_x, MXFP4) read x at
// 16 bits with a scale per 32; the K types (Q4_K, Q5_K, Q6_K) read it at 8 bits with one scale per 256, as
// llama.cpp's Q8_K, so that their sub-block scales apply to integer sums (docs/kernels.md, "x for the K types").
// The SIMD kernels of quant_x86.h where the compiler targets AVX2 or AVX-512, else the portable reference below
// (the same integers, each block unpacked by `block_integers`).
// Shared by quant_gemv.c and decode_layer.c.
#pragma once
#include <math.h>

#include "quant_blocks.h"
#if defined(__x86_64__) || defined(__i386__)
#include "quant_x86.h"
#endif

// x[begin, end) (multiples of 32) into x_q: per 32, step = max |x| / 127, q = x / step and r = (x / step - q) 256,
// each rounded to nearest even (all 0 where the 32 are 0), d = step / 256, and the sums of v = 256 q + r.
// |x - d v| <= d / 2 (d where r is clamped from 128; plus float32's rounding of x / step): 16 bits of x, not 8 as llama.cpp keeps, for one
// more u8 x s8 product per 32 weights. tests/kernels/test_cpu_quant.py repeats these float32 steps in torch.
static inline void quantize_x(const float *x, int64_t begin, int64_t end, const qvec *x_q) {
    for (int64_t k = begin / 32; k < end / 32; k++) {
        const float *v = x + 32 * k;
#ifdef HAS_SIMD_DOTS
        float step;
        int32_t sum[2];
        quantize_block_x(v, x_q->q + 32 * k, x_q->r + 32 * k, sum, &step);
#else
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        const float step = amax / 127.0f, inv = step != 0.0f ? 1.0f / step : 0.0f;
        int8_t *q = x_q->q + 32 * k, *r = x_q->r + 32 * k;
        int32_t sum[2] = {0, 0};
        for (int j = 0; j < 32; j++) {  // + 1.5 * 2^23 rounds |t| < 2^22 to an integer, ties to even
            float t = v[j] * inv, tq = (t + 12582912.0f) - 12582912.0f;
            float tr = ((t - tq) * 256.0f + 12582912.0f) - 12582912.0f;  // t - tq is exact
            q[j] = (int8_t)(int)tq;
            r[j] = (int8_t)(tr > 127.0f ? 127 : tr < -127.0f ? -127 : (int)tr);
            sum[j / 16] += 256 * q[j] + r[j];
        }
#endif
        x_q->sum16[2 * k] = sum[0];
        x_q->sum16[2 * k + 1] = sum[1];
        x_q->d[k] = step / 256.0f;
        x_q->s[k] = x_q->d[k] * (float)(sum[0] + sum[1]);
    }
    // the K types' form of every 256 inside [begin, end): kd = max |x| / 127, k = x / kd rounded to nearest even
    // (all 0 where the 256 are 0), |x - kd k| <= kd / 2; tests/kernels/test_cpu_quant.py repeats these steps
    for (int64_t b = (begin + QK_K - 1) / QK_K; b < end / QK_K; b++) {
        const float *v = x + QK_K * b;
        float amax = 0.0f;
        for (int j = 0; j < QK_K; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        const float step = amax / 127.0f, inv = step != 0.0f ? 1.0f / step : 0.0f;
        int8_t *k = x_q->k + QK_K * b;
        for (int g = 0; g < QK_K / 16; g++) {
            int sum = 0;
            for (int j = 16 * g; j < 16 * g + 16; j++) {
                k[j] = (int8_t)(int)((v[j] * inv + 12582912.0f) - 12582912.0f);  // |x / kd| <= 127
                sum += k[j];
            }
            x_q->ksum[QK_K / 16 * b + g] = (int16_t)sum;
        }
        x_q->kd[b] = step;
    }
}

// sum over the row's `num_blocks` blocks of w * x, x as quantize_x made it
typedef float (*row_dot)(const uint8_t *row, const qvec *x, int64_t num_blocks);

#ifdef HAS_SIMD_DOTS
static const row_dot DOTS[NUM_TYPES] = {
    [Q8_0] = dot_q8_0, [Q4_0] = dot_q4_0, [Q4_1] = dot_q4_1, [Q5_0] = dot_q5_0,
    [Q5_1] = dot_q5_1, [Q4_K] = dot_q4_k, [Q5_K] = dot_q5_k, [Q6_K] = dot_q6_k, [MXFP4] = dot_mxfp4,
};
#else
// One block as integers: weight j = scale[j / 16] * q[j] - min[j / 32], each scale and minimum computed as
// dequantize_block computes them.
static inline void block_integers(int type, const uint8_t *b, int8_t *q, float *scale, float *min) {
    const int elems = TYPES[type].elems;
    for (int k = 0; k < elems / 32; k++) min[k] = 0.0f;
    switch (type) {
    case Q8_0:
        memcpy(q, b + 2, 32);
        scale[0] = scale[1] = f16_to_f32(b);
        break;
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
        const int has_min = type == Q4_1 || type == Q5_1, has_high = type == Q5_0 || type == Q5_1;
        const uint8_t *qh = b + 2 + 2 * has_min, *qs = qh + 4 * has_high;
        uint32_t high = 0;
        if (has_high) high = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
        const int offset = has_min ? 0 : has_high ? 16 : 8;
        for (int j = 0; j < 16; j++) {  // bit j of qh is the fifth bit of weight j, bit j + 16 that of weight j + 16
            q[j] = (int8_t)(((qs[j] & 0x0F) | (((high >> j) & 1) << 4)) - offset);
            q[j + 16] = (int8_t)(((qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4)) - offset);
        }
        scale[0] = scale[1] = f16_to_f32(b);
        if (has_min) min[0] = -f16_to_f32(b + 2);
        break;
    }
    case Q4_K:
    case Q5_K: {
        float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
        uint8_t sc[8], mn[8];
        k_scales(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *qs = type == Q4_K ? b + 16 : b + 48;
        k_quants(qs, qh, type == Q5_K, (uint8_t *)q);  // 0..31: the same bytes as int8
        for (int j = 0; j < 8; j++) {
            scale[2 * j] = scale[2 * j + 1] = d * (float)sc[j];
            min[j] = dmin * (float)mn[j];
        }
        break;
    }
    case MXFP4:
        for (int j = 0; j < 16; j++) {
            q[j] = MXFP4_VALUES[b[1 + j] & 0x0F];
            q[j + 16] = MXFP4_VALUES[b[1 + j] >> 4];
        }
        scale[0] = scale[1] = mxfp4_scale(b[0]);
        break;
    case Q6_K: {
        float d = f16_to_f32(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int half = 0; half < 2; half++) {  // 128 weights each: ql[64], qh[32]
            const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
            int8_t *y = q + 128 * half;
            for (int l = 0; l < 32; l++) {
                y[l] = (int8_t)(((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32);
                y[l + 32] = (int8_t)(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        for (int g = 0; g < 16; g++) scale[g] = d * (float)sc[g];
        break;
    }
    }
}

// The K types against x's K form: per 16 an exact int32 sum of q * k, then its scale and x's one per 256; minimums
// through the sums of k.
static inline float dot_reference_k(int type, const uint8_t *row, const qvec *x, int64_t nb) {
    int8_t q[QK_K];
    float scale[QK_K / 16], min[QK_K / 32], sum = 0.0f;
    for (int64_t i = 0; i < nb; i++, row += TYPES[type].bytes) {
        block_integers(type, row, q, scale, min);
        const int8_t *k = x->k + QK_K * i;
        const int16_t *ks = x->ksum + QK_K / 16 * i;
        for (int g = 0; g < QK_K / 16; g++) {
            int32_t isum = 0;
            for (int j = 16 * g; j < 16 * g + 16; j++) isum += q[j] * k[j];
            sum += scale[g] * x->kd[i] * (float)isum - min[g / 2] * x->kd[i] * (float)ks[g];
        }
    }
    return sum;
}

// The reference: the K types as above; the types of 32 per 16 weights an exact int32 sum of q * v, then its
// scales; minimums through x's sums.
static inline float dot_reference(int type, const uint8_t *row, const qvec *x, int64_t nb) {
    if (TYPES[type].elems == QK_K) return dot_reference_k(type, row, x, nb);
    const int elems = TYPES[type].elems, bytes = TYPES[type].bytes;
    int8_t q[QK_K];
    float scale[QK_K / 16], min[QK_K / 32], sum = 0.0f;
    for (int64_t i = 0; i < nb; i++, row += bytes) {
        block_integers(type, row, q, scale, min);
        const int8_t *xq = x->q + i * elems, *xr = x->r + i * elems;
        const float *xd = x->d + i * elems / 32, *xs = x->s + i * elems / 32;
        for (int g = 0; g < elems / 16; g++) {
            int32_t isum = 0;
            for (int j = 0; j < 16; j++) isum += q[16 * g + j] * (256 * xq[16 * g + j] + xr[16 * g + j]);
            sum += scale[g] * xd[g / 2] * (float)isum;
        }
        for (int k = 0; k < elems / 32; k++) sum -= min[k] * xs[k];
    }
    return sum;
}

#define REFERENCE_DOT(T) \
    static float dot_reference_##T(const uint8_t *row, const qvec *x, int64_t nb) { return dot_reference(T, row, x, nb); }
REFERENCE_DOT(Q8_0)
REFERENCE_DOT(Q4_0)
REFERENCE_DOT(Q4_1)
REFERENCE_DOT(Q5_0)
REFERENCE_DOT(Q5_1)
REFERENCE_DOT(Q4_K)
REFERENCE_DOT(Q5_K)
REFERENCE_DOT(Q6_K)
REFERENCE_DOT(MXFP4)
static const row_dot DOTS[NUM_TYPES] = {
    [Q8_0] = dot_reference_Q8_0, [Q4_0] = dot_reference_Q4_0, [Q4_1] = dot_reference_Q4_1,
    [Q5_0] = dot_reference_Q5_0, [Q5_1] = dot_reference_Q5_1, [Q4_K] = dot_reference_Q4_K,
    [Q5_K] = dot_reference_Q5_K, [Q6_K] = dot_reference_Q6_K, [MXFP4] = dot_reference_MXFP4,
};
#endif
