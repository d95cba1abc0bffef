/* The projections' GEMM on AVX-512 (and, further down, AVX2): out (M, N) = x (M, K) @ W.T (+ residual), with W (N, K) packed
 * once (kernels/cpu_gemm.py) into panels of GEMM_NR = 64 output columns:
 *   fp32  [N / 64][K][64]         one k of a panel is 4 zmm of weights (AVX-512: "rows")
 *   bf16  [N / 64][K / 2][64][2]  pairs (k, k + 1) of a column side by side, as vdpbf16ps takes them
 * and in the AVX2 build, four strips of 16 columns a panel, each contiguous over K:
 *   fp32  [N / 64][4][K][16]
 *   bf16  [N / 64][4][K / 2][16][2]
 * (N a multiple of 64: the packer takes no other; a caller's n may stop short of the last panel's
 * end, and the stores are masked there). A tile of up to GEMM_MR = 6 rows by 64 columns keeps its
 * 24 accumulators in registers for all of K: per k (pair of k) it loads 4 zmm of the panel and
 * broadcasts one element (pair) of each row, so each weight loaded serves 6 rows and each x element
 * 64 columns. Threads split the panels (and, when there are few, the rows), each thread's panels
 * contiguous so a panel (K x 64: 72 KiB in bf16 at K = 576) stays in its L2 while every row tile of
 * its share passes over it.
 *
 * Measured on 2 Zen 4 cores against oneDNN's packed linear (torch's mkldnn._linear_pointwise), in one
 * process: kernels/cpu_gemm.py's docstring has the numbers, its main() prints them again. Declines
 * (returns 2) where it has no code: neither AVX-512 nor AVX2 and FMA, bf16 on AVX-512 without
 * AVX512-BF16 (oneDNN's bf16 serves there), an odd K in bf16.
 *
 * Also here: the sampler's row-wise argmax, and the GEMM with that argmax folded in (greedy tokens
 * from the lm_head without its logits). */
#include "kernels.h"

enum {
    GEMM_MR = 6, /* rows a tile */
    /* threads share a product this big or with a weight of this many elements: at a few rows the
     * weight's stream from DRAM is the work, and one core reads about half what two do */
    GEMM_PARALLEL_WEIGHT = 1 << 18,
    /* Rows in blocks of GEMM_ROW_BLOCK (a prefill's thousands): a block's rows and outputs stay in
     * cache and in the TLB while its panels pass over them (measured: 8192 rows x 576 x 3072 went from
     * 0.93x to parity with oneDNN); a decode step's rows are one block. */
    GEMM_ROW_BLOCK = 240,
};
/* bf16 panels have code: vdpbf16ps (AVX512-BF16) or AVX2's widening; AVX-512 without BF16 declines */
#if HAVE_AVX2 || (HAVE_AVX512 && defined(__AVX512BF16__))
#define HAVE_GEMM_BF16 1
#else
#define HAVE_GEMM_BF16 0
#endif

#if HAVE_SIMD
/* The thread's next panel into L2 while it works on this one, pf_n lines per step of k (pf_n > 0)
 * or one line every -pf_n steps: a panel comes from DRAM (a model's weights are far larger than
 * L3), and without this its first row tile waited on it. Spread over all of the panel's row tiles,
 * not crowded into the first few: one core reads ~15 GB/s from DRAM, and a burst asked more (fp32,
 * 64 rows, 30 layers' projections in one process: 54 ms against 65 when the next panel came within
 * four tiles, 69 without the prefetch). */
ALWAYS_INLINE void gemm_prefetch(const char *pf, int64_t k, int pf_n) {
    if (pf_n > 0)
        for (int q = 0; q < pf_n; q++) _mm_prefetch(pf + (k * pf_n + q) * 64, _MM_HINT_T1);
    else if (k % -pf_n == 0)
        _mm_prefetch(pf + (k / -pf_n) * 64, _MM_HINT_T1);
}
#endif

#if HAVE_AVX512

/* 16 elements of type dt at p where mask m is set, as fp32 (0 elsewhere); v's lanes in m into p as dt */
ALWAYS_INLINE __m512 ld16(__mmask16 m, const void *p, const int dt) {
    return dt == BF16 ? bf16x16_to_ps(_mm256_maskz_loadu_epi16(m, p)) : _mm512_maskz_loadu_ps(m, p);
}
ALWAYS_INLINE void st16(void *p, __mmask16 m, __m512 v, const int dt) {
    if (dt == BF16) _mm256_mask_storeu_epi16(p, m, ps_to_bf16x16(v));
    else _mm512_mask_storeu_ps(p, m, v);
}

/* accumulator (r, j): a tile's register, or (acc NULL) row r's columns 16 j .. 16 j + 15 of buf (rows
 * GEMM_NR apart) */
ALWAYS_INLINE __m512 acc_at(__m512 (*acc)[4], const float *buf, int r, int j) {
    return acc ? acc[r][j] : _mm512_loadu_ps(buf + r * GEMM_NR + 16 * j);
}

/* the tile's epilogue: the accumulators (+ residual, of res_dt) into out's rows (of out_dt), the
 * first ncols (<= 64) columns; with silu (a gate/up panel: columns 0-31 gate, 32-63 up) silu(gate) *
 * up into ncols (<= 32) columns */
ALWAYS_INLINE void gemm_store(__m512 (*acc)[4], const float *buf, const int mr, void *out, int64_t os, int ncols,
                              const void *res, int64_t rs, const int silu, const int out_dt, const int res_dt) {
    for (int r = 0; r < mr; r++) {
        for (int j = 0; j < (silu ? 2 : 4); j++) {
            const int c0 = 16 * j;
            if (c0 >= ncols) break;
            const __mmask16 m = ncols - c0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (ncols - c0)) - 1u);
            __m512 v = acc_at(acc, buf, r, j);
            if (silu) {
                const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v));
                v = _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), acc_at(acc, buf, r, j + 2));
            } else if (res) {
                v = _mm512_add_ps(v, ld16(m, elem(res, r * rs + c0, res_dt), res_dt));
            }
            st16(elem_w(out, r * os + c0, out_dt), m, v, out_dt);
        }
    }
}

