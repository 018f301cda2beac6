// Chunked prefill attention in float32 with the unit's states in vector lanes: included by prefill_attention.h after
// its generic prefill, on every vector build (AVX2, AVX-512); the CPUs with AVX512-BF16 run prefill_bf16.h for bf16
// queries over bf16/fp8 caches without a soft-cap.
//
// The same units as the generic kernel (a KV head and a tile of queries: its (query, head) pairs are "states"), the
// cache read in place a step of at most 16 keys at a time, each row widened to float32 once per step, online
// softmax. What differs is the layout of the scores:
//   scores  lanes are states: the unit's queries are transposed once (qt[d][state], scaled), and each key's
//           dimension d is broadcast from its widened row; no K is transposed per step;
//   softmax lane-wise per state: the running maximum and sum are vectors, no horizontal maximum or sum;
//   p V     lanes are dimensions, as in the generic kernel, each state's weights read from its lane of the scores.
// The generic kernel (now the scalar build's) transposed K element by element at every step of every unit and ran
// the softmax per state in scalar loops. Sums are float32 as there; the result differs from it by the order of the
// sums. Gemma 2's soft-cap goes lane by lane through tanhf, as there.

#ifdef VEC_LANES
#define PL_VECS (PF_STATES / VEC_LANES)  // vectors of states in a unit

// s where lo <= kpos <= hi lane-wise (the state sees the key), else -inf
static inline vf pl_seen(vf s, vf kpos, vf lo, vf hi) {
#if VEC_LANES == 16
    const __mmask16 k = _mm512_cmp_ps_mask(kpos, hi, _CMP_LE_OQ) & _mm512_cmp_ps_mask(kpos, lo, _CMP_GE_OQ);
    return _mm512_mask_blend_ps(k, vset(-INFINITY), s);
#else
    const vf k = _mm256_and_ps(_mm256_cmp_ps(kpos, hi, _CMP_LE_OQ), _mm256_cmp_ps(kpos, lo, _CMP_GE_OQ));
    return _mm256_blendv_ps(vset(-INFINITY), s, k);
#endif
}

// s[j][v] = qt[.][v] . krow[j] for 4 keys and the state vectors v0, v0 + 1 (two == 0: v0 alone)
static inline __attribute__((always_inline)) void pl_scores4(const float *qt, const float *const *krow, int hd,
                                                             int v0, int two, vf s[PF_KEYS][PL_VECS], int j) {
    vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    vf b0 = vzero(), b1 = vzero(), b2 = vzero(), b3 = vzero();
    for (int d = 0; d < hd; d++) {
        const vf q0 = vload(qt + (int64_t)d * PF_STATES + v0 * VEC_LANES);
        const vf k0 = vset(krow[0][d]), k1 = vset(krow[1][d]), k2 = vset(krow[2][d]), k3 = vset(krow[3][d]);
        a0 = vfma(q0, k0, a0), a1 = vfma(q0, k1, a1), a2 = vfma(q0, k2, a2), a3 = vfma(q0, k3, a3);
        if (two) {
            const vf q1 = vload(qt + (int64_t)d * PF_STATES + (v0 + 1) * VEC_LANES);
            b0 = vfma(q1, k0, b0), b1 = vfma(q1, k1, b1), b2 = vfma(q1, k2, b2), b3 = vfma(q1, k3, b3);
        }
    }
    s[j][v0] = a0, s[j + 1][v0] = a1, s[j + 2][v0] = a2, s[j + 3][v0] = a3;
    if (two) s[j][v0 + 1] = b0, s[j + 1][v0 + 1] = b1, s[j + 2][v0 + 1] = b2, s[j + 3][v0 + 1] = b3;
}

