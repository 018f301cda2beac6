// Chunked prefill attention for bf16 queries over a bf16 or fp8 (e4m3) paged cache, on AVX512-BF16: included by
// prefill_attention.h after its generic prefill (prefill_task, store_scalar; vexp from vec_math.h), which serves
// every other case.
//
// The same units as the generic kernel (a KV head and a tile of queries; its (query, head) pairs are "states"),
// the cache read in place a step of at most 16 keys at a time, online softmax. What differs is where the
// products go: both run on `vdpbf16ps` (32 products of bf16 pairs into 16 float32 sums per instruction), and
// nothing is transposed per step but V's pairs of rows.
//   scores  lanes are states: the unit's queries are laid out once as pairs of dimensions (qt[pair][state]), and
//           each key's pair of dimensions is broadcast from the cache row where it lies;
//   softmax lane-wise per state: no horizontal maximum or sum;
//   p V     lanes are dimensions: p rounded to bf16 pairs of keys (as torch's flash attention rounds it for its
//           product with V), V's rows of the step interleaved in pairs once per step.
// An fp8 cache's rows of a step are widened to bf16 first (exactly: every e4m3 value is a bf16 value; the
// scales multiply the scores and the output). Sums are float32 throughout; the products are exact. The result
// differs from the generic kernel's by p's rounding (relative 2^-9 per weight) and the order of the sums.

#if defined(__AVX512BF16__)
#define PB_STATES 32  // states per unit: two vectors of 16 lanes
#define PB_KEYS 16    // keys per step

static const uint16_t PB_ZERO_ROW[MAX_HEAD_DIM];  // the keys and values past a step's end

// n (a multiple of 16) e4m3fn bytes to bf16: sign, exponent rebiased from 7 to 127, mantissa shifted; the
// subnormals (exponent 0: m 2^-9) from a table of their 8 values
static inline void pb_fp8_row(const uint8_t *src, uint16_t *dst, int n) {
    const __m256i subnormals = _mm256_setr_epi16(0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60, 0, 0, 0,
                                                 0, 0, 0, 0, 0);
    for (int i = 0; i < n; i += 16) {
        const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + i)));
        const __m256i normal = _mm256_add_epi16(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 4),
                                                _mm256_set1_epi16(0x3C00));
        const __m256i small = _mm256_permutexvar_epi16(_mm256_and_si256(x, _mm256_set1_epi16(7)), subnormals);
        const __mmask16 sub = _mm256_cmpeq_epi16_mask(_mm256_and_si256(x, _mm256_set1_epi16(0x78)),
                                                      _mm256_setzero_si256());
        const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8);
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_or_si256(_mm256_mask_blend_epi16(sub, normal, small), sign));
    }
}

static inline int32_t pb_pair(const uint16_t *row, int p) {  // dimensions 2p and 2p + 1 as one word
    int32_t w;
    memcpy(&w, row + 2 * p, 4);
    return w;
}

static inline __m512i pb_index(int first, int second) {  // words k of a to 2k and k of b to 2k + 1 (+ offsets)
    uint16_t idx[32];
    for (int k = 0; k < 16; k++) idx[2 * k] = (uint16_t)(first + k), idx[2 * k + 1] = (uint16_t)(second + k);
    return _mm512_loadu_si512(idx);
}

// Scores of 4 keys against NV vectors of states: s[v][j] = sum over pairs of q . k (float32)
static inline __attribute__((always_inline)) void pb_scores4(const uint32_t *qt, const uint16_t *const *krow,
                                                             int pairs, const int nv, __m512 s[2][4]) {
    __m512 a[2][4];
    for (int v = 0; v < nv; v++)
        for (int i = 0; i < 4; i++) a[v][i] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        __m512bh q0 = (__m512bh)_mm512_loadu_si512(qt + p * PB_STATES), q1 = q0;
        if (nv > 1) q1 = (__m512bh)_mm512_loadu_si512(qt + p * PB_STATES + 16);
        for (int i = 0; i < 4; i++) {
            __m512bh kb = (__m512bh)_mm512_set1_epi32(pb_pair(krow[i], p));
            a[0][i] = _mm512_dpbf16_ps(a[0][i], kb, q0);
            if (nv > 1) a[1][i] = _mm512_dpbf16_ps(a[1][i], kb, q1);
        }
    }
    for (int v = 0; v < nv; v++)
        for (int i = 0; i < 4; i++) s[v][i] = a[v][i];
}