ALWAYS_INLINE void gemm_tile_f32(const int mr, const float *x, int64_t xs, const float *w, int64_t k_len, void *outv,
                                 int64_t os, int ncols, const float *res, int64_t rs, const char *pf, int pf_n,
                                 const int epi) {
    __m512 acc[GEMM_MR][4];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_len; k++, w += GEMM_NR) {
        if (pf) gemm_prefetch(pf, k, pf_n);
        const __m512 b0 = _mm512_loadu_ps(w), b1 = _mm512_loadu_ps(w + 16);
        const __m512 b2 = _mm512_loadu_ps(w + 32), b3 = _mm512_loadu_ps(w + 48);
        for (int r = 0; r < mr; r++) {
            const __m512 a = _mm512_set1_ps(x[r * xs + k]);
            acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(a, b3, acc[r][3]);
        }
    }
    gemm_store(acc, NULL, mr, outv, os, ncols, res, rs, epi == GEMM_SILU, F32, F32);
}

#if defined(__AVX512BF16__)
ALWAYS_INLINE void gemm_tile_bf16(const int mr, const uint16_t *x, int64_t xs, const uint16_t *w, int64_t pairs,
                                  void *outv, int64_t os, int ncols, const uint16_t *res, int64_t rs, const char *pf,
                                  int pf_n, const int epi) {
    __m512 acc[GEMM_MR][4];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < pairs; k++, w += 2 * GEMM_NR) {
        if (pf) gemm_prefetch(pf, k, pf_n);
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w), b1 = (__m512bh)_mm512_loadu_si512(w + 32);
        const __m512bh b2 = (__m512bh)_mm512_loadu_si512(w + 64), b3 = (__m512bh)_mm512_loadu_si512(w + 96);
        for (int r = 0; r < mr; r++) {
            uint32_t pair;
            memcpy(&pair, x + r * xs + 2 * k, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
        }
    }
    gemm_store(acc, NULL, mr, outv, os, ncols, res, rs, epi == GEMM_SILU, epi == GEMM_F32_OUT ? F32 : BF16, BF16);
}
#endif

#elif HAVE_AVX2
/* The same tiles with AVX2 and FMA, for CPUs without AVX-512 (Zen 2/3, Haswell to Comet Lake): 16
 * ymm registers instead of 32 zmm, so a tile of up to 6 rows takes its panel in four strips of 16
 * columns, each a pass over all of K with its 12 accumulators in registers (per k, 2 ymm of the
 * panel serve 6 rows and each x element 16 columns; x's rows come back from L1 for the next strip).
 * The strips land in a 6 x 64 fp32 buffer whose epilogue adds the residual, or computes silu(gate)
 * * up across the panel's halves, as the AVX-512 tile's does from its registers. bf16 panels (pairs
 * of k side by side, in strips as fp32's) are widened to fp32 in registers: a pair of k splits into
 * its even and odd halves with a shift and an and (x's rows are widened once a tile). Measured on
 * one core, CPU time of a SmolLM2-135M decode step's projections (30 layers and the lm_head, 64
 * rows): bf16 1.04-1.11x fp32's (the widening's ALU work; the weights' halved bytes do not matter at
 * that rate), a whole generate() 0.965x fp32's (the KV cache's halved bytes do). */
ALWAYS_INLINE void gemm_strip_f32(const int mr, const float *x, int64_t xs,
                                  const float *w, int64_t k_len, float *buf, const int acc_buf) {
    __m256 acc[GEMM_MR][2];
    for (int r = 0; r < mr; r++) {
        acc[r][0] = acc_buf ? _mm256_loadu_ps(buf + r * GEMM_NR) : _mm256_setzero_ps();
        acc[r][1] = acc_buf ? _mm256_loadu_ps(buf + r * GEMM_NR + 8) : _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < k_len; k++, w += 16) {
        const __m256 b0 = _mm256_loadu_ps(w), b1 = _mm256_loadu_ps(w + 8);
        for (int r = 0; r < mr; r++) {
            const __m256 a = _mm256_broadcast_ss(x + r * xs + k);
            acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(buf + r * GEMM_NR, acc[r][0]);
        _mm256_storeu_ps(buf + r * GEMM_NR + 8, acc[r][1]);
    }
}

/* bf16: 16 columns of a panel for mr rows over `pairs` pairs of k, x already widened to fp32 (xf, rows
 * xfs apart), into buf, adding to what it holds unless first */
ALWAYS_INLINE void gemm_strip_bf16(const int mr, const float *xf, int64_t xfs,
                                   const uint16_t *w, int64_t pairs, float *buf,
                                   const int first) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 acc[GEMM_MR][2];
    for (int r = 0; r < mr; r++) {
        acc[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(buf + r * GEMM_NR);
        acc[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(buf + r * GEMM_NR + 8);
    }
    for (int64_t k = 0; k < pairs; k++, w += 32) {
        /* k's elements, then k + 1's: 12 accumulators, 2 of weights and a broadcast fit the 16
         * registers, where both halves at once spilled; the barrier makes the second half load the
         * weights again (from L1) instead of keeping them in two more registers */
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)w), 16));
        const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(w + 16)), 16));
        for (int r = 0; r < mr; r++) { /* broadcasts from memory: load ports, not the vector ALUs */
            const __m256 a = _mm256_broadcast_ss(xf + r * xfs + 2 * k);
            acc[r][0] = _mm256_fmadd_ps(a, e0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, e1, acc[r][1]);
        }
        __asm__ __volatile__("" ::: "memory");
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)w), hi));
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(w + 16)), hi));
        for (int r = 0; r < mr; r++) {
            const __m256 a = _mm256_broadcast_ss(xf + r * xfs + 2 * k + 1);
            acc[r][0] = _mm256_fmadd_ps(a, o0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, o1, acc[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(buf + r * GEMM_NR, acc[r][0]);
        _mm256_storeu_ps(buf + r * GEMM_NR + 8, acc[r][1]);
    }
}

/* buf's mr rows (+ residual, or silu(gate) * up) into out's rows, the first ncols columns; bf16: out
 * and res hold bf16 (out fp32 with GEMM_F32_OUT), else both fp32 */
ALWAYS_INLINE void gemm_epilogue_avx2(const float *buf, const int mr, void *outv,
                                      int64_t os, int ncols, const void *resv,
                                      int64_t rs, const int epi, const int bf16) {
    const int f32_out = !bf16 || epi == GEMM_F32_OUT;
    for (int r = 0; r < mr; r++) {
        const float *b = buf + r * GEMM_NR;
        for (int c = 0; c < ncols; c += 8) {
            const int n = ncols - c < 8 ? ncols - c : 8;
            __m256 v = _mm256_loadu_ps(b + c);
            if (epi == GEMM_SILU) {
                const __m256 e = exp256_ps(_mm256_sub_ps(_mm256_setzero_ps(), v));
                v = _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), _mm256_loadu_ps(b + 32 + c));
            } else if (resv) {
                __m256 rv;
                if (bf16) {
                    uint16_t tmp[8] = {0};
                    memcpy(tmp, (const uint16_t *)resv + r * rs + c, sizeof(uint16_t) * (size_t)n);
                    rv = bf16x8_to_ps(_mm_loadu_si128((const __m128i *)tmp));
                } else {
                    rv = _mm256_maskload_ps((const float *)resv + r * rs + c, first_lanes(n));
                }
                v = _mm256_add_ps(v, rv);
            }
            if (f32_out) {
                float *o = (float *)outv + r * os + c;
                if (n == 8) _mm256_storeu_ps(o, v);
                else _mm256_maskstore_ps(o, first_lanes(n), v);
            } else {
                uint16_t *o = (uint16_t *)outv + r * os + c;
                const __m128i h = ps_to_bf16x8(v);
                if (n == 8) {
                    _mm_storeu_si128((__m128i *)o, h);
                } else {
                    uint16_t tmp[8];
                    _mm_storeu_si128((__m128i *)tmp, h);
                    memcpy(o, tmp, sizeof(uint16_t) * (size_t)n);
                }
            }
        }
    }
}

