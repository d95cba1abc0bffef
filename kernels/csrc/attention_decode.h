/* Paged decode attention's bodies (attention.c's comment says what they compute and how), included by
 * the units that instantiate them: attention_decode_f32.c and attention_decode_bf16.c, one dtype each,
 * so that their specialisations (16 shapes of G and head dim a dtype, with AVX-512 or AVX2) compile in
 * parallel (each was about half of the library's build); attention.c's paged_decode_attention splits
 * the items over threads and calls them. */
#ifndef BATCHGEN_ATTENTION_DECODE_H
#define BATCHGEN_ATTENTION_DECODE_H

#include "kernels.h"

enum {
    L2_AHEAD = 2,                    /* blocks */
    STREAM_LEAD_BYTES = 128 << 10,   /* how far a thread's L2 stream runs ahead (2 AMX Xeon cores: 128-192 KiB best) */
};

typedef struct {
    const void *q;
    int64_t q_seq_stride, q_head_stride;
    const void *k_cache, *v_cache;
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *context_lens;
    void *out;
    int num_q_heads, num_kv_heads, head_dim, block_size;
    float scale;
} Problem;

/* A work item's sequence s and KV head h, context length, block table, the elements between
 * consecutive tokens of a block, and its G output rows of D (contiguous). */
typedef struct {
    int64_t s;
    int h, ctx;
    const int32_t *table;
    int64_t token_stride;
    void *out;
} Item;

ALWAYS_INLINE Item item_at(const Problem *p, int64_t item, int G, int D, const int dt) {
    const int hkv = p->num_kv_heads;
    const int64_t s = item / hkv;
    const int h = (int)(item % hkv);
    return (Item){s, h, p->context_lens[s], p->block_tables + s * p->block_table_stride, (int64_t)hkv * D,
                  elem_w(p->out, (s * p->num_q_heads + (int64_t)h * G) * D, dt)};
}

