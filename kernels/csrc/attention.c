/* Attention over the block-paged KV cache, for fp32 and bf16 tensors (fp32 arithmetic either way;
 * isa.h says how one body serves both), and the KV-cache store.
 *
 * Paged decode attention: one query token per sequence reads its keys and values in place from
 * the block-paged cache (no gather copy), GQA-aware, split over threads. The torch reference
 * (kernels/attention_decode.py) is the specification it is tested against.
 *
 * Work item (s, h): the G = Hq / Hkv query heads of KV head h of sequence s. For each item:
 *   pass 1  scores[g, t] = scale * q_g . k_t          (each key read once for all G heads)
 *   pass 2  p[g, t] = exp(scores[g, t] - max_t), l_g = sum_t p[g, t]
 *   pass 3  out_g = (sum_t p[g, t] v_t) / l_g          (each value read once for all G heads)
 * Each OpenMP thread takes a contiguous run of items of about equal total context, so it knows its
 * next item and asks for that item's keys (values) while it reads this one's: the decode step's KV
 * comes from DRAM (every layer's cache is far larger than L3), and latency, not bandwidth, was what
 * bounded the kernel. With AVX-512 and G <= 8, head_dim in {32, 64, 128} (AVX2: G <= 8, head_dim in
 * {32, 64, 128} too, 8 lanes at a time), a specialised version keeps queries and accumulators in
 * registers and computes the softmax's exponentials a vector at a time.
 *
 * Paged prefill attention (bf16 with AVX512-BF16, optionally AMX tiles): paged_prefill_attention's
 * comment, below.
 *
 * The decode kernel's bodies are in attention_decode.h, instantiated per dtype by
 * attention_decode_f32.c and attention_decode_bf16.c (they compile in parallel); here its entry,
 * which splits the work items over threads. */
#include "attention_decode.h"

enum {
    PREFILL_TILE = 16,               /* paged_prefill_attention's work item: query tokens */
    PREFILL_AMX_MIN_Q = 16,          /* query tokens from which a prefill chunk's attention runs on AMX tiles */
};

/* Whether decode attention runs its L2 stream: on, unless batchgen_attention_stream() was told
 * otherwise (BATCHGEN_ATTN_STREAM). Its first form asked for a whole block at a time; on Intel that
 * burst of prefetches stalled the arithmetic queued behind it and it cost 3-24% on a 2-core AMX Xeon,
 * so it ran on AMD only. Spread a line or two per key and value read, it overlaps DRAM with compute
 * there too (128 sequences x 160-300 tokens, 30 layers: 36.8 against 42.0 ms; 64 x ~262: 20.2
 * against 24.2; 16 x ~1024: level). */
static int attn_stream = 1;

static int attention_stream_on(void) { return attn_stream; }

/* on 1 or 0 sets it, -1 only asks; returns whether the stream runs. */
int batchgen_attention_stream(int on) {
    if (on >= 0) attn_stream = on ? 1 : 0;
    return attention_stream_on();
}

/* The threads that ran the last prefill attention call (paged_prefill_attention), for a test: its
 * parallel region once counted only the vector kernel's work items, so a prefill whose every
 * sequence took AMX tiles ran on one thread (8192-token bf16 prefill steps 1.14-1.23 against
 * 1.03-1.09 s on both). */
static int prefill_team = 0;

int batchgen_prefill_threads(void) { return prefill_team; }

/* key/value (T, Hkv, D) rows (token strides given in bytes, heads and dims contiguous) into the
 * caches' flat slots (num_slots, Hkv, D) of row_bytes each, any element type; slot -1 skips the
 * token. Returns the first out-of-range slot's token + 1, or 0. */