/* whether strip j (16 columns) reaches the output: with silu, a gate strip and its up strip, 32
 * columns on, both do where the gate's columns do */
ALWAYS_INLINE int gemm_strip_used(int j, const int epi, int ncols) { return 16 * (epi == GEMM_SILU ? j % 2 : j) < ncols; }

/* Panels are strips here (fp32 [4][K][16], bf16 [4][K/2][16][2]; kernels/cpu_gemm.py pack_panels):
 * a strip's pass reads its weights in order, where the AVX-512 layouts' rows of 64 had it read one
 * line in every four, and the next panel is not prefetched. Measured on 2 Zen 3 cores, a decode
 * step's projections (30 layers, weights from DRAM, median of 15, ms at 64 / 128 rows): fp32 rows
 * with the prefetch 159 / 324, rows without it 135 / 251, strips with it 159 / 307, strips without
 * it 111 / 223 (on one core the prefetch still helped the rows, 202 against 225 ms, and strips
 * without it were the fastest, 183); bf16 128 / 254 in rows with the prefetch, 112 / 234 in strips
 * without it. */
ALWAYS_INLINE void gemm_tile_f32(
    const int mr, const float *x, int64_t xs, const float *w, int64_t k_len, void *outv, int64_t os,
    int ncols, const float *res, int64_t rs, const int epi) {
    float buf[GEMM_MR * GEMM_NR] __attribute__((aligned(32)));
    for (int j = 0; j < 4; j++)
        if (gemm_strip_used(j, epi, ncols)) gemm_strip_f32(mr, x, xs, w + 16 * j * k_len, k_len, buf + 16 * j, 0);
    gemm_epilogue_avx2(buf, mr, outv, os, ncols, res, rs, epi, 0);
}

/* A row task this tall takes K in chunks of about GEMM_KC (gemm_task_kblocked_f32): a prefill's (its
 * blocks of GEMM_KB_ROW_BLOCK rows, or a part of one), and at 128 sequences a decode step's gate/up;
 * a decode step of 64 keeps the unblocked tiles. */
enum {
    GEMM_KB_ROWS = 96,
    GEMM_KC = 256,
    GEMM_KB_ROW_BLOCK = 480, /* the fp32 AVX2 build's rows a block (gemm_rows): x's chunk 480 KiB */
};

/* gemm_strip_f32 adding to buf's sums, for a tile of h rows (1 .. GEMM_MR) */
ALWAYS_INLINE void gemm_strip_f32_h(int h, const float *x, int64_t xs, const float *w, int64_t k_len, float *buf) {
    switch (h) {
    case 6: gemm_strip_f32(6, x, xs, w, k_len, buf, 1); break;
    case 5: gemm_strip_f32(5, x, xs, w, k_len, buf, 1); break;
    case 4: gemm_strip_f32(4, x, xs, w, k_len, buf, 1); break;
    case 3: gemm_strip_f32(3, x, xs, w, k_len, buf, 1); break;
    case 2: gemm_strip_f32(2, x, xs, w, k_len, buf, 1); break;
    default: gemm_strip_f32(1, x, xs, w, k_len, buf, 1); break;
    }
}

/* A task of `rows` rows (at most GEMM_KB_ROW_BLOCK) in `tiles` tiles against one fp32 panel, K in
 * chunks of about GEMM_KC: each chunk of a strip (16 KiB at 256) passes over all the task's tiles
 * while it stays in L1, and the x rows' chunk in L2, where the unblocked tiles read a whole block
 * of rows (240 x 576 fp32, 540 KiB, more than a Zen 3's L2 of 512 KiB) once a panel. The sums wait
 * in c (rows x 64 fp32) between chunks, and each accumulator takes its k in order, as the unblocked
 * tile's does: the same products, bit for bit. The blocks of rows can then be twice as tall, so the
 * weights stream half as often. Measured on 2 Zen 3 cores, a prefill's four projections of 8192
 * rows with 6 layers' weights (GFLOP/s, medians of 5 alternated rounds, two runs): unblocked 107.6,
 * chunks with blocks of 240 rows 120.0 / 102.9, of 360 99.0, of 480 125.5 / 118.4, of 720 117.5,
 * of 480 with chunks of 128 115.2; at 128 rows (a decode step's gate/up, one block) 120.3 against
 * 118.7 unblocked. */
