// The CPU decode step of a Llama-family model, one token of one sequence, in one call for a run of layers:
// input norm, Q/K/V products, Q/K norms, rotary, the new K/V written into its paged-cache slot, attention over
// the sequence's blocks read in place through the block table (online softmax, grouped KV heads, split over the
// context), output projection, residual, norms, gate/up, SiLU or GELU-tanh, down, residual. Plus the final norm
// and the output head. A layer of experts routes the MLP instead: the router's logits, softmax, top-k (renormalized
// when norm_topk), and each chosen expert's gate/up/down for the lanes that chose it, weighted and summed: only the
// chosen experts' rows are read, each once for all its lanes (docs/moe.md). Weights are read where they lie (the memory map): f32, f16, bf16 rows or ggml blocks.
// Activations are float32 inside a call; nothing is allocated per step.
//
// The pieces, each an implementation header of this one translation unit (static functions):
//   decode_types.h      the structs kernels/cpu_decode.py mirrors; f16/bf16/fp8 conversions, cache rows
//   vec_math.h          the float32 vector layer (widening loads, exp, sums of four)
//   thread_pool.h       the pool every parallel phase runs on
//   row_dots.h          the matrix products, one lane or several
//   decode_scratch.h    the per-lane scratch
//   decode_attention.h  decode attention over the paged cache
//   prefill_attention.h chunked prefill attention (attention_prefill, kernels/cpu_attention.py)
// Built per instruction set by kernels/cpu_decode.py; see docs/kernels.md.
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "quant_dots.h"
// in dependency order (each also includes the ones it needs)
#include "decode_types.h"
#include "vec_math.h"
#include "thread_pool.h"
#include "row_dots.h"
#include "decode_scratch.h"
#include "decode_attention.h"
#include "prefill_attention.h"
#include "quant_matmul.h"

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

// A cache in blocks stores each row rotated: every run of n = hd & -hd values times the orthonormal Walsh-Hadamard
// matrix (its own inverse), as kernels/kv_quant.py's hadamard. Here in place on `rows` rows of hd, as the fast
// transform: log2(n) rounds of sums and differences, then the 1 / sqrt(n).
static void hadamard_rows(float *x, int64_t rows, int hd) {
    const int n = hd & -hd;
    const float norm = 1.0f / sqrtf((float)n);
    for (int64_t r = 0; r < rows * hd; r += n) {
        float *v = x + r;
        for (int len = 1; len < n; len <<= 1)
            for (int i = 0; i < n; i += 2 * len)
                for (int j = i; j < i + len; j++) {
                    float a = v[j], b = v[j + len];
                    v[j] = a + b;
                    v[j + len] = a - b;
                }
        for (int i = 0; i < n; i++) v[i] *= norm;
    }
}

typedef struct {
    const matrix *gate, *up;
    const input *in;         // [lanes]
    const model *m;          // its act (and ACT_SWIGLU_CLAMPED's limit and alpha)
    const input *out;        // [lanes]: act, the down product's input
    scratch *const *s;       // [lanes]
    int lanes;
} ffn_task;

