/* The typed kernels, included once per storage type by cpu_kernels.c with these defined:
 *   T            the element type in memory (float, or uint16_t holding bf16 bits)
 *   SFX          the name suffix (f32, bf16): paged_decode_attention_SFX, ...
 *   LD(p)        *p as a float;            ST(p, x)     *p = x rounded to T
 *   VLD(p)       16 elements as a __m512;  VST(p, v)    16 floats rounded to T
 *   VLDM(m, p)   masked load (0 elsewhere); VSTM(p, m, v) masked store
 *   VROUND(v)    v rounded to T and back (identity for f32)
 *   VLD2(p, a, b) 32 elements as two __m512 in "pair order"; VST2(p, a, b) stores them back. The
 *                order is what converts fastest (bf16: evens, then odds; f32: as in memory), and
 *                dot products and element-wise sums do not care which it is.
 *   DP_BF16      1 where keys are bf16 and the CPU has vdpbf16ps, which multiplies raw bf16 pairs
 * Arithmetic is fp32 throughout; only loads and stores know T. VLD/VST/VROUND take VW lanes (16 with
 * AVX-512, 8 with AVX2; vf, VADD, ... in cpu_kernels.c); VLD2/VST2 and DP_BF16 exist with AVX-512.
 */

#define FN(name) CAT(name, SFX)
#define PROBLEM FN(Problem)

typedef struct {
    const T *q;
    int64_t q_seq_stride, q_head_stride;
    const T *k_cache, *v_cache;
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *context_lens;
    T *out;
    int num_q_heads, num_kv_heads, head_dim, block_size;
    float scale;
} PROBLEM;

/* A work item's locals: its sequence s and KV head h, context length, block table, the elements
 * between consecutive tokens of a block, and its G output rows (contiguous); G defined before. */
#define ITEM_LOCALS(D_)                                                         \
    const int hkv = p->num_kv_heads, D = (D_), B = p->block_size;               \
    const int64_t s = item / hkv;                                               \
    const int h = (int)(item % hkv);                                            \
    const int ctx = p->context_lens[s];                                         \
    const int32_t *table = p->block_tables + s * p->block_table_stride;         \
    const int64_t token_stride = (int64_t)hkv * D;                              \
    T *out = p->out + (s * p->num_q_heads + (int64_t)h * G) * D;

