// ggml's block layouts (llama.cpp ggml-common.h) and the exact per-block dequantization of each type.
// Every weight is computed with the same float32 operations in the same order as kernels/quants.py
// (built with -ffp-contract=off, so no product and sum is fused behind our back): the scalar kernels
// differ from the torch reference only in the order of the dot product's sums.
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

enum { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4, NUM_TYPES };
#define QK_K 256

typedef struct {
    const char *name;
    int elems;  // weights per block
    int bytes;  // bytes per block
} block_type;

static const block_type TYPES[NUM_TYPES] = {
    [Q8_0] = {"q8_0", 32, 34},       [Q4_0] = {"q4_0", 32, 18},       [Q4_1] = {"q4_1", 32, 20},
    [Q5_0] = {"q5_0", 32, 22},       [Q5_1] = {"q5_1", 32, 24},       [Q4_K] = {"q4_k", QK_K, 144},
    [Q5_K] = {"q5_k", QK_K, 176},    [Q6_K] = {"q6_k", QK_K, 210},    [MXFP4] = {"mxfp4", 32, 17},
};

// An activation vector as the integer row dots read it (quant_dots.h's quantize_x): in blocks of 32 (as Q8_0
// stores weights), x ~ d * v with v = 256 q + r a 16-bit integer held as two int8 planes, q = x / (256 d)
// rounded and r the rest in 256ths, so that u8 x s8 instructions multiply it; plus the sums the weights'
// minimums and offsets need.
typedef struct {
    int8_t *q;       // [n] round(x / (256 d)), in -127..127
    int8_t *r;       // [n] round(x / d - 256 q), in -127..127
    float *d;        // [n / 32] max |x| / 127 / 256 of each 32
    float *s;        // [n / 32] d * sum of v over each 32
    int32_t *sum16;  // [n / 16] sum of v over each 16 (Q6_K's sub-blocks)
    // x again as the K types' dots read it (llama.cpp's Q8_K): one scale per 256, so that the weights' sub-block
    // scales apply to integer sums and a super-block is converted to float once. Filled where n is a multiple of
    // 256 (a K-type row's length always is); quantize_x fills each 256 lying whole inside the range it is given.
    int8_t *k;       // [n] round(x / kd), in -127..127
    float *kd;       // [n / 256] max |x| / 127 of each 256
    int16_t *ksum;   // [n / 16] sum of k over each 16
} qvec;

// bytes of a qvec's buffers for n values, rounded up to 4 so that what is carved after them stays aligned whatever
// n is (a bf16 model's widths need not be multiples of 32); kernels/cpu_decode.py qvec_bytes says the same
#define QVEC_BYTES(n) ((8 * ((n) / 32) + 4 * ((n) / 256) + 6 * ((n) / 16) + 3 * (n) + 3) / 4 * 4)

// x's buffers for n values laid out from `at` (4-byte aligned): QVEC_BYTES(n) of them; the byte past them
static inline char *qvec_carve(qvec *x, char *at, int64_t n) {
    x->d = (float *)at;
    x->s = x->d + n / 32;
    x->kd = x->s + n / 32;
    x->sum16 = (int32_t *)(x->kd + n / 256);
    x->ksum = (int16_t *)(x->sum16 + n / 16);
    x->q = (int8_t *)(x->ksum + n / 16);
    x->r = x->q + n;
    x->k = x->r + n;
    return (char *)(x->k + n);
}

// The type named as kernels/quants.py names it ("q4_k"), or -1.
static inline int block_type_id(const char *name) {
    for (int t = 0; t < NUM_TYPES; t++)
        if (strcmp(TYPES[t].name, name) == 0) return t;
    return -1;
}

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float32
        float f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000 | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

