/*
 * CPU kernels for minisgl, compiled at first use (see build.py) and called through ctypes.
 *
 * Every kernel takes raw pointers, element strides and a dtype code (0 = float32,
 * 1 = bfloat16); all arithmetic is float32. Parallel loops use OpenMP; the library is
 * loaded after torch, so it shares torch's OpenMP runtime and thread count.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define DT_F32 0
#define DT_BF16 1
#define MAX_TASK_DIM 8192  /* query heads x head_dim that one attention task may hold */
#define MAX_TASK_HEADS 64 /* query heads one attention task may hold */
#define MAX_HEAD_DIM 256

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void load_row(float *dst, const void *src, int64_t n, int dtype) {
    if (dtype == DT_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    }
}

static inline void store_row(void *dst, const float *src, int64_t n, int dtype) {
    if (dtype == DT_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    }
}

static inline float round_to(float x, int dtype) {
    return dtype == DT_F32 ? x : bf16_to_f32(f32_to_bf16(x));
}

static inline const char *elem(const void *base, int64_t index, int dtype) {
    return (const char *)base + index * (dtype == DT_F32 ? 4 : 2);
}

/*
 * Paged attention for requests with few new tokens (decode, short extends).
 *
 * Request r owns query rows [q_start[r], q_start[r] + q_len[r]) and kv_len[r] keys whose
 * token slots come from its page list: key j lives at slot pages[r][j / page_size] *
 * page_size + j % page_size. Query i of request r sees keys [0, kv_len - q_len + i].
 * K and V of slot s start at k + s * slot_stride (and v + ...), heads head_dim apart.
 * Query heads [hk * group, (hk + 1) * group) share KV head hk. q / out have dtype, the pool
 * kv_dtype (a float32 model may keep its KV cache in bfloat16).
 */
typedef struct {
    const void *k, *v;
    int64_t slot_stride, page_size, head_dim, group;
    const int64_t *pages;
    int dtype;
} AttnTask;

static inline int64_t key_offset(const AttnTask *a, int64_t j, int64_t hk) {
    const int64_t slot = a->pages[j / a->page_size] * a->page_size + j % a->page_size;
    return slot * a->slot_stride + hk * a->head_dim;
}

/* qf: [group][d] scaled queries; acc: [group][d] outputs for keys [0, limit). */
static void attend_generic(const AttnTask *a, int64_t hk, int64_t limit, const float *qf,
                           float *acc) {
    const int64_t d = a->head_dim, group = a->group;
    float kb[MAX_HEAD_DIM], vb[MAX_HEAD_DIM], m[64], l[64];
    for (int64_t g = 0; g < group; g++) {
        m[g] = -1e30f;
        l[g] = 0.0f;
        for (int64_t x = 0; x < d; x++) acc[g * d + x] = 0.0f;
    }
    for (int64_t j = 0; j < limit; j++) {
        const int64_t off = key_offset(a, j, hk);
        load_row(kb, elem(a->k, off, a->dtype), d, a->dtype);
        load_row(vb, elem(a->v, off, a->dtype), d, a->dtype);
        for (int64_t g = 0; g < group; g++) {
            float dot = 0.0f;
            for (int64_t x = 0; x < d; x++) dot += qf[g * d + x] * kb[x];
            const float best = dot > m[g] ? dot : m[g];
            const float corr = expf(m[g] - best), p = expf(dot - best);
            l[g] = l[g] * corr + p;
            m[g] = best;
            for (int64_t x = 0; x < d; x++) acc[g * d + x] = acc[g * d + x] * corr + p * vb[x];
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t x = 0; x < d; x++) acc[g * d + x] /= l[g];
}

#ifdef __AVX512F__
#include <immintrin.h>
#define HAVE_AVX512 1

static inline __m512 load16(const void *base, int64_t idx, int dtype) {
    if (dtype == DT_BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + idx);
}

/* exp(x) on 16 lanes for x <= 0 to ~3e-8 relative: 2^(x log2 e) = 2^f * 2^floor, with a
 * degree-6 polynomial for 2^f on [0, 1) and an exact scale by 2^floor. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, fi);
    __m512 p = _mm512_set1_ps(0.0002168343198718503f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0012437946861609817f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009679985232651234f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05548214912414551f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24023030698299408f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931468844413757f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, fi);
}

/* Lane t of the result is the sum of the 16 lanes of v[t]: pairwise shuffles and adds, in
 * place of 16 separate horizontal reductions. */
static inline __m512 hsum16(const __m512 *v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xee));
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                     _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                     _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88),
                         _mm512_shuffle_f32x4(u01, u23, 0xdd));
}