static void gemm_task_kblocked_f32(const float *x, int64_t xs, int64_t rows, int64_t k, const float *wp,
                                   void *o, int64_t os, int ncols, const float *rp, int64_t rs,
                                   int64_t tiles, const int epi) {
    float c[GEMM_KB_ROW_BLOCK * GEMM_NR] __attribute__((aligned(32))); /* 120 KiB of the thread's stack */
    const int64_t chunks = (k + GEMM_KC - 1) / GEMM_KC, kc = (k + chunks - 1) / chunks;
    memset(c, 0, sizeof(float) * (size_t)(rows * GEMM_NR));
    for (int64_t k0 = 0; k0 < k; k0 += kc) {
        const int64_t kl = k - k0 < kc ? k - k0 : kc;
        for (int j = 0; j < 4; j++) {
            if (!gemm_strip_used(j, epi, ncols)) continue;
            const float *ws = wp + 16 * (j * k + k0);
            for (int64_t i = 0, r = 0; i < tiles; i++) {
                const int h = (int)(rows / tiles + (i < rows % tiles));
                gemm_strip_f32_h(h, x + r * xs + k0, xs, ws, kl, c + r * GEMM_NR + 16 * j);
                r += h;
            }
        }
    }
    for (int64_t i = 0, r = 0; i < tiles; i++) {
        const int h = (int)(rows / tiles + (i < rows % tiles));
        gemm_epilogue_avx2(c + r * GEMM_NR, h, (float *)o + r * os, os, ncols, rp ? rp + r * rs : NULL, rs, epi, 0);
        r += h;
    }
}

/* bf16: x's rows are widened to fp32 GEMM_XF_PAIRS pairs of k at a time (a 12 KiB buffer on the
 * stack), once for the four strips; broadcasting a bf16 in the inner loop instead (a shift and a
 * move per row) left the vector ALUs short of the FMA rate */
enum { GEMM_XF_PAIRS = 256 };
ALWAYS_INLINE void gemm_tile_bf16(
    const int mr, const uint16_t *x, int64_t xs, const uint16_t *w, int64_t pairs, void *outv,
    int64_t os, int ncols, const uint16_t *res, int64_t rs, const int epi) {
    float buf[GEMM_MR * GEMM_NR] __attribute__((aligned(32)));
    float xf[GEMM_MR * 2 * GEMM_XF_PAIRS] __attribute__((aligned(32)));
    for (int64_t k0 = 0; k0 < pairs; k0 += GEMM_XF_PAIRS) {
        const int64_t np = pairs - k0 < GEMM_XF_PAIRS ? pairs - k0 : GEMM_XF_PAIRS;
        for (int r = 0; r < mr; r++) {
            const uint16_t *xr = x + r * xs + 2 * k0;
            float *d = xf + r * 2 * GEMM_XF_PAIRS;
            int64_t i = 0;
            for (; i + 8 <= 2 * np; i += 8) _mm256_storeu_ps(d + i, bf16x8_to_ps(_mm_loadu_si128((const __m128i *)(xr + i))));
            for (; i < 2 * np; i++) d[i] = bf16_to_f32(xr[i]);
        }
        for (int j = 0; j < 4; j++)
            if (gemm_strip_used(j, epi, ncols))
                gemm_strip_bf16(mr, xf, 2 * GEMM_XF_PAIRS, w + 32 * (j * pairs + k0), np, buf + 16 * j, k0 == 0);
    }
    gemm_epilogue_avx2(buf, mr, outv, os, ncols, res, rs, epi, 1);
}
#endif

#if HAVE_SIMD
/* How many parts to split the rows into, so that panels * parts tasks share num_threads threads
 * evenly (at most 5% idle, else the evenest of 1, 2, 4, 8 parts), each part at least min_rows rows. */
static int64_t gemm_row_parts(int64_t m, int64_t panels, int num_threads, int64_t min_rows) {
    int64_t best = 1;
    double best_idle = 1.0;
    for (int64_t parts = 1; parts <= 8 && (parts == 1 || m / parts >= min_rows); parts *= 2) {
        const int64_t tasks = panels * parts, rounds = (tasks + num_threads - 1) / num_threads;
        const double idle = 1.0 - (double)tasks / (double)(rounds * num_threads);
        if (idle < best_idle - 1e-9) best = parts, best_idle = idle;
        if (idle <= 0.05) break;
    }
    return best;
}
/* One tile of mr rows (1 .. GEMM_MR) of the panel wp: the kernel of type dt, with mr, epi and dt
 * constants (kk: its steps of k, a pair of k in bf16). */
ALWAYS_INLINE void gemm_tile_mr(const int mr, const void *xr, int64_t xs, const void *wp, int64_t kk, void *orow,
                                int64_t os, int ncols, const void *rrow, int64_t rs, const char *pf, int pf_n,
                                const int epi, const int dt) {
#if HAVE_AVX2 /* strips, read in order: no prefetch of the next panel (gemm_tile_f32) */
    (void)pf, (void)pf_n;
    if (dt == BF16) gemm_tile_bf16(mr, xr, xs, wp, kk, orow, os, ncols, rrow, rs, epi);
    else gemm_tile_f32(mr, xr, xs, wp, kk, orow, os, ncols, rrow, rs, epi);
#else
#if HAVE_GEMM_BF16
    if (dt == BF16) {
        gemm_tile_bf16(mr, xr, xs, wp, kk, orow, os, ncols, rrow, rs, pf, pf_n, epi);
        return;
    }
#endif
    (void)dt;
    gemm_tile_f32(mr, xr, xs, wp, kk, orow, os, ncols, rrow, rs, pf, pf_n, epi);
#endif
}

ALWAYS_INLINE void gemm_tile(int h, const void *xr, int64_t xs, const void *wp, int64_t kk, void *orow, int64_t os,
                             int ncols, const void *rrow, int64_t rs, const char *pf, int pf_n, const int epi,
                             const int dt) {
    switch (h) {
    case 6: gemm_tile_mr(6, xr, xs, wp, kk, orow, os, ncols, rrow, rs, pf, pf_n, epi, dt); break;
    case 5: gemm_tile_mr(5, xr, xs, wp, kk, orow, os, ncols, rrow, rs, pf, pf_n, epi, dt); break;
    case 4: gemm_tile_mr(4, xr, xs, wp, kk, orow, os, ncols, rrow, rs, pf, pf_n, epi, dt); break;
    case 3: gemm_tile_mr(3, xr, xs, wp, kk, orow, os, ncols, rrow, rs, pf, pf_n, epi, dt); break;
    case 2: gemm_tile_mr(2, xr, xs, wp, kk, orow, os, ncols, rrow, rs, pf, pf_n, epi, dt); break;
    default: gemm_tile_mr(1, xr, xs, wp, kk, orow, os, ncols, rrow, rs, pf, pf_n, epi, dt); break;
    }
}