// MXFP4 (gpt-oss): an E8M0 scale byte e, then 32 E2M1 codes (weight j in byte j's low nibble, j + 16 in its high
// one); a weight is MXFP4_VALUES[code] * 2^(e - 128), the E2M1 values doubled as ggml's kvalues_mxfp4 keeps them.
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128) as ggml_e8m0_to_fp32_half makes it (e = 0 and 1: float32 subnormals)
static inline float mxfp4_scale(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// The 8 six-bit scales and mins of a Q4_K / Q5_K super-block, packed in 12 bytes (get_scale_min_k4).
static inline void k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

// A Q4_K / Q5_K super-block's 256 quants (0..15, or 0..31 with qh's fifth bits) into q: each of the 4 chunks of qs
// holds 32 bytes, sub-block 2c in the low nibbles and 2c + 1 in the high ones.
static inline void k_quants(const uint8_t *qs, const uint8_t *qh, int five_bits, uint8_t q[256]) {
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            int lo = qs[32 * c + l] & 0x0F, hi = qs[32 * c + l] >> 4;
            if (five_bits) {  // bit i of qh[l] is the fifth bit of weight l of sub-block i
                lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
            }
            q[64 * c + l] = (uint8_t)lo;
            q[64 * c + 32 + l] = (uint8_t)hi;
        }
    }
}

// One block of `type` into float32 `out` (TYPES[type].elems weights).
static inline void dequantize_block(int type, const uint8_t *b, float *out) {
    switch (type) {
    case Q8_0: {
        float d = f16_to_f32(b);
        for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)b[2 + j] * d;
        break;
    }
    case Q4_0: {
        float d = f16_to_f32(b);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((b[2 + j] & 0x0F) - 8);
            out[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
        break;
    }
    case Q4_1: {
        float d = f16_to_f32(b), m = f16_to_f32(b + 2);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(b[4 + j] & 0x0F) + m;
            out[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
        break;
    }
    case Q5_0:
    case Q5_1: {
        int has_min = type == Q5_1;
        float d = f16_to_f32(b), m = has_min ? f16_to_f32(b + 2) : 0.0f;
        const uint8_t *qh = b + 2 + 2 * has_min, *qs = qh + 4;
        uint32_t high = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
        for (int j = 0; j < 16; j++) {  // bit j of qh is the fifth bit of weight j, bit j + 16 that of weight j + 16
            int q0 = (qs[j] & 0x0F) | (((high >> j) & 1) << 4), q1 = (qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4);
            if (has_min) {
                out[j] = d * (float)q0 + m;
                out[j + 16] = d * (float)q1 + m;
            } else {
                out[j] = d * (float)(q0 - 16);
                out[j + 16] = d * (float)(q1 - 16);
            }
        }
        break;
    }
    case Q4_K:
    case Q5_K: {
        float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
        uint8_t sc[8], mn[8];
        k_scales(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *qs = type == Q4_K ? b + 16 : b + 48;
        for (int c = 0; c < 4; c++) {  // 32 bytes per chunk: sub-block 2c in the low nibbles, 2c + 1 in the high
            float d1 = d * (float)sc[2 * c], m1 = dmin * (float)mn[2 * c];
            float d2 = d * (float)sc[2 * c + 1], m2 = dmin * (float)mn[2 * c + 1];
            for (int l = 0; l < 32; l++) {
                int lo = qs[32 * c + l] & 0x0F, hi = qs[32 * c + l] >> 4;
                if (type == Q5_K) {  // bit i of qh[l] is the fifth bit of weight l of sub-block i
                    lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
                out[64 * c + l] = d1 * (float)lo - m1;
                out[64 * c + 32 + l] = d2 * (float)hi - m2;
            }
        }
        break;
    }
    case MXFP4: {
        float d = mxfp4_scale(b[0]);
        for (int j = 0; j < 16; j++) {
            out[j] = (float)MXFP4_VALUES[b[1 + j] & 0x0F] * d;
            out[j + 16] = (float)MXFP4_VALUES[b[1 + j] >> 4] * d;
        }
        break;
    }
    case Q6_K: {
        float d = f16_to_f32(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int half = 0; half < 2; half++) {  // 128 weights each: ql[64], qh[32], scales[8]
            const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
            float *y = out + 128 * half;
            const int8_t *s = sc + 8 * half;
            for (int l = 0; l < 32; l++) {
                int g = l / 16;
                y[l] = d * (float)s[g] * (float)(((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32);
                y[l + 32] = d * (float)s[g + 2] * (float)(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = d * (float)s[g + 4] * (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = d * (float)s[g + 6] * (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        break;
    }
    }
}
