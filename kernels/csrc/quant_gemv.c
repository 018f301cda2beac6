// y = W x for the decode step, W in ggml blocks where they lie (the memory map), x and y float32.
// Decoding reads every weight once per token, so it is bound by memory bandwidth: each row's blocks are
// read once for all `n` input rows (quantized to integers first) and multiplied as integers in registers.
// Rows are split over OpenMP threads. Built at first use by kernels/cpu_quant.py, once per instruction
// set (kernels/native_libs.py: portable C; AVX2; AVX-512 with VNNI); see docs/kernels.md.
#include <stdlib.h>

#include "quant_dots.h"

// The type's id for quant_gemv, or -1: the names are kernels/quants.py's.
int quant_type_id(const char *name) { return block_type_id(name); }

// The instruction set this library was built for.
const char *quant_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return "avx512";
#elif defined(HAS_SIMD_DOTS)
    return "avx2";
#else
    return "scalar";
#endif
}

// y[t, r] = sum_c W[r, c] x[t, c] (+ bias[r]) for t < n: W [rows, cols] in blocks of `type` (rows contiguous),
// x float32 [n, cols], bias float32 [rows] or NULL, y float32 [n, rows]. Each input row is quantized once
// (quantize_x), then every weight row dotted with it. Returns 0, or -1 when out of memory.
int quant_gemv(int type, const uint8_t *w, const float *x, const float *bias, float *y, int64_t rows,
               int64_t cols, int64_t n, int num_threads) {
    const int64_t num_blocks = cols / TYPES[type].elems, row_bytes = num_blocks * TYPES[type].bytes;
    char *buf = malloc((size_t)(n * QVEC_BYTES(cols)));  // each input row's integer forms (quant_blocks.h)
    if (buf == NULL) return -1;
    qvec *xq = malloc((size_t)n * sizeof(qvec));
    if (xq == NULL) {
        free(buf);
        return -1;
    }
    for (int64_t t = 0; t < n; t++) {
        qvec_carve(&xq[t], buf + t * QVEC_BYTES(cols), cols);
        quantize_x(x + t * cols, 0, cols, &xq[t]);
    }
    const row_dot dot = DOTS[type];
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = w + r * row_bytes;
        for (int64_t t = 0; t < n; t++)  // the row's blocks stay in L1 for every input row
            y[t * rows + r] = dot(row, &xq[t], num_blocks) + (bias ? bias[r] : 0.0f);
    }
    free(xq);
    free(buf);
    return 0;
}