/* Task t of a block of m rows: panel t / parts, row part t % parts. A part's rows go in tiles of
 * near-equal height (64 rows: nine of 6 and two of 5, not ten of 6 and one of 4). */
ALWAYS_INLINE void gemm_task(const void *x, int64_t xs, int64_t m, int64_t k, const void *w, int64_t n, void *out,
                             int64_t os, const void *res, int64_t rs, int64_t t, int64_t parts, int64_t rows_per,
                             int64_t panels, const int epi, const int dt) {
    const int width = epi == GEMM_SILU ? GEMM_NR / 2 : GEMM_NR; /* output columns a panel */
    const int64_t osz = epi == GEMM_F32_OUT ? 4 : dt_size(dt);  /* bytes an output */
    const int64_t kstep = dt == BF16 ? 2 : 1;                   /* k a step: a pair in bf16 */
    const int64_t p = t / parts, r0 = (t % parts) * rows_per;
    const int64_t r1 = r0 + rows_per < m ? r0 + rows_per : m;
    const void *wp = elem(w, p * GEMM_NR * k, dt);
    const int ncols = (int)(n - p * width < width ? n - p * width : width);
    char *o = (char *)out + p * width * osz;
    const void *rp = res ? elem(res, p * width, dt) : NULL;
    const int64_t tiles = (r1 - r0 + GEMM_MR - 1) / GEMM_MR;
#if HAVE_AVX2
    if (dt == F32 && r1 - r0 >= GEMM_KB_ROWS) {
        gemm_task_kblocked_f32(elem(x, r0 * xs, dt), xs, r1 - r0, k, wp, o + r0 * os * osz, os, ncols,
                               rp ? elem(rp, r0 * rs, dt) : NULL, rs, tiles, epi);
        return;
    }
#endif
    const int64_t kk = k / kstep;
#if HAVE_AVX2 /* strips, read in order: no prefetch of the next panel (gemm_tile_mr) */
    (void)panels;
    const int pf_n = 0;
#else
    const int64_t lpk = kstep * dt_size(dt); /* lines a step of k */
    const int pf_n = tiles > lpk ? -(int)(tiles / lpk) : (int)((lpk + tiles - 1) / tiles);
    const int64_t pf_tile = pf_n > 0 ? pf_n * kk : (kk - pf_n - 1) / -pf_n; /* lines a tile */
    const char *next = p + 1 < panels ? (const char *)elem(wp, GEMM_NR * k, dt) : NULL;
#endif
    for (int64_t i = 0, r = r0; i < tiles; i++) {
        const int h = (int)((r1 - r0) / tiles + (i < (r1 - r0) % tiles));
        const void *xr = elem(x, r * xs, dt);
        char *orow = o + r * os * osz;
        const void *rrow = rp ? elem(rp, r * rs, dt) : NULL;
#if HAVE_AVX2
        const char *pf = NULL;
#else
        const char *pf = next && i * pf_tile < lpk * kk ? next + i * pf_tile * 64 : NULL;
#endif
        gemm_tile(h, xr, xs, wp, kk, orow, os, ncols, rrow, rs, pf, pf_n, epi, dt);
        r += h;
    }
}

/* gemm_task with epi and dt constants: each combination its own inlined copy */
static void gemm_task_of(const void *x, int64_t xs, int64_t m, int64_t k, const void *w, int64_t n, void *out,
                         int64_t os, const void *res, int64_t rs, int64_t t, int64_t parts, int64_t rows_per,
                         int64_t panels, int epi, int dt) {
#if HAVE_GEMM_BF16
    if (dt == BF16) {
        if (epi == GEMM_SILU)
            gemm_task(x, xs, m, k, w, n, out, os, res, rs, t, parts, rows_per, panels, GEMM_SILU, BF16);
        else if (epi == GEMM_F32_OUT)
            gemm_task(x, xs, m, k, w, n, out, os, res, rs, t, parts, rows_per, panels, GEMM_F32_OUT, BF16);
        else
            gemm_task(x, xs, m, k, w, n, out, os, res, rs, t, parts, rows_per, panels, 0, BF16);
        return;
    }
#endif
    (void)dt;
    if (epi == GEMM_SILU)
        gemm_task(x, xs, m, k, w, n, out, os, res, rs, t, parts, rows_per, panels, GEMM_SILU, F32);
    else if (epi == GEMM_F32_OUT)
        gemm_task(x, xs, m, k, w, n, out, os, res, rs, t, parts, rows_per, panels, GEMM_F32_OUT, F32);
    else
        gemm_task(x, xs, m, k, w, n, out, os, res, rs, t, parts, rows_per, panels, 0, F32);
}

/* One block of m rows. Task t = (panel t / parts, row part t % parts): a static schedule hands each
 * thread a contiguous run of them, so its panels are its own. */
static void gemm_block(const void *x, int64_t xs, int64_t m, int64_t k, const void *w, int64_t n, void *out,
                       int64_t os, const void *res, int64_t rs, int epi, int num_threads, int dt) {
    const int width = epi == GEMM_SILU ? GEMM_NR / 2 : GEMM_NR; /* output columns a panel */
    const int64_t panels = (n + width - 1) / width;
    const int64_t parts = gemm_row_parts(m, panels, num_threads, GEMM_MR);
    const int64_t rows_per = (m + parts - 1) / parts, tasks = panels * parts;
#pragma omp parallel for num_threads(num_threads) if (tasks > 1 && (m * n * k >= PARALLEL_MIN_ELEMS * 16 || n * k >= GEMM_PARALLEL_WEIGHT)) schedule(static)
    for (int64_t t = 0; t < tasks; t++)
        gemm_task_of(x, xs, m, k, w, n, out, os, res, rs, t, parts, rows_per, panels, epi, dt);
}

