// The types decode_layer.c shares with kernels/cpu_decode.py, the limits they set, and the conversions between
// float32 and the weights' and caches' element types (f16, bf16, fp8 e4m3fn): a value or a cache row at a time.
// Like every header here it is part of decode_layer.c's one translation unit (static functions, included once).
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "quant_dots.h"

// ---- types shared with kernels/cpu_decode.py (ctypes mirrors these structs field for field) ----------------

enum { W_F32 = 100, W_F16 = 101, W_BF16 = 102 };  // float weights; 0 .. NUM_TYPES - 1 are ggml block types
enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_SWIGLU_CLAMPED = 2 };  // the last: gpt-oss's (model's swiglu_*)
#define MAX_HEAD_DIM 512
#define MAX_SPLITS 64
#define MAX_GROUP 64  // query heads per KV head
#define MAX_THREADS 64
#define MAX_LANES 64  // sequences one batched step takes (decode_layers_batch)
#define MAX_TOPK 64   // experts one token chooses (num_experts_per_tok)

typedef struct {
    const void *data;  // [rows, cols]: rows of floats, or rows of blocks
    const void *bias;  // [rows] or NULL
    int32_t type, bias_type;
    int64_t rows, cols;
} matrix;

typedef struct {
    const void *data;  // [n] or NULL (absent)
    int32_t type;      // W_F32 / W_F16 / W_BF16
} vector;

typedef struct {
    matrix q, k, v, o, gate, up, down;
    vector input_norm, post_norm, pre_ff_norm, post_ff_norm, q_norm, k_norm;
    void *k_cache, *v_cache;  // [num_blocks, block_size, num_kv_heads, head_dim] in cache_type
    float k_scale, v_scale;   // fp8 caches store value / scale
    int32_t window;           // sliding window in tokens; 0: the whole context
    int32_t local_rope;       // 1: the sliding layers' own rotary base (Gemma 3)
    matrix router;            // [num_experts, hidden] of a layer of experts (docs/moe.md)
    const matrix *experts;    // [num_experts * 3]: each expert's gate, up, down; NULL: a dense layer (gate/up/down)
    const float *sinks;       // [num_heads] or NULL: gpt-oss's attention sinks, a logit per head in every softmax
} layer;

typedef struct {
    int32_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    int32_t cache_type;    // K's: W_F32 / W_F16 / W_BF16, 3: fp8 e4m3fn, CACHE_Q8_0 / CACHE_Q4_0: ggml blocks
    int32_t v_cache_type;  // V's, the same codes
    int32_t norm_plus_one, sandwich, qk_norm, act, num_layers;
    float eps, attn_scale, attn_softcap;  // softcap 0: none
    const float *inv_freq, *inv_freq_local;  // [head_dim / 2]
    const int64_t *qk_order;  // [head_dim] or NULL: Q/K outputs of a head read in this order (llama.cpp files)
    layer *layers;
    int32_t num_experts, top_k, norm_topk;  // a model of experts; 0 experts: dense. intermediate: the widest MLP
    float rope_scale;                  // cos and sin times this (YaRN's attention factor; 1 otherwise)
    float swiglu_limit, swiglu_alpha;  // ACT_SWIGLU_CLAMPED's (gpt-oss: 7, 1.702)
    int32_t softmax_after_topk;        // 1: the top-k of the router's logits, then a softmax over those (gpt-oss)
} model;

#define CACHE_FP8 3
// ggml's block types as KV caches (kernels/kv_quant.py), their ggml ids: a row of head_dim values is head_dim / 32
// blocks of an fp16 scale d and 32 quants, q8_0 int8 (value q * d), q4_0 nibbles (values 0-15 low, 16-31 high;
// value (q - 8) * d). Offsets into such a cache still count elements (values): always a multiple of 32.
#define CACHE_Q4_0 2
#define CACHE_Q8_0 8

static inline int cache_is_blocks(int32_t type) { return type == CACHE_Q8_0 || type == CACHE_Q4_0; }

// bytes of n cache elements (values; whole blocks for q8_0 / q4_0)
static inline int64_t cache_bytes(int32_t type, int64_t n) {
    switch (type) {
    case W_F32: return n * 4;
    case W_F16:
    case W_BF16: return n * 2;
    case CACHE_Q8_0: return n / 32 * 34;
    case CACHE_Q4_0: return n / 32 * 18;
    default: return n;
    }
}

// ---- scalar conversions -----------------------------------------------------------------------------------

static inline float f16_f32(uint16_t h) { return f16_to_f32((const uint8_t *)&h); }

static inline uint16_t f32_f16(float f) {  // round to nearest even; overflow to infinity, as torch does
#if defined(__F16C__)
    return _cvtss_sh(f, 0);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, a = x & 0x7fffffff;
    if (a > 0x7f800000) return (uint16_t)(sign | 0x7e00);
    if (a >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  // rounds past 65504
    if (a < 0x38800000) {  // below 2^-14: a subnormal half, mant = round(a / 2^-24)
        float v;
        memcpy(&v, &a, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(v * 16777216.0f));
    }
    uint32_t r = a - (112u << 23);
    r = (r + 0xfff + ((r >> 13) & 1)) >> 13;
    return (uint16_t)(sign | r);
#endif
}

static float FP8_TABLE[256];

static void build_fp8_table(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
        if ((b & 0x7f) == 0x7f) v = NAN;
        FP8_TABLE[b] = (b & 0x80) ? -v : v;
    }
}

