/* The CPU path's native kernels, for fp32 and bf16 tensors (computing in fp32 either way): paged
 * decode attention, (fused add +) RMSNorm, rotary embedding, SiLU-and-mul and the KV-cache store.
 * Each replaces several torch ops (and their temporaries) by one pass. The typed kernels are in
 * cpu_kernels_typed.h, included below once per storage type (C's templates).
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
 * Each OpenMP thread takes a contiguous run of items of about equal total context, so it knows its
 * next item and asks for that item's keys (values) while it reads this one's: the decode step's KV
 * comes from DRAM (every layer's cache is far larger than L3), and latency, not bandwidth, was what
 * bounded the kernel. With
 * AVX-512 and G <= 8, head_dim in {32, 64, 128}, a specialised version keeps queries and
 * accumulators in registers and computes the softmax's exponentials 16 at a time.
 */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512 1
#define HAVE_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX512 0
#define HAVE_AVX2 1
#else
#define HAVE_AVX512 0
#define HAVE_AVX2 0
#endif
#define HAVE_SIMD (HAVE_AVX512 || HAVE_AVX2)
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define PARALLEL_MIN_ELEMS 65536 /* elementwise kernels split rows over threads from this size */

/* bf16 <-> fp32: a bf16 is the top half of an fp32; rounding to nearest even, NaN kept quiet. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* e^u for |u| <= 0.35 by its degree-7 Taylor polynomial (Horner), in any vector width */
#define EXP_TAYLOR7(V, FMA, SET1, u) ({                                                              \
    V r_ = SET1(1.0f / 5040.0f);                                                                     \
    const float c_[7] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}; \
    for (int i_ = 0; i_ < 7; i_++) r_ = FMA(r_, (u), SET1(c_[i_]));                                 \
    r_;                                                                                               \
})

#if HAVE_AVX512
#include <immintrin.h>

/* exp(x), used for x <= 0 (scores minus their max) and for silu: 2^(x log2 e) = 2^n * e^(f ln 2), |f| <= 1/2, with
 * e^u (|u| <= 0.35) by its degree-7 Taylor polynomial (error < 1e-8) and 2^n by scalef, which
 * underflows cleanly to 0 for very negative x. */
static inline __m512 exp_ps(__m512 x) {
    const __m512 y = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _mm512_set1_ps(-200.0f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 u = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147180559945309f));
    const __m512 r = EXP_TAYLOR7(__m512, _mm512_fmadd_ps, _mm512_set1_ps, u);
    return _mm512_scalef_ps(r, n);
}

/* lane i of the result = the sum of v[i]'s 16 lanes: 16 horizontal sums in 45 shuffles and adds.
 * Lanes of v[i] reach only lane i, so a NaN in one input stays in its own lane. */
static inline __m512 sum16(const __m512 *v) {
    __m512 u[8], w[4];
    for (int k = 0; k < 8; k++) /* per 128-bit chunk: [a0+a2, b0+b2, a1+a3, b1+b3] */
        u[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) { /* per chunk: the chunk's sums of v[4k .. 4k+3] */
        const __m512d a = _mm512_castps_pd(u[2 * k]), b = _mm512_castps_pd(u[2 * k + 1]);
        w[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* add the 4 chunks of each w: chunk j of the result is w[j] summed over its chunks */
    const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
}

/* the largest of row[0 .. len - 1] (16 at a time, a masked tail); -inf for len 0 */
static inline float row_max_ps(const float *row, int len) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int t = 0;
    for (; t + 16 <= len; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + t));
    const __mmask16 tail = (__mmask16)((1u << (len - t)) - 1u);
    return _mm512_reduce_max_ps(_mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, row + t)));
}

static inline __m512 bf16x16_to_ps(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 32 bf16 at p as fp32: the even elements to *even, the odd ones to *odd (one shift, one and). */
static inline void bf16x32_to_ps_pairs(const uint16_t *p, __m512 *even, __m512 *odd) {
    const __m512i x = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* The inverse: even and odd elements rounded to bf16 (nearest even) and interleaved into p. */
static inline void ps_pairs_to_bf16x32(uint16_t *p, __m512 even, __m512 odd) {
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    const __m512i e = _mm512_castps_si512(even), o = _mm512_castps_si512(odd);
    const __m512i er = _mm512_add_epi32(e, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(e, 16), one)));
    const __m512i or_ = _mm512_add_epi32(o, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(o, 16), one)));
    _mm512_storeu_si512(p, _mm512_or_si512(_mm512_srli_epi32(er, 16),
                                           _mm512_and_si512(or_, _mm512_set1_epi32((int)0xffff0000u))));
}

static inline __m256i ps_to_bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else /* round to nearest even in integers; NaNs made quiet */
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
#endif
}

