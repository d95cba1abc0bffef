/* The CPU path's native kernels, fp32: paged decode attention, (fused add +) RMSNorm, rotary
 * embedding and SiLU-and-mul. Each replaces several torch ops (and their temporaries) by one pass.
 *
 * Paged decode attention: one query token per sequence reads its keys and values in place from
 * the block-paged cache (no gather copy), GQA-aware, split over threads.
 *
 * Built by kernels/cpu_native.py with the system C compiler and loaded through ctypes; the torch
 * reference (kernels/attention_decode.py) is the specification it is tested against.
 *
 * Work item (s, h): the G = Hq / Hkv query heads of KV head h of sequence s. For each item:
 *   pass 1  scores[g, t] = scale * q_g . k_t          (each key read once for all G heads)
 *   pass 2  p[g, t] = exp(scores[g, t] - max_t), l_g = sum_t p[g, t]
 *   pass 3  out_g = (sum_t p[g, t] v_t) / l_g          (each value read once for all G heads)
 * Items are shared out across OpenMP threads in small dynamic chunks. With
 * AVX-512 and G <= 8, head_dim in {32, 64, 128}, a specialised version keeps queries and
 * accumulators in registers and computes the softmax's exponentials 16 at a time.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>

/* exp(x), used for x <= 0 (scores minus their max) and for silu: 2^(x log2 e) = 2^n * e^(f ln 2), |f| <= 1/2, with
 * e^u (|u| <= 0.35) by its degree-7 Taylor polynomial (error < 1e-8) and 2^n by scalef, which
 * underflows cleanly to 0 for very negative x. */