int64_t store_kv_cache(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                       char *k_cache, char *v_cache, const int64_t *slot_mapping, int64_t rows,
                       int64_t row_bytes, int64_t num_slots) {
    for (int64_t t = 0; t < rows; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        if (slot >= num_slots) return t + 1;
        memcpy(k_cache + slot * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(v_cache + slot * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}

/* Thread t of n takes work items [first_item_of(t), first_item_of(t + 1)): contiguous runs of about
 * equal cost, an item (s, h) costing its context plus a fixed part. Contiguous, so that a thread
 * knows its next item; balanced, since contexts differ (a static schedule of counts would not be). */
static int64_t first_item_of(const int32_t *context_lens, int hkv, int64_t items, int t, int n) {
    if (t <= 0) return 0;
    if (t >= n) return items;
    int64_t total = 0;
    for (int64_t it = 0; it < items; it++) total += context_lens[it / hkv] + 32;
    const int64_t target = total * t / n;
    int64_t before = 0, it = 0;
    for (; it < items && before < target; it++) before += context_lens[it / hkv] + 32;
    return it;
}

/* ---- paged decode attention: the entry ---- */

/* Returns 0 on success, 1 when memory ran out, 2 for an unsupported shape (more than 64 query
 * heads per KV head). Threads come from OpenMP: linked by soname, torch's own libgomp serves, so
 * this kernel shares torch's thread pool instead of competing with it. */
int paged_decode_attention(const void *q, int64_t q_seq_stride, int64_t q_head_stride, const void *k_cache,
                           const void *v_cache, const int32_t *block_tables, int64_t block_table_stride,
                           const int32_t *context_lens, void *out, int64_t num_seqs, int num_q_heads,
                           int num_kv_heads, int head_dim, int block_size, float scale, int num_threads, int dt) {
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
    const int use_stream = attention_stream_on();
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
        if (dt == BF16) decode_items_bf16(&p, lo, hi, scores, max_ctx, use_stream);
        else decode_items_f32(&p, lo, hi, scores, max_ctx, use_stream);
        free(scores);
    }
    return failed;
}

int paged_decode_attention_f32(const float *q, int64_t q_seq_stride, int64_t q_head_stride, const float *k_cache,
                               const float *v_cache, const int32_t *block_tables, int64_t block_table_stride,
                               const int32_t *context_lens, float *out, int64_t num_seqs, int num_q_heads,
                               int num_kv_heads, int head_dim, int block_size, float scale, int num_threads) {
    return paged_decode_attention(q, q_seq_stride, q_head_stride, k_cache, v_cache, block_tables, block_table_stride,
                                  context_lens, out, num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, scale,
                                  num_threads, F32);
}

int paged_decode_attention_bf16(const uint16_t *q, int64_t q_seq_stride, int64_t q_head_stride,
                                const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *block_tables,
                                int64_t block_table_stride, const int32_t *context_lens, uint16_t *out,
                                int64_t num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                                float scale, int num_threads) {
    return paged_decode_attention(q, q_seq_stride, q_head_stride, k_cache, v_cache, block_tables, block_table_stride,
                                  context_lens, out, num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, scale,
                                  num_threads, BF16);
}

/* ---- paged prefill attention (bf16 with AVX512-BF16, optionally AMX tiles) ---- */

/* paged_prefill_attention's work item and its AMX form (the function's own comment, below, says how). */
#if HAVE_AVX512 && defined(__AVX512BF16__)
/* Keys t0 .. t0 + n - 1 (n <= 16; zeros past n) of KV head h, dims 32c .. 32c + 31, transposed into
 * kt[0 .. 15]: kt[m] holds dim pair 16c + m of the 16 keys, one key a 32-bit lane. That is a row of
 * a bf16 dot product's right-hand side in pairs (vdpbf16ps), and 16 of them are an AMX B tile. */
ALWAYS_INLINE void keys16_pairs(const uint16_t *k_cache, const int32_t *table, int B, int64_t token_stride,
                                int h, int D, int t0, int n, int c, __m512i *kt) {
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
ALWAYS_INLINE void prefill_tile_dp(const uint16_t *q, int64_t q_tok_stride, int64_t q_head_stride,
                                   const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, int64_t q0,
                                   int first, int nr, int h, int G, int hkv, int B, int num_q_heads, float scale,
                                   uint16_t *out, float *scores, uint16_t *probs, int ctx_pad, __m512i *kt,
                                   const int NP) {
    const int D = 32 * NP, rows = nr * G, cmax = first + nr;
    const int64_t token_stride = (int64_t)hkv * D;
    enum { RB = 4 };                          /* pass 1 rows per register block */
    const int GROUP = 24 / (2 * NP) > 0 ? 24 / (2 * NP) : 1; /* pass 3 rows per register block */
    const uint16_t *qrow[8 * PREFILL_TILE + 24];
    for (int r = 0; r < rows + 24; r++) {
        const int rr = r < rows ? r : rows - 1;
        qrow[r] = q + (q0 + rr / G) * q_tok_stride + (int64_t)(h * G + rr % G) * q_head_stride;
    }
    /* pass 1 */
    for (int t0 = 0; t0 < cmax; t0 += 16) {
        const int n = cmax - t0 < 16 ? cmax - t0 : 16;
        for (int c = 0; c < NP; c++) keys16_pairs(k_cache, table, B, token_stride, h, D, t0, n, c, kt + 16 * c);
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
            const uint16_t *v0 = v_cache + ((int64_t)table[t / B] * B + t % B) * token_stride + (int64_t)h * D;
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
            uint16_t *o = out + ((q0 + r / G) * (int64_t)num_q_heads + h * G + r % G) * D;
            const __m512 inv = _mm512_set1_ps(inv_sum[r]);
            for (int c = 0; c < NP; c++) {
                const __m512 lo = acc[x * 2 * NP + 2 * c], hi = acc[x * 2 * NP + 2 * c + 1];
                vst_bf16(o + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(lo, idx_lo, hi), inv));
                vst_bf16(o + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, idx_hi, hi), inv));
            }
        }
    }
}
#if HAVE_AMX
/* The tile shapes of prefill_seq_amx for query tiles of nr rows: tiles 0-4 nr rows (scores and
 * outputs, queries and probabilities), 5-7 16 rows (keys and values), all 64 bytes wide. */