static void prefill_chunk_lanes(void *ctx, int64_t begin, int64_t end) {
    prefill_task *t = ctx;
    const int hd = t->head_dim, kvh = t->num_kv_heads, group = t->num_heads / kvh;
    // on the thread's stack (about 170 KiB at MAX_HEAD_DIM): a call allocates nothing but its output
    float qt[MAX_HEAD_DIM * PF_STATES], acc[PF_STATES * MAX_HEAD_DIM], c[PF_STATES], p[PF_KEYS][PF_STATES];
    float rows[2 * PF_KEYS][MAX_HEAD_DIM], qpos_lanes[PF_STATES];
    const float *krow[PF_KEYS];
    vf s[PF_KEYS][PL_VECS], m[PL_VECS], l[PL_VECS], qpos[PL_VECS], qlow[PL_VECS];
    for (int64_t unit = begin; unit < end; unit++) {
        const prefill_unit u = unit_of(t, unit);
        const int states = u.states, nv = (states + VEC_LANES - 1) / VEC_LANES;
        for (int i = 0; i < nv * VEC_LANES; i++) {
            if (i < states) {
                const int64_t row = state_row(t, &u, i);
                for (int d = 0; d < hd; d++)
                    qt[d * PF_STATES + i] = load_scalar(t->query, t->q_type, row + d) * t->scale;
                qpos_lanes[i] = (float)(t->start + u.t0 + i / group);  // exact: positions below 2^24
            } else {
                for (int d = 0; d < hd; d++) qt[d * PF_STATES + i] = 0.0f;
                qpos_lanes[i] = -1.0f;  // sees no key
            }
        }
        memset(acc, 0, (size_t)states * hd * 4);
        for (int v = 0; v < nv; v++) {
            qpos[v] = vload(qpos_lanes + v * VEC_LANES);
            // the first key each state sees: its window's (below every position when there is none)
            qlow[v] = t->window > 0 ? _vadd(qpos[v], vset((float)(1 - t->window))) : vset(-1.0f);
            m[v] = vset(-1e30f), l[v] = vzero();  // finite: exp(m - m') never sees inf - inf
        }
        for (int64_t pos = u.lo; pos <= u.last_q;) {
            int64_t first;
            const int cnt = step_keys(t, &u, pos, PF_KEYS, &first);
            for (int j = 0; j < PF_KEYS; j++) {  // the step's K rows then V rows, widened; past its end: zeros
                krow[j] = rows[j];
                if (j < cnt) {
                    load_row(t->k_cache, t->cache_type, (first + (int64_t)j * kvh) * hd, hd, t->k_scale, rows[j]);
                    load_row(t->v_cache, t->v_type, (first + (int64_t)j * kvh) * hd, hd, t->v_scale,
                             rows[PF_KEYS + j]);
                } else if (j < ((cnt + 3) & ~3)) {
                    memset(rows[j], 0, (size_t)hd * 4);
                }
            }
            // the vectors of states that see a key of this step: states run in query order and the last sees every
            // step (the last query is the chunk's last)
            int v0 = 0;
            while (v0 < nv - 1 && qpos_lanes[v0 * VEC_LANES + VEC_LANES - 1] < (float)pos) v0++;
            for (int j = 0; j < cnt; j += 4)
                for (int v = v0; v < nv; v += 2) pl_scores4(qt, krow + j, hd, v, v + 1 < nv, s, j);
            if (t->softcap > 0.0f)  // Gemma 2: cap * tanh(score / cap), lane by lane as the generic kernel has it
                for (int v = v0; v < nv; v++)
                    for (int j = 0; j < cnt; j++) {
                        float x[VEC_LANES];
                        vstore(x, s[j][v]);
                        for (int i = 0; i < VEC_LANES; i++) x[i] = tanhf(x[i] / t->softcap) * t->softcap;
                        s[j][v] = vload(x);
                    }
            for (int v = v0; v < nv; v++) {
                vf top = vset(-INFINITY);
                for (int j = 0; j < cnt; j++) {
                    s[j][v] = pl_seen(s[j][v], vset((float)(pos + j)), qlow[v], qpos[v]);
                    top = vmaxv(top, s[j][v]);
                }
                const vf m_new = vmaxv(m[v], top), cv = vexp(_vadd(m[v], vmul(m_new, vset(-1.0f))));
                m[v] = m_new;
                const vf neg_m = vmul(m_new, vset(-1.0f));
                vf sum = vzero();
                for (int j = 0; j < cnt; j++) {
                    const vf e = vexp(_vadd(s[j][v], neg_m));  // a key it does not see: exp(-inf) = 0
                    sum = _vadd(sum, e);
                    vstore(p[j] + v * VEC_LANES, e);
                }
                l[v] = vfma(l[v], cv, sum);
                vstore(c + v * VEC_LANES, cv);
            }
            // acc = acc c + p V for the states that see a key of this step: each output vector in a register over
            // the step's values
            int from = v0 * VEC_LANES;
            while (qpos_lanes[from] < (float)pos) from++;
            for (int i = from; i < states; i++) {
                float *ai = acc + i * hd;
                const vf ci = vset(c[i]);
                int d = 0;
                for (; d + 4 * VEC_LANES <= hd; d += 4 * VEC_LANES) {
                    vf a0 = vmul(vload(ai + d), ci), a1 = vmul(vload(ai + d + VEC_LANES), ci),
                       a2 = vmul(vload(ai + d + 2 * VEC_LANES), ci), a3 = vmul(vload(ai + d + 3 * VEC_LANES), ci);
                    for (int j = 0; j < cnt; j++) {
                        const vf w = vset(p[j][i]);
                        const float *vr = rows[PF_KEYS + j] + d;
                        a0 = vfma(w, vload(vr), a0);
                        a1 = vfma(w, vload(vr + VEC_LANES), a1);
                        a2 = vfma(w, vload(vr + 2 * VEC_LANES), a2);
                        a3 = vfma(w, vload(vr + 3 * VEC_LANES), a3);
                    }
                    vstore(ai + d, a0), vstore(ai + d + VEC_LANES, a1), vstore(ai + d + 2 * VEC_LANES, a2),
                        vstore(ai + d + 3 * VEC_LANES, a3);
                }
                for (; d + VEC_LANES <= hd; d += VEC_LANES) {
                    vf a = vmul(vload(ai + d), ci);
                    for (int j = 0; j < cnt; j++) a = vfma(vset(p[j][i]), vload(rows[PF_KEYS + j] + d), a);
                    vstore(ai + d, a);
                }
                for (; d < hd; d++) {
                    float a = ai[d] * c[i];
                    for (int j = 0; j < cnt; j++) a += p[j][i] * rows[PF_KEYS + j][d];
                    ai[d] = a;
                }
            }
            pos += cnt;
        }
        float lsum[PF_STATES];
        for (int v = 0; v < nv; v++) vstore(lsum + v * VEC_LANES, l[v]);
        for (int i = 0; i < states; i++) {
            const int64_t row = state_row(t, &u, i);
            const float inv = lsum[i] > 0.0f ? 1.0f / lsum[i] : 0.0f;
            for (int d = 0; d < hd; d++) store_scalar(t->out, t->out_type, row + d, acc[i * hd + d] * inv);
        }
    }
}
#endif
