// The matrix products of the decode step: each weight row (f32, f16, bf16, or ggml blocks through quant_dots.h's
// DOTS) dotted with float32 inputs; for several sequences ("lanes") a block of rows against every lane's input while
// it is in the core's cache (lane_rows); matvecs, one parallel phase over up to three matrices' concatenated rows.
#pragma once
#include <stdint.h>

#include "bf16.h"
#include "decode_types.h"
#include "quant_dots.h"
#include "thread_pool.h"
#include "vec_math.h"

// ---- row dot products of float weights with a float32 x ---------------------------------------------------

// How far ahead of the dots a row is prefetched (0: not at all): the rows run back to back, and on AMD EPYCs
// the hardware prefetcher alone left the stream short of the memory's rate (docs/kernels.md, "Matrix rows").
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif

// One row at a time, two sums in flight: the matrix is read as one sequential stream, which the hardware
// prefetcher follows (it streamed faster than four interleaved rows: docs/kernels.md, "Matrix rows").
#ifdef VEC_LANES
#define FLOAT_DOTS(NAME, T, VLOAD, SLOAD)                                                                   \
    static void NAME(const T *w, int64_t cols, int64_t nrows, const float *x, float *y) {                 \
        for (int64_t r = 0; r < nrows; r++) {                                                             \
            const T *row = w + r * cols;                                                                  \
            vf a0 = vzero(), a1 = vzero();                                                                \
            int64_t i = 0;                                                                                \
            for (; i + 2 * VSTEP <= cols; i += 2 * VSTEP) {                                               \
                if (PF_BYTES) _mm_prefetch((const char *)(row + i) + PF_BYTES, _MM_HINT_T0);              \
                a0 = vfma(VLOAD(row + i), vload(x + i), a0);                                              \
                a1 = vfma(VLOAD(row + i + VSTEP), vload(x + i + VSTEP), a1);                              \
            }                                                                                             \
            for (; i + VSTEP <= cols; i += VSTEP) a0 = vfma(VLOAD(row + i), vload(x + i), a0);            \
            float s = vsum(_vadd(a0, a1));                                                                \
            for (; i < cols; i++) s += SLOAD(row[i]) * x[i];                                              \
            y[r] = s;                                                                                     \
        }                                                                                                 \
    }
#else
#define FLOAT_DOTS(NAME, T, VLOAD, SLOAD)                                                                   \
    static void NAME(const T *w, int64_t cols, int64_t nrows, const float *x, float *y) {                 \
        for (int64_t r = 0; r < nrows; r++) {                                                             \
            const T *row = w + r * cols;                                                                  \
            float s = 0.0f;                                                                               \
            for (int64_t i = 0; i < cols; i++) s += SLOAD(row[i]) * x[i];                                 \
            y[r] = s;                                                                                     \
        }                                                                                                 \
    }
#endif
#define SLOAD_F32(v) (v)
FLOAT_DOTS(dots_f32, float, vload_f32, SLOAD_F32)
FLOAT_DOTS(dots_f16, uint16_t, vload_f16, f16_f32)
#if !defined(__AVX512BF16__)
FLOAT_DOTS(dots_bf16, uint16_t, vload_bf16, bf16_to_f32)
#endif

#if defined(__AVX512BF16__)
// bf16 weights against x rounded to bf16 (the torch path's activations are bf16 too): one instruction per
// 32 products with float32 sums.
static void dots_bf16_native(const uint16_t *w, int64_t cols, int64_t nrows, const uint16_t *xb, float *y) {
    for (int64_t r = 0; r < nrows; r++) {
        const uint16_t *row = w + r * cols;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 64 <= cols; i += 64) {
            _mm_prefetch((const char *)(row + i) + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(row + i) + PF_BYTES + 64, _MM_HINT_T0);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(row + i), (__m512bh)_mm512_loadu_si512(xb + i));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(row + i + 32),
                                  (__m512bh)_mm512_loadu_si512(xb + i + 32));
        }
        for (; i + 32 <= cols; i += 32)
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(row + i), (__m512bh)_mm512_loadu_si512(xb + i));
        float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        for (; i < cols; i++) s += bf16_to_f32(row[i]) * bf16_to_f32(xb[i]);
        y[r] = s;
    }
}
#endif

// An input vector as every kind of weight wants it: float32, rounded to bf16, and quantized to integers per 32
// (ggml blocks' integer dots, quant_dots.h).
typedef struct {
    const float *x;
    uint16_t *xb;
    qvec xq;
} input;