static void prefill_amx_configure(int nr) {
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
static void prefill_seq_amx(const uint16_t *q, int64_t q_tok_stride, int64_t q_head_stride,
                            const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, int64_t q_first,
                            int q_len, int ctx, int h, int G, int hkv, int B, int D, int num_q_heads, float scale,
                            uint16_t *out, float *scores, uint16_t *probs, int ctx_pad, __m512i *kbuf,
                            __m512i *vbuf, int *cfg) {
    const int NP = D / 32, ND = D / 16; /* 32-dim halves of a key row; 16-dim column tiles of a value */
    const int64_t token_stride = (int64_t)hkv * D;
    /* the sequence's keys as B tiles: 16 keys x NP tiles of 16 dim pairs */
    for (int t0 = 0; t0 < ctx; t0 += 16)
        for (int c = 0; c < NP; c++)
            keys16_pairs(k_cache, table, B, token_stride, h, D, t0, ctx - t0 < 16 ? ctx - t0 : 16, c,
                             kbuf + (int64_t)(t0 / 16 * NP + c) * 16);
    /* its values as B tiles: 32 keys (16 pairs, zeros past ctx) x 16 dims, (v_t, v_t+1) side by side */
    const __m512i inter = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004,
                                            0x00150005, 0x00160006, 0x00170007, 0x00180008, 0x00190009,
                                            0x001a000a, 0x001b000b, 0x001c000c, 0x001d000d, 0x001e000e,
                                            0x001f000f);
    for (int t0 = 0; t0 < ctx; t0 += 32)
        for (int pr = 0; pr < 16; pr++) {
            const int t = t0 + 2 * pr;
            const uint16_t *va =
                t < ctx ? v_cache + ((int64_t)table[t / B] * B + t % B) * token_stride + (int64_t)h * D : NULL;
            const uint16_t *vb = t + 1 < ctx ? v_cache + ((int64_t)table[(t + 1) / B] * B + (t + 1) % B) * token_stride
                                            + (int64_t)h * D : NULL;
            for (int d = 0; d < ND; d++) {
                const __m256i a = va ? _mm256_loadu_si256((const __m256i *)(va + 16 * d)) : _mm256_setzero_si256();
                const __m256i b = vb ? _mm256_loadu_si256((const __m256i *)(vb + 16 * d)) : _mm256_setzero_si256();
                vbuf[(int64_t)(t0 / 32 * ND + d) * 16 + pr] =
                    _mm512_permutexvar_epi16(inter, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
            }
        }
    float obuf[16 * 64] __attribute__((aligned(64)));
    const int64_t qs = q_tok_stride * (int64_t)sizeof(uint16_t), ss = (int64_t)ctx_pad * 4, ps = (int64_t)ctx_pad * 2;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int i0 = 0; i0 < q_len; i0 += 16) {
        const int nr = q_len - i0 < 16 ? q_len - i0 : 16;
        const int first = ctx - q_len + i0, cmax = first + nr; /* row i sees keys 0 .. first + i */
        const int nk16 = (cmax + 15) / 16, nk32 = (cmax + 31) / 32;
        if (*cfg != nr) {
            prefill_amx_configure(nr);
            *cfg = nr;
        }
        const uint16_t *q0 = q + (q_first + i0) * q_tok_stride;
        /* pass 1 */
        for (int j = 0; j < nk16; j++) {
            const __m512i *kb = kbuf + (int64_t)j * NP * 16;
            _tile_loadd(5, kb, 64);
            if (NP > 1) _tile_loadd(6, kb + 16, 64);
            /* query heads three at a time, each into its own accumulator tile (0-2), so that their
             * products overlap instead of waiting on one tile */
            for (int g0 = 0; g0 < G; g0 += 3) {
                const uint16_t *qg = q0 + (int64_t)(h * G + g0) * q_head_stride;
                float *sg = scores + (int64_t)g0 * 16 * ctx_pad + 16 * j;
                const int ng = G - g0 < 3 ? G - g0 : 3;
                /* each head's products (the _tile_* intrinsics take literal tile numbers) */
                _tile_zero(0);
                _tile_loadd(3, qg, qs);
                _tile_dpbf16ps(0, 3, 5);
                if (NP > 1) {
                    _tile_loadd(4, qg + 32, qs);
                    _tile_dpbf16ps(0, 4, 6);
                }
                if (ng > 1) {
                    _tile_zero(1);
                    _tile_loadd(3, qg + q_head_stride, qs);
                    _tile_dpbf16ps(1, 3, 5);
                    if (NP > 1) {
                        _tile_loadd(4, qg + q_head_stride + 32, qs);
                        _tile_dpbf16ps(1, 4, 6);
                    }
                }
                if (ng > 2) {
                    _tile_zero(2);
                    _tile_loadd(3, qg + 2 * q_head_stride, qs);
                    _tile_dpbf16ps(2, 3, 5);
                    if (NP > 1) {
                        _tile_loadd(4, qg + 2 * q_head_stride + 32, qs);
                        _tile_dpbf16ps(2, 4, 6);
                    }
                }
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
                uint16_t *o = out + ((q_first + i0 + i) * (int64_t)num_q_heads + h * G + g) * D;
                const __m512 inv = _mm512_set1_ps(inv_sum[g * 16 + i]);
                for (int d = 0; d < ND; d++)
                    vst_bf16(o + 16 * d, _mm512_mul_ps(_mm512_load_ps(obuf + i * 64 + 16 * d), inv));
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
int paged_prefill_attention_bf16(const uint16_t *q, int64_t q_tok_stride, int64_t q_head_stride,
                                 const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *block_tables,
                                 int64_t block_table_stride, const int32_t *query_starts,
                                 const int32_t *context_lens, uint16_t *out, int64_t num_seqs, int num_q_heads,
                                 int num_kv_heads, int head_dim, int block_size, float scale, int num_threads) {
#if HAVE_AVX512 && defined(__AVX512BF16__)
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
                prefill_seq_amx(q, q_tok_stride, q_head_stride, k_cache, v_cache,
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
            switch (D / 32) { /* NP a constant in each case */
            case 1:
                prefill_tile_dp(q, q_tok_stride, q_head_stride, k_cache, v_cache, table, q0, first, nr, h, G, hkv, B,
                                num_q_heads, scale, out, scores, probs, ctx_pad, kt, 1);
                break;
            case 2:
                prefill_tile_dp(q, q_tok_stride, q_head_stride, k_cache, v_cache, table, q0, first, nr, h, G, hkv, B,
                                num_q_heads, scale, out, scores, probs, ctx_pad, kt, 2);
                break;
            case 4:
                prefill_tile_dp(q, q_tok_stride, q_head_stride, k_cache, v_cache, table, q0, first, nr, h, G, hkv, B,
                                num_q_heads, scale, out, scores, probs, ctx_pad, kt, 4);
                break;
            case 8:
                prefill_tile_dp(q, q_tok_stride, q_head_stride, k_cache, v_cache, table, q0, first, nr, h, G, hkv, B,
                                num_q_heads, scale, out, scores, probs, ctx_pad, kt, 8);
                break;
            }
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
#else /* no vdpbf16ps: the fp32 vector tiles, bf16 only in the loads and stores */
    return prefill_attention_vec(q, q_tok_stride, q_head_stride, k_cache, v_cache, block_tables, block_table_stride,
                                 query_starts, context_lens, out, num_seqs, num_q_heads, num_kv_heads, head_dim,
                                 block_size, scale, num_threads, BF16);
#endif
}

/* fp32 prefill attention: the vector tiles of attention_prefill.c */
int paged_prefill_attention_f32(const float *q, int64_t q_tok_stride, int64_t q_head_stride, const float *k_cache,
                                const float *v_cache, const int32_t *block_tables, int64_t block_table_stride,
                                const int32_t *query_starts, const int32_t *context_lens, float *out,
                                int64_t num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                                int block_size, float scale, int num_threads) {
    return prefill_attention_vec(q, q_tok_stride, q_head_stride, k_cache, v_cache, block_tables, block_table_stride,
                                 query_starts, context_lens, out, num_seqs, num_q_heads, num_kv_heads, head_dim,
                                 block_size, scale, num_threads, F32);
}