static inline __m512 exp_ps(__m512 x) {
    const __m512 y = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _mm512_set1_ps(-200.0f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 u = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 r = _mm512_set1_ps(1.0f / 5040.0f);
    r = _mm512_fmadd_ps(r, u, _mm512_set1_ps(1.0f / 720.0f));
    r = _mm512_fmadd_ps(r, u, _mm512_set1_ps(1.0f / 120.0f));
    r = _mm512_fmadd_ps(r, u, _mm512_set1_ps(1.0f / 24.0f));
    r = _mm512_fmadd_ps(r, u, _mm512_set1_ps(1.0f / 6.0f));
    r = _mm512_fmadd_ps(r, u, _mm512_set1_ps(0.5f));
    r = _mm512_fmadd_ps(r, u, _mm512_set1_ps(1.0f));
    r = _mm512_fmadd_ps(r, u, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(r, n);
}

#endif

typedef struct {
    const float *q;
    int64_t q_seq_stride, q_head_stride;
    const float *k_cache, *v_cache;
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *context_lens;
    float *out;
    int num_q_heads, num_kv_heads, head_dim, block_size;
    float scale;
} Problem;

static void attend_item(const Problem *p, int64_t item, float *scores, float *qs) {
    const int hkv = p->num_kv_heads, D = p->head_dim, B = p->block_size;
    const int G = p->num_q_heads / hkv;
    const int64_t s = item / hkv;
    const int h = (int)(item % hkv);
    const int ctx = p->context_lens[s];
    const int32_t *table = p->block_tables + s * p->block_table_stride;
    const int64_t token_stride = (int64_t)hkv * D; /* floats between consecutive tokens of a block */
    float *out = p->out + (s * p->num_q_heads + (int64_t)h * G) * D; /* G heads, contiguous */

    for (int g = 0; g < G; g++) { /* scaled copy of the G query rows, contiguous */
        const float *src = p->q + s * p->q_seq_stride + (int64_t)(h * G + g) * p->q_head_stride;
        for (int d = 0; d < D; d++) qs[g * D + d] = src[d] * p->scale;
    }
    /* pass 1: scores, block by block */
    for (int t0 = 0; t0 < ctx; t0 += B) {
        const int n = ctx - t0 < B ? ctx - t0 : B;
        const float *k = p->k_cache + ((int64_t)table[t0 / B] * B * hkv + h) * D;
        for (int i = 0; i < n; i++, k += token_stride) {
            for (int g = 0; g < G; g++) {
                const float *qg = qs + g * D;
                float acc = 0.0f;
                for (int d = 0; d < D; d++) acc += qg[d] * k[d];
                scores[(int64_t)g * ctx + t0 + i] = acc;
            }
        }
    }
    /* pass 2: softmax numerators in place; out_g starts at zero */
    float inv_sum[64];
    for (int g = 0; g < G; g++) {
        float *row = scores + (int64_t)g * ctx;
        float mx = -INFINITY;
        for (int t = 0; t < ctx; t++) mx = row[t] > mx ? row[t] : mx;
        float sum = 0.0f;
        for (int t = 0; t < ctx; t++) {
            row[t] = expf(row[t] - mx);
            sum += row[t];
        }
        inv_sum[g] = 1.0f / sum;
    }
    memset(out, 0, sizeof(float) * (size_t)G * D);
    /* pass 3: weighted sum of values */
    for (int t0 = 0; t0 < ctx; t0 += B) {
        const int n = ctx - t0 < B ? ctx - t0 : B;
        const float *v = p->v_cache + ((int64_t)table[t0 / B] * B * hkv + h) * D;
        for (int i = 0; i < n; i++, v += token_stride) {
            for (int g = 0; g < G; g++) {
                const float w = scores[(int64_t)g * ctx + t0 + i];
                float *og = out + g * D;
                for (int d = 0; d < D; d++) og[d] += w * v[d];
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) out[g * D + d] *= inv_sum[g];
}

#if defined(__AVX512F__)
/* attend_item for G query heads per KV head and a head dim of 16*C, both compile-time after
 * inlining, so the G*C query and accumulator vectors live in registers. */
static inline __attribute__((always_inline)) void attend_item_avx512(const Problem *p, int64_t item,
                                                                     float *scores, const int G,
                                                                     const int C) {
    const int hkv = p->num_kv_heads, D = 16 * C, B = p->block_size;
    const int64_t s = item / hkv;
    const int h = (int)(item % hkv);
    const int ctx = p->context_lens[s];
    const int32_t *table = p->block_tables + s * p->block_table_stride;
    const int64_t token_stride = (int64_t)hkv * D;
    float *out = p->out + (s * p->num_q_heads + (int64_t)h * G) * D;
    __m512 qv[8][8], acc[8][8];
    const __m512 scale = _mm512_set1_ps(p->scale);
    for (int g = 0; g < G; g++) {
        const float *src = p->q + s * p->q_seq_stride + (int64_t)(h * G + g) * p->q_head_stride;
        for (int c = 0; c < C; c++) qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(src + 16 * c), scale);
    }
    /* pass 1: scores */
    for (int t0 = 0; t0 < ctx; t0 += B) {
        const int n = ctx - t0 < B ? ctx - t0 : B;
        const float *k = p->k_cache + ((int64_t)table[t0 / B] * B * hkv + h) * D;
        for (int i = 0; i < n; i++, k += token_stride) {
            __m512 kc[8];
            for (int c = 0; c < C; c++) kc[c] = _mm512_loadu_ps(k + 16 * c);
            for (int g = 0; g < G; g++) {
                __m512 dot = _mm512_mul_ps(qv[g][0], kc[0]);
                for (int c = 1; c < C; c++) dot = _mm512_fmadd_ps(qv[g][c], kc[c], dot);
                scores[(int64_t)g * ctx + t0 + i] = _mm512_reduce_add_ps(dot);
            }
        }
    }
    /* pass 2: softmax numerators in place (16 at a time, a masked tail) */
    float inv_sum[8];
    for (int g = 0; g < G; g++) {
        float *row = scores + (int64_t)g * ctx;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        int t = 0;
        for (; t + 16 <= ctx; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + t));
        const __mmask16 tail = (__mmask16)((1u << (ctx - t)) - 1u);
        mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, row + t));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (t = 0; t + 16 <= ctx; t += 16) {
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + t), m));
            _mm512_storeu_ps(row + t, e);
            sum = _mm512_add_ps(sum, e);
        }
        if (tail) {
            const __m512 e = _mm512_maskz_mov_ps(
                tail, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + t), m)));
            _mm512_mask_storeu_ps(row + t, tail, e);
            sum = _mm512_add_ps(sum, e);
        }
        inv_sum[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* pass 3: weighted sum of values, accumulators in registers */
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) acc[g][c] = _mm512_setzero_ps();
    for (int t0 = 0; t0 < ctx; t0 += B) {
        const int n = ctx - t0 < B ? ctx - t0 : B;
        const float *v = p->v_cache + ((int64_t)table[t0 / B] * B * hkv + h) * D;
        for (int i = 0; i < n; i++, v += token_stride) {
            __m512 vc[8];
            for (int c = 0; c < C; c++) vc[c] = _mm512_loadu_ps(v + 16 * c);
            for (int g = 0; g < G; g++) {
                const __m512 w = _mm512_set1_ps(scores[(int64_t)g * ctx + t0 + i]);
                for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(w, vc[c], acc[g][c]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const __m512 r = _mm512_set1_ps(inv_sum[g]);
        for (int c = 0; c < C; c++) _mm512_storeu_ps(out + g * D + 16 * c, _mm512_mul_ps(acc[g][c], r));
    }
}

#define AVX512_CASE(G_, C_) \
    case (G_) * 16 + (C_): \
        attend_item_avx512(p, item, scores, G_, C_); \
        return 1;

/* 1 when a specialised kernel took the item, 0 when the generic one must. */
static int attend_item_fast(const Problem *p, int64_t item, float *scores) {
    const int G = p->num_q_heads / p->num_kv_heads;
    if (p->head_dim % 16) return 0;
    switch (G * 16 + p->head_dim / 16) {
        AVX512_CASE(1, 2) AVX512_CASE(2, 2) AVX512_CASE(3, 2) AVX512_CASE(4, 2)
        AVX512_CASE(1, 4) AVX512_CASE(2, 4) AVX512_CASE(3, 4) AVX512_CASE(4, 4)
        AVX512_CASE(5, 4) AVX512_CASE(6, 4) AVX512_CASE(7, 4) AVX512_CASE(8, 4)
        AVX512_CASE(1, 8) AVX512_CASE(2, 8) AVX512_CASE(3, 8) AVX512_CASE(4, 8)
        default: return 0;
    }
}
#else
static int attend_item_fast(const Problem *p, int64_t item, float *scores) {
    (void)p, (void)item, (void)scores;
    return 0;
}
#endif

/* Returns 0 on success, 1 when memory ran out, 2 for an unsupported shape (more than 64 query
 * heads per KV head). Threads come from OpenMP: linked by soname, torch's own libgomp serves, so
 * this kernel shares torch's thread pool instead of competing with it. */
int paged_decode_attention_f32(const float *q, int64_t q_seq_stride, int64_t q_head_stride,
                               const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t block_table_stride,
                               const int32_t *context_lens, float *out, int64_t num_seqs,
                               int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                               float scale, int num_threads) {
    if (num_q_heads / num_kv_heads > 64) return 2;
    const Problem p = {q, q_seq_stride, q_head_stride, k_cache, v_cache, block_tables,
                       block_table_stride, context_lens, out, num_q_heads, num_kv_heads, head_dim,
                       block_size, scale};
    const int64_t items = num_seqs * num_kv_heads;
    const int G = num_q_heads / num_kv_heads;
    int max_ctx = 1;
    for (int64_t s = 0; s < num_seqs; s++) max_ctx = context_lens[s] > max_ctx ? context_lens[s] : max_ctx;
    if (num_threads < 1) num_threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (items > 1)
    {
        float *scores = (float *)malloc(sizeof(float) * ((size_t)G * max_ctx + (size_t)G * head_dim));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t it = 0; it < items; it++) {
            if (scores && !attend_item_fast(&p, it, scores))
                attend_item(&p, it, scores, scores + (size_t)G * max_ctx);
        }
        free(scores);
    }
    return failed;
}

/* ---- elementwise kernels: rows split over OpenMP threads when there is enough work ---- */

#define PARALLEL_MIN_FLOATS 65536

/* out = weight * (r / sqrt(mean(r^2) + eps)) with r = x + residual (written to residual_out) or,
 * when residual is NULL, r = x. Rows of x may be strided; every other array is contiguous. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *residual, const float *weight,
                  float *out, float *residual_out, int64_t rows, int64_t dim, float eps,
                  int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_FLOATS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *xr = x + t * x_stride;
        const float *r = xr;
        if (residual) {
            float *ro = residual_out + t * dim;
            const float *rr = residual + t * dim;
            for (int64_t d = 0; d < dim; d++) ro[d] = xr[d] + rr[d];
            r = ro;
        }
        float ss = 0.0f;
        for (int64_t d = 0; d < dim; d++) ss += r[d] * r[d];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *o = out + t * dim;
        for (int64_t d = 0; d < dim; d++) o[d] = weight[d] * (r[d] * inv);
    }
}

/* In place, for q (T, nq, D) and k (T, nk, D) with any token and head strides (head dim
 * contiguous): each head's halves x1, x2 become x1*cos - x2*sin and x2*cos + x1*sin, with
 * cos_sin (max_len, D) = [cos | sin] at the token's position. */
void rotary_f32(const int64_t *positions, float *q, int64_t q_tok_stride, int64_t q_head_stride,
                int nq, float *k, int64_t k_tok_stride, int64_t k_head_stride, int nk,
                const float *cos_sin, int64_t rows, int64_t dim, int num_threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * (nq + nk) * dim >= PARALLEL_MIN_FLOATS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_sin + positions[t] * dim;
        const float *sn = c + half;
        for (int h = 0; h < nq + nk; h++) {
            float *x = h < nq ? q + t * q_tok_stride + h * q_head_stride
                              : k + t * k_tok_stride + (h - nq) * k_head_stride;
            float *x2 = x + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x2[i];
                x[i] = a * c[i] - b * sn[i];
                x2[i] = b * c[i] + a * sn[i];
            }
        }
    }
}

/* x (T, 2I) rows [gate | up] (row stride x_stride) -> out (T, I) = silu(gate) * up. */
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t inter,
                      int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_FLOATS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = x + t * x_stride, *u = g + inter;
        float *o = out + t * inter;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= inter; i += 16) {
            const __m512 gv = _mm512_loadu_ps(g + i);
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* key/value (T, Hkv, D) rows (token strides given, heads and dims contiguous) into the caches'
 * flat slots (num_slots, Hkv, D); slot -1 skips the token. Returns the first out-of-range slot's
 * token + 1, or 0. */
int64_t store_kv_cache_f32(const float *key, int64_t key_stride, const float *value,
                           int64_t value_stride, float *k_cache, float *v_cache,
                           const int64_t *slot_mapping, int64_t rows, int64_t row_floats,
                           int64_t num_slots) {
    for (int64_t t = 0; t < rows; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        if (slot >= num_slots) return t + 1;
        memcpy(k_cache + slot * row_floats, key + t * key_stride, sizeof(float) * (size_t)row_floats);
        memcpy(v_cache + slot * row_floats, value + t * value_stride, sizeof(float) * (size_t)row_floats);
    }
    return 0;
}