/* Pool slots are scattered pages, so hardware prefetch cannot see the next block coming:
 * request the K and V rows of heads [hk0, hk0 + nkv) while the current block is computed. */
static inline void prefetch_keys(const AttnTask *a, int64_t hk0, int64_t nkv, int64_t j0,
                                 int64_t limit) {
    const int64_t end = j0 + 16 < limit ? j0 + 16 : limit;
    const int64_t bytes = nkv * a->head_dim * (a->dtype == DT_F32 ? 4 : 2);
    for (int64_t j = j0; j < end; j++) {
        const int64_t off = key_offset(a, j, hk0);
        const char *kp = elem(a->k, off, a->dtype), *vp = elem(a->v, off, a->dtype);
        for (int64_t b = 0; b < bytes; b += 64) {
            _mm_prefetch(kp + b, _MM_HINT_T0);
            _mm_prefetch(vp + b, _MM_HINT_T0);
        }
    }
}

/* KV heads [hk0, hk0 + nkv) of one query over keys [0, limit), in blocks of 16 keys: the
 * scores of every query head, one vector softmax update per head, then V accumulated with
 * the 16 probabilities. qf / acc hold the nkv * group heads. Needs head_dim % 16 == 0. */
static inline __attribute__((always_inline)) void attend_blocks(
    const AttnTask *a, int64_t hk0, int64_t nkv, int64_t limit, const float *qf, float *acc,
    const int64_t chunks) {
    const int64_t d = chunks * 16, group = a->group, heads = nkv * group;
    float m[MAX_TASK_HEADS], l[MAX_TASK_HEADS], corr_h[MAX_TASK_HEADS];
    float sc[MAX_TASK_HEADS * 16];
    __m512 prod[MAX_TASK_HEADS * 16];
    int64_t offs[16];
    for (int64_t h = 0; h < heads; h++) {
        m[h] = -1e30f;
        l[h] = 0.0f;
    }
    for (int64_t x = 0; x < heads * d; x++) acc[x] = 0.0f;
    for (int64_t j0 = 0; j0 < limit; j0 += 16) {
        const int64_t n = limit - j0 < 16 ? limit - j0 : 16;
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        for (int64_t t = 0; t < n; t++) offs[t] = key_offset(a, j0 + t, hk0);
        prefetch_keys(a, hk0, nkv, j0 + 16, limit);
        for (int64_t t = 0; t < 16; t++) {
            if (t >= n) {
                for (int64_t h = 0; h < heads; h++) prod[h * 16 + t] = _mm512_setzero_ps();
                continue;
            }
            for (int64_t kh = 0; kh < nkv; kh++) {
                __m512 kv[MAX_HEAD_DIM / 16];
                for (int64_t c = 0; c < chunks; c++)
                    kv[c] = load16(a->k, offs[t] + kh * d + c * 16, a->dtype);
                for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
                    __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qf + h * d), kv[0]);
                    for (int64_t c = 1; c < chunks; c++)
                        dot = _mm512_fmadd_ps(_mm512_loadu_ps(qf + h * d + c * 16), kv[c], dot);
                    prod[h * 16 + t] = dot;
                }
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            const __m512 s = hsum16(prod + h * 16);
            const float blk = _mm512_mask_reduce_max_ps(valid, s);
            const float best = blk > m[h] ? blk : m[h];
            const __m512 p =
                _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(best))));
            corr_h[h] = expf(m[h] - best);
            l[h] = l[h] * corr_h[h] + _mm512_reduce_add_ps(p);
            m[h] = best;
            _mm512_storeu_ps(sc + h * 16, p);
        }
        for (int64_t kh = 0; kh < nkv; kh++) {
            for (int64_t c = 0; c < chunks; c++) {
                __m512 vv[16];
                for (int64_t t = 0; t < n; t++)
                    vv[t] = load16(a->v, offs[t] + kh * d + c * 16, a->dtype);
                for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
                    float *ah = acc + h * d + c * 16;
                    __m512 r = _mm512_mul_ps(_mm512_loadu_ps(ah), _mm512_set1_ps(corr_h[h]));
                    for (int64_t t = 0; t < n; t++)
                        r = _mm512_fmadd_ps(_mm512_set1_ps(sc[h * 16 + t]), vv[t], r);
                    _mm512_storeu_ps(ah, r);
                }
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        const float inv = 1.0f / l[h];
        for (int64_t x = 0; x < d; x++) acc[h * d + x] *= inv;
    }
}