static void FN(attend_item)(const PROBLEM *p, int64_t item, float *scores, float *qs) {
    const int G = p->num_q_heads / p->num_kv_heads;
    ITEM_LOCALS(p->head_dim)
    float *acc = qs + (size_t)G * D;                                /* G fp32 output rows */

    for (int g = 0; g < G; g++) { /* scaled copy of the G query rows, contiguous */
        const T *src = p->q + s * p->q_seq_stride + (int64_t)(h * G + g) * p->q_head_stride;
        for (int d = 0; d < D; d++) qs[g * D + d] = LD(src + d) * p->scale;
    }
    /* pass 1: scores, block by block */
    for (int t0 = 0; t0 < ctx; t0 += B) {
        const int n = ctx - t0 < B ? ctx - t0 : B;
        const T *k = p->k_cache + ((int64_t)table[t0 / B] * B * hkv + h) * D;
        for (int i = 0; i < n; i++, k += token_stride) {
            for (int g = 0; g < G; g++) {
                const float *qg = qs + g * D;
                float dot = 0.0f;
                for (int d = 0; d < D; d++) dot += qg[d] * LD(k + d);
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
        const T *v = p->v_cache + ((int64_t)table[t0 / B] * B * hkv + h) * D;
        for (int i = 0; i < n; i++, v += token_stride) {
            for (int g = 0; g < G; g++) {
                const float w = scores[(int64_t)g * ctx + t0 + i];
                float *ag = acc + g * D;
                for (int d = 0; d < D; d++) ag[d] += w * LD(v + d);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) ST(out + g * D + d, acc[g * D + d] * inv_sum[g]);
}

#if HAVE_SIMD
/* A thread's L2 prefetch stream: the KV blocks (every head's rows) of its sequences, in the order it
 * first reads them (a sequence's K blocks, then its V blocks, then the next sequence), kept ahead of
 * the reads by a steady rate. A thread takes all KV heads of a sequence in a row, and the first head
 * brings the whole rows in; without the stream, no DRAM request went out while the later heads read
 * L2, and DRAM time added to compute time instead of overlapping it. The stream starts
 * STREAM_LEAD_BYTES ahead and then asks for D * sizeof(T) / 64 lines with every key or value row a
 * head reads (stream_step), a sequence's worth per sequence, so the lead stays put. A sequence whose
 * first block is the previous one's (a shared prefix) streams only the blocks past what that one streamed. */
typedef struct {
    const PROBLEM *p;
    int64_t seq, end_seq; /* the sequence being streamed; one past the thread's last */
    int kv, block, first_block, nblocks;
    int32_t prev_first;
    int prev_nblocks;
    int off; /* the stream switched off (batchgen_attention_stream): block_rows asks only for L1 */
    const char *line; /* the next line to ask for, in the block being streamed, and bytes left there */
    int64_t left;
} FN(Stream);

static void FN(stream_enter)(FN(Stream) *st) {
    if (st->seq >= st->end_seq) return;
    const PROBLEM *p = st->p;
    const int32_t *table = p->block_tables + st->seq * p->block_table_stride;
    st->nblocks = (p->context_lens[st->seq] + p->block_size - 1) / p->block_size;
    st->first_block = st->nblocks > 0 && st->prev_nblocks > 0 && table[0] == st->prev_first ? st->prev_nblocks - 1 : 0;
    st->block = st->first_block;
    st->kv = 0;
}

/* Ask for the stream's next n cache lines into L2: one or two at a time between the reads, not a block
 * in a burst (a burst of prefetches fills the line buffers and stalls the arithmetic behind it, so DRAM
 * time added to compute time instead of overlapping it). */
static void FN(stream_lines)(FN(Stream) *st, int n) {
    const PROBLEM *p = st->p;
    const int B = p->block_size;
    const int64_t token_bytes = (int64_t)p->num_kv_heads * p->head_dim * (int64_t)sizeof(T);
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
                FN(stream_enter)(st);
            }
            continue;
        }
        const int ctx = p->context_lens[st->seq];
        const int32_t blk = p->block_tables[st->seq * p->block_table_stride + st->block];
        const int tokens = ctx - st->block * B < B ? ctx - st->block * B : B;
        st->line = (const char *)((st->kv ? p->v_cache : p->k_cache) + (int64_t)blk * B * p->num_kv_heads * p->head_dim);
        st->left = tokens * token_bytes;
        st->block++;
    }
}

/* The stream's share of one key's or value's read: n lines (the thread's K and V bytes over the reads it makes). */
static inline __attribute__((always_inline)) void FN(stream_step)(FN(Stream) *st, int n) {
    if (st->off) return;
    if (st->left >= 64 * (int64_t)n) {
        for (int i = 0; i < n; i++) _mm_prefetch(st->line + 64 * i, _MM_HINT_T1);
        st->line += 64 * n;
        st->left -= 64 * (int64_t)n;
    } else {
        FN(stream_lines)(st, n);
    }
}

static void FN(stream_start)(FN(Stream) *st, const PROBLEM *p, int64_t first_seq, int64_t end_seq, int on) {
    *st = (FN(Stream)){p, first_seq, end_seq, 0, 0, 0, 0, -1, 0, !on, NULL, 0};
    if (first_seq >= end_seq || !on) return;
    FN(stream_enter)(st);
    FN(stream_lines)(st, STREAM_LEAD_BYTES / 64);
}

/* The rows of KV head h in the cache block that holds token t0 (token_stride apart), after asking for
 * the next block's rows into L1, if the context goes on (blocks lie anywhere in the cache), and
 * moving the thread's L2 stream on. Where the stream has nothing (a sequence whose heads are split
 * between threads, as a lone long one is), head 0 asks for the whole rows L2_AHEAD blocks on. */
static inline const T *FN(block_rows)(FN(Stream) *st, const T *cache, const int32_t *table, int t0, int ctx,
                                      int B, int hkv, int h, int D) {
    const int64_t token_bytes = (int64_t)hkv * D * (int64_t)sizeof(T);
    const int ahead = t0 + L2_AHEAD * B;
    if (h == 0 && st->seq >= st->end_seq && ahead < ctx) /* a sequence the stream does not take */
        prefetch_bytes_l2(cache + (int64_t)table[ahead / B] * B * hkv * D, (ctx - ahead < B ? ctx - ahead : B) * token_bytes);
    if (t0 + B < ctx)
        prefetch_rows(cache + ((int64_t)table[t0 / B + 1] * B * hkv + h) * D, ctx - t0 - B < B ? ctx - t0 - B : B,
                      token_bytes, D * (int)sizeof(T));
    return cache + ((int64_t)table[t0 / B] * B * hkv + h) * D;
}

/* Ask for the rows of blocks [j0, j1) of work item `item` (none when it is -1) in cache (keys or
 * values), clipped to its context: the thread's next item, while it reads this one. */
static inline void FN(prefetch_item_blocks)(const PROBLEM *p, const T *cache, int64_t item, int j0, int j1) {
    if (item < 0) return;
    const int hkv = p->num_kv_heads, D = p->head_dim, B = p->block_size;
    const int64_t s = item / hkv;
    const int h = (int)(item % hkv), ctx = p->context_lens[s];
    const int32_t *table = p->block_tables + s * p->block_table_stride;
    for (int j = j0; j < j1 && j * B < ctx; j++)
        prefetch_rows(cache + ((int64_t)table[j] * B * hkv + h) * D, ctx - j * B < B ? ctx - j * B : B,
                      (int64_t)hkv * D * (int64_t)sizeof(T), D * (int)sizeof(T));
}
#endif

#if HAVE_AVX512
/* attend_item for G query heads per KV head and a head dim of 16*C (C even), both compile-time
 * after inlining, so the G*C query and accumulator vectors live in registers. Scores are made 16 keys at
 * a time: each key's G partial-product vectors go to dots, then one transposing reduction per query
 * head sums all 16 (sum16), a third of the work of 16 separate horizontal sums. While a block is
 * read, the next block's rows of this KV head are prefetched (blocks lie anywhere in the cache), and
 * the same block of the thread's next item. */
static inline __attribute__((always_inline)) void FN(attend_item_avx512)(const PROBLEM *p, FN(Stream) *st,
                                                                         int64_t item, int64_t next, float *scores,
                                                                         const int G, const int C) {
    ITEM_LOCALS(16 * C)
    const int lps = D * (int)sizeof(T) / 64 > 0 ? D * (int)sizeof(T) / 64 : 1; /* stream lines a read */
    __m512 acc[8][8], dots[8][16];
    const __m512 scale = _mm512_set1_ps(p->scale);
#if DP_BF16
    __m512bh qb[8][4]; /* raw bf16 query pairs */
    for (int g = 0; g < G; g++) {
        const T *src = p->q + s * p->q_seq_stride + (int64_t)(h * G + g) * p->q_head_stride;
        for (int c = 0; c < C / 2; c++) qb[g][c] = (__m512bh)_mm512_loadu_si512(src + 32 * c);
    }
#else
    __m512 qv[8][8];
    for (int g = 0; g < G; g++) {
        const T *src = p->q + s * p->q_seq_stride + (int64_t)(h * G + g) * p->q_head_stride;
        for (int c = 0; c < C / 2; c++) VLD2(src + 32 * c, qv[g][2 * c], qv[g][2 * c + 1]);
    }
#endif
    /* pass 1: scores */
    for (int t0 = 0; t0 < ctx; t0 += B) {
        const int n = ctx - t0 < B ? ctx - t0 : B;
        const T *k = FN(block_rows)(st, p->k_cache, table, t0, ctx, B, hkv, h, D);
        FN(prefetch_item_blocks)(p, p->k_cache, next, t0 / B, t0 / B + 1);
        for (int i0 = 0; i0 < n; i0 += 16) {
            const int m = n - i0 < 16 ? n - i0 : 16;
            for (int i = 0; i < m; i++, k += token_stride) {
                FN(stream_step)(st, lps);
#if DP_BF16
                __m512bh kb[4];
                for (int c = 0; c < C / 2; c++) kb[c] = (__m512bh)_mm512_loadu_si512(k + 32 * c);
                for (int g = 0; g < G; g++) {
                    __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], kb[0]);
                    for (int c = 1; c < C / 2; c++) dot = _mm512_dpbf16_ps(dot, qb[g][c], kb[c]);
                    dots[g][i] = dot;
                }
#else
                __m512 kc[8];
                for (int c = 0; c < C / 2; c++) VLD2(k + 32 * c, kc[2 * c], kc[2 * c + 1]);
                for (int g = 0; g < G; g++) {
                    __m512 dot = _mm512_mul_ps(qv[g][0], kc[0]);
                    for (int c = 1; c < C; c++) dot = _mm512_fmadd_ps(qv[g][c], kc[c], dot);
                    dots[g][i] = dot;
                }
#endif
            }
            for (int g = 0; g < G; g++) {
                for (int i = m; i < 16; i++) dots[g][i] = _mm512_setzero_ps();
                _mm512_mask_storeu_ps(scores + (int64_t)g * ctx + t0 + i0, (__mmask16)((1u << m) - 1u),
                                      _mm512_mul_ps(sum16(dots[g]), scale));
            }
        }
    }
    FN(prefetch_item_blocks)(p, p->k_cache, next, (ctx + B - 1) / B, INT32_MAX); /* its longer rest */
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
        const T *v = FN(block_rows)(st, p->v_cache, table, t0, ctx, B, hkv, h, D);
        FN(prefetch_item_blocks)(p, p->v_cache, next, t0 / B, t0 / B + 1);
        for (int i = 0; i < n; i++, v += token_stride) {
            FN(stream_step)(st, lps);
            __m512 vc[8];
            for (int c = 0; c < C / 2; c++) VLD2(v + 32 * c, vc[2 * c], vc[2 * c + 1]);
            for (int g = 0; g < G; g++) {
                const __m512 w = _mm512_set1_ps(scores[(int64_t)g * ctx + t0 + i]);
                for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(w, vc[c], acc[g][c]);
            }
        }
    }
    FN(prefetch_item_blocks)(p, p->v_cache, next, (ctx + B - 1) / B, INT32_MAX);
    for (int g = 0; g < G; g++) {
        const __m512 r = _mm512_set1_ps(inv_sum[g]);
        for (int c = 0; c < C / 2; c++)
            VST2(out + g * D + 32 * c, _mm512_mul_ps(acc[g][2 * c], r), _mm512_mul_ps(acc[g][2 * c + 1], r));
    }
}

