/* Paged prefill attention in fp32 vectors (AVX-512 or AVX2), for fp32 tensors and for bf16 ones on
 * a CPU without AVX512-BF16 (attention.c's vdpbf16ps tiles take bf16 where it has them): the
 * contract of attention.c's paged_prefill_attention_bf16, arithmetic in fp32, the storage type
 * only in the loads and stores (isa.h).
 *
 * Work item: PF_TILE consecutive query tokens of one sequence and one KV head, so that their
 * rows = G * PF_TILE query rows share every key and value they read, where each query token going
 * through the decode kernel on its own reads them once per token. On a Zen 4, one thread, 24 prompts
 * of 64-256 tokens, SmolLM2's 9 x 3 x 64 heads, fp32: 11.2-11.8 ms against 15.2-15.7 row by row
 * (AVX-512), 13.4-14.0 against 17.3-19.4 (the avx2 variant). The item's rows are the vector lanes:
 *   pass 1  the rows' queries, scaled, transposed once into qt[d][row]; per block of PF_KB keys
 *           each dim d takes one broadcast of the key's element per key against PF_RV vectors of
 *           rows: scores[t][row], no horizontal sums and no transposed keys
 *   pass 2  per vector of rows, each row's causal length (first + its token + 1) as a lane mask:
 *           the max, then the numerators exp(score - max) in place (0 past the row's length) and
 *           their sum
 *   pass 3  per group of PF_GR rows and CH vectors of dims: each value read once, a broadcast
 *           of each row's numerator against it, the sums scaled by 1 / sum at the store
 * D a multiple of 2 * VW up to 256, G <= 8; 2 for anything else (the caller goes row by row). */
#include "kernels.h"

#if HAVE_SIMD