// acc[s][d] = acc[s][d] * c[s] + sum over the step's key pairs of p . V, for NS states and ND vectors of d.
static inline __attribute__((always_inline)) void pb_values(float *acc, int hd, const float *c,
                                                            const uint32_t *pp, const uint32_t *vt, int npairs,
                                                            const int ns, const int nd) {
    __m512 a[4][4];
    for (int s = 0; s < ns; s++) {
        __m512 cs = _mm512_set1_ps(c[s]);
        for (int i = 0; i < nd; i++) a[s][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + s * hd + 16 * i), cs);
    }
    for (int jp = 0; jp < npairs; jp++) {
        __m512bh w[4];
        for (int i = 0; i < nd; i++) w[i] = (__m512bh)_mm512_loadu_si512(vt + jp * MAX_HEAD_DIM + 16 * i);
        for (int s = 0; s < ns; s++) {
            __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp[jp * PB_STATES + s]);
            for (int i = 0; i < nd; i++) a[s][i] = _mm512_dpbf16_ps(a[s][i], pb, w[i]);
        }
    }
    for (int s = 0; s < ns; s++)
        for (int i = 0; i < nd; i++) _mm512_storeu_ps(acc + s * hd + 16 * i, a[s][i]);
}

// pb_values over `ns` states from `s0` and every vector of d, in blocks of at most 4 x 4
static void pb_values_states(float *acc, int hd, const float *c, const uint32_t *pp, const uint32_t *vt, int npairs,
                             int s0, int ns) {
    for (int d0 = 0; d0 < hd; d0 += 64) {
        const int nd = (hd - d0) / 16 < 4 ? (hd - d0) / 16 : 4;
        if (ns == 4 && nd == 4) {
            pb_values(acc + s0 * hd + d0, hd, c + s0, pp + s0, vt + d0, npairs, 4, 4);
            continue;
        }
        for (int s = s0; s < s0 + ns; s++) switch (nd) {
            case 1: pb_values(acc + s * hd + d0, hd, c + s, pp + s, vt + d0, npairs, 1, 1); break;
            case 2: pb_values(acc + s * hd + d0, hd, c + s, pp + s, vt + d0, npairs, 1, 2); break;
            case 3: pb_values(acc + s * hd + d0, hd, c + s, pp + s, vt + d0, npairs, 1, 3); break;
            default: pb_values(acc + s * hd + d0, hd, c + s, pp + s, vt + d0, npairs, 1, 4);
            }
    }
}