#elif HAVE_AVX2
/* attend_item for AVX2 machines: G query heads per KV head and a head dim of 8*C, compile-time after
 * inlining. Scores are made 8 keys at a time (each key loaded once for the G heads, one transposing
 * reduction, sum8, per head); the next block's rows are prefetched; the softmax's exponentials
 * are taken 8 at a time. */
static inline __attribute__((always_inline)) void FN(attend_item_avx2)(const PROBLEM *p, FN(Stream) *st,
                                                                       int64_t item, int64_t next, float *scores,
                                                                       const int G, const int C) {
    ITEM_LOCALS(8 * C)
    const int lps = D * (int)sizeof(T) / 64 > 0 ? D * (int)sizeof(T) / 64 : 1; /* stream lines a read */
    const __m256 scale = _mm256_set1_ps(p->scale);
    __m256 qv[8][16], dots[8][8], acc[8][16];
    for (int g = 0; g < G; g++) {
        const T *src = p->q + s * p->q_seq_stride + (int64_t)(h * G + g) * p->q_head_stride;
        for (int c = 0; c < C; c++) qv[g][c] = VLD(src + 8 * c);
    }
    /* pass 1: scores */
    for (int t0 = 0; t0 < ctx; t0 += B) {
        const int n = ctx - t0 < B ? ctx - t0 : B;
        const T *k = FN(block_rows)(st, p->k_cache, table, t0, ctx, B, hkv, h, D);
        FN(prefetch_item_blocks)(p, p->k_cache, next, t0 / B, t0 / B + 1);
        for (int i0 = 0; i0 < n; i0 += 8) {
            const int m = n - i0 < 8 ? n - i0 : 8;
            for (int i = 0; i < m; i++, k += token_stride) {
                FN(stream_step)(st, lps);
                __m256 kc[16];
                for (int c = 0; c < C; c++) kc[c] = VLD(k + 8 * c);
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
    FN(prefetch_item_blocks)(p, p->k_cache, next, (ctx + B - 1) / B, INT32_MAX); /* its longer rest */
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
        const T *v = FN(block_rows)(st, p->v_cache, table, t0, ctx, B, hkv, h, D);
        FN(prefetch_item_blocks)(p, p->v_cache, next, t0 / B, t0 / B + 1);
        for (int i = 0; i < n; i++, v += token_stride) {
            FN(stream_step)(st, lps);
            __m256 vc[16];
            for (int c = 0; c < C; c++) vc[c] = VLD(v + 8 * c);
            for (int g = 0; g < G; g++) {
                const __m256 w = _mm256_set1_ps(scores[(int64_t)g * ctx + t0 + i]);
                for (int c = 0; c < C; c++) acc[g][c] = _mm256_fmadd_ps(w, vc[c], acc[g][c]);
            }
        }
    }
    FN(prefetch_item_blocks)(p, p->v_cache, next, (ctx + B - 1) / B, INT32_MAX);
    for (int g = 0; g < G; g++) {
        const __m256 r = _mm256_set1_ps(inv_sum[g]);
        for (int c = 0; c < C; c++) VST(out + g * D + 8 * c, _mm256_mul_ps(acc[g][c], r));
    }
}

#endif

#if HAVE_SIMD
#if HAVE_AVX512
#define ATTEND_SIMD FN(attend_item_avx512)
#else
#define ATTEND_SIMD FN(attend_item_avx2)
#endif
#define SIMD_CASE(G_, D_) \
    case (G_) * 256 + (D_) / VW: \
        ATTEND_SIMD(p, st, item, next, scores, G_, (D_) / VW); \
        return 1;

/* 1 when a specialised kernel took the item, 0 when the generic one must. */
static int FN(attend_item_fast)(const PROBLEM *p, FN(Stream) *st, int64_t item, int64_t next, float *scores) {
    const int G = p->num_q_heads / p->num_kv_heads;
    if (p->head_dim % VW) return 0;
    switch (G * 256 + p->head_dim / VW) {
        SIMD_CASE(1, 32) SIMD_CASE(2, 32) SIMD_CASE(3, 32) SIMD_CASE(4, 32)
        SIMD_CASE(1, 64) SIMD_CASE(2, 64) SIMD_CASE(3, 64) SIMD_CASE(4, 64)
        SIMD_CASE(5, 64) SIMD_CASE(6, 64) SIMD_CASE(7, 64) SIMD_CASE(8, 64)
        SIMD_CASE(1, 128) SIMD_CASE(2, 128) SIMD_CASE(3, 128) SIMD_CASE(4, 128)
        default: return 0;
    }
}
#undef SIMD_CASE
#undef ATTEND_SIMD
#else
static int FN(attend_item_fast)(const PROBLEM *p, void *st, int64_t item, int64_t next, float *scores) {
    (void)p, (void)st, (void)item, (void)next, (void)scores;
    return 0;
}
#endif

/* Returns 0 on success, 1 when memory ran out, 2 for an unsupported shape (more than 64 query
 * heads per KV head). Threads come from OpenMP: linked by soname, torch's own libgomp serves, so
 * this kernel shares torch's thread pool instead of competing with it. */
int FN(paged_decode_attention)(const T *q, int64_t q_seq_stride, int64_t q_head_stride,
                               const T *k_cache, const T *v_cache, const int32_t *block_tables,
                               int64_t block_table_stride, const int32_t *context_lens, T *out,
                               int64_t num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                               int block_size, float scale, int num_threads) {
    if (num_q_heads / num_kv_heads > 64) return 2;
    const PROBLEM p = {q, q_seq_stride, q_head_stride, k_cache, v_cache, block_tables,
                       block_table_stride, context_lens, out, num_q_heads, num_kv_heads, head_dim,
                       block_size, scale};
    const int64_t items = num_seqs * num_kv_heads;
    const int G = num_q_heads / num_kv_heads;
    int max_ctx = 1;
    for (int64_t s = 0; s < num_seqs; s++) max_ctx = context_lens[s] > max_ctx ? context_lens[s] : max_ctx;
    if (num_threads < 1) num_threads = 1;
    int failed = 0;
#if HAVE_SIMD
    const int use_stream = attention_stream_on();
#endif
#pragma omp parallel num_threads(num_threads) if (items > 1)
    {
        /* scores (G x max_ctx), then the generic kernel's queries and accumulators (2 x G x D) */
        float *scores = (float *)malloc(sizeof(float) * ((size_t)G * max_ctx + 2 * (size_t)G * head_dim));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
        int tid = 0, nth = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        nth = omp_get_num_threads();
#endif
        const int64_t lo = first_item_of(context_lens, num_kv_heads, items, tid, nth);
        const int64_t hi = first_item_of(context_lens, num_kv_heads, items, tid + 1, nth);
#if HAVE_SIMD
        FN(Stream) stream, *st = &stream;
        /* streamed: the sequences whose every head is this thread's (whole rows serve only those) */
        FN(stream_start)(st, &p, (lo + num_kv_heads - 1) / num_kv_heads, hi / num_kv_heads, use_stream);
#else
        void *st = NULL;
#endif
        for (int64_t it = lo; it < hi && scores; it++) {
            if (!FN(attend_item_fast)(&p, st, it, it + 1 < hi ? it + 1 : -1, scores))
                FN(attend_item)(&p, it, scores, scores + (size_t)G * max_ctx);
        }
        free(scores);
    }
    return failed;
}

/* paged_prefill_attention's work item and its AMX form (the function's own comment, below, says how). */
#define PREFILL_TILE 16
#if HAVE_AVX512 && DP_BF16
/* Keys t0 .. t0 + n - 1 (n <= 16; zeros past n) of KV head h, dims 32c .. 32c + 31, transposed into
 * kt[0 .. 15]: kt[m] holds dim pair 16c + m of the 16 keys, one key a 32-bit lane. That is a row of
 * a bf16 dot product's right-hand side in pairs (vdpbf16ps), and 16 of them are an AMX B tile. */
static inline __attribute__((always_inline)) void FN(keys16_pairs)(const T *k_cache, const int32_t *table, int B,
                                                                   int64_t token_stride, int h, int D, int t0,
                                                                   int n, int c, __m512i *kt) {
    __m512i r[16], a[16], b[16];
    for (int i = 0; i < 16; i++) {
        const int t = t0 + i;
        r[i] = i < n ? _mm512_loadu_si512(k_cache + ((int64_t)table[t / B] * B + t % B) * token_stride
                                          + (int64_t)h * D + 32 * c)
                     : _mm512_setzero_si512();
    }
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int e = 0; e < 4; e++) { /* column 4L + e: dim pair 16c + 4L + e */
        const __m512i c0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44);
        const __m512i c1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xEE);
        const __m512i d0 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44);
        const __m512i d1 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xEE);
        kt[e] = _mm512_shuffle_i32x4(c0, d0, 0x88);
        kt[4 + e] = _mm512_shuffle_i32x4(c0, d0, 0xDD);
        kt[8 + e] = _mm512_shuffle_i32x4(c1, d1, 0x88);
        kt[12 + e] = _mm512_shuffle_i32x4(c1, d1, 0xDD);
    }
}