// in's other forms of x[begin, end) (begin a multiple of 32)
static void prepare_part(const input *in, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) in->xb[i] = f32_to_bf16(in->x[i]);
    quantize_x(in->x, begin, end, &in->xq);
}

static void prepare(input *in, int64_t n) { prepare_part(in, 0, n); }

// y[r - r0] = W[r] . x for r in [r0, r1), without the bias
static void row_dots(const matrix *m, int64_t r0, int64_t r1, const input *in, float *y) {
    const int64_t cols = m->cols, n = r1 - r0;
    switch (m->type) {
    case W_F32: dots_f32((const float *)m->data + r0 * cols, cols, n, in->x, y); break;
    case W_F16: dots_f16((const uint16_t *)m->data + r0 * cols, cols, n, in->x, y); break;
    case W_BF16:
#if defined(__AVX512BF16__)
        dots_bf16_native((const uint16_t *)m->data + r0 * cols, cols, n, in->xb, y);
#else
        dots_bf16((const uint16_t *)m->data + r0 * cols, cols, n, in->x, y);
#endif
        break;
    default: {
        const int64_t nb = cols / TYPES[m->type].elems, row_bytes = nb * TYPES[m->type].bytes;
        const uint8_t *w = (const uint8_t *)m->data + r0 * row_bytes;
        const row_dot dot = DOTS[m->type];
        for (int64_t r = 0; r < n; r++) y[r] = dot(w + r * row_bytes, &in->xq, nb);
    }
    }
}

// y[r - r0] = W[r] . x + bias[r] for r in [r0, r1)
static void matvec_rows(const matrix *m, int64_t r0, int64_t r1, const input *in, float *y) {
    row_dots(m, r0, r1, in, y);
    if (m->bias)
        for (int64_t r = 0; r < r1 - r0; r++) y[r] += load_scalar(m->bias, m->bias_type, r0 + r);
}

// ---- every lane's rows at once, and the parallel phase ----------------------------------------------------

#define LANE_ROWS 16  // rows dotted with every lane's input before the next: they stay in the core's cache

typedef struct {
    const matrix *m[3];
    int64_t offset[4];  // row offsets of the matrices in the concatenated output
    const input *in;    // [lanes]
    float *const *y;    // [lanes]
    int lanes;
} matvec_task;

#if defined(__AVX512BF16__)
// How far ahead the batched dots fetch the weight rows, into L2 (_MM_HINT_T1). With 8 lanes a cache line of
// weights takes several cycles of arithmetic, and a prefetch into L1 a few rows ahead (or the hardware's own) kept
// too few lines in flight: a core reached neither its memory's rate nor its arithmetic's. Two rows a pass and
// this distance into L2 keep enough lines in flight (docs/kernels.md, "Several sequences").
#ifndef LANE_PF_BYTES
#define LANE_PF_BYTES 8192
#endif
// The lanes' bf16 inputs a pass keeps in L1 (32 KiB on the CPUs that have AVX512-BF16) beside the weights:
// wider rows go in groups of 4 lanes (x of 8 lanes of 2,560 columns is 40 KiB, and every load of it then came
// from L2 while the weights' lines waited).
#define LANE_X_BYTES (24 * 1024)

// lane b's row sum: its vector of sums, then the columns past the last whole 32
static inline void lane_sums(const uint16_t *row, int64_t cols, int64_t i, const uint16_t *const *x,
                             const __m512 *a, int lanes, float *const *y, int64_t at) {
    for (int b = 0; b < lanes; b++) {
        float s = _mm512_reduce_add_ps(a[b]);
        for (int64_t k = i; k < cols; k++) s += bf16_to_f32(row[k]) * bf16_to_f32(x[b][k]);
        y[b][at] = s;
    }
}