/* attend_blocks with the common head dims as constants, so the per-chunk vectors stay in
 * registers. */
static void attend_avx512(const AttnTask *a, int64_t hk0, int64_t nkv, int64_t limit,
                          const float *qf, float *acc) {
    switch (a->head_dim) {
        case 64:
            attend_blocks(a, hk0, nkv, limit, qf, acc, 4);
            break;
        case 128:
            attend_blocks(a, hk0, nkv, limit, qf, acc, 8);
            break;
        default:
            attend_blocks(a, hk0, nkv, limit, qf, acc, a->head_dim / 16);
    }
}
#else
#define HAVE_AVX512 0
#endif

void paged_attention(const void *q, int64_t q_tok_stride, int64_t q_head_stride,
                     const void *k, const void *v, int64_t slot_stride,
                     const int64_t *pages, int64_t pages_stride, int64_t page_size,
                     const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len,
                     int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, float scale, void *out, int64_t out_tok_stride,
                     int dtype, int kv_dtype) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t d = head_dim;
    const int vector = HAVE_AVX512 && d % 16 == 0;
    /* One task reads whole slot rows (all KV heads) when there are enough requests to keep
     * every thread busy; otherwise tasks split the KV heads. */
    const int whole = vector && num_reqs >= 2 * omp_get_max_threads() &&
                      num_heads <= MAX_TASK_HEADS && num_heads * d <= MAX_TASK_DIM;
    const int64_t per_task = whole ? num_kv_heads : 1;
    const int64_t chunks = num_kv_heads / per_task;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t r = 0; r < num_reqs; r++) {
        for (int64_t ch = 0; ch < chunks; ch++) {
            float qf[MAX_TASK_DIM], acc[MAX_TASK_DIM];
            const int64_t hk0 = ch * per_task, h0 = hk0 * group, heads = per_task * group;
            const AttnTask task = {k, v, slot_stride, page_size, d, group,
                                   pages + r * pages_stride, kv_dtype};
            const int64_t first = kv_len[r] - q_len[r];
            for (int64_t i = 0; i < q_len[r]; i++) {
                const int64_t tok = q_start[r] + i;
                for (int64_t h = 0; h < heads; h++) {
                    const void *src = elem(q, tok * q_tok_stride + (h0 + h) * q_head_stride, dtype);
                    load_row(qf + h * d, src, d, dtype);
                    for (int64_t x = 0; x < d; x++) qf[h * d + x] *= scale;
                }
#if HAVE_AVX512
                if (vector)
                    attend_avx512(&task, hk0, per_task, first + i + 1, qf, acc);
                else
#endif
                    attend_generic(&task, hk0, first + i + 1, qf, acc);
                for (int64_t h = 0; h < heads; h++)
                    store_row((char *)out + (tok * out_tok_stride + (h0 + h) * d) * (dtype ? 2 : 4),
                              acc + h * d, d, dtype);
            }
        }
    }
}

/*
 * RMSNorm over rows of width n, optionally adding x into residual first:
 *   add:  residual += x;  out = norm(residual) * weight
 *   else:                 out = norm(x) * weight
 * bfloat16 rounds like the reference: the normalized value to bf16, then the product.
 */