static void prefill_chunk_bf16(void *ctx, int64_t begin, int64_t end) {
    prefill_task *t = ctx;
    const int hd = t->head_dim, kvh = t->num_kv_heads, group = t->num_heads / kvh;
    const int pairs = hd / 2;
    // on the thread's stack (about 147 KiB at MAX_HEAD_DIM)
    uint32_t qt[MAX_HEAD_DIM / 2 * PB_STATES], vt[PB_KEYS / 2 * MAX_HEAD_DIM], pp[PB_KEYS / 2 * PB_STATES];
    uint16_t kwide[PB_KEYS * MAX_HEAD_DIM], vwide[PB_KEYS * MAX_HEAD_DIM];  // an fp8 step's rows in bf16
    float acc[PB_STATES * MAX_HEAD_DIM], c[PB_STATES];
    int32_t qpos_lanes[PB_STATES];
    const __m512i lo_idx = pb_index(0, 32), hi_idx = pb_index(16, 48), pair_idx = pb_index(0, 16);
    const float scale = t->scale * t->k_scale;
    const uint16_t *query = t->query, *kc = t->k_cache, *vc = t->v_cache;
    const int fp8 = t->cache_type == CACHE_FP8;
    for (int64_t unit = begin; unit < end; unit++) {
        const prefill_unit u = unit_of(t, unit);
        const int states = u.states, nv = states > 16 ? 2 : 1;
        for (int i = 0; i < PB_STATES; i++) {
            if (i < states) {
                const uint16_t *row = query + state_row(t, &u, i);
                for (int p = 0; p < pairs; p++) qt[p * PB_STATES + i] = (uint32_t)pb_pair(row, p);
                qpos_lanes[i] = (int32_t)(t->start + u.t0 + i / group);
            } else {
                for (int p = 0; p < pairs; p++) qt[p * PB_STATES + i] = 0;
                qpos_lanes[i] = -1;  // sees no key
            }
        }
        memset(acc, 0, (size_t)states * hd * 4);
        __m512i qpos[2], qlow[2];
        __m512 m[2], l[2];
        for (int v = 0; v < 2; v++) {
            qpos[v] = _mm512_loadu_si512(qpos_lanes + 16 * v);
            // the first key each state sees: its window's (a position no key has when there is none)
            qlow[v] = t->window > 0 ? _mm512_sub_epi32(qpos[v], _mm512_set1_epi32(t->window - 1))
                                    : _mm512_set1_epi32(INT32_MIN);
            m[v] = _mm512_set1_ps(-1e30f), l[v] = _mm512_setzero_ps();  // finite: exp(m - m') never sees inf - inf
        }
        for (int64_t pos = u.lo; pos <= u.last_q;) {
            int64_t first;
            const int cnt = step_keys(t, &u, pos, PB_KEYS, &first);
            const uint16_t *krow[PB_KEYS];
            const uint16_t *vrow[PB_KEYS];
            for (int j = 0; j < PB_KEYS; j++) {
                const int64_t at = (first + (int64_t)j * kvh) * hd;
                if (j >= cnt) {
                    krow[j] = vrow[j] = PB_ZERO_ROW;
                } else if (fp8) {
                    pb_fp8_row((const uint8_t *)t->k_cache + at, kwide + j * hd, hd);
                    pb_fp8_row((const uint8_t *)t->v_cache + at, vwide + j * hd, hd);
                    krow[j] = kwide + j * hd, vrow[j] = vwide + j * hd;
                } else {
                    krow[j] = kc + at, vrow[j] = vc + at;
                }
            }
            const int npairs = (cnt + 1) / 2;
            for (int jp = 0; jp < npairs; jp++) {  // V's rows 2jp and 2jp + 1 interleaved: vt[jp][d] is their pair
                const uint16_t *r0 = vrow[2 * jp], *r1 = vrow[2 * jp + 1];
                for (int d = 0; d < hd; d += 32) {
                    const __mmask32 k = hd - d >= 32 ? 0xffffffffu : 0xffffu;
                    __m512i a = _mm512_maskz_loadu_epi16(k, r0 + d), b = _mm512_maskz_loadu_epi16(k, r1 + d);
                    _mm512_storeu_si512(vt + jp * MAX_HEAD_DIM + d, _mm512_permutex2var_epi16(a, lo_idx, b));
                    if (hd - d >= 32)
                        _mm512_storeu_si512(vt + jp * MAX_HEAD_DIM + d + 16, _mm512_permutex2var_epi16(a, hi_idx, b));
                }
            }
            // the vectors of states that see a key of this step: states run in query order, and the last state
            // sees every step (the last query is the chunk's last)
            const int v0 = nv == 2 && qpos_lanes[15] < pos ? 1 : 0, active = nv - v0;
            __m512 s[2][PB_KEYS];
            const int keys = (cnt + 3) & ~3;
            for (int j = 0; j < keys; j += 4) {
                __m512 four[2][4];
                if (active == 2) {
                    pb_scores4(qt, krow + j, pairs, 2, four);
                    for (int i = 0; i < 4; i++) s[0][j + i] = four[0][i], s[1][j + i] = four[1][i];
                } else {
                    pb_scores4(qt + 16 * v0, krow + j, pairs, 1, four);
                    for (int i = 0; i < 4; i++) s[v0][j + i] = four[0][i];
                }
            }
            for (int v = v0; v < nv; v++) {
                __m512 top = _mm512_set1_ps(-INFINITY);
                for (int j = 0; j < cnt; j++) {
                    const __m512i kpos = _mm512_set1_epi32((int32_t)(pos + j));
                    const __mmask16 sees = _mm512_cmp_epi32_mask(qpos[v], kpos, _MM_CMPINT_NLT) &
                                           _mm512_cmp_epi32_mask(kpos, qlow[v], _MM_CMPINT_NLT);
                    s[v][j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), sees, s[v][j], _mm512_set1_ps(scale));
                    top = _mm512_max_ps(top, s[v][j]);
                }
                const __m512 m_new = _mm512_max_ps(m[v], top), cv = vexp(_mm512_sub_ps(m[v], m_new));
                m[v] = m_new;
                __m512 sum = _mm512_setzero_ps();
                for (int j = 0; j < cnt; j++) {
                    s[v][j] = vexp(_mm512_sub_ps(s[v][j], m_new));  // a key it does not see: exp(-inf) = 0
                    sum = _mm512_add_ps(sum, s[v][j]);
                }
                l[v] = _mm512_add_ps(_mm512_mul_ps(l[v], cv), sum);
                _mm512_storeu_ps(c + 16 * v, cv);
                for (int jp = 0; jp < npairs; jp++) {  // p of keys 2jp and 2jp + 1 as one bf16 pair per state
                    __m512 odd = 2 * jp + 1 < cnt ? s[v][2 * jp + 1] : _mm512_setzero_ps();
                    __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, s[v][2 * jp]);
                    _mm512_storeu_si512(pp + jp * PB_STATES + 16 * v, _mm512_permutexvar_epi16(pair_idx, both));
                }
            }
            int from = 16 * v0;  // from the first state that sees a key of this step to the last
            while (qpos_lanes[from] < pos) from++;
            for (; from + 4 <= states; from += 4) pb_values_states(acc, hd, c, pp, vt, npairs, from, 4);
            if (from < states) pb_values_states(acc, hd, c, pp, vt, npairs, from, states - from);
            pos += cnt;
        }
        float inv[PB_STATES];
        for (int v = 0; v < 2; v++) {
            __m512 lv = l[v];
            __mmask16 some = _mm512_cmp_ps_mask(lv, _mm512_setzero_ps(), _CMP_GT_OQ);
            _mm512_storeu_ps(inv + 16 * v, _mm512_maskz_div_ps(some, _mm512_set1_ps(t->v_scale), lv));
        }
        for (int i = 0; i < states; i++) {
            const int64_t row = state_row(t, &u, i);
            for (int d = 0; d < hd; d++) store_scalar(t->out, t->out_type, row + d, acc[i * hd + d] * inv[i]);
        }
    }
}
#endif