/* The rows in blocks of GEMM_ROW_BLOCK; an epi other than GEMM_SILU and GEMM_F32_OUT is 0. */
static int gemm_rows(const void *x, int64_t xs, int64_t m, int64_t k, const void *w, int64_t n, void *out,
                     int64_t os, const void *res, int64_t rs, int epi, int num_threads, int dt) {
    epi = epi == GEMM_SILU || epi == GEMM_F32_OUT ? epi : 0;
    const int64_t osz = epi == GEMM_F32_OUT ? 4 : dt_size(dt); /* bytes an output */
#if HAVE_AVX2
    const int64_t block = dt == F32 ? GEMM_KB_ROW_BLOCK : GEMM_ROW_BLOCK; /* fp32: K in chunks (gemm_task) */
#else
    const int64_t block = GEMM_ROW_BLOCK;
#endif
    for (int64_t b0 = 0; b0 < m; b0 += block) {
        const int64_t mb = m - b0 < block ? m - b0 : block;
        gemm_block(elem(x, b0 * xs, dt), xs, mb, k, w, n, (char *)out + b0 * os * osz, os,
                   res ? elem(res, b0 * rs, dt) : NULL, rs, epi, num_threads, dt);
    }
    return 0;
}
#endif /* HAVE_SIMD */

/* bf16 on AMX (Sapphire Rapids and later): the same panels, read as tiles. A tile multiply
 * (tdpbf16ps) takes C (16 x 16 fp32) += A (16 rows x 32 k of x) . B (32 k x 16 columns), B's rows
 * being pairs of k side by side: exactly 16 pair-rows of 16 columns of a bf16 panel (64 bytes of a
 * 256-byte pair-row), so one packing serves both kernels. A block of up to 32 rows takes a panel in
 * two halves of 32 columns: 2 x 2 accumulator tiles, 2 tiles of x and 2 of the panel per 32 k (4
 * loads for 4 multiplies), stored to a per-thread fp32 buffer of 32 x 64 whose epilogue is the
 * vector kernel's (residual, or silu(gate) * up across the halves of a gate/up panel). Without the
 * tiles (common.c: amx_on), or with K not a multiple of 32, bf16 takes the vdpbf16ps kernel. */
#if HAVE_AMX
/* tiles 0-3 accumulators (row block 0: 0, 1; row block 1: 2, 3), 4-5 x, 6-7 the panel */
static void amx_configure(int rows0, int rows1) {
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    const int colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_shapes(rows, colsb);
}

/* columns [32 h, 32 h + 32) of a panel for 16 (two = 0) or 32 (two = 1) rows into buf (rows 64 floats
 * apart); pf_n lines of the next panel (pf) into L2 per 32 k */
ALWAYS_INLINE void amx_half(
    const uint16_t *x, int64_t xs, const uint16_t *wp, int64_t steps, float *buf, int h, const int two,
    const char *pf, int pf_n) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const uint16_t *b = wp + 2 * 32 * h; /* 32 h columns in, pairs */
    for (int64_t s = 0; s < steps; s++, b += 16 * 2 * GEMM_NR, x += 32) {
        if (pf) gemm_prefetch(pf, s, pf_n);
        _tile_loadd(6, b, 4 * GEMM_NR);
        _tile_loadd(7, b + 32, 4 * GEMM_NR);
        _tile_loadd(4, x, xs * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x + 16 * xs, xs * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, buf + 32 * h, 4 * GEMM_NR);
    _tile_stored(1, buf + 32 * h + 16, 4 * GEMM_NR);
    if (two) {
        _tile_stored(2, buf + 16 * GEMM_NR + 32 * h, 4 * GEMM_NR);
        _tile_stored(3, buf + 16 * GEMM_NR + 32 * h + 16, 4 * GEMM_NR);
    }
}

static void amx_epilogue(const float *buf, int mr, void *outv, int64_t os, int ncols,
                         const uint16_t *res, int64_t rs, const int epi) {
    gemm_store(NULL, buf, mr, outv, os, ncols, res, rs, epi == GEMM_SILU, epi == GEMM_F32_OUT ? F32 : BF16, BF16);
}

enum {
    AMX_ROWS = 32,       /* a block: two tiles of x */
    AMX_TILE_ROWS = 16,  /* a tile's rows */
    AMX_ROW_BLOCK = 480, /* rows a pass over the panels: x's block (480 x 576 bf16, 540 KiB) stays in L2 */
};

