// Y = X W^T for a prefill chunk on the CPU, W in ggml blocks where they lie (the memory map), X and Y float32 or bf16
// (kernels/cpu_quant_matmul.py). A chunk of n tokens multiplies every weight n times, so unlike decode this is bound
// by arithmetic: the activations are quantized once per call to int8 per 32 (as llama.cpp's Q8_0 / Q8_K: a float
// scale and the sums the weights' minimums and offsets need), each panel of weight rows is unpacked once per call
// into bytes (unsigned; signed for Q8_0) with a float scale and minimum per 32 (per 16 for Q6_K), interleaved 8 rows
// at a time, and tiles of MM_MG x 8 rows x MM_NR tokens are integer dot products (AVX2 `vpmaddubsw` + `vpmaddwd`,
// AVX-512 VNNI `vpdpbusd`; plain C elsewhere) whose int32 sums are scaled once per 32. Panels are thread_pool.h's
// chunks: a thread the OS takes away delays a call by one panel at most. See docs/kernels.md.
#pragma once
#include <math.h>
#include <stdlib.h>

#include "quant_blocks.h"
#include "thread_pool.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MM_SIMD 1
#endif

#define MM_NR 3           // tokens per tile
#define MM_MG 2           // groups of 8 weight rows per tile
#define MM_PANEL_ROWS 32  // weight rows unpacked at a time by one thread: their bytes and scales stay in L2

// How a type's unpacked weights are multiplied: unsigned of 4 bits (Q4_0, Q4_1, Q4_K), 5 bits (Q5_0, Q5_1, Q5_K)
// or 6 bits with a scale per 16 (Q6_K), or signed bytes (Q8_0). The bits bound how many u8 x s8 pair sums an int16
// lane holds before it could overflow: 8 steps of 2 * 15 * 127, 4 of 2 * 31 * 127, 2 of 2 * 63 * 127, 1 of 2 * 128
// * 127, each at most 32,767.
enum { MM_K4, MM_K5, MM_K6, MM_K8 };

static int mm_kind_of(int type) {
    return type == Q8_0 ? MM_K8 : type == Q6_K ? MM_K6 : type == Q5_0 || type == Q5_1 || type == Q5_K ? MM_K5 : MM_K4;
}

// The type's id for quant_matmul, or -1: the names are kernels/quants.py's.
int quant_matmul_type_id(const char *name) {
    const int t = block_type_id(name);
    return t == Q8_0 || t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q4_K || t == Q5_K || t == Q6_K ? t
                                                                                                              : -1;
}

// One activation row x[cols] quantized per 32: step = max |x| / 127, q = round(x / step) (ties to even; all 0 where
// the 32 are 0); d[k] = step, s[g] = step * sum of q over each group of `group` (32, or 16 for Q6_K).
// tests/kernels/test_quant_matmul.py repeats these float32 steps in torch.
static void mm_quantize_row(const void *x, int x_bf16, int64_t cols, int group, int8_t *q, float *d, float *s) {
    for (int64_t k = 0; k < cols / 32; k++) {
        const float *v = (const float *)x + 32 * k;
        float widened[32];
        if (x_bf16) {  // bf16 activations widened here (exact): no float32 copy of the chunk
            const uint16_t *h = (const uint16_t *)x + 32 * k;
#ifdef MM_SIMD
            for (int j = 0; j < 4; j++)
                _mm256_storeu_ps(widened + 8 * j, _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + 8 * j))), 16)));
#else
            for (int j = 0; j < 32; j++) {
                const uint32_t bits = (uint32_t)h[j] << 16;
                memcpy(widened + j, &bits, 4);
            }
#endif
            v = widened;
        }