/* The element-wise kernels' vectors: VW fp32 lanes and their operations, one spelling per ISA. */
typedef __m512 vf;
#define VW 16
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VSUB(a, b) _mm512_sub_ps((a), (b))
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VDIV(a, b) _mm512_div_ps((a), (b))
#define VFMADD(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VFMSUB(a, b, c) _mm512_fmsub_ps((a), (b), (c))
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define VEXP(v) exp_ps(v)
#define VLD_F32(p) _mm512_loadu_ps(p)
#define VST_F32(p, v) _mm512_storeu_ps((p), (v))
#define VLD_BF16(p) bf16x16_to_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VST_BF16(p, v) _mm256_storeu_si256((__m256i *)(p), ps_to_bf16x16(v))
#define VROUND_BF16(v) bf16x16_to_ps(ps_to_bf16x16(v))

#elif HAVE_AVX2
#include <immintrin.h>

/* exp(x) as exp_ps above, 8 at a time, for x in [-87, 88] (clamped there: e^-87 is as good as 0
 * next to a softmax's 1, and silu's e^-x only grows); 2^n built in the exponent bits. */
static inline __m256 exp256_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 u = _mm256_mul_ps(_mm256_sub_ps(y, n), _mm256_set1_ps(0.693147180559945309f));
    const __m256 r = EXP_TAYLOR7(__m256, _mm256_fmadd_ps, _mm256_set1_ps, u);
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(r, _mm256_castsi256_ps(bits));
}