/* Any item, scalar (the specialised kernels below take the common shapes). */
ALWAYS_INLINE void attend_item(const Problem *p, int64_t item, float *scores, float *qs, const int dt) {
    const int G = p->num_q_heads / p->num_kv_heads;
    const int hkv = p->num_kv_heads, D = p->head_dim, B = p->block_size;
    const Item I = item_at(p, item, G, D, dt);
    const int64_t s = I.s, token_stride = I.token_stride;
    const int h = I.h, ctx = I.ctx;
    const int32_t *table = I.table;
    float *acc = qs + (size_t)G * D; /* G fp32 output rows */

    for (int g = 0; g < G; g++) { /* scaled copy of the G query rows, contiguous */
        const void *src = elem(p->q, s * p->q_seq_stride + (int64_t)(h * G + g) * p->q_head_stride, dt);
        for (int d = 0; d < D; d++) qs[g * D + d] = ld(src, d, dt) * p->scale;
    }
    /* pass 1: scores, block by block */
    for (int t0 = 0; t0 < ctx; t0 += B) {
        const int n = ctx - t0 < B ? ctx - t0 : B;
        const void *k = elem(p->k_cache, ((int64_t)table[t0 / B] * B * hkv + h) * D, dt);
        for (int i = 0; i < n; i++, k = elem(k, token_stride, dt)) {
            for (int g = 0; g < G; g++) {
                const float *qg = qs + g * D;
                float dot = 0.0f;
                for (int d = 0; d < D; d++) dot += qg[d] * ld(k, d, dt);
                scores[(int64_t)g * ctx + t0 + i] = dot;
            }
        }
    }
    /* pass 2: softmax numerators in place; accumulators start at zero */
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
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    /* pass 3: weighted sum of values */
    for (int t0 = 0; t0 < ctx; t0 += B) {
        const int n = ctx - t0 < B ? ctx - t0 : B;
        const void *v = elem(p->v_cache, ((int64_t)table[t0 / B] * B * hkv + h) * D, dt);
        for (int i = 0; i < n; i++, v = elem(v, token_stride, dt)) {
            for (int g = 0; g < G; g++) {
                const float w = scores[(int64_t)g * ctx + t0 + i];
                float *ag = acc + g * D;
                for (int d = 0; d < D; d++) ag[d] += w * ld(v, d, dt);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) st(I.out, g * D + d, acc[g * D + d] * inv_sum[g], dt);
}

#if HAVE_SIMD
/* Ask for the cache lines of n rows of row_bytes each, stride apart (a KV block's rows of one head). */
static inline void prefetch_rows(const void *base, int n, int64_t stride, int row_bytes) {
    const char *row = (const char *)base;
    for (int i = 0; i < n; i++, row += stride)
        for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
}

/* Ask for n contiguous bytes into L2 (a KV block's rows of every head). */
static inline void prefetch_bytes_l2(const void *base, int64_t n) {
    for (int64_t b = 0; b < n; b += 64) _mm_prefetch((const char *)base + b, _MM_HINT_T1);
}

/* A thread's L2 prefetch stream: the KV blocks (every head's rows) of its sequences, in the order it
 * first reads them (a sequence's K blocks, then its V blocks, then the next sequence), kept ahead of
 * the reads by a steady rate. A thread takes all KV heads of a sequence in a row, and the first head
 * brings the whole rows in; without the stream, no DRAM request went out while the later heads read
 * L2, and DRAM time added to compute time instead of overlapping it. The stream starts
 * STREAM_LEAD_BYTES ahead and then asks for D * dt_size(dt) / 64 lines with every key or value row a
 * head reads (stream_step), a sequence's worth per sequence, so the lead stays put. A sequence whose
 * first block is the previous one's (a shared prefix) streams only the blocks past what that one streamed. */
typedef struct {
    const Problem *p;
    int64_t seq, end_seq; /* the sequence being streamed; one past the thread's last */
    int kv, block, first_block, nblocks;
    int32_t prev_first;
    int prev_nblocks;
    int off; /* the stream switched off (batchgen_attention_stream): block_rows asks only for L1 */
    const char *line; /* the next line to ask for, in the block being streamed, and bytes left there */
    int64_t left;
} Stream;

static inline void stream_enter(Stream *st) {
    if (st->seq >= st->end_seq) return;
    const Problem *p = st->p;
    const int32_t *table = p->block_tables + st->seq * p->block_table_stride;
    st->nblocks = (p->context_lens[st->seq] + p->block_size - 1) / p->block_size;
    st->first_block = st->nblocks > 0 && st->prev_nblocks > 0 && table[0] == st->prev_first ? st->prev_nblocks - 1 : 0;
    st->block = st->first_block;
    st->kv = 0;
}

/* Ask for the stream's next n cache lines into L2: one or two at a time between the reads, not a block
 * in a burst (a burst of prefetches fills the line buffers and stalls the arithmetic behind it, so DRAM
 * time added to compute time instead of overlapping it). */
static inline void stream_lines(Stream *st, int n, int dt) {
    const Problem *p = st->p;
    const int B = p->block_size;
    const int64_t token_bytes = (int64_t)p->num_kv_heads * p->head_dim * dt_size(dt);
    while (n > 0) {
        if (st->left > 0) {
            _mm_prefetch(st->line, _MM_HINT_T1);
            st->line += 64;
            st->left -= 64;
            n--;
            continue;
        }
        if (st->seq >= st->end_seq) {
            st->off = 1; /* nothing left to stream: stream_step returns at once from here on */
            return;
        }
        if (st->block >= st->nblocks) {
            if (st->kv == 0 && st->nblocks > 0) {
                st->kv = 1;
                st->block = st->first_block;
            } else {
                if (st->nblocks > 0) {
                    st->prev_first = p->block_tables[st->seq * p->block_table_stride];
                    st->prev_nblocks = st->nblocks;
                }
                st->seq++;
                stream_enter(st);
            }
            continue;
        }
        const int ctx = p->context_lens[st->seq];
        const int32_t blk = p->block_tables[st->seq * p->block_table_stride + st->block];
        const int tokens = ctx - st->block * B < B ? ctx - st->block * B : B;
        st->line = (const char *)elem(st->kv ? p->v_cache : p->k_cache,
                                      (int64_t)blk * B * p->num_kv_heads * p->head_dim, dt);
        st->left = tokens * token_bytes;
        st->block++;
    }
}

/* The stream's share of one key's or value's read: n lines (the thread's K and V bytes over the reads it makes). */
ALWAYS_INLINE void stream_step(Stream *st, int n, const int dt) {
    if (st->off) return;
    if (st->left >= 64 * (int64_t)n) {
        for (int i = 0; i < n; i++) _mm_prefetch(st->line + 64 * i, _MM_HINT_T1);
        st->line += 64 * n;
        st->left -= 64 * (int64_t)n;
    } else {
        stream_lines(st, n, dt);
    }
}

static inline void stream_start(Stream *st, const Problem *p, int64_t first_seq, int64_t end_seq, int on, int dt) {
    *st = (Stream){p, first_seq, end_seq, 0, 0, 0, 0, -1, 0, !on, NULL, 0};
    if (first_seq >= end_seq || !on) return;
    stream_enter(st);
    stream_lines(st, STREAM_LEAD_BYTES / 64, dt);
}

/* The rows of KV head h in the cache block that holds token t0 (token_stride apart), after asking for
 * the next block's rows into L1, if the context goes on (blocks lie anywhere in the cache), and
 * moving the thread's L2 stream on. Where the stream has nothing (a sequence whose heads are split
 * between threads, as a lone long one is), head 0 asks for the whole rows L2_AHEAD blocks on. */
ALWAYS_INLINE const void *block_rows(Stream *st, const void *cache, const int32_t *table, int t0, int ctx, int B,
                                     int hkv, int h, int D, const int dt) {
    const int64_t token_bytes = (int64_t)hkv * D * dt_size(dt);
    const int ahead = t0 + L2_AHEAD * B;
    if (h == 0 && st->seq >= st->end_seq && ahead < ctx) /* a sequence the stream does not take */
        prefetch_bytes_l2(elem(cache, (int64_t)table[ahead / B] * B * hkv * D, dt),
                          (ctx - ahead < B ? ctx - ahead : B) * token_bytes);
    if (t0 + B < ctx)
        prefetch_rows(elem(cache, ((int64_t)table[t0 / B + 1] * B * hkv + h) * D, dt),
                      ctx - t0 - B < B ? ctx - t0 - B : B, token_bytes, D * (int)dt_size(dt));
    return elem(cache, ((int64_t)table[t0 / B] * B * hkv + h) * D, dt);
}

/* Ask for the rows of blocks [j0, j1) of work item `item` (none when it is -1) in cache (keys or
 * values), clipped to its context: the thread's next item, while it reads this one. */
ALWAYS_INLINE void prefetch_item_blocks(const Problem *p, const void *cache, int64_t item, int j0, int j1,
                                        const int dt) {
    if (item < 0) return;
    const int hkv = p->num_kv_heads, D = p->head_dim, B = p->block_size;
    const int64_t s = item / hkv;
    const int h = (int)(item % hkv), ctx = p->context_lens[s];
    const int32_t *table = p->block_tables + s * p->block_table_stride;
    for (int j = j0; j < j1 && j * B < ctx; j++)
        prefetch_rows(elem(cache, ((int64_t)table[j] * B * hkv + h) * D, dt), ctx - j * B < B ? ctx - j * B : B,
                      (int64_t)hkv * D * dt_size(dt), D * (int)dt_size(dt));
}
#endif

#if HAVE_AVX512
/* attend_item for G query heads per KV head and a head dim of 16*C (C even), both compile-time
 * after inlining, so the G*C query and accumulator vectors live in registers. Scores are made 16 keys at
 * a time: each key's G partial-product vectors go to dots, then one transposing reduction per query
 * head sums all 16 (sum16), a third of the work of 16 separate horizontal sums. While a block is
 * read, the next block's rows of this KV head are prefetched (blocks lie anywhere in the cache), and
 * the same block of the thread's next item. bf16 keys on a CPU with AVX512-BF16 multiply as raw
 * pairs (vdpbf16ps). */
ALWAYS_INLINE void attend_item_simd(const Problem *p, Stream *st, int64_t item, int64_t next, float *scores,
                                    const int G, const int C, const int dt) {
    const int hkv = p->num_kv_heads, D = 16 * C, B = p->block_size;
    const Item I = item_at(p, item, G, D, dt);
    const int64_t s = I.s, token_stride = I.token_stride;
    const int h = I.h, ctx = I.ctx;
    const int32_t *table = I.table;
    const int lps = D * (int)dt_size(dt) / 64 > 0 ? D * (int)dt_size(dt) / 64 : 1; /* stream lines a read */
    __m512 acc[8][8], dots[8][16];
    const __m512 scale = _mm512_set1_ps(p->scale);
#if defined(__AVX512BF16__)
    const int dp_bf16 = dt == BF16; /* keys and queries multiplied as raw bf16 pairs */
    __m512bh qb[8][4];
#endif
    __m512 qv[8][8];
    for (int g = 0; g < G; g++) {
        const void *src = elem(p->q, s * p->q_seq_stride + (int64_t)(h * G + g) * p->q_head_stride, dt);
#if defined(__AVX512BF16__)
        if (dp_bf16) {
            for (int c = 0; c < C / 2; c++) qb[g][c] = (__m512bh)_mm512_loadu_si512(elem(src, 32 * c, dt));
            continue;
        }
#endif
        for (int c = 0; c < C / 2; c++) vld2(src, 32 * c, &qv[g][2 * c], &qv[g][2 * c + 1], dt);
    }
    /* pass 1: scores */
    for (int t0 = 0; t0 < ctx; t0 += B) {
        const int n = ctx - t0 < B ? ctx - t0 : B;
        const void *k = block_rows(st, p->k_cache, table, t0, ctx, B, hkv, h, D, dt);
        prefetch_item_blocks(p, p->k_cache, next, t0 / B, t0 / B + 1, dt);
        for (int i0 = 0; i0 < n; i0 += 16) {
            const int m = n - i0 < 16 ? n - i0 : 16;
            for (int i = 0; i < m; i++, k = elem(k, token_stride, dt)) {
                stream_step(st, lps, dt);
#if defined(__AVX512BF16__)
                if (dp_bf16) {
                    __m512bh kb[4];
                    for (int c = 0; c < C / 2; c++) kb[c] = (__m512bh)_mm512_loadu_si512(elem(k, 32 * c, dt));
                    for (int g = 0; g < G; g++) {
                        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], kb[0]);
                        for (int c = 1; c < C / 2; c++) dot = _mm512_dpbf16_ps(dot, qb[g][c], kb[c]);
                        dots[g][i] = dot;
                    }
                    continue;
                }
#endif
                __m512 kc[8];
                for (int c = 0; c < C / 2; c++) vld2(k, 32 * c, &kc[2 * c], &kc[2 * c + 1], dt);
                for (int g = 0; g < G; g++) {
                    __m512 dot = _mm512_mul_ps(qv[g][0], kc[0]);
                    for (int c = 1; c < C; c++) dot = _mm512_fmadd_ps(qv[g][c], kc[c], dot);
                    dots[g][i] = dot;
                }
            }
            for (int g = 0; g < G; g++) {
                for (int i = m; i < 16; i++) dots[g][i] = _mm512_setzero_ps();
                _mm512_mask_storeu_ps(scores + (int64_t)g * ctx + t0 + i0, (__mmask16)((1u << m) - 1u),
                                      _mm512_mul_ps(sum16(dots[g]), scale));
            }
        }
    }
    prefetch_item_blocks(p, p->k_cache, next, (ctx + B - 1) / B, INT32_MAX, dt); /* its longer rest */
    /* pass 2: softmax numerators in place (16 at a time, a masked tail) */
    float inv_sum[8];
    for (int g = 0; g < G; g++) {
        float *row = scores + (int64_t)g * ctx;
        const __m512 m = _mm512_set1_ps(row_max_ps(row, ctx));
        int t;
        const __mmask16 tail = (__mmask16)((1u << (ctx % 16)) - 1u);
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
        const void *v = block_rows(st, p->v_cache, table, t0, ctx, B, hkv, h, D, dt);
        prefetch_item_blocks(p, p->v_cache, next, t0 / B, t0 / B + 1, dt);
        for (int i = 0; i < n; i++, v = elem(v, token_stride, dt)) {
            stream_step(st, lps, dt);
            __m512 vc[8];
            for (int c = 0; c < C / 2; c++) vld2(v, 32 * c, &vc[2 * c], &vc[2 * c + 1], dt);
            for (int g = 0; g < G; g++) {
                const __m512 w = _mm512_set1_ps(scores[(int64_t)g * ctx + t0 + i]);
                for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(w, vc[c], acc[g][c]);
            }
        }
    }
    prefetch_item_blocks(p, p->v_cache, next, (ctx + B - 1) / B, INT32_MAX, dt);
    for (int g = 0; g < G; g++) {
        const __m512 r = _mm512_set1_ps(inv_sum[g]);
        for (int c = 0; c < C / 2; c++)
            vst2(I.out, g * D + 32 * c, _mm512_mul_ps(acc[g][2 * c], r), _mm512_mul_ps(acc[g][2 * c + 1], r), dt);
    }
}