enum { PF_TILE = 16, PF_MAX_ROWS = 8 * PF_TILE };
#if HAVE_AVX512
enum { PF_KB = 8, PF_RV = 3, PF_GR = 6 }; /* 24 + 3 + 1 and 24 + 4 + 1 of 32 registers */
typedef __m512i vlen;
ALWAYS_INLINE vlen vlen_load(const int32_t *p) { return _mm512_loadu_si512(p); }
/* x where lane's length > t, else other */
ALWAYS_INLINE vf below(vf x, vf other, vlen len, int t) {
    return _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(len, _mm512_set1_epi32(t)), other, x);
}
ALWAYS_INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
#else
enum { PF_KB = 6, PF_RV = 2, PF_GR = 6 }; /* 12 + 2 + 1 and (CH 2) 12 + 2 + 1 of 16 registers */
typedef __m256i vlen;
ALWAYS_INLINE vlen vlen_load(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
ALWAYS_INLINE vf below(vf x, vf other, vlen len, int t) {
    return _mm256_blendv_ps(other, x, _mm256_castsi256_ps(_mm256_cmpgt_epi32(len, _mm256_set1_epi32(t))));
}
ALWAYS_INLINE vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
#endif

/* scores[t0 + j][VW * (rv + i) ..] for keys k[j] (PF_KB pointers, those past the block's real keys repeat one)
 * and RVN vectors of rows from rv */
ALWAYS_INLINE void pf_scores(const float *qt, int rp, int rv, const void *const *k, int D, float *scores, int ps,
                             int t0, const int RVN, const int dt) {
    vf acc[PF_KB][PF_RV];
    for (int j = 0; j < PF_KB; j++)
        for (int i = 0; i < RVN; i++) acc[j][i] = vzero();
    for (int d = 0; d < D; d++) {
        vf qv[PF_RV];
        for (int i = 0; i < RVN; i++) qv[i] = vld_f32(qt + (int64_t)d * rp + (rv + i) * VW);
        for (int j = 0; j < PF_KB; j++) {
            const vf kb = vset1(ld(k[j], d, dt));
            for (int i = 0; i < RVN; i++) acc[j][i] = vfmadd(kb, qv[i], acc[j][i]);
        }
    }
    /* every key of the block stored: scores has PF_KB spare keys, and a constant bound keeps acc in
     * registers (a run-time one made GCC keep it in memory) */
    for (int j = 0; j < PF_KB; j++)
        for (int i = 0; i < RVN; i++) vst_f32(scores + (int64_t)(t0 + j) * ps + (rv + i) * VW, acc[j][i]);
}

/* out rows r0 .. r0 + PF_GR - 1 (those below rows), dims c0 .. c0 + CH * VW - 1, from keys 0 .. tmax - 1 */
ALWAYS_INLINE void pf_values(const float *probs, int ps, int r0, int rows, int tmax, const void *v_cache,
                             const int64_t *toff, int c0, const float *inv, void *out, const int64_t *orow,
                             const int CH, const int dt) {
    vf acc[PF_GR][4];
    for (int x = 0; x < PF_GR; x++)
        for (int c = 0; c < CH; c++) acc[x][c] = vzero();
    for (int t = 0; t < tmax; t++) {
        const void *v = elem(v_cache, toff[t] + c0, dt);
        vf vv[4];
        for (int c = 0; c < CH; c++) vv[c] = vld(v, (int64_t)c * VW, dt);
        const float *p = probs + (int64_t)t * ps + r0;
        for (int x = 0; x < PF_GR; x++) {
            const vf pb = vset1(p[x]);
            for (int c = 0; c < CH; c++) acc[x][c] = vfmadd(pb, vv[c], acc[x][c]);
        }
    }
    for (int x = 0; x < PF_GR; x++) { /* a constant bound: acc stays in registers */
        if (r0 + x >= rows) break;
        const vf s = vset1(inv[r0 + x]);
        for (int c = 0; c < CH; c++) vst(out, orow[r0 + x] + c0 + (int64_t)c * VW, vmul(acc[x][c], s), dt);
    }
}

/* One work item: query tokens i0 .. i0 + nr - 1 of a sequence (q rows q0 ..; positions first ..), KV
 * head h. qt: D * rp floats; scores: ps floats a key, ps >= rp + PF_GR (lanes past rp stay 0: pass
 * 3's last group reads them); toff: a slot per key. */
ALWAYS_INLINE void pf_item(const void *q, int64_t q_tok_stride, int64_t q_head_stride, const void *k_cache,
                           const void *v_cache, const int32_t *table, int64_t q0, int first, int nr, int h, int G,
                           int hkv, int B, int D, int num_q_heads, float scale, void *out, float *qt,
                           float *scores, int ps, int64_t *toff, const int CH, const int dt) {
    const int rows = nr * G, rp = (rows + VW - 1) / VW * VW, cmax = first + nr, nv = rp / VW;
    int32_t len[PF_MAX_ROWS + 16];
    int64_t orow[PF_MAX_ROWS + PF_GR];
    for (int r = 0; r < rp; r++) {
        len[r] = r < rows ? first + r / G + 1 : 1; /* a padding row sees key 0 (its sum is not 0) */
        orow[r] = r < rows ? ((q0 + r / G) * num_q_heads + (int64_t)h * G + r % G) * D : 0;
    }
    const void *src[PF_MAX_ROWS];
    for (int r = 0; r < rows; r++)
        src[r] = elem(q, (q0 + r / G) * q_tok_stride + (int64_t)(h * G + r % G) * q_head_stride, dt);
    for (int d = 0; d < D; d++) { /* a dim's rows in turn: the stores in order (a row's dims in turn, 11% of the time) */
        float *row = qt + (int64_t)d * rp;
        for (int r = 0; r < rows; r++) row[r] = ld(src[r], d, dt) * scale;
        for (int r = rows; r < rp; r++) row[r] = 0.0f;
    }
    for (int t0 = 0; t0 < cmax; t0 += B) { /* each key's offset in the caches, a block table entry a block */
        const int64_t base = (int64_t)table[t0 / B] * B;
        for (int t = t0; t < t0 + B && t < cmax; t++) toff[t] = ((base + t - t0) * hkv + h) * D;
    }
    /* pass 1 */
    for (int t0 = 0; t0 < cmax; t0 += PF_KB) {
        const int n = cmax - t0 < PF_KB ? cmax - t0 : PF_KB;
        const void *k[PF_KB];
        for (int j = 0; j < PF_KB; j++) k[j] = elem(k_cache, toff[t0 + (j < n ? j : n - 1)], dt);
        int rv = 0;
        for (; rv + PF_RV <= nv; rv += PF_RV) pf_scores(qt, rp, rv, k, D, scores, ps, t0, PF_RV, dt);
        if (nv - rv == 2) pf_scores(qt, rp, rv, k, D, scores, ps, t0, 2, dt);
        else if (nv - rv == 1) pf_scores(qt, rp, rv, k, D, scores, ps, t0, 1, dt);
    }
    /* pass 2 */
    float inv[PF_MAX_ROWS + PF_GR];
    for (int i = 0; i < nv; i++) {
        const vlen L = vlen_load(len + i * VW);
        const vf ninf = vset1(-INFINITY);
        vf mx = ninf;
        for (int t = 0; t < cmax; t++) mx = vmax(mx, below(vld_f32(scores + (int64_t)t * ps + i * VW), ninf, L, t));
        vf sum = vzero();
        for (int t = 0; t < cmax; t++) {
            float *s = scores + (int64_t)t * ps + i * VW;
            const vf e = below(vexp(vsub(vld_f32(s), mx)), vzero(), L, t);
            vst_f32(s, e);
            sum = vadd(sum, e);
        }
        vst_f32(inv + i * VW, vdiv(vset1(1.0f), sum));
    }
    /* pass 3: a group needs the keys up to its last row's (reading them a group at a time, the values
     * from L2, was quicker on a Zen 4 than 32 or 128 keys at a time for every group, sums kept between) */
    for (int r0 = 0; r0 < rows; r0 += PF_GR) {
        const int last = r0 + PF_GR - 1 < rows ? r0 + PF_GR - 1 : rows - 1;
        for (int c0 = 0; c0 < D; c0 += CH * VW)
            pf_values(scores, ps, r0, rows, len[last], v_cache, toff, c0, inv, out, orow, CH, dt);
    }
}

int prefill_attention_vec(const void *q, int64_t q_tok_stride, int64_t q_head_stride, const void *k_cache,
                          const void *v_cache, const int32_t *block_tables, int64_t block_table_stride,
                          const int32_t *query_starts, const int32_t *context_lens, void *out, int64_t num_seqs,
                          int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                          int num_threads, int dt) {
    const int D = head_dim, B = block_size, hkv = num_kv_heads;
    if (D % (2 * VW) || D > 256 || B < 1 || hkv < 1 || num_q_heads % hkv || num_q_heads / hkv > 8) return 2;
    const int G = num_q_heads / hkv;
    int64_t tiles = 0;
    int max_ctx = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        tiles += (query_starts[s + 1] - query_starts[s] + PF_TILE - 1) / PF_TILE;
        max_ctx = context_lens[s] > max_ctx ? context_lens[s] : max_ctx;
    }
    int64_t *tile_seq = (int64_t *)malloc(sizeof(int64_t) * (size_t)(tiles + 1));
    if (!tile_seq) return 1;
    for (int64_t s = 0, t = 0; s < num_seqs; s++)
        for (int i = 0; i < query_starts[s + 1] - query_starts[s]; i += PF_TILE) tile_seq[t++] = (s << 32) | i;
    const int ps = (G * PF_TILE + VW - 1) / VW * VW + 16; /* >= rp + PF_GR */
    /* dims a pass 3 sweep: AVX2 takes 2 vectors for 6 rows (on a Zen 4, 13.4-14.0 ms against 14.4-16.1 for
     * 4 vectors and 2 rows, the row-by-row path's 19.3 alongside; 24 prompts of 64-256 tokens, 9 x 3 x 64) */
    const int CH = HAVE_AVX512 && (D / VW) % 4 == 0 ? 4 : 2;
    int failed = 0;
    if (num_threads < 1) num_threads = 1;
    const int64_t items = tiles * hkv;
#pragma omp parallel num_threads(num_threads) if (items > 1)
    {
        float *qt = (float *)malloc(sizeof(float) * (size_t)D * (PF_MAX_ROWS + 16));
        float *scores = (float *)calloc((size_t)ps * (max_ctx + PF_KB), sizeof(float));
        int64_t *toff = (int64_t *)malloc(sizeof(int64_t) * (size_t)(max_ctx + PF_KB));
        if (!qt || !scores || !toff) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!qt || !scores || !toff) continue;
            const int64_t s = tile_seq[it / hkv] >> 32;
            const int i0 = (int)(tile_seq[it / hkv] & 0xffffffff), h = (int)(it % hkv);
            const int q_len = query_starts[s + 1] - query_starts[s];
            const int nr = q_len - i0 < PF_TILE ? q_len - i0 : PF_TILE;
            const int first = context_lens[s] - q_len + i0;
            const int32_t *table = block_tables + s * block_table_stride;
            const int64_t q0 = query_starts[s] + i0;
#define PF_ITEM(ch, t) pf_item(q, q_tok_stride, q_head_stride, k_cache, v_cache, table, q0, first, nr, h, G, hkv, B, \
                               D, num_q_heads, scale, out, qt, scores, ps, toff, ch, t)
            if (dt == BF16) {
                if (CH == 4) PF_ITEM(4, BF16);
                else PF_ITEM(2, BF16);
            } else {
                if (CH == 4) PF_ITEM(4, F32);
                else PF_ITEM(2, F32);
            }
#undef PF_ITEM
        }
        free(toff);
        free(scores);
        free(qt);
    }
    free(tile_seq);
    return failed;
}

#else /* no vector unit this library knows: the caller goes row by row */

int prefill_attention_vec(const void *q, int64_t q_tok_stride, int64_t q_head_stride, const void *k_cache,
                          const void *v_cache, const int32_t *block_tables, int64_t block_table_stride,
                          const int32_t *query_starts, const int32_t *context_lens, void *out, int64_t num_seqs,
                          int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                          int num_threads, int dt) {
    (void)q, (void)q_tok_stride, (void)q_head_stride, (void)k_cache, (void)v_cache, (void)block_tables;
    (void)block_table_stride, (void)query_starts, (void)context_lens, (void)out, (void)num_seqs;
    (void)num_q_heads, (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale, (void)num_threads;
    (void)dt;
    return 2;
}
#endif