static int gemm_bf16_amx(const uint16_t *x, int64_t xs, int64_t m, int64_t k, const uint16_t *w,
                         int64_t n, void *out, int64_t os, const uint16_t *res, int64_t rs, int epi,
                         int num_threads) {
    const int silu = epi == GEMM_SILU;
    const int64_t osz = epi == GEMM_F32_OUT ? 4 : 2; /* bytes an output */
    const int width = silu ? GEMM_NR / 2 : GEMM_NR; /* output columns a panel */
    const int64_t panels = (n + width - 1) / width, steps = k / 32;
    for (int64_t b0 = 0; b0 < m; b0 += AMX_ROW_BLOCK) {
        const int64_t mb = m - b0 < AMX_ROW_BLOCK ? m - b0 : AMX_ROW_BLOCK;
        const int64_t parts = gemm_row_parts(mb, panels, num_threads, AMX_TILE_ROWS);
        const int64_t rows_per = (mb + parts - 1) / parts, tasks = panels * parts;
#pragma omp parallel num_threads(num_threads) if (tasks > 1 && (mb * n * k >= PARALLEL_MIN_ELEMS * 64 || n * k >= GEMM_PARALLEL_WEIGHT))
        {
            float buf[AMX_ROWS * GEMM_NR] __attribute__((aligned(64)));
            int cfg0 = -1, cfg1 = -1;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) {
                const int64_t p = t / parts, r0 = b0 + (t % parts) * rows_per;
                const int64_t r1 = r0 + rows_per < b0 + mb ? r0 + rows_per : b0 + mb;
                if (r0 >= r1) continue;
                const uint16_t *wp = w + p * GEMM_NR * k;
                const int ncols = (int)(n - p * width < width ? n - p * width : width);
                const int64_t blocks = (r1 - r0 + AMX_ROWS - 1) / AMX_ROWS;
                /* the next panel's 2 K * 64 bytes = 2 K lines, spread over this task's 2 * blocks * steps steps */
                const int pf_n = (int)((2 * k + 2 * blocks * steps - 1) / (2 * blocks * steps));
                const char *next = p + 1 < panels ? (const char *)(wp + GEMM_NR * k) : NULL;
                for (int64_t i = 0, r = r0; r < r1; i++, r += AMX_ROWS) {
                    const int mr = (int)(r1 - r < AMX_ROWS ? r1 - r : AMX_ROWS);
                    const int rows0 = mr < AMX_TILE_ROWS ? mr : AMX_TILE_ROWS, rows1 = mr - rows0;
                    if (rows0 != cfg0 || rows1 != cfg1) {
                        amx_configure(rows0, rows1);
                        cfg0 = rows0, cfg1 = rows1;
                    }
                    for (int h = 0; h < 2; h++) {
                        const int64_t done = (2 * i + h) * steps * pf_n; /* lines prefetched before */
                        const char *pf = next && done < 2 * k ? next + done * 64 : NULL;
                        if (h * 32 >= ncols && !silu) break; /* the panel's last columns are past n */
                        if (rows1)
                            amx_half(x + r * xs, xs, wp, steps, buf, h, 1, pf, pf_n);
                        else
                            amx_half(x + r * xs, xs, wp, steps, buf, h, 0, pf, pf_n);
                    }
                    amx_epilogue(buf, mr, (char *)out + (r * os + p * width) * osz, os, ncols,
                                 res ? res + r * rs + p * width : NULL, rs, epi);
                }
            }
            if (cfg0 >= 0) _tile_release();
        }
    }
    return 0;
}
#endif /* HAVE_AMX */
/* out (m, n), rows os apart = x (m, k), rows xs apart, @ the packed weight (+ res (m, n), rows rs
 * apart, when not NULL; it may be out itself). epi GEMM_SILU (res unused): the weight's panels are
 * gate/up pairs (32 columns of each, kernels/cpu_gemm.py pack_gate_up) and out (m, n) = silu(x @
 * gate.T) * (x @ up.T), n the intermediate size; GEMM_F32_OUT (bf16): out is fp32, the accumulators
 * unrounded (the logits, which the sampler reads as fp32). 0 done, 2 declined (no code for this CPU). */
int gemm(const void *x, int64_t xs, int64_t m, int64_t k, const void *w, int64_t n, void *out, int64_t os,
         const void *res, int64_t rs, int epi, int num_threads, int dt) {
#if HAVE_GEMM_BF16
    if (dt == BF16) {
        if (k % 2) return 2;
#if HAVE_AMX
        if (k % 32 == 0 && amx_on()) return gemm_bf16_amx(x, xs, m, k, w, n, out, os, res, rs, epi, num_threads);
#endif
        return gemm_rows(x, xs, m, k, w, n, out, os, res, rs, epi, num_threads, BF16);
    }
#endif
#if HAVE_SIMD
    if (dt == F32) return gemm_rows(x, xs, m, k, w, n, out, os, res, rs, epi, num_threads, F32);
#endif
    (void)x, (void)xs, (void)m, (void)k, (void)w, (void)n, (void)out, (void)os, (void)res, (void)rs;
    (void)epi, (void)num_threads, (void)dt;
    return 2;
}

int gemm_f32(const float *x, int64_t xs, int64_t m, int64_t k, const float *w, int64_t n, float *out,
             int64_t os, const float *res, int64_t rs, int epi, int num_threads) {
    return gemm(x, xs, m, k, w, n, out, os, res, rs, epi, num_threads, F32);
}

int gemm_bf16(const uint16_t *x, int64_t xs, int64_t m, int64_t k, const uint16_t *w, int64_t n,
              void *out, int64_t os, const uint16_t *res, int64_t rs, int epi, int num_threads) {
    return gemm(x, xs, m, k, w, n, out, os, res, rs, epi, num_threads, BF16);
}

/* The first index of row's largest value, or of its first NaN, as torch.argmax answers; *top gets
 * that value (NaN for a NaN). cols >= 1. */
static inline int64_t row_argmax(const float *row, int64_t cols, float *top_out) {
    int64_t best = 0, j = 0;
    float top = -INFINITY;
    int64_t nan_at = -1;
#if HAVE_AVX512
    if (cols >= 16) {
        __m512 mv = _mm512_loadu_ps(row);
        const __m512i step = _mm512_set1_epi32(16);
        __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i mi = idx;
        __mmask16 nan = _mm512_cmp_ps_mask(mv, mv, _CMP_UNORD_Q);
        for (j = 16; !nan && j + 16 <= cols; j += 16) {
            const __m512 v = _mm512_loadu_ps(row + j);
            idx = _mm512_add_epi32(idx, step);
            nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ); /* strict: keeps the first */
            mv = _mm512_mask_mov_ps(mv, gt, v);
            mi = _mm512_mask_mov_epi32(mi, gt, idx);
        }
        if (nan) { /* the chunk it was found in began at j - 16, the first chunk included */
            nan_at = j - 16 + __builtin_ctz(nan);
        } else {
            top = _mm512_reduce_max_ps(mv);
            const __mmask16 eq = _mm512_cmp_ps_mask(mv, _mm512_set1_ps(top), _CMP_EQ_OQ);
            best = _mm512_mask_reduce_min_epi32(eq, mi);
        }
    }
#elif HAVE_AVX2
    if (cols >= 8) { /* as above, 8 at a time */
        __m256 mv = _mm256_loadu_ps(row);
        const __m256i step = _mm256_set1_epi32(8);
        __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), mi = idx;
        int nan = _mm256_movemask_ps(_mm256_cmp_ps(mv, mv, _CMP_UNORD_Q));
        for (j = 8; !nan && j + 8 <= cols; j += 8) {
            const __m256 v = _mm256_loadu_ps(row + j);
            idx = _mm256_add_epi32(idx, step);
            nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            const __m256 gt = _mm256_cmp_ps(v, mv, _CMP_GT_OQ); /* strict: keeps the first */
            mv = _mm256_blendv_ps(mv, v, gt);
            mi = _mm256_blendv_epi8(mi, idx, _mm256_castps_si256(gt));
        }
        if (nan) {
            nan_at = j - 8 + __builtin_ctz((unsigned)nan);
        } else {
            top = hmax256(mv);
            const int eq = _mm256_movemask_ps(_mm256_cmp_ps(mv, _mm256_set1_ps(top), _CMP_EQ_OQ));
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, mi);
            best = INT64_MAX;
            for (int l = 0; l < 8; l++)
                if ((eq >> l & 1) && lanes[l] < best) best = lanes[l];
        }
    }