static inline float hsum256(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

static inline float hmax256(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

/* lane i of the result = the sum of v[i]'s 8 lanes (a transposing reduction: 7 adds, 2 permutes). */
static inline __m256 sum8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* the first m lanes set (m in 0 .. 8), for masked loads and stores */
static inline __m256i first_lanes(int m) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __m256 bf16x8_to_ps(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 8 floats rounded to bf16 (nearest even in integers; NaNs made quiet) */
static inline __m128i ps_to_bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

typedef __m256 vf;
#define VW 8
#define VZERO() _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VSUB(a, b) _mm256_sub_ps((a), (b))
#define VMUL(a, b) _mm256_mul_ps((a), (b))
#define VDIV(a, b) _mm256_div_ps((a), (b))
#define VFMADD(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VFMSUB(a, b, c) _mm256_fmsub_ps((a), (b), (c))
#define VHSUM(v) hsum256(v)
#define VEXP(v) exp256_ps(v)
#define VLD_F32(p) _mm256_loadu_ps(p)
#define VST_F32(p, v) _mm256_storeu_ps((p), (v))
#define VLD_BF16(p) bf16x8_to_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VST_BF16(p, v) _mm_storeu_si128((__m128i *)(p), ps_to_bf16x8(v))
#define VROUND_BF16(v) bf16x8_to_ps(ps_to_bf16x8(v))
#endif

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
#define L2_AHEAD 2 /* blocks */
#define STREAM_LEAD_BYTES (128 << 10) /* how far a thread's L2 stream runs ahead (2 AMX Xeon cores: 128-192 KiB best) */
#endif

/* Whether decode attention runs its L2 stream (cpu_kernels_typed.h): on, unless
 * batchgen_attention_stream() was told otherwise (BATCHGEN_ATTN_STREAM). Its first form asked for a
 * whole block at a time; on Intel that burst of prefetches stalled the arithmetic queued behind it
 * and it cost 3-24% on a 2-core AMX Xeon, so it ran on AMD only. Spread a line or two per key and
 * value read, it overlaps DRAM with compute there too (128 sequences x 160-300 tokens, 30 layers:
 * 36.8 against 42.0 ms; 64 x ~262: 20.2 against 24.2; 16 x ~1024: level). */
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

/* AMX (Xeon Sapphire Rapids and later): eight tile registers of up to 16 rows x 64 bytes and a
 * multiply (tdpbf16ps) of bf16 tiles into fp32 ones. Linux gives a process the tiles only once it
 * asks (arch_prctl, 5.16+); amx_on() asks once, and batchgen_amx() switches their use off and on
 * (BATCHGEN_AMX=0, kernels/cpu_native.py). The bf16 GEMM (cpu_gemm.h) uses them; without, its
 * vector code runs. (Decode attention on tiles was tried: on 2 Xeon cores it reads its keys and
 * values at ~13 GB/s either way, bound by memory, not arithmetic, so it stays vector code. Tried
 * again with the spread L2 stream, its scores only, keys straight from the cache as A tiles: 30
 * layers of 16 sequences in L2 2.3-2.4 against 2.8 ms, but 128 sequences from DRAM 38.6-40.7
 * against 38.1-39.8 ms.) */
#if HAVE_AVX512 && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

static int amx_state = -1; /* -1 not asked yet, 0 refused or switched off, 1 in use */

static int amx_on(void) {
    if (amx_state < 0) /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
        amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_state;
}

/* The calling thread's tile shapes: rows and bytes a row of tiles 0-7 (0 rows: unused). */
static void amx_shapes(const int rows[8], const int colsb[8]) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = (uint16_t)(rows[t] ? colsb[t] : 0);
    }
    /* GCC 12 does not count ldtilecfg's 64-byte read as a use of c and may drop the stores above
     * (seen: only the palette byte written, then a #GP on the garbage): make them happen first */
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}
#else
#define HAVE_AMX 0
#endif
#define PREFILL_AMX_MIN_Q 16 /* query tokens from which a prefill chunk's attention runs on AMX tiles */

/* Whether the kernels use AMX tiles: enable 1 (asking Linux for them once) or 0 switches, -1 only
 * asks; returns 1 when they do (built with AMX, tiles granted, switched on). */
int batchgen_amx(int enable) {
#if HAVE_AMX
    if (enable == 0) amx_state = 0;
    else if (enable == 1 && amx_state == 0) amx_state = -1;
    return enable == 0 ? 0 : amx_on();
#else
    (void)enable;
    return 0;
#endif
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

/* ---- fp32 ---- */
#define T float
#define SFX f32
#define LD(p) (*(p))
#define ST(p, x) (*(p) = (x))
#define VLD(p) VLD_F32(p)
#define VST(p, v) VST_F32(p, v)
#define VROUND(v) (v)
#define VLD2(p, a, b) ((a) = _mm512_loadu_ps(p), (b) = _mm512_loadu_ps((p) + 16))
#define VST2(p, a, b) (_mm512_storeu_ps((p), (a)), _mm512_storeu_ps((p) + 16, (b)))
#define DP_BF16 0
#include "cpu_kernels_typed.h" /* which undefines the parameters above */

/* ---- bf16 (uint16_t bits) ---- */
#define T uint16_t
#define SFX bf16
#define LD(p) bf16_to_f32(*(p))
#define ST(p, x) (*(p) = f32_to_bf16(x))
#define VLD(p) VLD_BF16(p)
#define VST(p, v) VST_BF16(p, v)
#define VROUND(v) VROUND_BF16(v)
#define VLD2(p, a, b) bf16x32_to_ps_pairs(p, &(a), &(b))
#define VST2(p, a, b) ps_pairs_to_bf16x32(p, a, b)
#if defined(__AVX512BF16__)
#define DP_BF16 1
#else
#define DP_BF16 0
#endif
#include "cpu_kernels_typed.h" /* which undefines the parameters above */


/* What this build's kernels use: 1 AVX-512, 2 AVX2 (without AVX-512), 4 AVX512-BF16's vdpbf16ps (the
 * tiled bf16 prefill), 8 a panel GEMM for fp32 (cpu_gemm.h: AVX-512 or AVX2), 16 one for bf16
 * (vdpbf16ps or AMX tiles; with AVX2 widened to fp32 in registers). */
int cpu_kernels_features(void) {
#if defined(__AVX512BF16__)
    const int dp = HAVE_AVX512 ? 4 : 0;
#else
    const int dp = 0;
#endif
    const int gemm_bf16 = dp || HAVE_AVX2 ? 16 : 0;
    return (HAVE_AVX512 ? 1 : 0) | (HAVE_AVX2 ? 2 : 0) | dp | (HAVE_SIMD ? 8 : 0) | gemm_bf16;
}

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

#include "cpu_gemm.h"
#include "cpu_decode.h"

/* Greedy tokens from the lm_head without its logits: out (m,) int64 = argmax over n of x (m, k) @ W.T,
 * W in panels (cpu_gemm.h), as gemm then argmax_rows_f32 would answer (the same fp32 sums: a bf16
 * product's accumulators unrounded, GEMM_F32_OUT). Each thread takes an even run of the panels and
 * goes through it a chunk at a time: the chunk's products for every row into its own part of scratch
 * (about ARGMAX_CHUNK_FLOATS: it stays in the thread's L2), then folded into its own picks at once,
 * so the (m, n) logits never reach memory and no thread reads products another one wrote (128 x 49152
 * fp32 is 25 MB). The threads' picks are then folded in column order: the first maximum (first NaN)
 * stays, as in torch.argmax. scratch: the caller's, num_threads x argmax_scratch_floats(m); top: m
 * floats of the caller's. 0 done, 1 out of memory, 2 declined (the GEMM has no code here). */
#define ARGMAX_CHUNK_FLOATS 65536 /* 256 KiB of products a chunk */

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
    return gemm_f32((const float *)x, xs, m, k, (const float *)w, n, out, n, NULL, 0, 0, 1);
}

static int chunk_bf16(const void *x, int64_t xs, int64_t m, int64_t k, const void *w, int64_t n, float *out) {
    return gemm_bf16((const uint16_t *)x, xs, m, k, (const uint16_t *)w, n, out, n, NULL, 0, GEMM_F32_OUT, 1);
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