/* One work item of paged_prefill_attention: query tokens i0 .. i0 + nr - 1 of sequence s (at positions
 * first ..), KV head h; NP = D / 32, compile-time after inlining, so every accumulator is a register.
 * scores and probs hold RG + 8 rows of ctx_pad; rows past the tile's are scratch (their results are
 * dropped), which keeps the register blocks whole. */
static inline __attribute__((always_inline)) void FN(prefill_tile_dp)(
    const T *q, int64_t q_tok_stride, int64_t q_head_stride, const T *k_cache, const T *v_cache,
    const int32_t *table, int64_t q0, int first, int nr, int h, int G, int hkv, int B, int num_q_heads,
    float scale, T *out, float *scores, uint16_t *probs, int ctx_pad, __m512i *kt, const int NP) {
    const int D = 32 * NP, rows = nr * G, cmax = first + nr;
    const int64_t token_stride = (int64_t)hkv * D;
    enum { RB = 4 };                          /* pass 1 rows per register block */
    const int GROUP = 24 / (2 * NP) > 0 ? 24 / (2 * NP) : 1; /* pass 3 rows per register block */
    const T *qrow[8 * PREFILL_TILE + 24];
    for (int r = 0; r < rows + 24; r++) {
        const int rr = r < rows ? r : rows - 1;
        qrow[r] = q + (q0 + rr / G) * q_tok_stride + (int64_t)(h * G + rr % G) * q_head_stride;
    }
    /* pass 1 */
    for (int t0 = 0; t0 < cmax; t0 += 16) {
        const int n = cmax - t0 < 16 ? cmax - t0 : 16;
        for (int c = 0; c < NP; c++) FN(keys16_pairs)(k_cache, table, B, token_stride, h, D, t0, n, c, kt + 16 * c);
        const __m512 sc = _mm512_set1_ps(scale);
        for (int r0 = 0; r0 < rows; r0 += RB) {
            __m512 acc[RB];
            const int32_t *qp[RB];
            for (int x = 0; x < RB; x++) acc[x] = _mm512_setzero_ps(), qp[x] = (const int32_t *)qrow[r0 + x];
            for (int j = 0; j < 16 * NP; j++) {
                const __m512bh k = (__m512bh)kt[j];
                for (int x = 0; x < RB; x++)
                    acc[x] = _mm512_dpbf16_ps(acc[x], k, (__m512bh)_mm512_set1_epi32(qp[x][j]));
            }
            for (int x = 0; x < RB; x++)
                _mm512_storeu_ps(scores + (int64_t)(r0 + x) * ctx_pad + t0, _mm512_mul_ps(acc[x], sc));
        }
    }
    /* pass 2: row i * G + g sees keys 0 .. first + i */
    float inv_sum[8 * PREFILL_TILE + 24];
    const int cpairs = (cmax + 1) / 2 * 2;
    for (int r = 0; r < rows; r++) {
        const int len = first + r / G + 1;
        float *row = scores + (int64_t)r * ctx_pad;
        uint16_t *pr = probs + (int64_t)r * ctx_pad;
        const __m512 mv = _mm512_set1_ps(row_max_ps(row, len));
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < cpairs; t += 16) {
            const int valid = len - t < 0 ? 0 : len - t > 16 ? 16 : len - t;
            const __mmask16 k = (__mmask16)((1u << valid) - 1u);
            const __m512 e = _mm512_maskz_mov_ps(k, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + t), mv)));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)(pr + t), (__m256i)_mm512_cvtneps_pbh(e));
        }
        inv_sum[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* pass 3: two values at a time as (v_t, v_t+1) pairs */
    const __m512i idx_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i idx_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int r0 = 0; r0 < rows; r0 += GROUP) {
        __m512 acc[24];
        const uint16_t *pp[24];
        for (int x = 0; x < GROUP; x++) {
            pp[x] = probs + (int64_t)(r0 + x) * ctx_pad;
            for (int c = 0; c < 2 * NP; c++) acc[x * 2 * NP + c] = _mm512_setzero_ps();
        }
        for (int t = 0; t < cmax; t += 2) {
            const T *v0 = v_cache + ((int64_t)table[t / B] * B + t % B) * token_stride + (int64_t)h * D;
            const int two = t + 1 < cmax;
            __m512i vp[16];
            for (int c = 0; c < NP; c++) {
                const __m512i va = _mm512_loadu_si512(v0 + 32 * c);
                const __m512i vb = two ? _mm512_loadu_si512(v0 + token_stride + 32 * c) : _mm512_setzero_si512();
                vp[2 * c] = _mm512_unpacklo_epi16(va, vb);
                vp[2 * c + 1] = _mm512_unpackhi_epi16(va, vb);
            }
            for (int x = 0; x < GROUP; x++) {
                int32_t pair;
                memcpy(&pair, pp[x] + t, sizeof pair);
                const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
                for (int c = 0; c < 2 * NP; c++)
                    acc[x * 2 * NP + c] = _mm512_dpbf16_ps(acc[x * 2 * NP + c], (__m512bh)vp[c], pb);
            }
        }
        for (int x = 0; x < GROUP && r0 + x < rows; x++) {
            const int r = r0 + x;
            T *o = out + ((q0 + r / G) * (int64_t)num_q_heads + h * G + r % G) * D;
            const __m512 inv = _mm512_set1_ps(inv_sum[r]);
            for (int c = 0; c < NP; c++) {
                const __m512 lo = acc[x * 2 * NP + 2 * c], hi = acc[x * 2 * NP + 2 * c + 1];
                VST(o + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(lo, idx_lo, hi), inv));
                VST(o + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, idx_hi, hi), inv));
            }
        }
    }
}
#if HAVE_AMX
/* The tile shapes of prefill_seq_amx for query tiles of nr rows: tiles 0-4 nr rows (scores and
 * outputs, queries and probabilities), 5-7 16 rows (keys and values), all 64 bytes wide. */