#endif
    if (nan_at < 0) {
        for (; j < cols; j++) {
            const float v = row[j];
            if (v != v) {
                nan_at = j;
                break;
            }
            if (v > top) top = v, best = j;
        }
    }
    *top_out = nan_at >= 0 ? NAN : top;
    return nan_at >= 0 ? nan_at : best;
}

/* Row-wise argmax of x (rows, cols) fp32 rows x_stride apart into out (rows,) int64: the first index
 * of the row's largest value, or of its first NaN, as torch.argmax answers (the sampler's greedy
 * pick, which torch takes ~10x longer over a vocabulary-wide row). cols < 2^31. */
void argmax_rows_f32(const float *x, int64_t x_stride, int64_t rows, int64_t cols, int64_t *out,
                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float top;
        out[r] = row_argmax(x + r * x_stride, cols, &top);
    }
}

/* Greedy tokens from the lm_head without its logits: out (m,) int64 = argmax over n of x (m, k) @ W.T,
 * W in panels (above), as gemm then argmax_rows_f32 would answer (the same fp32 sums: a bf16
 * product's accumulators unrounded, GEMM_F32_OUT). Each thread takes an even run of the panels and
 * goes through it a chunk at a time: the chunk's products for every row into its own part of scratch
 * (about ARGMAX_CHUNK_FLOATS: it stays in the thread's L2), then folded into its own picks at once,
 * so the (m, n) logits never reach memory and no thread reads products another one wrote (128 x 49152
 * fp32 is 25 MB). The threads' picks are then folded in column order: the first maximum (first NaN)
 * stays, as in torch.argmax. scratch: the caller's, num_threads x argmax_scratch_floats(m); top: m
 * floats of the caller's. 0 done, 1 out of memory, 2 declined (the GEMM has no code here). */
enum { ARGMAX_CHUNK_FLOATS = 65536 }; /* 256 KiB of products a chunk */

static int64_t argmax_chunk_panels(int64_t m) {
    const int64_t p = ARGMAX_CHUNK_FLOATS / (m * 64);
    return p > 0 ? p : 1;
}

int64_t argmax_scratch_floats(int64_t m) { return argmax_chunk_panels(m) * 64 * m; }

/* pick (v, j) into (top, idx) where it comes after them in column order: larger, or a first NaN */
static inline void argmax_take(float *top, int64_t *idx, float v, int64_t j, int first) {
    if (first || (*top == *top && (v != v || v > *top))) *top = v, *idx = j;
}

/* One thread's chunk: x (m, k) @ the n columns of panels w -> out (m, n) fp32, on the calling thread. */
typedef int (*ChunkGemm)(const void *x, int64_t xs, int64_t m, int64_t k, const void *w, int64_t n, float *out);

static int chunk_f32(const void *x, int64_t xs, int64_t m, int64_t k, const void *w, int64_t n, float *out) {
    return gemm(x, xs, m, k, w, n, out, n, NULL, 0, 0, 1, F32);
}

static int chunk_bf16(const void *x, int64_t xs, int64_t m, int64_t k, const void *w, int64_t n, float *out) {
    return gemm(x, xs, m, k, w, n, out, n, NULL, 0, GEMM_F32_OUT, 1, BF16);
}

static int gemm_argmax(ChunkGemm gemm, size_t esize, const void *x, int64_t xs, int64_t m, int64_t k,
                       const char *w, int64_t n, float *scratch, float *top, int64_t *out, int num_threads) {
    const int64_t panels = (n + 63) / 64, cp = argmax_chunk_panels(m);
    if (num_threads < 1) num_threads = 1;
    if (num_threads > panels) num_threads = (int)panels;
    float *tops = (float *)malloc(sizeof(float) * (size_t)(num_threads * m));
    int64_t *idxs = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_threads * m));
    int rc = tops && idxs ? 0 : 1, used = 1;
    if (!rc) {
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
        {
            int t = 0, nth = 1;
#ifdef _OPENMP
            t = omp_get_thread_num();
            nth = omp_get_num_threads();
#endif
            if (t == 0) used = nth;
            float *scr = scratch + (int64_t)t * cp * 64 * m, *tp = tops + (int64_t)t * m;
            int64_t *ip = idxs + (int64_t)t * m;
            const int64_t p0 = panels * t / nth, p1 = panels * (t + 1) / nth;
            for (int64_t pp = p0; pp < p1; pp += cp) {
                const int64_t c0 = pp * 64, c1 = (pp + cp < p1 ? pp + cp : p1) * 64;
                const int64_t cols = (c1 < n ? c1 : n) - c0;
                const int e = gemm(x, xs, m, k, w + c0 * k * (int64_t)esize, cols, scr);
                if (e) {
#pragma omp atomic write
                    rc = e;
                    break;
                }
                for (int64_t r = 0; r < m; r++) {
                    float v;
                    const int64_t j = row_argmax(scr + r * cols, cols, &v);
                    argmax_take(tp + r, ip + r, v, c0 + j, pp == p0);
                }
            }
        }
        for (int t = 0; t < used && !rc; t++)
            for (int64_t r = 0; r < m; r++) argmax_take(top + r, out + r, tops[t * m + r], idxs[t * m + r], t == 0);
    }
    free(tops);
    free(idxs);
    return rc;
}

int gemm_argmax_f32(const float *x, int64_t xs, int64_t m, int64_t k, const float *w, int64_t n, float *scratch,
                    float *top, int64_t *out, int num_threads) {
    return gemm_argmax(chunk_f32, sizeof(float), x, xs, m, k, (const char *)w, n, scratch, top, out, num_threads);
}

int gemm_argmax_bf16(const uint16_t *x, int64_t xs, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                     float *scratch, float *top, int64_t *out, int num_threads) {
    return gemm_argmax(chunk_bf16, sizeof(uint16_t), x, xs, m, k, (const char *)w, n, scratch, top, out,
                       num_threads);
}