static inline uint8_t f32_fp8(float f) {  // e4m3fn, round to nearest even, saturating at 448 as torch does
    uint32_t x;
    memcpy(&x, &f, 4);
    uint8_t sign = (uint8_t)((x >> 24) & 0x80);
    uint32_t a = x & 0x7fffffff;
    if (a > 0x7f800000) return sign | 0x7f;
    if (a > 0x43e00000) return sign | 0x7e;  // past 448 (infinity too)
    if (a < 0x3c800000) {                    // below 2^-6: subnormal, mant = round(a / 2^-9)
        float v;
        memcpy(&v, &a, 4);
        return sign | (uint8_t)nearbyintf(v * 512.0f);
    }
    uint32_t r = a - (120u << 23);
    r = (r + 0x7ffff + ((r >> 20) & 1)) >> 20;
    return sign | (uint8_t)(r > 0x7e ? 0x7e : r);
}

static inline float load_scalar(const void *p, int32_t type, int64_t i) {
    switch (type) {
    case W_F16: return f16_f32(((const uint16_t *)p)[i]);
    case W_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline float block_scale(const uint8_t *b) {
    uint16_t h;
    memcpy(&h, b, 2);
    return f16_f32(h);
}

// The i-th of a q8_0 / q4_0 block's 32 quants as an integer value (q4_0's minus its 8)
static inline int block_quant(const uint8_t *b, int32_t type, int i) {
    if (type == CACHE_Q8_0) return ((const int8_t *)b)[2 + i];
    return (i < 16 ? b[2 + i] & 15 : b[2 + i - 16] >> 4) - 8;
}

// 32 values into one block, as ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref (bit for bit: float32, roundf;
// q4_0's products kept apart from the + 8.5 (volatile), which a fused multiply-add would round differently)
static void quantize_block(int32_t type, const float *x, uint8_t *b) {
    float amax = 0.0f, top = 0.0f;
    for (int i = 0; i < 32; i++)
        if (amax < fabsf(x[i])) amax = fabsf(x[i]), top = x[i];
    const float d = type == CACHE_Q8_0 ? amax / 127.0f : top / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t h = f32_f16(d);
    memcpy(b, &h, 2);
    if (type == CACHE_Q8_0) {
        for (int i = 0; i < 32; i++) ((int8_t *)b)[2 + i] = (int8_t)roundf(x[i] * id);
        return;
    }
    for (int j = 0; j < 16; j++) {
        volatile float x0 = x[j] * id, x1 = x[16 + j] * id;
        int q0 = (int8_t)(x0 + 8.5f), q1 = (int8_t)(x1 + 8.5f);
        q0 = q0 < 15 ? q0 : 15, q1 = q1 < 15 ? q1 : 15;
        b[2 + j] = (uint8_t)(q0 | q1 << 4);
    }
}

// a row of n cache elements from `offset` as float32, and back (fp8 caches hold value / scale)
static void load_row(const void *cache, int32_t type, int64_t offset, int n, float scale, float *out) {
    if (cache_is_blocks(type)) {  // widened a block at a time: q * d
        const uint8_t *b = (const uint8_t *)cache + cache_bytes(type, offset);
        const int64_t bb = cache_bytes(type, 32);
        for (int k = 0; k < n; k += 32, b += bb) {  // loops without a branch per value: the compiler widens them
            const float d = block_scale(b);
            if (type == CACHE_Q8_0) {
                for (int i = 0; i < 32; i++) out[k + i] = (float)((const int8_t *)b)[2 + i] * d;
            } else {
                for (int i = 0; i < 16; i++) out[k + i] = (float)((b[2 + i] & 15) - 8) * d;
                for (int i = 0; i < 16; i++) out[k + 16 + i] = (float)((b[2 + i] >> 4) - 8) * d;
            }
        }
        return;
    }
    switch (type) {
    case W_F32: memcpy(out, (const float *)cache + offset, (size_t)n * 4); break;
    case W_F16:
        for (int i = 0; i < n; i++) out[i] = f16_f32(((const uint16_t *)cache)[offset + i]);
        break;
    case W_BF16:
        for (int i = 0; i < n; i++) out[i] = bf16_to_f32(((const uint16_t *)cache)[offset + i]);
        break;
    default:
        for (int i = 0; i < n; i++) out[i] = FP8_TABLE[((const uint8_t *)cache)[offset + i]] * scale;
    }
}

static void store_row(void *cache, int32_t type, int64_t offset, int n, float scale, const float *in) {
    if (cache_is_blocks(type)) {
        uint8_t *b = (uint8_t *)cache + cache_bytes(type, offset);
        for (int k = 0; k < n; k += 32, b += cache_bytes(type, 32)) quantize_block(type, in + k, b);
        return;
    }
    switch (type) {
    case W_F32: memcpy((float *)cache + offset, in, (size_t)n * 4); break;
    case W_F16:
        for (int i = 0; i < n; i++) ((uint16_t *)cache)[offset + i] = f32_f16(in[i]);
        break;
    case W_BF16:
        for (int i = 0; i < n; i++) ((uint16_t *)cache)[offset + i] = f32_to_bf16(in[i]);
        break;
    default:
        for (int i = 0; i < n; i++) ((uint8_t *)cache)[offset + i] = f32_fp8(in[i] / scale);
    }
}