void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
              int64_t n, float eps, int add, int dtype) {
#pragma omp parallel for schedule(static) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float buf[8192], w[8192];
        const int64_t off = r * n;
        load_row(buf, elem(x, off, dtype), n, dtype);
        if (add) {
            float res[8192];
            load_row(res, elem(residual, off, dtype), n, dtype);
            for (int64_t i = 0; i < n; i++) buf[i] = round_to(buf[i] + res[i], dtype);
            store_row((char *)elem(residual, off, dtype), buf, n, dtype);
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += buf[i] * buf[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        load_row(w, weight, n, dtype);
        if (dtype == DT_F32) {
            for (int64_t i = 0; i < n; i++) buf[i] = buf[i] * inv * w[i];
        } else {
            for (int64_t i = 0; i < n; i++) buf[i] = w[i] * round_to(buf[i] * inv, dtype);
        }
        store_row((char *)elem(out, off, dtype), buf, n, dtype);
    }
}

/*
 * Rotary embedding in place ("rotate half" form) on x viewed as [tokens, heads, head_dim]
 * with the given strides. cos / sin tables are [positions, head_dim] rows (row stride
 * table_stride) with rotate_half's sign folded into sin:
 *   x' = x * cos + cat(x2, x1) * sin
 */
void rotary(void *x, int64_t tokens, int64_t heads, int64_t tok_stride, int64_t head_stride,
            int64_t head_dim, const int64_t *positions, const void *cos_table,
            const void *sin_table, int64_t table_stride, int dtype) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= 65536)
    for (int64_t t = 0; t < tokens; t++) {
        float c[MAX_HEAD_DIM], s[MAX_HEAD_DIM], a[MAX_HEAD_DIM], o[MAX_HEAD_DIM];
        const int64_t row = positions[t] * table_stride;
        load_row(c, elem(cos_table, row, dtype), head_dim, dtype);
        load_row(s, elem(sin_table, row, dtype), head_dim, dtype);
        for (int64_t h = 0; h < heads; h++) {
            char *p = (char *)elem(x, t * tok_stride + h * head_stride, dtype);
            load_row(a, p, head_dim, dtype);
            for (int64_t i = 0; i < half; i++) {
                o[i] = round_to(round_to(a[i] * c[i], dtype) + a[i + half] * s[i], dtype);
                o[i + half] =
                    round_to(round_to(a[i + half] * c[i + half], dtype) + a[i] * s[i + half], dtype);
            }
            store_row(p, o, head_dim, dtype);
        }
    }
}

/*
 * y = x w^T (+ bias) with float32 activations x [M, K] and a weight packed into panels of
 * 32 output rows: panel p holds w[32p + j, k] at [p][k][j] (rows past N are zero), stored
 * as float32 or bfloat16. A tile of up to 12 rows x 32 outputs lives in 24 AVX-512
 * accumulators; each k step loads two weight vectors and broadcasts one x value per row,
 * so small M is bound by weight bandwidth and large M by FMA throughput. Threads split
 * the panels, so each weight byte is read from memory once per call.
 *
 *   w panel p:   k=0: [w(32p,0) ... w(32p+31,0)]   k=1: [w(32p,1) ...]  ...  (K rows)
 */
#define PANEL 32
#define TILE_M 12
#define PREFETCH_BYTES 1024 /* how far ahead a small tile prefetches its weight stream */

#ifdef __AVX512F__
#include <immintrin.h>

int gemm_native(void) { return 1; }

static inline __m512 load_panel(const void *w, int64_t idx, int wbf16) {
    if (wbf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + idx));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)w + idx);
}

