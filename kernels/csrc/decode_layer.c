// The CPU decode step of a Llama-family model, one token of one sequence, in one call for a run of layers:
// input norm, Q/K/V products, Q/K norms, rotary, the new K/V written into its paged-cache slot, attention over
// the sequence's blocks read in place through the block table (online softmax, grouped KV heads, split over the
// context), output projection, residual, norms, gate/up, SiLU or GELU-tanh, down, residual. Plus the final norm
// and the output head. Weights are read where they lie (the memory map): f32, f16, bf16 rows or ggml blocks.
// Activations are float32 inside a call; nothing is allocated per step.
//
// Threads: a pool of our own. Each parallel phase is cut into chunks that threads take from one atomic
// ticket, so a thread the OS has taken away (a busy machine, the GUI's thread) delays a phase by at most one
// chunk instead of its fixed share; the calling thread works too, and waiting threads spin briefly, then
// sleep on a futex. Built per instruction set by kernels/cpu_decode.py; see docs/kernels.md.
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>

#include "bf16.h"
#include "quant_dots.h"

// ---- types shared with kernels/cpu_decode.py (ctypes mirrors these structs field for field) ----------------

enum { W_F32 = 100, W_F16 = 101, W_BF16 = 102 };  // float weights; 0 .. NUM_TYPES - 1 are ggml block types
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
#define MAX_HEAD_DIM 512
#define MAX_SPLITS 64
#define MAX_GROUP 64  // query heads per KV head
#define MAX_THREADS 64
#define MAX_LANES 64  // sequences one batched step takes (decode_layers_batch)

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
} layer;

typedef struct {
    int32_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    int32_t cache_type;  // W_F32 / W_F16 / W_BF16, or 3: fp8 e4m3fn
    int32_t norm_plus_one, sandwich, qk_norm, act, num_layers;
    float eps, attn_scale, attn_softcap;  // softcap 0: none
    const float *inv_freq, *inv_freq_local;  // [head_dim / 2]
    const int64_t *qk_order;  // [head_dim] or NULL: Q/K outputs of a head read in this order (llama.cpp files)
    layer *layers;
} model;

#define CACHE_FP8 3

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

// ---- row dot products of float weights with a float32 x ---------------------------------------------------

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

// How far ahead of the dots a row is prefetched (0: not at all): the rows run back to back, and on AMD EPYCs
// the hardware prefetcher alone left the stream short of the memory's rate (Zen 4, avx512bf16 level: 4 KiB
// ahead took the 1.7b shape's layers from 140 to ~110 ms a token on one core).
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif

// One row at a time, two sums in flight: the matrix is read as one sequential stream, which the hardware
// prefetcher follows (measured on rows of 576-8192: 13-19 GB/s on one core, where four interleaved rows
// reached 8-13).
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

// ---- the thread pool --------------------------------------------------------------------------------------

typedef void (*task_fn)(void *ctx, int64_t begin, int64_t end);

typedef struct {
    task_fn fn;
    void *ctx;
    int64_t total, grain;
    _Atomic int64_t done;
} job;

// The ticket is (generation << 32 | next item): a thread takes items with one compare-and-swap, and one of an
// older generation can never take any (its swap fails). Jobs alternate between two slots, so the one being
// filled is never the one a late thread still reads.
static struct {
    _Atomic uint64_t ticket;
    job jobs[2];
    _Atomic uint32_t wake;
    _Atomic int sleeping, stop, started;
    int num_threads;  // the calling thread included
    pthread_t threads[MAX_THREADS];
    int64_t spin_ns;
} pool = {.num_threads = 1, .spin_ns = 100000};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void work(uint32_t generation) {
    job *j = &pool.jobs[generation & 1];
    for (;;) {
        uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        if ((uint32_t)(t >> 32) != generation) return;
        int64_t begin = (int64_t)(t & 0xffffffffu);
        if (begin >= j->total) return;
        int64_t end = begin + j->grain < j->total ? begin + j->grain : j->total;
        if (!atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + (uint64_t)(end - begin),
                                                   memory_order_acq_rel, memory_order_relaxed))
            continue;
        j->fn(j->ctx, begin, end);  // the slot stays as it is until `done` reaches `total`, which needs us
        atomic_fetch_add_explicit(&j->done, end - begin, memory_order_release);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    uint32_t seen = (uint32_t)(atomic_load(&pool.ticket) >> 32);
    int64_t idle_since = now_ns();
    for (int spins = 0;; spins++) {
        if (atomic_load_explicit(&pool.stop, memory_order_acquire)) return NULL;
        uint32_t g = (uint32_t)(atomic_load_explicit(&pool.ticket, memory_order_acquire) >> 32);
        if (g != seen) {
            work(g);
            seen = g;
            idle_since = now_ns();
            spins = 0;
            continue;
        }
        if (spins < 64) {  // the next phase of a layer is usually microseconds away
            cpu_relax();
            continue;
        }
        if ((spins & 15) != 15 || now_ns() - idle_since < pool.spin_ns) {
            sched_yield();  // idle, but let a thread that has work on this core (torch's, the GUI's) run first
            continue;
        }
        // Sleep until the next job: announce it first, then look once more, so a job published meanwhile is
        // either seen here or finds us counted and wakes us.
        atomic_fetch_add(&pool.sleeping, 1);
        uint32_t w = atomic_load(&pool.wake);
        if ((uint32_t)(atomic_load(&pool.ticket) >> 32) == seen && !atomic_load(&pool.stop))
            syscall(SYS_futex, &pool.wake, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
        atomic_fetch_sub(&pool.sleeping, 1);
        idle_since = now_ns();
        spins = 0;
    }
}

static void wake_all(void) {
    atomic_fetch_add(&pool.wake, 1);
    syscall(SYS_futex, &pool.wake, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
}

static void stop_pool(void) {
    if (!atomic_load(&pool.started)) return;
    atomic_store(&pool.stop, 1);
    wake_all();
    for (int i = 0; i < pool.num_threads - 1; i++) pthread_join(pool.threads[i], NULL);
    atomic_store(&pool.stop, 0);
    atomic_store(&pool.started, 0);
}

// Run fn over [0, total) in chunks of `grain`, on every thread of the pool; returns when all are done.
static void parallel(task_fn fn, void *ctx, int64_t total, int64_t grain) {
    if (pool.num_threads == 1 || total <= grain) {
        fn(ctx, 0, total);
        return;
    }
    uint32_t g = (uint32_t)(atomic_load(&pool.ticket) >> 32) + 1;
    job *j = &pool.jobs[g & 1];
    j->fn = fn, j->ctx = ctx, j->total = total, j->grain = grain;
    atomic_store(&j->done, 0);
    atomic_store(&pool.ticket, (uint64_t)g << 32);
    if (atomic_load(&pool.sleeping) > 0) wake_all();
    work(g);
    for (int spins = 1; atomic_load_explicit(&j->done, memory_order_acquire) < total; spins++) {
        cpu_relax();
        if ((spins & 63) == 0) sched_yield();  // the thread holding the last chunk may be waiting for this core
    }
}

// One call at a time into the pool and the lanes' scratch, which are the process's: two engines decoding on two
// threads (or a prefill beside a decode) would otherwise share the pool's job slots and each other's scratch.
static pthread_mutex_t CALLS = PTHREAD_MUTEX_INITIALIZER;

// Use `n` threads (the caller included) from now on; 1: everything on the calling thread.
int decode_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&CALLS);
    stop_pool();
    pool.num_threads = n;
    for (int i = 0; i < n - 1; i++)
        if (pthread_create(&pool.threads[i], NULL, worker_main, NULL) != 0) {
            pool.num_threads = i + 1;
            break;
        }
    atomic_store(&pool.started, 1);
    pthread_mutex_unlock(&CALLS);
    return pool.num_threads;
}