#elif HAVE_AVX2
/* attend_item for AVX2 machines: G query heads per KV head and a head dim of 8*C, compile-time after
 * inlining. Scores are made 8 keys at a time (each key loaded once for the G heads, one transposing
 * reduction, sum8, per head); the next block's rows are prefetched; the softmax's exponentials
 * are taken 8 at a time. */
ALWAYS_INLINE void attend_item_simd(const Problem *p, Stream *st, int64_t item, int64_t next, float *scores,
                                    const int G, const int C, const int dt) {
    const int hkv = p->num_kv_heads, D = 8 * C, B = p->block_size;
    const Item I = item_at(p, item, G, D, dt);
    const int64_t s = I.s, token_stride = I.token_stride;
    const int h = I.h, ctx = I.ctx;
    const int32_t *table = I.table;
    const int lps = D * (int)dt_size(dt) / 64 > 0 ? D * (int)dt_size(dt) / 64 : 1; /* stream lines a read */
    const __m256 scale = _mm256_set1_ps(p->scale);
    __m256 qv[8][16], dots[8][8], acc[8][16];
    for (int g = 0; g < G; g++) {
        const void *src = elem(p->q, s * p->q_seq_stride + (int64_t)(h * G + g) * p->q_head_stride, dt);
        for (int c = 0; c < C; c++) qv[g][c] = vld(src, 8 * c, dt);
    }
    /* pass 1: scores */
    for (int t0 = 0; t0 < ctx; t0 += B) {
        const int n = ctx - t0 < B ? ctx - t0 : B;
        const void *k = block_rows(st, p->k_cache, table, t0, ctx, B, hkv, h, D, dt);
        prefetch_item_blocks(p, p->k_cache, next, t0 / B, t0 / B + 1, dt);
        for (int i0 = 0; i0 < n; i0 += 8) {
            const int m = n - i0 < 8 ? n - i0 : 8;
            for (int i = 0; i < m; i++, k = elem(k, token_stride, dt)) {
                stream_step(st, lps, dt);
                __m256 kc[16];
                for (int c = 0; c < C; c++) kc[c] = vld(k, 8 * c, dt);
                for (int g = 0; g < G; g++) {
                    __m256 dot = _mm256_mul_ps(qv[g][0], kc[0]);
                    for (int c = 1; c < C; c++) dot = _mm256_fmadd_ps(qv[g][c], kc[c], dot);
                    dots[g][i] = dot;
                }
            }
            for (int g = 0; g < G; g++) {
                for (int i = m; i < 8; i++) dots[g][i] = _mm256_setzero_ps();
                const __m256 r = _mm256_mul_ps(sum8(dots[g]), scale);
                float *dst = scores + (int64_t)g * ctx + t0 + i0;
                if (m == 8) _mm256_storeu_ps(dst, r);
                else _mm256_maskstore_ps(dst, first_lanes(m), r);
            }
        }
    }
    prefetch_item_blocks(p, p->k_cache, next, (ctx + B - 1) / B, INT32_MAX, dt); /* its longer rest */
    /* pass 2: softmax numerators in place (8 at a time, the tail one by one) */
    float inv_sum[8];
    for (int g = 0; g < G; g++) {
        float *row = scores + (int64_t)g * ctx;
        __m256 mxv = _mm256_set1_ps(-INFINITY);
        int t = 0;
        for (; t + 8 <= ctx; t += 8) mxv = _mm256_max_ps(mxv, _mm256_loadu_ps(row + t));
        float mx = hmax256(mxv);
        for (; t < ctx; t++) mx = row[t] > mx ? row[t] : mx;
        const __m256 m = _mm256_set1_ps(mx);
        __m256 sumv = _mm256_setzero_ps();
        for (t = 0; t + 8 <= ctx; t += 8) {
            const __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(row + t), m));
            _mm256_storeu_ps(row + t, e);
            sumv = _mm256_add_ps(sumv, e);
        }
        float sum = hsum256(sumv);
        for (; t < ctx; t++) {
            row[t] = expf(row[t] - mx);
            sum += row[t];
        }
        inv_sum[g] = 1.0f / sum;
    }
    /* pass 3: weighted sum of values */
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) acc[g][c] = _mm256_setzero_ps();
    for (int t0 = 0; t0 < ctx; t0 += B) {
        const int n = ctx - t0 < B ? ctx - t0 : B;
        const void *v = block_rows(st, p->v_cache, table, t0, ctx, B, hkv, h, D, dt);
        prefetch_item_blocks(p, p->v_cache, next, t0 / B, t0 / B + 1, dt);
        for (int i = 0; i < n; i++, v = elem(v, token_stride, dt)) {
            stream_step(st, lps, dt);
            __m256 vc[16];
            for (int c = 0; c < C; c++) vc[c] = vld(v, 8 * c, dt);
            for (int g = 0; g < G; g++) {
                const __m256 w = _mm256_set1_ps(scores[(int64_t)g * ctx + t0 + i]);
                for (int c = 0; c < C; c++) acc[g][c] = _mm256_fmadd_ps(w, vc[c], acc[g][c]);
            }
        }
    }
    prefetch_item_blocks(p, p->v_cache, next, (ctx + B - 1) / B, INT32_MAX, dt);
    for (int g = 0; g < G; g++) {
        const __m256 r = _mm256_set1_ps(inv_sum[g]);
        for (int c = 0; c < C; c++) vst(I.out, g * D + 8 * c, _mm256_mul_ps(acc[g][c], r), dt);
    }
}
#endif