#ifdef MM_SIMD
        const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 xv[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) m = _mm256_max_ps(m, _mm256_and_ps(xv[j] = _mm256_loadu_ps(v + 8 * j), abs));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float step = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.0f;
        const __m256 inv = _mm256_set1_ps(step != 0.0f ? 1.0f / step : 0.0f);
        __m256i iq[4];
        __m256 fs[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int j = 0; j < 4; j++) {
            const __m256 t = _mm256_round_ps(_mm256_mul_ps(xv[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            fs[j / 2] = _mm256_add_ps(fs[j / 2], t);  // integers: exact
            iq[j] = _mm256_cvttps_epi32(t);
        }
        // packs work per 128-bit lane: bytes come out in the order of the 4-byte groups 0 4 1 5 2 6 3 7
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(iq[0], iq[1]), _mm256_packs_epi32(iq[2], iq[3]));
        _mm256_storeu_si256((__m256i *)(q + 32 * k),
                            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        int32_t sum[2];
        for (int h = 0; h < 2; h++) {
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(fs[h]), _mm256_extractf128_ps(fs[h], 1));
            s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            sum[h] = (int32_t)_mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
        }
#else
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        const float step = amax / 127.0f, inv = step != 0.0f ? 1.0f / step : 0.0f;
        int32_t sum[2] = {0, 0};
        for (int j = 0; j < 32; j++) {
            const int qj = (int)nearbyintf(v[j] * inv);  // the default rounding mode: to nearest, ties to even
            q[32 * k + j] = (int8_t)qj;
            sum[j / 16] += qj;
        }
#endif
        d[k] = step;
        if (group == 32) {
            s[k] = step * (float)(sum[0] + sum[1]);
        } else {
            s[2 * k] = step * (float)sum[0];
            s[2 * k + 1] = step * (float)sum[1];
        }
    }
}

// One block of `type` as bytes q (weight = scale * q + min per group) with its scales and minimums: per 32 for
// every type but Q6_K, whose are per 16.
static void mm_unpack_block(int type, const uint8_t *b, uint8_t *q, float *sc, float *mn) {
    switch (type) {
    case Q8_0:
        memcpy(q, b + 2, 32);
        sc[0] = f16_to_f32(b);
        mn[0] = 0.0f;
        break;
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
        const int has_min = type == Q4_1 || type == Q5_1, has_high = type == Q5_0 || type == Q5_1;
        const uint8_t *qh = b + 2 + 2 * has_min, *qs = qh + 4 * has_high;
        uint32_t high = 0;
        if (has_high) high = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
#ifdef MM_SIMD
        const __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
        __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
        if (has_high) {  // byte j gets 0x10 where bit j of `high` is set
            const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                    2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
            const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
            const __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)high), spread);
            v = _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit),
                                                    _mm256_set1_epi8(0x10)));
        }
        _mm256_storeu_si256((__m256i *)q, v);
#else
        for (int j = 0; j < 16; j++) {  // bit j of qh is the fifth bit of weight j
            q[j] = (uint8_t)((qs[j] & 0x0F) | (((high >> j) & 1) << 4));
            q[j + 16] = (uint8_t)((qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4));
        }
#endif
        const float d = f16_to_f32(b);
        sc[0] = d;
        mn[0] = has_min ? f16_to_f32(b + 2) : -(has_high ? 16.0f : 8.0f) * d;
        break;
    }
    case Q4_K:
    case Q5_K: {
        const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
        uint8_t s6[8], m6[8];
        k_scales(b + 4, s6, m6);
        const uint8_t *qh = b + 16, *qs = type == Q4_K ? b + 16 : b + 48;
#ifdef MM_SIMD
        if (type == Q4_K) {
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c)), low4 = _mm256_set1_epi8(0x0F);
                _mm256_storeu_si256((__m256i *)(q + 64 * c), _mm256_and_si256(v, low4));
                _mm256_storeu_si256((__m256i *)(q + 64 * c + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
            }
        } else
#endif
        k_quants(qs, qh, type == Q5_K, q);
        for (int j = 0; j < 8; j++) {
            sc[j] = d * (float)s6[j];
            mn[j] = -dmin * (float)m6[j];
        }
        break;
    }
    case Q6_K: {
        const float d = f16_to_f32(b + 208);
        const int8_t *s = (const int8_t *)(b + 192);
        for (int half = 0; half < 2; half++) {  // 128 weights each: ql[64], qh[32]
            const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
            uint8_t *y = q + 128 * half;
#ifdef MM_SIMD
            const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
            const __m256i a = _mm256_loadu_si256((const __m256i *)ql), c = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
            _mm256_storeu_si256((__m256i *)y, _mm256_or_si256(_mm256_and_si256(a, low4),
                                                              _mm256_and_si256(_mm256_slli_epi16(h, 4), bits45)));
            _mm256_storeu_si256((__m256i *)(y + 32), _mm256_or_si256(_mm256_and_si256(c, low4),
                                                                     _mm256_and_si256(_mm256_slli_epi16(h, 2), bits45)));
            _mm256_storeu_si256((__m256i *)(y + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4),
                                                                     _mm256_and_si256(h, bits45)));
            _mm256_storeu_si256((__m256i *)(y + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low4),
                                                                     _mm256_and_si256(_mm256_srli_epi16(h, 2), bits45)));
            continue;
