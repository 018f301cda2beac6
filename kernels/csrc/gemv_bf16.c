// y = W x for one token (decode): W bf16 [rows, cols] row-major, x bf16 [cols], y bf16 [rows].
// torch's bf16 matrix-vector product on the CPU reads weights at a fraction of the memory
// bandwidth; this streams each row once through AVX512-BF16 dot products (fp32 accumulation),
// split over rows with OpenMP. Built at first use by kernels/cpu_gemv.py; see docs/kernels.md.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

static inline float row_dot(const uint16_t *row, const uint16_t *x, int64_t cols) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= cols; i += 64) {  // two accumulators: dot products overlap instead of waiting
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(row + i), (__m512bh)_mm512_loadu_si512(x + i));
        acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(row + i + 32),
                                (__m512bh)_mm512_loadu_si512(x + i + 32));
    }
    for (; i + 32 <= cols; i += 32)
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(row + i), (__m512bh)_mm512_loadu_si512(x + i));
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    for (; i < cols; i++) sum += bf16_to_f32(row[i]) * bf16_to_f32(x[i]);
    return sum;
}

static inline void rows4_dot(const uint16_t *w, const uint16_t *x, int64_t cols, float out[4]) {
    // four rows at once: each x chunk is loaded once, and four streams keep more loads in flight
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    const uint16_t *r0 = w, *r1 = w + cols, *r2 = w + 2 * cols, *r3 = w + 3 * cols;
    int64_t i = 0;
    for (; i + 32 <= cols; i += 32) {
        __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(r0 + i), xv);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(r1 + i), xv);
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(r2 + i), xv);
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(r3 + i), xv);
    }
    out[0] = _mm512_reduce_add_ps(a0);
    out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2);
    out[3] = _mm512_reduce_add_ps(a3);
    for (; i < cols; i++) {
        float xi = bf16_to_f32(x[i]);
        out[0] += bf16_to_f32(r0[i]) * xi;
        out[1] += bf16_to_f32(r1[i]) * xi;
        out[2] += bf16_to_f32(r2[i]) * xi;
        out[3] += bf16_to_f32(r3[i]) * xi;
    }
}

void gemv_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t rows,
               int64_t cols, int num_threads) {
    int64_t groups = rows / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < groups + (rows % 4); g++) {
        if (g < groups) {
            float sums[4];
            rows4_dot(w + 4 * g * cols, x, cols, sums);
            for (int k = 0; k < 4; k++) {
                int64_t r = 4 * g + k;
                y[r] = f32_to_bf16(sums[k] + (bias ? bf16_to_f32(bias[r]) : 0.0f));
            }
        } else {  // the last rows % 4 rows, one at a time
            int64_t r = 4 * groups + (g - groups);
            float sum = row_dot(w + r * cols, x, cols);
            y[r] = f32_to_bf16(sum + (bias ? bf16_to_f32(bias[r]) : 0.0f));
        }
    }
}