#if HAVE_SIMD
/* 1 when a specialised kernel took the item (G <= 8 query heads a KV head, head dim 32, 64 or 128;
 * G and head dim compile-time in each case), 0 when the generic one must. */
ALWAYS_INLINE int attend_item_fast(const Problem *p, Stream *st, int64_t item, int64_t next, float *scores,
                                   const int dt) {
    const int G = p->num_q_heads / p->num_kv_heads;
    if (p->head_dim % VW) return 0;
    switch (G * 256 + p->head_dim / VW) {
    case 1 * 256 + 32 / VW: attend_item_simd(p, st, item, next, scores, 1, 32 / VW, dt); return 1;
    case 2 * 256 + 32 / VW: attend_item_simd(p, st, item, next, scores, 2, 32 / VW, dt); return 1;
    case 3 * 256 + 32 / VW: attend_item_simd(p, st, item, next, scores, 3, 32 / VW, dt); return 1;
    case 4 * 256 + 32 / VW: attend_item_simd(p, st, item, next, scores, 4, 32 / VW, dt); return 1;
    case 1 * 256 + 64 / VW: attend_item_simd(p, st, item, next, scores, 1, 64 / VW, dt); return 1;
    case 2 * 256 + 64 / VW: attend_item_simd(p, st, item, next, scores, 2, 64 / VW, dt); return 1;
    case 3 * 256 + 64 / VW: attend_item_simd(p, st, item, next, scores, 3, 64 / VW, dt); return 1;
    case 4 * 256 + 64 / VW: attend_item_simd(p, st, item, next, scores, 4, 64 / VW, dt); return 1;
    case 5 * 256 + 64 / VW: attend_item_simd(p, st, item, next, scores, 5, 64 / VW, dt); return 1;
    case 6 * 256 + 64 / VW: attend_item_simd(p, st, item, next, scores, 6, 64 / VW, dt); return 1;
    case 7 * 256 + 64 / VW: attend_item_simd(p, st, item, next, scores, 7, 64 / VW, dt); return 1;
    case 8 * 256 + 64 / VW: attend_item_simd(p, st, item, next, scores, 8, 64 / VW, dt); return 1;
    case 1 * 256 + 128 / VW: attend_item_simd(p, st, item, next, scores, 1, 128 / VW, dt); return 1;
    case 2 * 256 + 128 / VW: attend_item_simd(p, st, item, next, scores, 2, 128 / VW, dt); return 1;
    case 3 * 256 + 128 / VW: attend_item_simd(p, st, item, next, scores, 3, 128 / VW, dt); return 1;
    case 4 * 256 + 128 / VW: attend_item_simd(p, st, item, next, scores, 4, 128 / VW, dt); return 1;
    default: return 0;
    }
}
#endif