int decode_num_threads(void) { return pool.num_threads; }

// How long an idle worker spins before it sleeps (nanoseconds).
void decode_set_spin(int64_t ns) { pool.spin_ns = ns; }

// ---- the per-call scratch ---------------------------------------------------------------------------------

typedef struct {
    float *h, *x, *qkv, *attn, *o, *gate, *up, *act, *cos, *sin, *part;
    uint16_t *xb, *ab;  // bf16 copies of x (or the attention output) and of the MLP's activation
    qvec xq, aq;        // the same quantized to integers
    int64_t cap;         // bytes
} scratch;

// One scratch per lane (sequence) of a step; lane 0 serves the single-token step and the head.
static scratch LANES[MAX_LANES];

static int ensure_lane(scratch *s, const model *m) {
    int64_t hidden = m->hidden, q = (int64_t)m->num_heads * m->head_dim,
            kv = (int64_t)m->num_kv_heads * m->head_dim, inter = m->intermediate;
    int64_t wide = hidden > q ? hidden : q;  // what x's copies hold
    int64_t floats = hidden + wide + (q + 2 * kv) + q + hidden + 3 * inter + m->head_dim +
                     (int64_t)m->num_heads * MAX_SPLITS * (m->head_dim + 2) + 2 * (wide / 32) + 2 * (inter / 32);
    int64_t halves = wide + inter;  // bf16 copies
    int64_t need = 4 * floats + 2 * (halves + 1) + 4 * (wide / 16 + inter / 16) + 2 * (wide + inter);
    if (s->cap < need) {
        free(s->h);
        float *base = malloc((size_t)need);
        if (!base) {
            *s = (scratch){0};
            return -1;
        }
        s->h = base;
        s->cap = need;
    }
    // laid out for this model every time: a buffer kept from a model of other dimensions has other offsets
    s->x = s->h + hidden;
    s->qkv = s->x + wide;
    s->attn = s->qkv + q + 2 * kv;
    s->o = s->attn + q;
    s->gate = s->o + hidden;
    s->up = s->gate + inter;
    s->act = s->up + inter;
    s->cos = s->act + inter;
    s->sin = s->cos + m->head_dim / 2;
    s->part = s->sin + m->head_dim / 2;
    s->xq.d = s->part + (int64_t)m->num_heads * MAX_SPLITS * (m->head_dim + 2);
    s->xq.s = s->xq.d + wide / 32;
    s->aq.d = s->xq.s + wide / 32;
    s->aq.s = s->aq.d + inter / 32;
    s->xb = (uint16_t *)(s->aq.s + inter / 32);
    s->ab = s->xb + wide;
    s->xq.sum16 = (int32_t *)(s->ab + inter + ((wide + inter) & 1));  // 4-byte aligned
    s->aq.sum16 = s->xq.sum16 + wide / 16;
    s->xq.q = (int8_t *)(s->aq.sum16 + inter / 16);
    s->xq.r = s->xq.q + wide;
    s->aq.q = s->xq.r + wide;
    s->aq.r = s->aq.q + inter;
    return 0;
}

static int ensure_scratch(const model *m, int lanes) {
    for (int b = 0; b < lanes; b++)
        if (ensure_lane(&LANES[b], m) != 0) return -1;
    return 0;
}

// ---- the pieces of a layer --------------------------------------------------------------------------------

static void rms_norm(const float *in, float *out, int64_t n, const vector *w, float eps, int plus_one) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)in[i] * in[i];
    float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) {
        float g = load_scalar(w->data, w->type, i);
        out[i] = in[i] * inv * (plus_one ? 1.0f + g : g);
    }
}

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
// weights takes ~9 cycles of arithmetic, and a prefetch into L1 a few rows ahead (or the hardware's own) kept
// too few lines in flight: one core streamed 8.6 GB/s and reached 34 of its ~110 GMAC/s, neither bound. Two
// rows a pass and 8 KiB ahead into L2: 20 GB/s and ~80 GMAC/s on a Zen 4 (rows of 960 from DRAM).
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

typedef struct {
    const layer *l;
    const input *in;   // [lanes]
    int act;
    const input *out;  // [lanes]: act, the down product's input
    scratch *s;        // [lanes]
    int lanes;
} ffn_task;

static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// act[r] = f(gate[r] . x) * (up[r] . x), prepared as the down product's input (bf16 copy, integers)
static void ffn_chunk(void *ctx, int64_t begin, int64_t end) {
    ffn_task *t = ctx;
    float *gate[MAX_LANES], *up[MAX_LANES];
    for (int b = 0; b < t->lanes; b++) gate[b] = t->s[b].gate, up[b] = t->s[b].up;
    // the gate's rows, then the up's: one stream of weights at a time (interleaving the two in blocks of 16 rows
    // cost 8-12% of a one-lane step on a Zen 4 VM, 1.7b and 360m shapes: docs/kernels.md)
    lane_rows(&t->l->gate, begin, end, t->in, gate, begin, t->lanes);
    lane_rows(&t->l->up, begin, end, t->in, up, begin, t->lanes);
    for (int b = 0; b < t->lanes; b++) {
        scratch *s = &t->s[b];
        for (int64_t r = begin; r < end; r++) {
            float g = s->gate[r];
            float a = t->act == ACT_GELU_TANH ? gelu_tanh(g) : g / (1.0f + expf(-g));
            s->act[r] = a * s->up[r];
        }
        prepare_part(&t->out[b], begin, end);  // chunks are whole groups of 32
    }
}