#endif
            for (int l = 0; l < 32; l++) {
                y[l] = (uint8_t)((ql[l] & 0x0F) | ((qh[l] & 3) << 4));
                y[l + 32] = (uint8_t)((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
                y[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                y[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        }
        for (int g = 0; g < 16; g++) {
            sc[g] = d * (float)s[g];
            mn[g] = -32.0f * sc[g];
        }
        break;
    }
    }
}

// Weight rows unpacked in groups of 8, interleaved so that one 32-byte vector holds 4 weights of each of the 8 rows:
// q [group][block of 32][step k < 8][row < 8][4 bytes]; sc and mn [group][block][s < S][row < 8] with S scales per 32
// (2 for Q6_K). A row past the matrix's end is zeros.
typedef struct {
    uint8_t *q;
    float *sc, *mn;
    uint8_t *rows8;  // scratch: 8 rows' bytes in order, before they are interleaved
} mm_panel;

// Where the products go: float32 or bf16 (rounded to nearest even, as torch rounds), rows of ld values.
typedef struct {
    void *p;
    int bf16;
    int64_t ld;
} mm_output;

static inline void mm_store(const mm_output *y, int64_t t, int64_t r, float v) {
    if (!y->bf16) {
        ((float *)y->p)[t * y->ld + r] = v;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits = v != v ? 0x7fc00000u : bits + 0x7fffu + ((bits >> 16) & 1);
    ((uint16_t *)y->p)[t * y->ld + r] = (uint16_t)(bits >> 16);
}

// The activations quantized: q [n][cols], d [n][cols / 32], s [n][ng] (ng sums per row: one per 32, per 16 for Q6_K).
typedef struct {
    int8_t *q;
    float *d, *s;
    int64_t ng;
} mm_rows;

// y[t][r] (+= nothing: stored) for one group of 8 rows (R of them real) and T <= MM_NR tokens from t0: per block of 32,
// each step's 4 bytes of a token broadcast against the 8 rows' 4 bytes, pair sums held in int16 for the kind's run
// of steps, then in int32; once per block (per 16 for Q6_K) the sums are converted and scaled by the rows' scales
// times the token's step, and the rows' minimums times the token's sums are added.
static inline __attribute__((always_inline)) void mm_group_tile(int kind, int G, int T, const uint8_t *gq,
                                                             const float *gsc, const float *gmn, const mm_rows *x,
                                                             int64_t t0, int64_t cols, const float *bias, int R,
                                                             const mm_output *y, int64_t r0) {
    const int64_t nb = cols / 32, gs = nb * (kind == MM_K6 ? 2 : 1) * 8;  // a group's scales (and minimums)
    const int S = kind == MM_K6 ? 2 : 1, run = kind == MM_K4 ? 8 : kind == MM_K5 ? 4 : kind == MM_K6 ? 2 : 1;
#ifdef MM_SIMD
    __m256 acc[MM_MG][MM_NR];
    for (int g = 0; g < G; g++)
        for (int t = 0; t < T; t++) acc[g][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i isum[MM_MG][MM_NR][2];
        for (int g = 0; g < G; g++)
            for (int t = 0; t < T; t++) isum[g][t][0] = isum[g][t][1] = _mm256_setzero_si256();
        for (int k0 = 0; k0 < 8; k0 += run) {
            __m256i p16[MM_MG][MM_NR];
            for (int g = 0; g < G; g++)
                for (int t = 0; t < T; t++) p16[g][t] = _mm256_setzero_si256();
            for (int k = k0; k < k0 + run; k++) {
                __m256i wv[MM_MG], u[MM_MG];
                for (int g = 0; g < G; g++) {
                    wv[g] = _mm256_loadu_si256((const __m256i *)(gq + g * nb * 256 + 256 * b + 32 * k));
                    u[g] = kind == MM_K8 ? _mm256_sign_epi8(wv[g], wv[g]) : wv[g];
                }
                for (int t = 0; t < T; t++) {
                    int32_t four;
                    memcpy(&four, x->q + (t0 + t) * cols + 32 * b + 4 * k, 4);
                    const __m256i xb = _mm256_set1_epi32(four);
                    for (int g = 0; g < G; g++) {
                        const __m256i xs = kind == MM_K8 ? _mm256_sign_epi8(xb, wv[g]) : xb;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                        isum[g][t][k / 4 * (S - 1)] = _mm256_dpbusd_epi32(isum[g][t][k / 4 * (S - 1)], u[g], xs);
#else
                        p16[g][t] = _mm256_add_epi16(p16[g][t], _mm256_maddubs_epi16(u[g], xs));
#endif
                    }
                }
            }
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
            for (int g = 0; g < G; g++)
                for (int t = 0; t < T; t++)
                    isum[g][t][k0 / 4 * (S - 1)] = _mm256_add_epi32(isum[g][t][k0 / 4 * (S - 1)],
                                                                    _mm256_madd_epi16(p16[g][t], _mm256_set1_epi16(1)));
#else
            (void)p16;
#endif
        }
        for (int t = 0; t < T; t++) {
            const __m256 dx = _mm256_broadcast_ss(x->d + (t0 + t) * nb + b);
            for (int s = 0; s < S; s++) {
                const __m256 xs = _mm256_broadcast_ss(x->s + (t0 + t) * x->ng + S * b + s);
                for (int g = 0; g < G; g++) {
                    const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(gsc + g * gs + 8 * (S * b + s)), dx);
                    acc[g][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[g][t][s]), scale, acc[g][t]);
                    if (kind != MM_K8)
                        acc[g][t] = _mm256_fmadd_ps(_mm256_loadu_ps(gmn + g * gs + 8 * (S * b + s)), xs, acc[g][t]);
                }
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int t = 0; t < T; t++) {
            float out[8];
            _mm256_storeu_ps(out, acc[g][t]);
            for (int r = 0; r < 8 && 8 * g + r < R; r++)
                mm_store(y, t0 + t, r0 + 8 * g + r, out[r] + (bias ? bias[8 * g + r] : 0.0f));
        }
#else
    (void)run, (void)G;
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) {
            const uint8_t *q = gq + r / 8 * nb * 256;
            const float *sc = gsc + r / 8 * gs, *mn = gmn + r / 8 * gs;
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t isum[2] = {0, 0};
                for (int k = 0; k < 8; k++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t wj = q[256 * b + 32 * k + 4 * (r % 8) + j];
                        isum[k / 4 * (S - 1)] += (kind == MM_K8 ? (int)(int8_t)wj : (int)wj) *
                                                 x->q[(t0 + t) * cols + 32 * b + 4 * k + j];
                    }
                for (int s = 0; s < S; s++) {
                    sum += (float)isum[s] * (sc[8 * (S * b + s) + r % 8] * x->d[(t0 + t) * nb + b]);
                    if (kind != MM_K8) sum += mn[8 * (S * b + s) + r % 8] * x->s[(t0 + t) * x->ng + S * b + s];
                }
            }
            mm_store(y, t0 + t, r0 + r, sum + (bias ? bias[r] : 0.0f));
        }
#endif
}

