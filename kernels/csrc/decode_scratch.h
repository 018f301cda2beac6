// The per-call scratch of the decode step: one per lane (sequence), laid out for the model at every call; the
// process's, as the pool is, so a call holds thread_pool.h's CALLS while it uses it.
#pragma once
#include <stdint.h>
#include <stdlib.h>

#include "decode_types.h"

typedef struct {
    float *h, *x, *qkv, *attn, *o, *gate, *up, *act, *cos, *sin, *part;
    float *logits, *moe;  // a layer of experts: the router's logits [num_experts], the weighted sum [hidden]
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
    int64_t experts = m->num_experts ? m->num_experts + hidden : 0;
    int64_t floats = hidden + wide + (q + 2 * kv) + q + hidden + 3 * inter + m->head_dim +
                     (int64_t)m->num_heads * MAX_SPLITS * (m->head_dim + 2) + experts;
    int64_t need = 4 * floats + QVEC_BYTES(wide) + QVEC_BYTES(inter) + 2 * (wide + inter);  // then bf16 copies
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
    s->logits = s->part + (int64_t)m->num_heads * MAX_SPLITS * (m->head_dim + 2);
    s->moe = s->logits + m->num_experts;
    char *at = (char *)(s->logits + experts) + QVEC_BYTES(wide);  // QVEC_BYTES keeps every carve aligned
    qvec_carve(&s->xq, (char *)(s->logits + experts), wide);
    qvec_carve(&s->aq, at, inter);
    s->xb = (uint16_t *)(at + QVEC_BYTES(inter));
    s->ab = s->xb + wide;
    return 0;
}

static int ensure_scratch(const model *m, int lanes) {
    for (int b = 0; b < lanes; b++)
        if (ensure_lane(&LANES[b], m) != 0) return -1;
    return 0;
}