static void FN(prefill_amx_configure)(int nr) {
    const int rows[8] = {nr, nr, nr, nr, nr, 16, 16, 16};
    const int colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_shapes(rows, colsb);
}

/* paged_prefill_attention for all query tokens of sequence s and KV head h on AMX tiles (bf16, D
 * = 32 or 64, G <= 8), the same three passes as prefill_tile_dp, per tile of 16 query tokens:
 *   pass 1  S (16 tokens x 16 keys) of query head g = Q (16 x D) . K^T, the keys transposed once for
 *           the whole sequence into B tiles (kbuf: 16 keys' D/2 dim pairs, 1 KiB a 32 dims)
 *   pass 2  softmax numerators as bf16, zero past each row's causal end up to 32 keys
 *   pass 3  O (16 x D) of head g = P (16 x 32 keys) . V, the values laid out once for the sequence as
 *           B tiles of (key pair, dim) (vbuf: 32 keys x 16 dims a tile)
 * Score row g * 16 + i is query token i of head h * G + g (queries of one head are q_tok_stride
 * apart, which a tile load can stride over). *cfg is the row count the tiles are configured for. */
static void FN(prefill_seq_amx)(const T *q, int64_t q_tok_stride, int64_t q_head_stride, const T *k_cache,
                                const T *v_cache, const int32_t *table, int64_t q_first, int q_len, int ctx,
                                int h, int G, int hkv, int B, int D, int num_q_heads, float scale, T *out,
                                float *scores, uint16_t *probs, int ctx_pad, __m512i *kbuf, __m512i *vbuf,
                                int *cfg) {
    const int NP = D / 32, ND = D / 16; /* 32-dim halves of a key row; 16-dim column tiles of a value */
    const int64_t token_stride = (int64_t)hkv * D;
    /* the sequence's keys as B tiles: 16 keys x NP tiles of 16 dim pairs */
    for (int t0 = 0; t0 < ctx; t0 += 16)
        for (int c = 0; c < NP; c++)
            FN(keys16_pairs)(k_cache, table, B, token_stride, h, D, t0, ctx - t0 < 16 ? ctx - t0 : 16, c,
                             kbuf + (int64_t)(t0 / 16 * NP + c) * 16);
    /* its values as B tiles: 32 keys (16 pairs, zeros past ctx) x 16 dims, (v_t, v_t+1) side by side */
    const __m512i inter = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004,
                                            0x00150005, 0x00160006, 0x00170007, 0x00180008, 0x00190009,
                                            0x001a000a, 0x001b000b, 0x001c000c, 0x001d000d, 0x001e000e,
                                            0x001f000f);
    for (int t0 = 0; t0 < ctx; t0 += 32)
        for (int pr = 0; pr < 16; pr++) {
            const int t = t0 + 2 * pr;
            const T *va = t < ctx ? v_cache + ((int64_t)table[t / B] * B + t % B) * token_stride + (int64_t)h * D : NULL;
            const T *vb = t + 1 < ctx ? v_cache + ((int64_t)table[(t + 1) / B] * B + (t + 1) % B) * token_stride
                                            + (int64_t)h * D : NULL;
            for (int d = 0; d < ND; d++) {
                const __m256i a = va ? _mm256_loadu_si256((const __m256i *)(va + 16 * d)) : _mm256_setzero_si256();
                const __m256i b = vb ? _mm256_loadu_si256((const __m256i *)(vb + 16 * d)) : _mm256_setzero_si256();
                vbuf[(int64_t)(t0 / 32 * ND + d) * 16 + pr] =
                    _mm512_permutexvar_epi16(inter, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
            }
        }
    float obuf[16 * 64] __attribute__((aligned(64)));
    const int64_t qs = q_tok_stride * (int64_t)sizeof(T), ss = (int64_t)ctx_pad * 4, ps = (int64_t)ctx_pad * 2;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int i0 = 0; i0 < q_len; i0 += 16) {
        const int nr = q_len - i0 < 16 ? q_len - i0 : 16;
        const int first = ctx - q_len + i0, cmax = first + nr; /* row i sees keys 0 .. first + i */
        const int nk16 = (cmax + 15) / 16, nk32 = (cmax + 31) / 32;
        if (*cfg != nr) {
            FN(prefill_amx_configure)(nr);
            *cfg = nr;
        }
        const T *q0 = q + (q_first + i0) * q_tok_stride;
        /* pass 1 */
        for (int j = 0; j < nk16; j++) {
            const __m512i *kb = kbuf + (int64_t)j * NP * 16;
            _tile_loadd(5, kb, 64);
            if (NP > 1) _tile_loadd(6, kb + 16, 64);
            /* query heads three at a time, each into its own accumulator tile (0-2), so that their
             * products overlap instead of waiting on one tile */
            for (int g0 = 0; g0 < G; g0 += 3) {
                const T *qg = q0 + (int64_t)(h * G + g0) * q_head_stride;
                float *sg = scores + (int64_t)g0 * 16 * ctx_pad + 16 * j;
                const int ng = G - g0 < 3 ? G - g0 : 3;
#define PASS1_HEAD(C_, i_)                                                          \
                _tile_zero(C_);                                                     \
                _tile_loadd(3, qg + (i_) * q_head_stride, qs);                      \
                _tile_dpbf16ps(C_, 3, 5);                                           \
                if (NP > 1) {                                                       \
                    _tile_loadd(4, qg + (i_) * q_head_stride + 32, qs);             \
                    _tile_dpbf16ps(C_, 4, 6);                                       \
                }
                PASS1_HEAD(0, 0)
                if (ng > 1) { PASS1_HEAD(1, 1) }
                if (ng > 2) { PASS1_HEAD(2, 2) }
#undef PASS1_HEAD
                _tile_stored(0, sg, ss);
                if (ng > 1) _tile_stored(1, sg + 16 * ctx_pad, ss);
                if (ng > 2) _tile_stored(2, sg + 32 * ctx_pad, ss);
            }
        }
        /* pass 2 */
        float inv_sum[8 * 16];
        for (int g = 0; g < G; g++)
            for (int i = 0; i < nr; i++) {
                const int r = g * 16 + i, len = first + i + 1;
                float *row = scores + (int64_t)r * ctx_pad;
                uint16_t *pr = probs + (int64_t)r * ctx_pad;
                int t;
                __m512 mv = _mm512_set1_ps(-INFINITY);
                for (t = 0; t + 16 <= len; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(row + t));
                const __mmask16 tail = (__mmask16)((1u << (len - t)) - 1u);
                if (len - t) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, tail, row + t));
                const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv) * scale);
                __m512 sum = _mm512_setzero_ps();
                for (t = 0; t < 32 * nk32; t += 16) {
                    const int valid = len - t < 0 ? 0 : len - t > 16 ? 16 : len - t;
                    const __mmask16 k = (__mmask16)((1u << valid) - 1u);
                    const __m512 e = _mm512_maskz_mov_ps(
                        k, exp_ps(_mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, row + t), sc), m)));
                    sum = _mm512_add_ps(sum, e);
                    _mm256_storeu_si256((__m256i *)(pr + t), (__m256i)_mm512_cvtneps_pbh(e));
                }
                inv_sum[r] = 1.0f / _mm512_reduce_add_ps(sum);
            }
        /* pass 3 */
        for (int g = 0; g < G; g++) {
            const uint16_t *pg = probs + (int64_t)g * 16 * ctx_pad;
            _tile_zero(0);
            _tile_zero(1);
            if (ND > 2) {
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int j = 0; j < nk32; j++) {
                const __m512i *vb = vbuf + (int64_t)j * ND * 16;
                _tile_loadd(4, pg + 32 * j, ps);
                _tile_loadd(5, vb, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, vb + 16, 64);
                _tile_dpbf16ps(1, 4, 6);
                if (ND > 2) {
                    _tile_loadd(7, vb + 32, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_loadd(5, vb + 48, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            _tile_stored(0, obuf, 256);
            _tile_stored(1, obuf + 16, 256);
            if (ND > 2) {
                _tile_stored(2, obuf + 32, 256);
                _tile_stored(3, obuf + 48, 256);
            }
            for (int i = 0; i < nr; i++) {
                T *o = out + ((q_first + i0 + i) * (int64_t)num_q_heads + h * G + g) * D;
                const __m512 inv = _mm512_set1_ps(inv_sum[g * 16 + i]);
                for (int d = 0; d < ND; d++) VST(o + 16 * d, _mm512_mul_ps(_mm512_load_ps(obuf + i * 64 + 16 * d), inv));
            }
        }
    }
}
#endif
#endif

/* Prefill attention over the paged cache for sequences' query chunks: sequence s's queries are rows
 * query_starts[s] .. query_starts[s + 1] - 1 of q (T, Hq, D), at positions context_lens[s] - q_len
 * onwards, each attending causally to the keys up to its own position. Work item: PREFILL_TILE
 * consecutive query tokens of one sequence and one KV head, so that their G * PREFILL_TILE query
 * rows share every key and value they read:
 *   pass 1  16 keys at a time are transposed in registers (lanes = keys, one vector per pair of
 *           dims), and each query row takes D/2 vdpbf16ps against them: no per-key horizontal sums
 *   pass 2  softmax numerators, stored as bf16 (what pass 3's vdpbf16ps multiplies)
 *   pass 3  two values at a time, interleaved into (v_t, v_t+1) pairs per dim, vdpbf16ps with the
 *           rows' (p_t, p_t+1) pairs; the dims come out permuted within each 128-bit lane and are
 *           put back in order at the store
 * On a CPU with AMX (tiles granted, BATCHGEN_AMX not 0), a sequence's chunk of PREFILL_AMX_MIN_Q or
 * more queries with D 32 or 64 is one work item per KV head instead, on tiles (prefill_seq_amx:
 * measured on 2 Xeon cores, 51 prompts of 64-256 tokens, SmolLM2's 9 x 3 x 64 heads: 6.4-7.4 against
 * 11.5-12.0 ms a layer); its results differ from the vector code's within bf16 rounding.
 * bf16 with AVX512-BF16 only, D in {32, 64, 128, 256}, G <= 8, an even block size; returns 2 for
 * anything else (the caller then takes the decode kernel row by row), 1 when memory ran out. fp32,
 * and bf16 on AVX2, stay row by row: the tiles are built on vdpbf16ps's pairs, which AVX2 has no
 * counterpart for, and a prefill's attention is a small share of a step at the prompt lengths
 * measured here (the GEMMs dominate), so no AVX2 tiled version has been written. */
int FN(paged_prefill_attention)(const T *q, int64_t q_tok_stride, int64_t q_head_stride, const T *k_cache,
                                const T *v_cache, const int32_t *block_tables, int64_t block_table_stride,
                                const int32_t *query_starts, const int32_t *context_lens, T *out,
                                int64_t num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                                int block_size, float scale, int num_threads) {
#if HAVE_AVX512 && DP_BF16
    const int D = head_dim, B = block_size, hkv = num_kv_heads;
    if ((D != 32 && D != 64 && D != 128 && D != 256) || B % 2 || num_q_heads % hkv || num_q_heads / hkv > 8)
        return 2;
    const int G = num_q_heads / hkv, RG = PREFILL_TILE * G;
#if HAVE_AMX
    const int amx = (D == 32 || D == 64) && amx_on(); /* sequences of PREFILL_AMX_MIN_Q queries take tiles */
#else
    const int amx = 0;
#endif
    int64_t tiles = 0, amx_seqs = 0;
    int max_ctx = 2;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int q_len = query_starts[s + 1] - query_starts[s];
        if (amx && q_len >= PREFILL_AMX_MIN_Q) amx_seqs++;
        else tiles += (q_len + PREFILL_TILE - 1) / PREFILL_TILE;
        max_ctx = context_lens[s] > max_ctx ? context_lens[s] : max_ctx;
    }
    /* work: (sequence, KV head) on tiles for amx_seqs sequences, then the other sequences' query tiles */
    int64_t *tile_seq = (int64_t *)malloc(sizeof(int64_t) * (size_t)(amx_seqs + tiles + 1));
    if (!tile_seq) return 1;
    for (int64_t s = 0, t = 0, a = 0; s < num_seqs; s++) {
        const int q_len = query_starts[s + 1] - query_starts[s];
        if (amx && q_len >= PREFILL_AMX_MIN_Q) tile_seq[a++] = s << 32;
        else
            for (int i = 0; i < q_len; i += PREFILL_TILE) tile_seq[amx_seqs + t++] = (s << 32) | i;
    }
    const int ctx_pad = (max_ctx + 31) / 32 * 32;
    int failed = 0;
    if (num_threads < 1) num_threads = 1;
    const int64_t items = (amx_seqs + tiles) * hkv; /* the parallel region's condition and its loop: one count */
#pragma omp parallel num_threads(num_threads) if (items > 1)
    {
#ifdef _OPENMP
        if (omp_get_thread_num() == 0) prefill_team = omp_get_num_threads();
#else
        prefill_team = 1;
#endif
        float *scores = (float *)malloc(sizeof(float) * (size_t)(RG + 24) * ctx_pad);
        uint16_t *probs = (uint16_t *)calloc((size_t)(RG + 24) * ctx_pad, sizeof(uint16_t));
        __m512i kt[128];
        /* an AMX item's keys and values as B tiles: 1 KiB a 16 keys x 32 dims, and a 32 keys x 16 dims */
        const size_t kv_bytes = (size_t)((max_ctx + 31) / 32) * 2048 * (D / 16);
        __m512i *kvbuf = amx_seqs ? (__m512i *)aligned_alloc(64, 2 * kv_bytes) : NULL;
#if HAVE_AMX
        int cfg = -1;
#endif
        if (!scores || !probs || (amx_seqs && !kvbuf)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!scores || !probs || (amx_seqs && !kvbuf)) continue;
#if HAVE_AMX
            if (it < amx_seqs * hkv) {
                const int64_t s = tile_seq[it / hkv] >> 32;
                const int q_len = query_starts[s + 1] - query_starts[s];
                FN(prefill_seq_amx)(q, q_tok_stride, q_head_stride, k_cache, v_cache,
                                    block_tables + s * block_table_stride, query_starts[s], q_len, context_lens[s],
                                    (int)(it % hkv), G, hkv, B, D, num_q_heads, scale, out, scores, probs, ctx_pad,
                                    kvbuf, kvbuf + kv_bytes / sizeof(__m512i), &cfg);
                continue;
            }
#endif
            const int64_t s = tile_seq[it / hkv] >> 32;
            const int i0 = (int)(tile_seq[it / hkv] & 0xffffffff), h = (int)(it % hkv);
            const int q_len = query_starts[s + 1] - query_starts[s];
            const int nr = q_len - i0 < PREFILL_TILE ? q_len - i0 : PREFILL_TILE;
            const int first = context_lens[s] - q_len + i0;
            const int32_t *table = block_tables + s * block_table_stride;
            const int64_t q0 = query_starts[s] + i0;
#define PREFILL_CASE(NP_)                                                                                    \
    case NP_:                                                                                                \
        FN(prefill_tile_dp)(q, q_tok_stride, q_head_stride, k_cache, v_cache, table, q0, first, nr, h, G, hkv, \
                            B, num_q_heads, scale, out, scores, probs, ctx_pad, kt, NP_);                    \
        break;
            switch (D / 32) {
                PREFILL_CASE(1) PREFILL_CASE(2) PREFILL_CASE(4) PREFILL_CASE(8)
            }
#undef PREFILL_CASE
        }
#if HAVE_AMX
        if (cfg >= 0) _tile_release();
#endif
        free(kvbuf);
        free(scores);
        free(probs);
    }
    free(tile_seq);
    return failed;
#else
    (void)q, (void)q_tok_stride, (void)q_head_stride, (void)k_cache, (void)v_cache, (void)block_tables;
    (void)block_table_stride, (void)query_starts, (void)context_lens, (void)out, (void)num_seqs;
    (void)num_q_heads, (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale, (void)num_threads;
    return 2;
#endif
}

/* out = weight * round(r / sqrt(mean(r^2) + eps)) with r = round(x + residual) (written to
 * residual_out) or, when residual is NULL, r = x; round() is to T, as Hugging Face's Llama casts
 * before scaling. Rows of x may be strided; every other array is contiguous. */
void FN(rms_norm)(const T *x, int64_t x_stride, const T *residual, const T *weight, T *out,
                  T *residual_out, int64_t rows, int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const T *xr = x + t * x_stride;
        const T *r = xr;
        int64_t d = 0;
        float ss = 0.0f;
#if HAVE_SIMD
        vf ssv = VZERO();
#endif
        if (residual) {
            T *ro = residual_out + t * dim;
            const T *rr = residual + t * dim;
#if HAVE_SIMD
            for (; d + VW <= dim; d += VW) {
                const vf sum = VROUND(VADD(VLD(xr + d), VLD(rr + d)));
                VST(ro + d, sum);
                ssv = VFMADD(sum, sum, ssv);
            }
#endif
            for (; d < dim; d++) {
                ST(ro + d, LD(xr + d) + LD(rr + d));
                ss += LD(ro + d) * LD(ro + d);
            }
            r = ro;
        } else {
#if HAVE_SIMD
            for (; d + VW <= dim; d += VW) {
                const vf v = VLD(xr + d);
                ssv = VFMADD(v, v, ssv);
            }
#endif
            for (; d < dim; d++) ss += LD(xr + d) * LD(xr + d);
        }
#if HAVE_SIMD
        ss += VHSUM(ssv);
#endif
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        T *o = out + t * dim;
        d = 0;
#if HAVE_SIMD
        const vf invv = VSET1(inv);
        for (; d + VW <= dim; d += VW) VST(o + d, VMUL(VLD(weight + d), VROUND(VMUL(VLD(r + d), invv))));
#endif
        for (; d < dim; d++) {
            T normed;
            ST(&normed, LD(r + d) * inv);
            ST(o + d, LD(weight + d) * LD(&normed));
        }
    }
}