#define MM_TILE(G, T) mm_group_tile(kind, G, T, gq, gsc, gmn, x, t, cols, gb, R, y, r0 + 8 * g)

// Rows [0, rows) of the mm_panel (at most MM_PANEL_ROWS) against every token, tiles of MM_MG groups of 8 rows x MM_NR tokens:
// a tile's activations stay in L1 while the mm_panel's groups stream from L2.
static inline __attribute__((always_inline)) void mm_panel_product(int kind, const mm_panel *p, int64_t rows,
                                                                const mm_rows *x, int64_t n, int64_t cols,
                                                                const float *bias, const mm_output *y, int64_t r0) {
    const int S = kind == MM_K6 ? 2 : 1;
    const int64_t nb = cols / 32;
    for (int64_t t = 0; t < n; t += MM_NR) {
        const int T = n - t < MM_NR ? (int)(n - t) : MM_NR;
        for (int64_t g = 0; 8 * g < rows; g += MM_MG) {
            const int R = rows - 8 * g < 8 * MM_MG ? (int)(rows - 8 * g) : 8 * MM_MG, G = (R + 7) / 8;
            const uint8_t *gq = p->q + g * nb * 256;
            const float *gsc = p->sc + g * nb * S * 8, *gmn = p->mn + g * nb * S * 8;
            const float *gb = bias ? bias + 8 * g : NULL;
            if (G == MM_MG) {
                switch (T) {
                case MM_NR: MM_TILE(MM_MG, MM_NR); break;
#if MM_NR > 3
                case 3: MM_TILE(MM_MG, 3); break;
#endif
                case 2: MM_TILE(MM_MG, 2); break;
                default: MM_TILE(MM_MG, 1); break;
                }
            } else {  // the mm_panel's last group alone
                switch (T) {
                case MM_NR: MM_TILE(1, MM_NR); break;
#if MM_NR > 3
                case 3: MM_TILE(1, 3); break;
#endif
                case 2: MM_TILE(1, 2); break;
                default: MM_TILE(1, 1); break;
                }
            }
        }
    }
}