static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// act[r] = f(gate[r] . x) * (up[r] . x), prepared as the down product's input (bf16 copy, integers)
static void ffn_chunk(void *ctx, int64_t begin, int64_t end) {
    ffn_task *t = ctx;
    float *gate[MAX_LANES], *up[MAX_LANES];
    for (int b = 0; b < t->lanes; b++) gate[b] = t->s[b]->gate, up[b] = t->s[b]->up;
    // the gate's rows, then the up's: one stream of weights at a time (interleaving the two in blocks of 16 rows
    // was slower: docs/kernels.md, "One stream of weights at a time")
    lane_rows(t->gate, begin, end, t->in, gate, begin, t->lanes);
    lane_rows(t->up, begin, end, t->in, up, begin, t->lanes);
    for (int b = 0; b < t->lanes; b++) {
        scratch *s = t->s[b];
        if (t->m->act == ACT_SWIGLU_CLAMPED) {  // gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
            const float limit = t->m->swiglu_limit, alpha = t->m->swiglu_alpha;
            for (int64_t r = begin; r < end; r++) {
                float g = s->gate[r] < limit ? s->gate[r] : limit, u = s->up[r];
                u = u < -limit ? -limit : u > limit ? limit : u;
                s->act[r] = (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
            }
        } else {
            for (int64_t r = begin; r < end; r++) {
                float g = s->gate[r];
                float a = t->m->act == ACT_GELU_TANH ? gelu_tanh(g) : g / (1.0f + expf(-g));
                s->act[r] = a * s->up[r];
            }
        }
        prepare_part(&t->out[b], begin, end);  // chunks are act_grain's
    }
}

// A chunk of an MLP's rows, as ffn_chunk prepares act for `down`: whole 256s where a K-type down reads act's form
// made per 256 (quant_dots.h), else whole 32s.
static int64_t act_grain(int64_t rows, int64_t grain, const matrix *down) {
    const int k_form = down->type == Q4_K || down->type == Q5_K || down->type == Q6_K;
    const int64_t unit = k_form && rows % QK_K == 0 ? QK_K : 32;
    return (grain + unit - 1) / unit * unit;
}

// gate/up, the activation and down for `lanes` inputs: out[b] = down . (f(gate . in[b]) * (up . in[b]))
static void mlp(const model *m, const matrix *gate, const matrix *up, const matrix *down, const input *in,
                const input *mid, scratch *const *s, float *const *out, int lanes) {
    // every gate/up chunk reads x's copies and writes its rows of act's copies: two sets of buffers
    ffn_task f = {gate, up, in, m, mid, s, lanes};
    parallel(ffn_chunk, &f, gate->rows, act_grain(gate->rows, grain_for(gate->rows), down));
    matvecs(down, NULL, NULL, mid, out, lanes);
}

// ---- a layer of experts ----------------------------------------------------------------------------------
// A step's chosen (lane, expert) pairs, grouped by expert into units (each expert read once for all its lanes), and
// per pair the expert's gate/up/act rows and act's prepared forms. Two parallel phases per layer whatever k is:
// every unit's gate/up rows, then the hidden rows of every unit's down, weighted and summed as they are made (one
// phase per expert and product kept a thread waiting on the other 2 k times a layer: docs/moe.md).

typedef struct {
    const matrix *x;  // the expert's gate, up, down
    int first, n;     // its pairs: PAIRS.order[first .. first + n)
} expert_unit;

static struct {
    scratch *s;       // [pairs]: gate, up, act of each pair
    input *mid;       // [pairs]: act's prepared forms
    input *unit_in, *unit_mid;  // [pairs] in unit order: the lane's x, the pair's mid
    scratch **unit_s;           // [pairs] in unit order
    float *weight;    // [pairs]
    int *order;         // [pairs]: the pairs in unit order
    float **out;        // [pairs]
    ffn_task *task;     // [pairs]: a unit's gate/up task (at its first pair)
    expert_unit *unit;  // [pairs]
    int num_units, rows_per_item, items_per_unit;
    int64_t cap;  // bytes
} PAIRS;

#define PAIR_TABLE_BYTES 640
_Static_assert(sizeof(scratch) + 3 * sizeof(input) + sizeof(float) + sizeof(int) + 2 * sizeof(float *) +
                   sizeof(ffn_task) + sizeof(expert_unit) <= PAIR_TABLE_BYTES, "a pair's tables");

// PAIRS for `lanes` of m's top_k pairs each; kept and grown, never allocated per step. 0, or -1 without memory.
static int ensure_pairs(const model *m, int lanes) {
    int64_t inter = 0;
    for (int i = 0; i < m->num_layers; i++)
        if (m->layers[i].experts && m->layers[i].experts[0].rows > inter) inter = m->layers[i].experts[0].rows;
    if (!inter) return 0;
    const int64_t n = (int64_t)lanes * m->top_k;
    // per pair: gate, up, act (floats); act's integer forms and bf16 copy; the tables, within PAIR_TABLE_BYTES
    // (kernels/cpu_decode.py scratch_bytes counts the same)
    const int64_t per_pair = 4 * 3 * inter + QVEC_BYTES(inter) + 2 * inter + PAIR_TABLE_BYTES;
    const int64_t need = n * per_pair + 32;
    if (PAIRS.cap < need) {
        free(PAIRS.s);
        PAIRS.s = malloc((size_t)need);
        if (!PAIRS.s) {
            PAIRS.cap = 0;
            return -1;
        }
        PAIRS.cap = need;
    }
    char *at = (char *)(PAIRS.s + n);
#define TAKE(field, count) (PAIRS.field = (void *)at, at += (count) * sizeof(*PAIRS.field))
    TAKE(mid, n), TAKE(unit_in, n), TAKE(unit_mid, n), TAKE(unit_s, n), TAKE(task, n), TAKE(unit, n), TAKE(out, n),
        TAKE(weight, n), TAKE(order, n);
#undef TAKE
    float *f = (float *)(((uintptr_t)at + 31) & ~(uintptr_t)31);
    for (int64_t p = 0; p < n; p++) {
        scratch *s = &PAIRS.s[p];
        s->gate = f, s->up = f + inter, s->act = f + 2 * inter;
        qvec_carve(&s->aq, (char *)(f + 3 * inter), inter);
        s->ab = (uint16_t *)((char *)(f + 3 * inter) + QVEC_BYTES(inter));
        f = (float *)(s->ab + inter);  // an expert's width is a multiple of 32 (native_decode.py): aligned
        PAIRS.mid[p] = (input){s->act, s->ab, s->aq};
    }
    return 0;
}

// items of a unit's gate/up phase: rows_per_item rows each, act_grain's
static void unit_gate_up(void *ctx, int64_t begin, int64_t end) {
    (void)ctx;
    for (int64_t item = begin; item < end; item++) {
        const expert_unit *u = &PAIRS.unit[item / PAIRS.items_per_unit];
        const int64_t r0 = (item % PAIRS.items_per_unit) * PAIRS.rows_per_item, rows = u->x[0].rows;
        ffn_chunk(&PAIRS.task[u->first], r0, r0 + PAIRS.rows_per_item < rows ? r0 + PAIRS.rows_per_item : rows);
    }
}

#define DOWN_ROWS 64  // a unit's down rows made at a time for its lanes, then weighted into their sums

// hidden rows [begin, end) of every pair's weighted down product, summed into the lanes' o in unit (expert) order
static void units_down(void *ctx, int64_t begin, int64_t end) {
    (void)ctx;
    float tmp[MAX_LANES][DOWN_ROWS], *y[MAX_LANES];
    for (int b = 0; b < MAX_LANES; b++) y[b] = tmp[b];
    for (int64_t r0 = begin; r0 < end; r0 += DOWN_ROWS) {
        const int64_t r1 = r0 + DOWN_ROWS < end ? r0 + DOWN_ROWS : end;
        for (int i = 0; i < PAIRS.num_units; i++) {
            const expert_unit *u = &PAIRS.unit[i];
            input mid[MAX_LANES];
            for (int j = 0; j < u->n; j++) mid[j] = PAIRS.mid[PAIRS.order[u->first + j]];
            lane_rows(&u->x[2], r0, r1, mid, y, 0, u->n);
            for (int j = 0; j < u->n; j++) {
                const int p = PAIRS.order[u->first + j];
                float *o = PAIRS.out[p] + r0;
                const float w = PAIRS.weight[p];
                for (int64_t r = 0; r < r1 - r0; r++) o[r] += w * tmp[j][r];
            }
        }
    }
}

// The routed MLP of a layer of experts for `lanes` inputs (x prepared): its sum into each lane's o.
static void moe(const model *m, const layer *l, const input *in, int lanes) {
    const int64_t hidden = m->hidden, ne = m->num_experts;
    const int k = m->top_k;
    float *logits[MAX_LANES];
    int chosen[MAX_LANES][MAX_TOPK];
    for (int b = 0; b < lanes; b++) logits[b] = LANES[b].logits;
    matvecs(&l->router, NULL, NULL, in, logits, lanes);
    for (int b = 0; b < lanes; b++) {
        float *p = logits[b], top = p[0], sum = 0.0f, *weight = PAIRS.weight + b * k;
        for (int64_t e = 1; e < ne; e++) top = p[e] > top ? p[e] : top;
        // softmax_after_topk (gpt-oss): the top-k of the logits themselves, then a softmax over those k
        if (!m->softmax_after_topk)
            for (int64_t e = 0; e < ne; e++) sum += p[e] = expf(p[e] - top);
        float chosen_sum = 0.0f;
        for (int j = 0; j < k; j++) {  // the largest, the lowest index first among equals
            int best = -1;
            for (int64_t e = 0; e < ne; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= chosen[b][i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = (int)e;
            }
            chosen[b][j] = best;
            weight[j] = m->softmax_after_topk ? expf(p[best] - top) : p[best] / sum;
            chosen_sum += weight[j];
        }
        if (m->norm_topk || m->softmax_after_topk)
            for (int j = 0; j < k; j++) weight[j] /= chosen_sum;
        memset(LANES[b].o, 0, (size_t)hidden * 4);
    }
    // the units, in expert order: each chosen expert once, with every lane that chose it; a unit's lanes' inputs,
    // act buffers and scratch side by side, as ffn_chunk takes them
    int n = 0, units = 0;
    for (int64_t e = 0; e < ne; e++) {
        const int first = n;
        for (int b = 0; b < lanes; b++)
            for (int j = 0; j < k; j++)
                if (chosen[b][j] == e) {
                    const int p = b * k + j;
                    PAIRS.order[n] = p, PAIRS.out[p] = LANES[b].o;
                    PAIRS.unit_in[n] = in[b], PAIRS.unit_mid[n] = PAIRS.mid[p], PAIRS.unit_s[n] = &PAIRS.s[p];
                    n++;
                }
        if (n == first) continue;
        expert_unit *u = &PAIRS.unit[units++];
        *u = (expert_unit){&l->experts[3 * e], first, n - first};
        PAIRS.task[first] = (ffn_task){&u->x[0], &u->x[1], PAIRS.unit_in + first, m, PAIRS.unit_mid + first,
                                       PAIRS.unit_s + first, u->n};
    }
    PAIRS.num_units = units;
    const int64_t inter = l->experts[0].rows;
    int g = 128;
    while (g > 32 && inter % g) g -= 32;
    PAIRS.rows_per_item = (int)act_grain(inter, inter % g ? inter : g, &l->experts[2]);
    PAIRS.items_per_unit = (int)((inter + PAIRS.rows_per_item - 1) / PAIRS.rows_per_item);
    parallel(unit_gate_up, NULL, (int64_t)units * PAIRS.items_per_unit, 1);
    parallel(units_down, NULL, hidden, grain_for(hidden));
}

static void rotate(float *x, const float *cos, const float *sin, int half) {
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
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
            s->cos[i] = cosf(angle) * m->rope_scale;  // YaRN's attention factor; 1 otherwise
            s->sin[i] = sinf(angle) * m->rope_scale;
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
        if (cache_is_blocks(m->cache_type)) {
            hadamard_rows(q, m->num_heads, m->head_dim);
            hadamard_rows(k, m->num_kv_heads, m->head_dim);
        }
        if (cache_is_blocks(m->v_cache_type)) hadamard_rows(v, m->num_kv_heads, m->head_dim);
        const int32_t *table = block_tables[b];
        int64_t slot = (int64_t)table[positions[b] / m->block_size] * m->block_size + positions[b] % m->block_size;
        store_row(l->k_cache, m->cache_type, slot * kvd, (int)kvd, l->k_scale, k);
        store_row(l->v_cache, m->v_cache_type, slot * kvd, (int)kvd, l->v_scale, v);
    }
    attention(m, l, lanes, block_tables, positions);
    for (int b = 0; b < lanes; b++) {
        if (cache_is_blocks(m->v_cache_type)) hadamard_rows(LANES[b].attn, m->num_heads, m->head_dim);  // back
        prepare(&ain[b], qd);
    }
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
    if (l->experts) {
        moe(m, l, in, lanes);
    } else {
        scratch *s[MAX_LANES];
        for (int b = 0; b < lanes; b++) s[b] = &LANES[b];
        mlp(m, &l->gate, &l->up, &l->down, in, din, s, o, lanes);
    }
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
    if (lanes < 1 || lanes > MAX_LANES || ensure_scratch(m, lanes) != 0 || ensure_pairs(m, lanes) != 0) return -1;
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