/* In place, for q (T, nq, D) and k (T, nk, D) with any token and head strides (head dim
 * contiguous): each head's halves x1, x2 become x1*cos - x2*sin and x2*cos + x1*sin, with
 * cos_sin (max_len, D) = [cos | sin] at the token's position. Returns the first token whose
 * position is outside 0 .. max_len - 1, plus 1, having touched nothing; else 0. */
int64_t FN(rotary)(const int64_t *positions, T *q, int64_t q_tok_stride, int64_t q_head_stride, int nq,
                   T *k, int64_t k_tok_stride, int64_t k_head_stride, int nk, const T *cos_sin,
                   int64_t max_len, int64_t rows, int64_t dim, int num_threads) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < rows; t++)
        if (positions[t] < 0 || positions[t] >= max_len) return t + 1;
#pragma omp parallel for num_threads(num_threads) if (rows * (nq + nk) * dim >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const T *c = cos_sin + positions[t] * dim;
        const T *sn = c + half;
        for (int h = 0; h < nq + nk; h++) {
            T *x = h < nq ? q + t * q_tok_stride + h * q_head_stride
                          : k + t * k_tok_stride + (h - nq) * k_head_stride;
            T *x2 = x + half;
            int64_t i = 0;
#if HAVE_SIMD
            for (; i + VW <= half; i += VW) {
                const vf a = VLD(x + i), b = VLD(x2 + i), cv = VLD(c + i), sv = VLD(sn + i);
                VST(x + i, VFMSUB(a, cv, VMUL(b, sv)));
                VST(x2 + i, VFMADD(b, cv, VMUL(a, sv)));
            }
#endif
            for (; i < half; i++) {
                const float a = LD(x + i), b = LD(x2 + i), cv = LD(c + i), sv = LD(sn + i);
                ST(x + i, a * cv - b * sv);
                ST(x2 + i, b * cv + a * sv);
            }
        }
    }
    return 0;
}

/* x (T, 2I) rows [gate | up] (row stride x_stride) -> out (T, I) = silu(gate) * up. */
void FN(silu_and_mul)(const T *x, int64_t x_stride, T *out, int64_t rows, int64_t inter,
                      int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const T *g = x + t * x_stride, *u = g + inter;
        T *o = out + t * inter;
        int64_t i = 0;
#if HAVE_SIMD
        const vf one = VSET1(1.0f);
        for (; i + VW <= inter; i += VW) {
            const vf gv = VLD(g + i);
            const vf silu = VDIV(gv, VADD(one, VEXP(VSUB(VZERO(), gv))));
            VST(o + i, VMUL(silu, VLD(u + i)));
        }
#endif
        for (; i < inter; i++) {
            const float gi = LD(g + i);
            ST(o + i, gi / (1.0f + expf(-gi)) * LD(u + i));
        }
    }
}

#undef PROBLEM
#undef FN
#undef ITEM_LOCALS
/* the including file's parameters, so that it can include this again for another type */
#undef T
#undef SFX
#undef LD
#undef ST
#undef VLD
#undef VST
#undef VROUND
#undef VLD2
#undef VST2
#undef DP_BF16