static void mm_panel_product_kind(int kind, const mm_panel *p, int64_t rows, const mm_rows *x, int64_t n, int64_t cols,
                               const float *bias, const mm_output *y, int64_t r0) {
    switch (kind) {  // one instance per kind, so the tiles' branches on it fold away
    case MM_K4: mm_panel_product(MM_K4, p, rows, x, n, cols, bias, y, r0); break;
    case MM_K5: mm_panel_product(MM_K5, p, rows, x, n, cols, bias, y, r0); break;
    case MM_K6: mm_panel_product(MM_K6, p, rows, x, n, cols, bias, y, r0); break;
    default: mm_panel_product(MM_K8, p, rows, x, n, cols, bias, y, r0); break;
    }
}

// Rows [r0, r0 + count) of W into the mm_panel's interleaved layout (zeros past count, up to whole groups of 8): each
// group's rows unpacked in order, then each block's 8 x 8 four-byte words transposed.
static void mm_unpack_panel(int type, const uint8_t *w, int64_t r0, int64_t count, int64_t cols, const mm_panel *p) {
    const int elems = TYPES[type].elems, bytes = TYPES[type].bytes, S = type == Q6_K ? 2 : 1;
    const int64_t nb = cols / 32, row_bytes = cols / elems * bytes;
    float sc[QK_K / 16], mn[QK_K / 16];
    for (int64_t g = 0; 8 * g < count; g++) {
        uint8_t *gq = p->q + g * nb * 256;
        float *gsc = p->sc + g * nb * S * 8, *gmn = p->mn + g * nb * S * 8;
        for (int r = 0; r < 8; r++) {
            uint8_t *q = p->rows8 + r * cols;
            if (8 * g + r >= count) {
                memset(q, 0, (size_t)cols);
                for (int64_t b = 0; b < nb * S; b++) gsc[8 * b + r] = gmn[8 * b + r] = 0.0f;
                continue;
            }
            const uint8_t *row = w + (r0 + 8 * g + r) * row_bytes;
            for (int64_t i = 0; i < cols / elems; i++) {
                mm_unpack_block(type, row + i * bytes, q + i * elems, sc, mn);
                for (int j = 0; j < S * elems / 32; j++) {
                    gsc[8 * (i * S * elems / 32 + j) + r] = sc[j];
                    gmn[8 * (i * S * elems / 32 + j) + r] = mn[j];
                }
            }
        }
        for (int64_t b = 0; b < nb; b++) {  // out[k] = word k of rows 0..7
#ifdef MM_SIMD
            __m256i v[8], t[8];
            for (int r = 0; r < 8; r++) v[r] = _mm256_loadu_si256((const __m256i *)(p->rows8 + r * cols + 32 * b));
            for (int r = 0; r < 8; r += 2) {
                t[r] = _mm256_unpacklo_epi32(v[r], v[r + 1]);      // words 0 0 1 1 | 4 4 5 5 of rows r, r + 1
                t[r + 1] = _mm256_unpackhi_epi32(v[r], v[r + 1]);  // 2 2 3 3 | 6 6 7 7
            }
            for (int r = 0; r < 8; r += 4)
                for (int h = 0; h < 2; h++) {
                    v[r + 2 * h] = _mm256_unpacklo_epi64(t[r + h], t[r + 2 + h]);      // word 2h | 2h + 4 of 4 rows
                    v[r + 2 * h + 1] = _mm256_unpackhi_epi64(t[r + h], t[r + 2 + h]);  // word 2h + 1 | 2h + 5
                }
            for (int k = 0; k < 4; k++) {
                _mm256_storeu_si256((__m256i *)(gq + 256 * b + 32 * k), _mm256_permute2x128_si256(v[k], v[4 + k], 0x20));
                _mm256_storeu_si256((__m256i *)(gq + 256 * b + 32 * (k + 4)),
                                    _mm256_permute2x128_si256(v[k], v[4 + k], 0x31));
            }
#else
            for (int k = 0; k < 8; k++)
                for (int r = 0; r < 8; r++) memcpy(gq + 256 * b + 32 * k + 4 * r, p->rows8 + r * cols + 32 * b + 4 * k, 4);
#endif
        }
    }
}

