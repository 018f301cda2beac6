// The row dot product of each ggml block type, for the instruction set this file is compiled for: the SIMD
// kernels of quant_x86.h where the compiler targets AVX2 or AVX-512, else each block dequantized exactly as
// kernels/quants.py does, then dotted with x. Shared by quant_gemv.c and decode_layer.c.
#pragma once
#include "quant_blocks.h"
#if defined(__x86_64__) || defined(__i386__)
#include "quant_x86.h"
#endif

// sum over the row's `num_blocks` blocks of w * x; xsum: the sums of x per 32 inputs (Q4_K's minimums)
typedef float (*row_dot)(const uint8_t *row, const float *x, const float *xsum, int64_t num_blocks);

#ifdef HAS_SIMD_DOTS
static const row_dot DOTS[NUM_TYPES] = {
    [Q8_0] = dot_q8_0, [Q4_0] = dot_q4_0, [Q4_1] = dot_q4_1, [Q5_0] = dot_q5_0,
    [Q5_1] = dot_q5_1, [Q4_K] = dot_q4_k, [Q5_K] = dot_q5_k, [Q6_K] = dot_q6_k,
};
#else
static inline float dot_block(const float *w, const float *x, int n) {
    float sum = 0.0f;
    for (int j = 0; j < n; j++) sum += w[j] * x[j];
    return sum;
}

#define GENERIC_DOT(T)                                                                          \
    static float dot_generic_##T(const uint8_t *row, const float *x, const float *xsum, int64_t nb) { \
        (void)xsum;                                                                             \
        float w[QK_K], sum = 0.0f;                                                              \
        const int elems = TYPES[T].elems, bytes = TYPES[T].bytes;                               \
        for (int64_t i = 0; i < nb; i++, row += bytes, x += elems) {                            \
            dequantize_block(T, row, w);                                                        \
            sum += dot_block(w, x, elems);                                                      \
        }                                                                                       \
        return sum;                                                                             \
    }
GENERIC_DOT(Q8_0)
GENERIC_DOT(Q4_0)
GENERIC_DOT(Q4_1)
GENERIC_DOT(Q5_0)
GENERIC_DOT(Q5_1)
GENERIC_DOT(Q4_K)
GENERIC_DOT(Q5_K)
GENERIC_DOT(Q6_K)
static const row_dot DOTS[NUM_TYPES] = {
    [Q8_0] = dot_generic_Q8_0, [Q4_0] = dot_generic_Q4_0, [Q4_1] = dot_generic_Q4_1, [Q5_0] = dot_generic_Q5_0,
    [Q5_1] = dot_generic_Q5_1, [Q4_K] = dot_generic_Q4_K, [Q5_K] = dot_generic_Q5_K, [Q6_K] = dot_generic_Q6_K,
};
#endif