static void rotate(float *x, const float *cos, const float *sin, int half) {
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

static void load_row(const void *cache, int32_t type, int64_t offset, int n, float scale, float *out) {
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

static inline float dot(const float *a, const float *b, int n) {
#ifdef VEC_LANES
    vf acc = vzero();
    int i = 0;
    for (; i + VEC_LANES <= n; i += VEC_LANES) acc = vfma(vload(a + i), vload(b + i), acc);
    float s = vsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
#else
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
#endif
}

static inline void axpy(float *y, float a, const float *x, int n) {  // y += a x
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

typedef struct {
    const model *m;
    const layer *l;
    const int32_t *block_table;
    int64_t lo, hi;  // the keys attended: positions [lo, hi)
    int64_t splits, per_split;
    scratch *s;  // the lane's: its queries, partial sums and output
} attn_task;

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

// q . key row, through a converted row (fp8 caches, rows of no whole vectors; block_scores has the vector path)
static inline float key_dot(const float *q, const void *cache, int32_t type, int64_t offset, int n, float scale) {
    float row[MAX_HEAD_DIM];
    load_row(cache, type, offset, n, scale, row);
    return dot(q, row, n);
}

// acc[g] += p[g] v for the `group` heads, v widened from its cache row (caches of no whole vectors, fp8)
static inline void value_axpy(float *acc, int64_t acc_stride, const float *p, int64_t p_stride, int group,
                              const void *cache, int32_t type, int64_t offset, int n, float scale) {
    float row[MAX_HEAD_DIM];
    load_row(cache, type, offset, n, scale, row);
    for (int g = 0; g < group; g++) axpy(acc + g * acc_stride, p[g * p_stride], row, n);
}

#ifdef VEC_LANES
// one vector of a bf16, f16 or f32 cache row from element o, as float32
static inline vf cache_vec(const void *cache, int32_t type, int64_t o) {
    return type == W_BF16  ? vload_bf16((const uint16_t *)cache + o)
           : type == W_F16 ? vload_f16((const uint16_t *)cache + o)
                           : vload((const float *)cache + o);
}

// acc[h] += sum_j p[h][j] v_j for ng (1-4, a constant where it is inlined) heads: p: [ng][64], acc rows acc_stride
// apart. Each output vector stays in a register across the block's values: accumulating in memory, one value at a
// time, stalled on every store (the rows of acc are not vector-aligned). A head past ng costs nothing (it was
// computed and dropped: a quarter of the products for groups of three).
static inline __attribute__((always_inline)) void values_heads(float *acc, int64_t acc_stride, const float *p,
                                                               const void *cache, int32_t type, int64_t offset,
                                                               int64_t stride, int cnt, int n, const int ng) {
    float *c0 = acc, *c1 = acc + acc_stride, *c2 = acc + 2 * acc_stride, *c3 = acc + 3 * acc_stride;
    for (int i = 0; i < n; i += VEC_LANES) {  // named sums: an array would be spilled
        vf a0 = vload(c0 + i), a1 = vzero(), a2 = vzero(), a3 = vzero();
        if (ng > 1) a1 = vload(c1 + i);
        if (ng > 2) a2 = vload(c2 + i);
        if (ng > 3) a3 = vload(c3 + i);
        for (int j = 0; j < cnt; j++) {
            const int64_t o = offset + j * stride + i;
            const vf v = cache_vec(cache, type, o);
            a0 = vfma(vset(p[j]), v, a0);
            if (ng > 1) a1 = vfma(vset(p[64 + j]), v, a1);
            if (ng > 2) a2 = vfma(vset(p[128 + j]), v, a2);
            if (ng > 3) a3 = vfma(vset(p[192 + j]), v, a3);
        }
        vstore(c0 + i, a0);
        if (ng > 1) vstore(c1 + i, a1);
        if (ng > 2) vstore(c2 + i, a2);
        if (ng > 3) vstore(c3 + i, a3);
    }
}
#endif

// acc[g] += sum_j p[g][j] v_j over a block's `cnt` values (v_j at offset + j * stride), p: [group][64], four heads
// at a time
static inline void block_values(float *acc, int64_t acc_stride, const float *p, int group, const void *cache,
                                int32_t type, int vec, int64_t offset, int64_t stride, int cnt, int n, float scale) {
#ifdef VEC_LANES
    if (vec) {
        for (int g0 = 0; g0 < group; g0 += 4) {
            float *a = acc + g0 * acc_stride;
            const float *pg = p + g0 * 64;
            switch (group - g0) {
            case 1: values_heads(a, acc_stride, pg, cache, type, offset, stride, cnt, n, 1); break;
            case 2: values_heads(a, acc_stride, pg, cache, type, offset, stride, cnt, n, 2); break;
            case 3: values_heads(a, acc_stride, pg, cache, type, offset, stride, cnt, n, 3); break;
            default: values_heads(a, acc_stride, pg, cache, type, offset, stride, cnt, n, 4);
            }
        }
        return;
    }
#endif
    for (int j = 0; j < cnt; j++)
        value_axpy(acc, acc_stride, p + j, 64, group, cache, type, offset + j * stride, n, scale);
}

#ifdef VEC_LANES
// sc[h][j] = q_h . key_j for ng (1-4, a constant where it is inlined) heads of one KV head, q_h n apart, sc: [ng][64]:
// the heads' sums share each key vector loaded (and converted) and are independent chains
static inline __attribute__((always_inline)) void scores_heads(float *sc, const float *q, const void *cache,
                                                               int32_t type, int64_t offset, int64_t stride, int cnt,
                                                               int n, const int ng) {
    for (int j = 0; j < cnt; j++) {
        const int64_t o = offset + j * stride;
        vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
        for (int i = 0; i < n; i += VEC_LANES) {
            const vf k = cache_vec(cache, type, o + i);
            a0 = vfma(vload(q + i), k, a0);
            if (ng > 1) a1 = vfma(vload(q + n + i), k, a1);
            if (ng > 2) a2 = vfma(vload(q + 2 * n + i), k, a2);
            if (ng > 3) a3 = vfma(vload(q + 3 * n + i), k, a3);
        }
        if (ng == 1) {
            sc[j] = vsum(a0);
            continue;
        }
        float four[4];
        _mm_storeu_ps(four, vsum4(a0, a1, a2, a3));
        sc[j] = four[0], sc[64 + j] = four[1];
        if (ng > 2) sc[128 + j] = four[2];
        if (ng > 3) sc[192 + j] = four[3];
    }
}
#endif

// sc[g][j] = q_g . key_j for the `group` query heads of a KV head over a block's `cnt` keys (key_j at offset +
// j * stride), sc: [group][64]. Four heads' sums at a time share each key vector loaded (and converted), and are
// independent chains; one head (no grouping: MHA) takes four keys at a time instead.
static inline void block_scores(float *sc, const float *q, int group, const void *cache, int32_t type,
                                int64_t offset, int64_t stride, int cnt, int n) {
#ifdef VEC_LANES
    if (group == 1) {
        int j = 0;
        for (; j + 4 <= cnt; j += 4) {
            const int64_t o = offset + j * stride;
            vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
            for (int i = 0; i < n; i += VEC_LANES) {
                vf qi = vload(q + i);
                a0 = vfma(qi, cache_vec(cache, type, o + i), a0);
                a1 = vfma(qi, cache_vec(cache, type, o + stride + i), a1);
                a2 = vfma(qi, cache_vec(cache, type, o + 2 * stride + i), a2);
                a3 = vfma(qi, cache_vec(cache, type, o + 3 * stride + i), a3);
            }
            _mm_storeu_ps(sc + j, vsum4(a0, a1, a2, a3));
        }
        for (; j < cnt; j++) {
            vf a0 = vzero();
            for (int i = 0; i < n; i += VEC_LANES)
                a0 = vfma(vload(q + i), cache_vec(cache, type, offset + j * stride + i), a0);
            sc[j] = vsum(a0);
        }
        return;
    }
    for (int g0 = 0; g0 < group; g0 += 4) {
        const float *qg = q + (int64_t)g0 * n;
        float *sg = sc + g0 * 64;
        switch (group - g0) {
        case 1: scores_heads(sg, qg, cache, type, offset, stride, cnt, n, 1); break;
        case 2: scores_heads(sg, qg, cache, type, offset, stride, cnt, n, 2); break;
        case 3: scores_heads(sg, qg, cache, type, offset, stride, cnt, n, 3); break;
        default: scores_heads(sg, qg, cache, type, offset, stride, cnt, n, 4);
        }
    }
#else
    (void)q, (void)group, (void)cache, (void)type, (void)offset, (void)stride, (void)cnt, (void)n, (void)sc;
#endif
}

// The cache lines of [p, p + bytes) on their way into the core's L2: a block's keys and values lie together (all
// KV heads of a block), but the next block is anywhere, where the hardware prefetcher cannot follow. Into L2, not
// L1: a block's lines at once filled L1's few miss buffers, and the prefetches themselves stalled (Zen 4, 360m
// shape, one sequence at a 3,000-token context: a token 47.7 -> 38.3 ms, the loads of keys and values had held
// half of attn_chunk's samples; 8 sequences at 400 tokens: a step 51.9 -> 44.9 ms).
static inline void prefetch_range(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 2);
}

// [k, k + bytes) and [v, v + bytes) loaded in memory order (the values discarded). A step's keys are then read a KV
// head at a time, rows strided by the other heads' (360m shape: 128 of every 640 bytes); from memory that pattern
// streamed at half the rate of a sequential one, from L1 it costs nothing. Zen 4, 2 threads, builds alternating in
// one process: 360m shape at a 512-token context, a token 4-5% faster (26.0 -> 24.7 ms), at 2,500 ~3%; the 135m and
// 1.7b shapes alike.
static inline void load_in_order(const void *k, const void *v, int64_t bytes) {
    const char *a = k, *b = v;
#if defined(VEC_LANES) && VEC_LANES == 16
    __m512i x = _mm512_setzero_si512();
    for (int64_t i = 0; i + 64 <= bytes; i += 64)
        x = _mm512_or_si512(x, _mm512_or_si512(_mm512_loadu_si512(a + i), _mm512_loadu_si512(b + i)));
    __asm__ volatile("" : : "v"(x));
#elif defined(VEC_LANES)
    __m256i x = _mm256_setzero_si256();
    for (int64_t i = 0; i + 32 <= bytes; i += 64)
        x = _mm256_or_si256(x, _mm256_or_si256(_mm256_loadu_si256((const __m256i *)(a + i)),
                                               _mm256_loadu_si256((const __m256i *)(b + i))));
    __asm__ volatile("" : : "x"(x));
#else
    (void)a, (void)b, (void)bytes;
#endif
}

// One head's scores of a block's `cnt` keys (sc: room for 64) into their weights exp(score - max), and its running
// maximum, sum and weighted values p = [max, sum, acc[hd]] brought up to date. Vector builds take whole vectors,
// the keys past cnt at -inf (weight 0): the maximum and the sum were scalar chains, one add waiting on the last.
static inline void block_softmax(float *sc, int cnt, const model *m, float *p, int hd) {
    if (m->attn_softcap > 0.0f)
        for (int j = 0; j < cnt; j++) sc[j] = tanhf(sc[j] * m->attn_scale / m->attn_softcap) * m->attn_softcap;
    else
        for (int j = 0; j < cnt; j++) sc[j] *= m->attn_scale;
    float top = p[0], sum = 0.0f;
#ifdef VEC_LANES
    const int whole = (cnt + VEC_LANES - 1) / VEC_LANES * VEC_LANES;
    for (int j = cnt; j < whole; j++) sc[j] = -INFINITY;
    vf vt = vset(-INFINITY);
    for (int j = 0; j < whole; j += VEC_LANES) vt = vmaxv(vt, vload(sc + j));
    const float block_top = vmax_all(vt);
    top = block_top > top ? block_top : top;
#else
    for (int j = 0; j < cnt; j++) top = sc[j] > top ? sc[j] : top;
#endif
    if (top > p[0]) {  // a new maximum: rescale what was summed so far
        float c = expf(p[0] - top);
        p[1] *= c;
        for (int i = 0; i < hd; i++) p[2 + i] *= c;
        p[0] = top;
    }
#ifdef VEC_LANES
    vf vs = vzero();
    const vf neg_top = vset(-top);
    for (int j = 0; j < whole; j += VEC_LANES) {
        const vf e = vexp(_vadd(vload(sc + j), neg_top));  // exp(-inf) = 0
        vstore(sc + j, e);
        vs = _vadd(vs, e);
    }
    sum = vsum(vs);
#else
    for (int j = 0; j < cnt; j++) sc[j] -= top;
    exp_inplace(sc, cnt);
    for (int j = 0; j < cnt; j++) sum += sc[j];
#endif
    p[1] += sum;
}

// One unit = one split of the keys, for every head: the running maximum, sum and weighted values of each query
// head (flash decoding), a cache block of keys at a time; merged afterwards. All KV heads of a block are read
// together, so the cache is one sequential stream (a head at a time, its rows strided by the other heads',
// read it at a fraction of the bandwidth), and the next block is prefetched while this one is summed.
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 65536
#endif
static void attn_chunk(void *ctx, int64_t begin, int64_t end) {
    attn_task *t = ctx;
    const model *m = t->m;
    const int hd = m->head_dim, kvh = m->num_kv_heads, group = m->num_heads / kvh, bs = m->block_size;
    const int32_t type = m->cache_type;
    const int64_t elem = type == W_F32 ? 4 : type == CACHE_FP8 ? 1 : 2;
#ifdef VEC_LANES
    const int vec = hd % VEC_LANES == 0 && type != CACHE_FP8;
#else
    const int vec = 0;
#endif
    // blocks prefetched ahead: two while their keys and values take a small part of L2 (measured: one, two and three
    // alike; four slower), else one (the 1.7b shape's blocks of 32 KV heads, 128 KiB with the values: 151 -> 133 ms
    // a token at a 1,500-token context, where none were prefetched before)
    const int64_t block_bytes = (int64_t)bs * kvh * hd * elem;
    int64_t ahead = PREFETCH_BYTES / (2 * block_bytes);
    if (ahead > 2) ahead = 2;
    if (ahead < 1) ahead = 1;
    float scores[MAX_GROUP * 64];  // [group][keys of a block]: blocks are read 64 tokens at most at a time
    for (int64_t split = begin; split < end; split++) {
        int64_t t0 = t->lo + split * t->per_split, t1 = t0 + t->per_split < t->hi ? t0 + t->per_split : t->hi;
        float *parts = t->s->part + split * m->num_heads * (hd + 2);  // per head: max, sum, acc
        for (int h = 0; h < m->num_heads; h++) {
            parts[h * (hd + 2)] = -INFINITY;
            parts[h * (hd + 2) + 1] = 0.0f;
            memset(parts + h * (hd + 2) + 2, 0, (size_t)hd * 4);
        }
        for (int64_t pos = t0; pos < t1;) {
            int off = (int)(pos % bs), cnt = bs - off;
            if (cnt > t1 - pos) cnt = (int)(t1 - pos);
            if (cnt > 64) cnt = 64;
            const int64_t slot = (int64_t)t->block_table[pos / bs] * bs + off;
            // `ahead` blocks on: at a split's start all of them at once, after that the one `ahead` blocks on, a KV
            // head's share at each head (all at once stalled on the core's outstanding misses)
            const char *pk = NULL, *pv = NULL;
            int64_t share = 0;
            for (int64_t b = pos / bs + 1; b <= pos / bs + ahead && b * bs < t1; b++) {
                if (pos != t0 && b < pos / bs + ahead) continue;
                const int64_t at = (int64_t)t->block_table[b] * block_bytes,
                              bytes = (b * bs + bs < t1 ? bs : t1 - b * bs) * kvh * hd * elem;
                pk = (const char *)t->l->k_cache + at, pv = (const char *)t->l->v_cache + at;
                share = pos == t0 ? 0 : (bytes / kvh + 63) & ~(int64_t)63;
                if (!share) {
                    prefetch_range(pk, bytes);
                    prefetch_range(pv, bytes);
                }
            }
            load_in_order((const char *)t->l->k_cache + slot * kvh * hd * elem,
                          (const char *)t->l->v_cache + slot * kvh * hd * elem, (int64_t)cnt * kvh * hd * elem);
            for (int kh = 0; kh < kvh; kh++) {
                if (share) {
                    prefetch_range(pk + kh * share, share);
                    prefetch_range(pv + kh * share, share);
                }
                const int64_t first = slot * kvh + kh;  // in rows of head_dim; the next token's is kvh rows on
                float *part = parts + (int64_t)kh * group * (hd + 2);
                const float *qh = t->s->qkv + (int64_t)kh * group * hd;
                if (vec)
                    block_scores(scores, qh, group, t->l->k_cache, type, first * hd, (int64_t)kvh * hd, cnt, hd);
                else
                    for (int g = 0; g < group; g++)
                        for (int j = 0; j < cnt; j++)
                            scores[g * 64 + j] = key_dot(qh + (int64_t)g * hd, t->l->k_cache, type,
                                                         (first + (int64_t)j * kvh) * hd, hd, t->l->k_scale);
                for (int g = 0; g < group; g++) block_softmax(scores + g * 64, cnt, m, part + g * (hd + 2), hd);
                block_values(part + 2, hd + 2, scores, group, t->l->v_cache, type, vec, first * hd,
                             (int64_t)kvh * hd, cnt, hd, t->l->v_scale);
            }
            pos += cnt;
        }
    }
}

// The keys each lane attends, split so that all lanes' splits together keep every thread busy (none under 32
// keys), and one parallel call over all of them: a batched step has as many attentions per layer as lanes.
typedef struct {
    attn_task *lane;  // [lanes]
    int64_t first[MAX_LANES + 1];  // lane b's splits are units [first[b], first[b + 1])
    int lanes;
} attn_batch;

static void attn_units(void *ctx, int64_t begin, int64_t end) {
    attn_batch *t = ctx;
    int b = 0;
    for (int64_t u = begin; u < end; u++) {
        while (u >= t->first[b + 1]) b++;
        attn_chunk(&t->lane[b], u - t->first[b], u - t->first[b] + 1);
    }
}

static void attention(const model *m, const layer *l, int lanes, const int32_t *const *block_tables,
                      const int64_t *positions) {
    const int hd = m->head_dim;
    attn_task task[MAX_LANES];
    attn_batch batch = {task, {0}, lanes};
    const int64_t share = (2 * pool.num_threads + lanes - 1) / lanes;  // splits a lane needs to fill the threads
    for (int b = 0; b < lanes; b++) {
        attn_task *t = &task[b];
        *t = (attn_task){m, l, block_tables[b], 0, positions[b] + 1, 1, 0, &LANES[b]};
        if (l->window > 0 && positions[b] + 1 > l->window) t->lo = positions[b] + 1 - l->window;
        int64_t n = t->hi - t->lo, want = share;
        if (n / 256 > want) want = n / 256;
        if (want > n / 32) want = n / 32;
        if (want > MAX_SPLITS) want = MAX_SPLITS;
        if (want < 1) want = 1;
        t->per_split = (n + want - 1) / want;
        t->splits = (n + t->per_split - 1) / t->per_split;
        batch.first[b + 1] = batch.first[b] + t->splits;
    }
    parallel(attn_units, &batch, batch.first[lanes], 1);
    for (int b = 0; b < lanes; b++) {
        const scratch *s = &LANES[b];
        for (int h = 0; h < m->num_heads; h++) {  // merge the splits of each head
            float top = -INFINITY, total = 0.0f, *out = s->attn + (int64_t)h * hd;
            for (int64_t k = 0; k < task[b].splits; k++) {
                float mx = s->part[(k * m->num_heads + h) * (hd + 2)];
                if (mx > top) top = mx;
            }
            memset(out, 0, (size_t)hd * 4);
            for (int64_t k = 0; k < task[b].splits; k++) {
                const float *p = s->part + (k * m->num_heads + h) * (hd + 2);
                if (p[1] == 0.0f) continue;
                float c = expf(p[0] - top);
                total += p[1] * c;
                axpy(out, c, p + 2, hd);
            }
            for (int i = 0; i < hd; i++) out[i] /= total;
        }
    }
}

static void head_norm_rope(const model *m, const scratch *s, float *x, int num_heads, const vector *norm, int rope) {
    const int hd = m->head_dim;
    float tmp[MAX_HEAD_DIM];
    for (int h = 0; h < num_heads; h++) {
        float *v = x + (int64_t)h * hd;
        if (m->qk_order) {
            for (int i = 0; i < hd; i++) tmp[i] = v[m->qk_order[i]];
            memcpy(v, tmp, (size_t)hd * 4);
        }
        if (m->qk_norm) rms_norm(v, v, hd, norm, m->eps, m->norm_plus_one);
        if (rope) rotate(v, s->cos, s->sin, hd / 2);
    }
}

// One layer for `lanes` sequences, each one new token (lane b: LANES[b].h, its block table, its position). The
// products read each weight row once for all lanes; norms, rotary, the cache writes and attention are per lane.
static void layer_step(const model *m, const layer *l, int lanes, const int32_t *const *block_tables,
                       const int64_t *positions) {
    const int64_t hidden = m->hidden, qd = (int64_t)m->num_heads * m->head_dim,
                  kvd = (int64_t)m->num_kv_heads * m->head_dim;
    input in[MAX_LANES], ain[MAX_LANES], din[MAX_LANES];
    float *qkv[MAX_LANES], *o[MAX_LANES];
    const float *inv = l->local_rope && m->inv_freq_local ? m->inv_freq_local : m->inv_freq;
    for (int b = 0; b < lanes; b++) {
        scratch *s = &LANES[b];
        in[b] = (input){s->x, s->xb, s->xq};
        ain[b] = (input){s->attn, s->xb, s->xq};
        din[b] = (input){s->act, s->ab, s->aq};
        qkv[b] = s->qkv;
        o[b] = s->o;
        for (int i = 0; i < m->head_dim / 2; i++) {  // as Hugging Face: the angle in float32, then its cos and sin
            float angle = (float)positions[b] * inv[i];
            s->cos[i] = cosf(angle);
            s->sin[i] = sinf(angle);
        }
        rms_norm(s->h, s->x, hidden, &l->input_norm, m->eps, m->norm_plus_one);
        prepare(&in[b], hidden);
    }
    matvecs(&l->q, &l->k, &l->v, in, qkv, lanes);
    for (int b = 0; b < lanes; b++) {
        scratch *s = &LANES[b];
        float *q = s->qkv, *k = s->qkv + qd, *v = k + kvd;
        head_norm_rope(m, s, q, m->num_heads, &l->q_norm, 1);
        head_norm_rope(m, s, k, m->num_kv_heads, &l->k_norm, 1);
        const int32_t *table = block_tables[b];
        int64_t slot = (int64_t)table[positions[b] / m->block_size] * m->block_size + positions[b] % m->block_size;
        store_row(l->k_cache, m->cache_type, slot * kvd, (int)kvd, l->k_scale, k);
        store_row(l->v_cache, m->cache_type, slot * kvd, (int)kvd, l->v_scale, v);
    }
    attention(m, l, lanes, block_tables, positions);
    for (int b = 0; b < lanes; b++) prepare(&ain[b], qd);
    matvecs(&l->o, NULL, NULL, ain, o, lanes);
    for (int b = 0; b < lanes; b++) {
        scratch *s = &LANES[b];
        if (m->sandwich) {  // Gemma: the attention output normalized before the residual, another norm before the MLP
            rms_norm(s->o, s->o, hidden, &l->post_norm, m->eps, m->norm_plus_one);
            for (int64_t i = 0; i < hidden; i++) s->h[i] += s->o[i];
            rms_norm(s->h, s->x, hidden, &l->pre_ff_norm, m->eps, m->norm_plus_one);
        } else {
            for (int64_t i = 0; i < hidden; i++) s->h[i] += s->o[i];
            rms_norm(s->h, s->x, hidden, &l->post_norm, m->eps, m->norm_plus_one);
        }
        prepare(&in[b], hidden);
    }
    // every gate/up chunk reads x's copies and writes its rows of act's copies: two sets of buffers
    ffn_task f = {l, in, m->act, din, LANES, lanes};
    int64_t grain = (grain_for(m->intermediate) + 31) & ~(int64_t)31;
    parallel(ffn_chunk, &f, m->intermediate, grain);
    matvecs(&l->down, NULL, NULL, din, o, lanes);
    for (int b = 0; b < lanes; b++) {
        scratch *s = &LANES[b];
        if (m->sandwich) rms_norm(s->o, s->o, hidden, &l->post_ff_norm, m->eps, m->norm_plus_one);
        for (int64_t i = 0; i < hidden; i++) s->h[i] += s->o[i];
    }
}

// ---- entry points -----------------------------------------------------------------------------------------

static void load_h(scratch *s, const void *h, int32_t type, int64_t n) {
    for (int64_t i = 0; i < n; i++) s->h[i] = load_scalar(h, type, i);
}

static void store_h(const scratch *s, void *h, int32_t type, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        switch (type) {
        case W_F16: ((uint16_t *)h)[i] = f32_f16(s->h[i]); break;
        case W_BF16: ((uint16_t *)h)[i] = f32_to_bf16(s->h[i]); break;
        default: ((float *)h)[i] = s->h[i];
        }
    }
}

// Layers [first, last) of `m` for `lanes` sequences, one new token each: sequence b at positions[b] (its block
// already reserved in every table), h [lanes, hidden] in h_type read and replaced by the output;
// block_tables[b * num_layers + l]: sequence b's block table for layer l. Returns 0; -1 when the scratch cannot
// be allocated or lanes is out of range.
static int layers_batch(const model *m, int first, int last, int lanes, void *h, int32_t h_type,
                        const int64_t *positions, const int32_t *const *block_tables) {
    if (lanes < 1 || lanes > MAX_LANES || ensure_scratch(m, lanes) != 0) return -1;
    const int64_t row_bytes = (int64_t)m->hidden * (h_type == W_F32 ? 4 : 2);
    const int32_t *tables[MAX_LANES];
    for (int b = 0; b < lanes; b++) load_h(&LANES[b], (const char *)h + b * row_bytes, h_type, m->hidden);
    for (int i = first; i < last; i++) {
        for (int b = 0; b < lanes; b++) tables[b] = block_tables[(int64_t)b * m->num_layers + i];
        layer_step(m, &m->layers[i], lanes, tables, positions);
    }
    for (int b = 0; b < lanes; b++) store_h(&LANES[b], (char *)h + b * row_bytes, h_type, m->hidden);
    return 0;
}

int decode_layers_batch(const model *m, int first, int last, int lanes, void *h, int32_t h_type,
                        const int64_t *positions, const int32_t *const *block_tables) {
    pthread_mutex_lock(&CALLS);
    int r = layers_batch(m, first, last, lanes, h, h_type, positions, block_tables);
    pthread_mutex_unlock(&CALLS);
    return r;
}

// decode_layers_batch for one sequence: block_tables[l] is its table for layer l.
int decode_layers(const model *m, int first, int last, void *h, int32_t h_type, int64_t position,
                  const int32_t *const *block_tables) {
    return decode_layers_batch(m, first, last, 1, h, h_type, &position, block_tables);
}

// logits [lanes, vocab] float32 = head . norm(h[b]) for h [lanes, hidden]; softcap 0: none. Each head row is read
// once for all lanes.
static int head_batch(const model *m, int lanes, const void *h, int32_t h_type, const vector *norm,
                      const matrix *head, float softcap, float *logits) {
    if (lanes < 1 || lanes > MAX_LANES || ensure_scratch(m, lanes) != 0) return -1;
    const int64_t row_bytes = (int64_t)m->hidden * (h_type == W_F32 ? 4 : 2);
    input in[MAX_LANES];
    float *out[MAX_LANES];
    for (int b = 0; b < lanes; b++) {
        scratch *s = &LANES[b];
        load_h(s, (const char *)h + b * row_bytes, h_type, m->hidden);
        rms_norm(s->h, s->x, m->hidden, norm, m->eps, m->norm_plus_one);
        in[b] = (input){s->x, s->xb, s->xq};
        prepare(&in[b], m->hidden);
        out[b] = logits + b * head->rows;
    }
    matvecs(head, NULL, NULL, in, out, lanes);
    if (softcap > 0.0f)
        for (int64_t i = 0; i < lanes * head->rows; i++) logits[i] = tanhf(logits[i] / softcap) * softcap;
    return 0;
}

int decode_head_batch(const model *m, int lanes, const void *h, int32_t h_type, const vector *norm,
                      const matrix *head, float softcap, float *logits) {
    pthread_mutex_lock(&CALLS);
    int r = head_batch(m, lanes, h, h_type, norm, head, softcap, logits);
    pthread_mutex_unlock(&CALLS);
    return r;
}

int decode_head(const model *m, const void *h, int32_t h_type, const vector *norm, const matrix *head,
                float softcap, float *logits) {
    return decode_head_batch(m, 1, h, h_type, norm, head, softcap, logits);
}

// The instruction set this library was built for.
const char *decode_isa(void) {
#if defined(__AVX512BF16__)
    return "avx512bf16";
#elif defined(__AVX512F__) && defined(__AVX512BW__)
    return "avx512";
#elif defined(HAS_SIMD_DOTS)
    return "avx2";
#else
    return "scalar";
#endif
}

__attribute__((constructor)) static void init(void) { build_fp8_table(); }

// The id decode_layers takes for a ggml block type named as kernels/quants.py names it, or -1.
int decode_type_id(const char *name) { return block_type_id(name); }

// ---- chunked prefill attention over the paged cache ---------------------------------------------------------
// A chunk of n new queries (their K/V already written) attends causally to the cache, read in place through the
// block table: no gathered copy of the context, no dense mask, no scores matrix. Units are (KV head, tile of
// queries); a unit keeps the running maximum, sum and output of each (query, head) of its tile and goes through
// its keys a step of at most 16 (within one cache block) at a time, online softmax.

#define PF_STATES 64  // (query, head) pairs per unit
#define PF_KEYS 16    // keys per step

typedef struct {
    const void *query;
    int32_t q_type, cache_type, out_type;
    int64_t n, start;
    const void *k_cache, *v_cache;
    float k_scale, v_scale, scale, softcap;
    const int32_t *block_table;
    int num_heads, num_kv_heads, head_dim, block_size, window, tile;
    int64_t num_tiles;
    void *out;
} prefill_task;

static void store_scalar(void *p, int32_t type, int64_t i, float v) {
    switch (type) {
    case W_F16: ((uint16_t *)p)[i] = f32_f16(v); break;
    case W_BF16: ((uint16_t *)p)[i] = f32_to_bf16(v); break;
    default: ((float *)p)[i] = v;
    }
}

// What a unit reads: KV head kh's queries [t0, t1) of the chunk (states: (query, head) pairs, state i being query
// t0 + i / group and head kh * group + i % group) and the keys at positions [lo, last_q].
typedef struct {
    int kh, states;
    int64_t t0, t1, lo, last_q;
} prefill_unit;

static inline prefill_unit unit_of(const prefill_task *t, int64_t unit) {
    prefill_unit u;
    u.kh = (int)(unit / t->num_tiles);
    u.t0 = (unit % t->num_tiles) * t->tile, u.t1 = u.t0 + t->tile < t->n ? u.t0 + t->tile : t->n;
    u.states = (int)(u.t1 - u.t0) * (t->num_heads / t->num_kv_heads);
    const int64_t first_q = t->start + u.t0;
    u.last_q = t->start + u.t1 - 1;
    u.lo = t->window > 0 && first_q + 1 > t->window ? first_q + 1 - t->window : 0;
    return u;
}

// Offset (in elements) of state i's row in the queries and the output
static inline int64_t state_row(const prefill_task *t, const prefill_unit *u, int i) {
    const int group = t->num_heads / t->num_kv_heads;
    return ((u->t0 + i / group) * t->num_heads + u->kh * group + i % group) * t->head_dim;
}

// The keys of the step from pos: within its cache block, at most `most`, none past last_q; *first is the cache row
// (in rows of head_dim) of the first one's KV head, the next ones num_kv_heads rows apart.
static inline int step_keys(const prefill_task *t, const prefill_unit *u, int64_t pos, int most, int64_t *first) {
    const int bs = t->block_size;
    int cnt = bs - (int)(pos % bs);
    if (cnt > most) cnt = most;
    if (cnt > u->last_q + 1 - pos) cnt = (int)(u->last_q + 1 - pos);
    *first = ((int64_t)t->block_table[pos / bs] * bs + pos % bs) * t->num_kv_heads + u->kh;
    return cnt;
}

// The portable kernel: the scalar build's, and past 2^24 positions (which float32 lanes cannot hold exactly).
// Vector builds run prefill_lanes.h (and prefill_bf16.h where AVX512-BF16 is).
static void prefill_chunk(void *ctx, int64_t begin, int64_t end) {
    prefill_task *t = ctx;
    const int hd = t->head_dim, kvh = t->num_kv_heads, group = t->num_heads / kvh;
    // on the thread's stack (at most 320 KiB): a call allocates nothing but its output
    float q[PF_STATES * MAX_HEAD_DIM], acc[PF_STATES * MAX_HEAD_DIM], kt[MAX_HEAD_DIM * PF_KEYS];
    float vrows[PF_KEYS][MAX_HEAD_DIM], m[PF_STATES], l[PF_STATES], s[PF_STATES][PF_KEYS];
    for (int64_t unit = begin; unit < end; unit++) {
        const prefill_unit u = unit_of(t, unit);
        const int states = u.states;
        for (int i = 0; i < states; i++) {
            const int64_t row = state_row(t, &u, i);
            for (int d = 0; d < hd; d++) q[i * hd + d] = load_scalar(t->query, t->q_type, row + d) * t->scale;
            m[i] = -INFINITY, l[i] = 0.0f;
            memset(acc + i * hd, 0, (size_t)hd * 4);
        }
        for (int64_t pos = u.lo; pos <= u.last_q;) {
            int64_t first;
            const int cnt = step_keys(t, &u, pos, PF_KEYS, &first);
            for (int j = 0; j < PF_KEYS; j++) {  // K transposed: kt[d][j]; V rows as float32
                if (j < cnt) {
                    float krow[MAX_HEAD_DIM];
                    load_row(t->k_cache, t->cache_type, (first + (int64_t)j * kvh) * hd, hd, t->k_scale, krow);
                    load_row(t->v_cache, t->cache_type, (first + (int64_t)j * kvh) * hd, hd, t->v_scale, vrows[j]);
                    for (int d = 0; d < hd; d++) kt[d * PF_KEYS + j] = krow[d];
                } else {
                    for (int d = 0; d < hd; d++) kt[d * PF_KEYS + j] = 0.0f;
                }
            }
            for (int i = 0; i < states; i++) {
                const int64_t qp = t->start + u.t0 + i / group;
                if (pos > qp) continue;  // every key of the step is after this query
                const float *qi = q + i * hd;
                float *si = s[i];
                for (int j = 0; j < PF_KEYS; j++) {
                    float x = 0.0f;
                    for (int d = 0; d < hd; d++) x += qi[d] * kt[d * PF_KEYS + j];
                    si[j] = x;
                }
                // the keys of this step the query sees: causal, and within its window
                const int jhi = qp - pos + 1 < cnt ? (int)(qp - pos + 1) : cnt;
                int jlo = 0;
                if (t->window > 0 && qp - t->window + 1 > pos) jlo = (int)(qp - t->window + 1 - pos);
                if (jlo >= jhi) {
                    for (int j = 0; j < PF_KEYS; j++) si[j] = 0.0f;
                    continue;
                }
                float top = -INFINITY;
                for (int j = jlo; j < jhi; j++) {
                    if (t->softcap > 0.0f) si[j] = tanhf(si[j] / t->softcap) * t->softcap;
                    top = si[j] > top ? si[j] : top;
                }
                if (top > m[i]) {
                    float c = expf(m[i] - top);
                    l[i] *= c;
                    for (int d = 0; d < hd; d++) acc[i * hd + d] *= c;
                    m[i] = top;
                }
                for (int j = 0; j < PF_KEYS; j++) si[j] = j >= jlo && j < jhi ? si[j] - m[i] : -200.0f;
                exp_inplace(si, PF_KEYS);  // exp(-200) is 0: keys it does not see weigh nothing
                for (int j = jlo; j < jhi; j++) l[i] += si[j];
            }
            for (int i = 0; i < states; i++) {  // acc += p V
                if (pos > t->start + u.t0 + i / group) continue;
                float *ai = acc + i * hd;
                const float *pi = s[i];
                for (int d = 0; d < hd; d++)
                    for (int j = 0; j < cnt; j++) ai[d] += pi[j] * vrows[j][d];
            }
            pos += cnt;
        }
        for (int i = 0; i < states; i++) {
            const int64_t row = state_row(t, &u, i);
            float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
            for (int d = 0; d < hd; d++) store_scalar(t->out, t->out_type, row + d, acc[i * hd + d] * inv);
        }
    }
}

#include "prefill_lanes.h"
#include "prefill_bf16.h"

// out [n, num_heads, head_dim] (out_type) for queries [n, num_heads, head_dim] (q_type) at positions start.. of
// one sequence, against its cache through block_table (softcap 0: none; window 0: the whole context).
int attention_prefill(const void *query, int32_t q_type, int64_t n, int64_t start, const void *k_cache,
                      const void *v_cache, int32_t cache_type, float k_scale, float v_scale, const int32_t *block_table,
                      int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale,
                      float softcap, int32_t window, void *out, int32_t out_type) {
    if (head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads) return -1;
    const int group = num_heads / num_kv_heads;
    if (group > PF_STATES) return -1;
    task_fn chunk = prefill_chunk;
    int states = PF_STATES;
#ifdef VEC_LANES
    if (start + n < (1 << 24)) chunk = prefill_chunk_lanes;  // positions exact as float32 lanes
#endif
#if defined(__AVX512BF16__)
    if (q_type == W_BF16 && (cache_type == W_BF16 || cache_type == CACHE_FP8) && softcap == 0.0f &&
        head_dim % 16 == 0 && group <= PB_STATES)
        chunk = prefill_chunk_bf16, states = PB_STATES;
#endif
    prefill_task t = {query, q_type, cache_type, out_type, n, start, k_cache, v_cache, k_scale, v_scale, scale,
                      softcap, block_table, num_heads, num_kv_heads, head_dim, block_size, window, states / group, 0,
                      out};
    // smaller tiles when there are too few units for the threads
    while (t.tile > 1 && num_kv_heads * ((n + t.tile - 1) / t.tile) < 4 * pool.num_threads) t.tile /= 2;
    t.num_tiles = (n + t.tile - 1) / t.tile;
    pthread_mutex_lock(&CALLS);
    parallel(chunk, &t, num_kv_heads * t.num_tiles, 1);
    pthread_mutex_unlock(&CALLS);
    return 0;
}