typedef struct {
    int type, kind, x_bf16;
    const uint8_t *w;
    const void *x;
    const float *bias;
    mm_output out;
    mm_rows xq;
    int64_t rows, cols, n;
    _Atomic int failed;
} mm_call;

static void mm_quantize_task(void *ctx, int64_t begin, int64_t end) {
    const mm_call *c = ctx;
    const int S = c->kind == MM_K6 ? 2 : 1;
    const int64_t nb = c->cols / 32;
    for (int64_t t = begin; t < end; t++)
        mm_quantize_row((const char *)c->x + t * c->cols * (c->x_bf16 ? 2 : 4), c->x_bf16, c->cols, 32 / S,
                        c->xq.q + t * c->cols, c->xq.d + t * nb, c->xq.s + t * S * nb);
}

// Each thread's panel scratch, kept between calls (the pool's threads live as long as the process) and grown as the
// matrices need: unpacking a panel costs no allocation.
static __thread struct {
    uint8_t *bytes;
    size_t size;
} mm_scratch;

static void mm_panel_task(void *ctx, int64_t begin, int64_t end) {
    mm_call *c = ctx;
    const int S = c->kind == MM_K6 ? 2 : 1;
    const int64_t cols = c->cols, ng = S * (cols / 32);
    const size_t q_bytes = (size_t)(MM_PANEL_ROWS * cols), f_bytes = (size_t)(MM_PANEL_ROWS * ng) * sizeof(float);
    const size_t need = q_bytes + 2 * f_bytes + (size_t)(8 * cols);
    if (mm_scratch.size < need) {
        void *grown = realloc(mm_scratch.bytes, need);
        if (grown == NULL) {
            atomic_store(&c->failed, 1);
            return;
        }
        mm_scratch.bytes = grown, mm_scratch.size = need;
    }
    const mm_panel p = {mm_scratch.bytes, (float *)(mm_scratch.bytes + q_bytes),
                        (float *)(mm_scratch.bytes + q_bytes + f_bytes), mm_scratch.bytes + q_bytes + 2 * f_bytes};
    for (int64_t i = begin; i < end; i++) {
        const int64_t r0 = i * MM_PANEL_ROWS, count = c->rows - r0 < MM_PANEL_ROWS ? c->rows - r0 : MM_PANEL_ROWS;
        mm_unpack_panel(c->type, c->w, r0, count, cols, &p);
        mm_panel_product_kind(c->kind, &p, count, &c->xq, c->n, cols, c->bias ? c->bias + r0 : NULL, &c->out, r0);
    }
}

// y[t, r] = sum_c W[r, c] x[t, c] (+ bias[r]) for t < n: W [rows, cols] in blocks of `type` (rows contiguous, cols
// a multiple of the type's block), x [n, cols] and y [n, rows] float32 or bf16 (`flags`: MM_X_BF16, MM_Y_BF16), bias
// float32 [rows] or NULL; on the pool's threads (decode_set_threads). Returns 0, -1 when out of memory, -2 for a type
// it does not take.
enum { MM_X_BF16 = 1, MM_Y_BF16 = 2 };
int quant_matmul(int type, const uint8_t *w, const void *x, const float *bias, void *y, int64_t rows, int64_t cols,
                 int64_t n, int flags) {
    if (type < 0 || type >= NUM_TYPES || quant_matmul_type_id(TYPES[type].name) < 0) return -2;
    const int kind = mm_kind_of(type), S = kind == MM_K6 ? 2 : 1;
    const int64_t nb = cols / 32;
    mm_call c = {type, kind, flags & MM_X_BF16, w, x, bias, {y, flags & MM_Y_BF16 ? 1 : 0, rows},
                 {malloc((size_t)(n * cols)), malloc((size_t)(n * nb) * sizeof(float)),
                  malloc((size_t)(n * S * nb) * sizeof(float)), S * nb},
                 rows, cols, n, 0};
    int status = -1;
    if (c.xq.q && c.xq.d && c.xq.s) {
        pthread_mutex_lock(&CALLS);
        parallel(mm_quantize_task, &c, n, 16);
        parallel(mm_panel_task, &c, (rows + MM_PANEL_ROWS - 1) / MM_PANEL_ROWS, 1);
        pthread_mutex_unlock(&CALLS);
        status = atomic_load(&c.failed) ? -1 : 0;
    }
    free(c.xq.q);
    free(c.xq.d);
    free(c.xq.s);
    return status;
}