/* One thread's work items [lo, hi) of paged_decode_attention, its L2 stream over the sequences whose
 * every head is its own (whole rows serve only those). */
ALWAYS_INLINE void decode_thread(const Problem *p, int64_t lo, int64_t hi, float *scores, int max_ctx,
                                 int use_stream, const int dt) {
    const int G = p->num_q_heads / p->num_kv_heads, hkv = p->num_kv_heads;
#if HAVE_SIMD
    Stream st;
    stream_start(&st, p, (lo + hkv - 1) / hkv, hi / hkv, use_stream, dt);
#else
    (void)use_stream, (void)hkv;
#endif
    for (int64_t it = lo; it < hi && scores; it++) {
#if HAVE_SIMD
        if (attend_item_fast(p, &st, it, it + 1 < hi ? it + 1 : -1, scores, dt)) continue;
#endif
        attend_item(p, it, scores, scores + (size_t)G * max_ctx, dt);
    }
}

/* One thread's work items [lo, hi) of paged_decode_attention, in the dtype of each unit's name
 * (scores: the thread's G x max_ctx scores, then the generic kernel's 2 x G x D floats) */
INTERNAL void decode_items_f32(const Problem *p, int64_t lo, int64_t hi, float *scores, int max_ctx, int use_stream);
INTERNAL void decode_items_bf16(const Problem *p, int64_t lo, int64_t hi, float *scores, int max_ctx,
                                int use_stream);

#endif /* BATCHGEN_ATTENTION_DECODE_H */