// bf16 rows against up to N lanes' x at once (N = 4 or 8), two rows a pass: each 32 weights loaded once for N
// independent sums, each 32 of a lane's x once for both rows. A lane's sum per row is the same whatever N is.
#define DOTS_BF16_LANES(N)                                                                                      \
    static void dots_bf16_lanes##N(const uint16_t *w, int64_t cols, int64_t nrows, const input *in,            \
                                   float *const *y, int64_t y_off, int lanes) {                                \
        const uint16_t *x[N];                                                                                    \
        for (int b = 0; b < N; b++) x[b] = in[b < lanes ? b : 0].xb; /* lanes past `lanes`: never stored */     \
        for (int64_t r = 0; r < nrows; r += 2) {                                                                 \
            const uint16_t *r0 = w + r * cols, *r1 = r + 1 < nrows ? r0 + cols : r0; /* an odd last row: twice */\
            __m512 a[N], c[N];                                                                                   \
            for (int b = 0; b < N; b++) a[b] = c[b] = _mm512_setzero_ps();                                       \
            int64_t i = 0;                                                                                       \
            for (; i + 32 <= cols; i += 32) {                                                                    \
                _mm_prefetch((const char *)(r0 + i) + LANE_PF_BYTES, _MM_HINT_T1);                               \
                _mm_prefetch((const char *)(r1 + i) + LANE_PF_BYTES, _MM_HINT_T1);                               \
                __m512bh w0 = (__m512bh)_mm512_loadu_si512(r0 + i), w1 = (__m512bh)_mm512_loadu_si512(r1 + i);  \
                _Pragma("GCC unroll 8") for (int b = 0; b < N; b++) {                                            \
                    __m512bh xv = (__m512bh)_mm512_loadu_si512(x[b] + i);                                        \
                    a[b] = _mm512_dpbf16_ps(a[b], w0, xv);                                                       \
                    c[b] = _mm512_dpbf16_ps(c[b], w1, xv);                                                       \
                }                                                                                                \
            }                                                                                                    \
            lane_sums(r0, cols, i, x, a, lanes, y, y_off + r);                                                   \
            if (r + 1 < nrows) lane_sums(r1, cols, i, x, c, lanes, y, y_off + r + 1);                            \
        }                                                                                                        \
    }
DOTS_BF16_LANES(4)
DOTS_BF16_LANES(8)
#elif defined(VEC_LANES)
// Float rows (f32, f16, bf16 widened) against up to N lanes' float32 x (N = 2 or 4): each weight vector is loaded
// and widened once for N sums instead of once per lane. Every lane's sum is added in FLOAT_DOTS's order (two sums
// in flight, the same tail), so a lane's products are bit for bit what its sequence gets alone.
#define FLOAT_LANES(NAME, N, T, VLOAD, SLOAD)                                                                  \
    static void NAME(const T *w, int64_t cols, int64_t nrows, const input *in, float *const *y, int64_t y_off, \
                     int lanes) {                                                                               \
        const float *x[N];                                                                                      \
        for (int b = 0; b < N; b++) x[b] = in[b < lanes ? b : 0].x; /* lanes past `lanes`: never stored */     \
        for (int64_t r = 0; r < nrows; r++) {                                                                   \
            const T *row = w + r * cols;                                                                        \
            vf a0[N], a1[N];                                                                                    \
            for (int b = 0; b < N; b++) a0[b] = a1[b] = vzero();                                                \
            int64_t i = 0;                                                                                      \
            for (; i + 2 * VSTEP <= cols; i += 2 * VSTEP) {                                                     \
                if (PF_BYTES) _mm_prefetch((const char *)(row + i) + PF_BYTES, _MM_HINT_T0);                    \
                vf w0 = VLOAD(row + i), w1 = VLOAD(row + i + VSTEP);                                            \
                _Pragma("GCC unroll 4") for (int b = 0; b < N; b++) {                                           \
                    a0[b] = vfma(w0, vload(x[b] + i), a0[b]);                                                   \
                    a1[b] = vfma(w1, vload(x[b] + i + VSTEP), a1[b]);                                           \
                }                                                                                               \
            }                                                                                                   \
            for (; i + VSTEP <= cols; i += VSTEP) {                                                             \
                vf w0 = VLOAD(row + i);                                                                         \
                _Pragma("GCC unroll 4") for (int b = 0; b < N; b++) a0[b] = vfma(w0, vload(x[b] + i), a0[b]);   \
            }                                                                                                   \
            for (int b = 0; b < lanes; b++) {                                                                   \
                float s = vsum(_vadd(a0[b], a1[b]));                                                            \
                for (int64_t k = i; k < cols; k++) s += SLOAD(row[k]) * x[b][k];                                \
                y[b][y_off + r] = s;                                                                            \
            }                                                                                                   \
        }                                                                                                       \
    }
FLOAT_LANES(lanes4_f32, 4, float, vload_f32, SLOAD_F32)
FLOAT_LANES(lanes4_f16, 4, uint16_t, vload_f16, f16_f32)
FLOAT_LANES(lanes4_bf16, 4, uint16_t, vload_bf16, bf16_to_f32)
FLOAT_LANES(lanes2_f32, 2, float, vload_f32, SLOAD_F32)
FLOAT_LANES(lanes2_f16, 2, uint16_t, vload_f16, f16_f32)
FLOAT_LANES(lanes2_bf16, 2, uint16_t, vload_bf16, bf16_to_f32)
#endif