static inline __attribute__((always_inline)) void gemm_tile(
    const float *x, int64_t ldx, const void *panel, int64_t k_dim, const float *bias, float *y,
    int64_t ldy, int64_t valid, const int mb, const int wbf16) {
    const __mmask16 lo = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
    const __mmask16 hi = valid >= 32   ? (__mmask16)0xffff
                         : valid <= 16 ? (__mmask16)0
                                       : (__mmask16)((1u << (valid - 16)) - 1u);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias != NULL) {
        b0 = _mm512_maskz_loadu_ps(lo, bias);
        b1 = _mm512_maskz_loadu_ps(hi, bias + 16);
    }
    __m512 acc[TILE_M][2];
    for (int i = 0; i < mb; i++) {
        acc[i][0] = b0;
        acc[i][1] = b1;
    }
    const char *ahead = (const char *)panel + PREFETCH_BYTES;
    const int64_t row_bytes = PANEL * (wbf16 ? 2 : 4);
    for (int64_t k = 0; k < k_dim; k++) {
        if (mb <= 4) _mm_prefetch(ahead + k * row_bytes, _MM_HINT_T0);
        const __m512 w0 = load_panel(panel, k * PANEL, wbf16);
        const __m512 w1 = load_panel(panel, k * PANEL + 16, wbf16);
        for (int i = 0; i < mb; i++) {
            const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
            acc[i][0] = _mm512_fmadd_ps(xb, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xb, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < mb; i++) {
        _mm512_mask_storeu_ps(y + i * ldy, lo, acc[i][0]);
        _mm512_mask_storeu_ps(y + i * ldy + 16, hi, acc[i][1]);
    }
}

#define GEMM_CASE(MB, BF)                                                                       \
    case MB:                                                                                    \
        gemm_tile(xm, ldx, panel, k_dim, bias_p, ym, ldy, valid, MB, BF);                       \
        break;

#define GEMM_SWITCH(BF)                                                                         \
    switch (mb) {                                                                               \
        GEMM_CASE(1, BF)                                                                        \
        GEMM_CASE(2, BF)                                                                        \
        GEMM_CASE(3, BF)                                                                        \
        GEMM_CASE(4, BF)                                                                        \
        GEMM_CASE(5, BF)                                                                        \
        GEMM_CASE(6, BF)                                                                        \
        GEMM_CASE(7, BF)                                                                        \
        GEMM_CASE(8, BF)                                                                        \
        GEMM_CASE(9, BF)                                                                        \
        GEMM_CASE(10, BF)                                                                       \
        GEMM_CASE(11, BF)                                                                       \
        default:                                                                                \
            gemm_tile(xm, ldx, panel, k_dim, bias_p, ym, ldy, valid, TILE_M, BF);               \
    }

void gemm_packed(const float *x, int64_t m_dim, int64_t ldx, const void *w, int64_t n_dim,
                 int64_t k_dim, const float *bias, float *y, int64_t ldy, int wbf16) {
    const int64_t panels = (n_dim + PANEL - 1) / PANEL;
    const int64_t esize = wbf16 ? 2 : 4;
    const int64_t tiles = (m_dim + TILE_M - 1) / TILE_M; /* rows split evenly over tiles */
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        int mb = 0;
        const int64_t n0 = p * PANEL;
        const int64_t valid = n_dim - n0 < PANEL ? n_dim - n0 : PANEL;
        const void *panel = (const char *)w + p * k_dim * PANEL * esize;
        const float *bias_p = bias != NULL ? bias + n0 : NULL;
        for (int64_t t = 0, m0 = 0; t < tiles; t++, m0 += mb) {
            mb = (int)(m_dim / tiles + (t < m_dim % tiles));
            const float *xm = x + m0 * ldx;
            float *ym = y + m0 * ldy + n0;
            if (wbf16) {
                GEMM_SWITCH(1)
            } else {
                GEMM_SWITCH(0)
            }
        }
    }
}
#else
int gemm_native(void) { return 0; }

void gemm_packed(const float *x, int64_t m_dim, int64_t ldx, const void *w, int64_t n_dim,
                 int64_t k_dim, const float *bias, float *y, int64_t ldy, int wbf16) {
    const int64_t esize = wbf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_dim; n++) {
        const char *panel = (const char *)w + (n / PANEL) * k_dim * PANEL * esize;
        for (int64_t m = 0; m < m_dim; m++) {
            float acc = bias != NULL ? bias[n] : 0.0f;
            for (int64_t k = 0; k < k_dim; k++) {
                float wv;
                load_row(&wv, panel + (k * PANEL + n % PANEL) * esize, 1, wbf16);
                acc += x[m * ldx + k] * wv;
            }
            y[m * ldy + n] = acc;
        }
    }
}
#endif