// every lane's rows [lo, hi) of the output get the matrix's bias
static inline void lanes_bias(const matrix *m, int64_t lo, int64_t hi, float *const *y, int64_t y_off, int lanes) {
    if (m->bias)
        for (int b = 0; b < lanes; b++)
            for (int64_t r = lo; r < hi; r++) y[b][y_off + r - lo] += load_scalar(m->bias, m->bias_type, r);
}

// rows [lo, hi) of one matrix for every lane: each weight row is read from memory once for all of them
static void lane_rows(const matrix *m, int64_t lo, int64_t hi, const input *in, float *const *y, int64_t y_off,
                      int lanes) {
#if defined(__AVX512BF16__)
    if (m->type == W_BF16 && lanes > 1) {
        const uint16_t *w = (const uint16_t *)m->data;
        for (int64_t r = lo; r < hi; r += LANE_ROWS) {
            int64_t e = r + LANE_ROWS < hi ? r + LANE_ROWS : hi;
            const int group = m->cols * 2 * 8 <= LANE_X_BYTES ? 8 : 4;
            for (int b = 0; b < lanes; b += group) {
                const int n = lanes - b < group ? lanes - b : group;
                (n > 4 ? dots_bf16_lanes8 : dots_bf16_lanes4)(w + r * m->cols, m->cols, e - r, in + b, y + b,
                                                              y_off + (r - lo), n);
            }
        }
        lanes_bias(m, lo, hi, y, y_off, lanes);
        return;
    }
#elif defined(VEC_LANES)
    if ((m->type == W_F32 || m->type == W_F16 || m->type == W_BF16) && lanes > 1) {
        const int64_t esize = m->type == W_F32 ? 4 : 2;
        for (int64_t r = lo; r < hi; r += LANE_ROWS) {
            int64_t e = r + LANE_ROWS < hi ? r + LANE_ROWS : hi;
            const void *w = (const char *)m->data + r * m->cols * esize;
            for (int b = 0, n; b < lanes; b += n) {
                n = lanes - b < 4 ? lanes - b : 4;
                float *const *yb = y + b;
                const int64_t off = y_off + (r - lo);
                if (n == 1) row_dots(m, r, e, &in[b], yb[0] + off);  // alone: no lane to share a load with
                else if (m->type == W_F32) (n > 2 ? lanes4_f32 : lanes2_f32)(w, m->cols, e - r, in + b, yb, off, n);
                else if (m->type == W_F16) (n > 2 ? lanes4_f16 : lanes2_f16)(w, m->cols, e - r, in + b, yb, off, n);
                else (n > 2 ? lanes4_bf16 : lanes2_bf16)(w, m->cols, e - r, in + b, yb, off, n);
            }
        }
        lanes_bias(m, lo, hi, y, y_off, lanes);
        return;
    }
#endif
    for (int64_t r = lo; r < hi; r += LANE_ROWS) {
        int64_t e = r + LANE_ROWS < hi ? r + LANE_ROWS : hi;
        for (int b = 0; b < lanes; b++) matvec_rows(m, r, e, &in[b], y[b] + y_off + (r - lo));
    }
}

static void matvec_chunk(void *ctx, int64_t begin, int64_t end) {
    matvec_task *t = ctx;
    for (int i = 0; i < 3 && t->m[i]; i++) {
        int64_t lo = begin > t->offset[i] ? begin : t->offset[i];
        int64_t hi = end < t->offset[i + 1] ? end : t->offset[i + 1];
        if (lo < hi) lane_rows(t->m[i], lo - t->offset[i], hi - t->offset[i], t->in, t->y, lo, t->lanes);
    }
}

static int64_t grain_for(int64_t rows) {  // about 8 chunks per thread, whole groups of 4 rows
    int64_t g = rows / (8 * pool.num_threads);
    g = (g + 3) & ~(int64_t)3;
    return g < 4 ? 4 : g;
}

// y[lane] = [A; B; C] x[lane] for up to three matrices of the same inputs
static void matvecs(const matrix *a, const matrix *b, const matrix *c, const input *in, float *const *y, int lanes) {
    matvec_task t = {{a, b, c}, {0}, in, y, lanes};
    t.offset[1] = a->rows;
    t.offset[2] = t.offset[1] + (b ? b->rows : 0);
    t.offset[3] = t.offset[2] + (c ? c->rows : 0);
    int64_t total = b ? (c ? t.offset[3] : t.offset[2]) : t.offset[1];
    parallel(matvec_chunk, &t, total, grain_for(total));
}
