/* The ISA helpers every unit of the native library shares (kernels/cpu_native.py compiles the units
 * into one library per ISA variant): which vector instructions this build has (HAVE_*), bf16 <-> fp32,
 * exp and horizontal sums in each vector width, the element-wise kernels' vectors (vf: VW fp32 lanes)
 * and the per-dtype loads and stores.
 *
 * Storage types: a kernel is written once, as an inline function whose last argument dt is F32 or
 * BF16, and its exported forms (name_f32, name_bf16) are thin wrappers passing that constant; the
 * loads and stores below (ld, st, vld, vst, vld2, vst2, vround, elem) take dt and fold to the one
 * type's code once inlined. Arithmetic is fp32 throughout; only loads and stores know the type. An
 * OpenMP region is outlined before inlining, so inside one dt is a run-time value: a region's body
 * branches on it once a row (or a thread, a task) into inlined bodies where it is a constant. */
#ifndef BATCHGEN_ISA_H
#define BATCHGEN_ISA_H

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

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
/* AMX (Xeon Sapphire Rapids and later): common.c asks Linux for the tiles (amx_on) */
#if HAVE_AVX512 && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* shared between the units, not exported from the library */
#define INTERNAL __attribute__((visibility("hidden")))

enum { PARALLEL_MIN_ELEMS = 65536 }; /* elementwise kernels split rows over threads from this size */

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

/* ---- the storage types: scalar loads and stores ---- */
enum { F32 = 0, BF16 = 1 };

ALWAYS_INLINE int64_t dt_size(const int dt) { return dt == BF16 ? 2 : 4; }

/* &p[i] for elements of type dt */
ALWAYS_INLINE const void *elem(const void *p, int64_t i, const int dt) { return (const char *)p + i * dt_size(dt); }
ALWAYS_INLINE void *elem_w(void *p, int64_t i, const int dt) { return (char *)p + i * dt_size(dt); }

ALWAYS_INLINE float ld_f32(const float *p) { return *p; }
ALWAYS_INLINE float ld_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
ALWAYS_INLINE void st_f32(float *p, float x) { *p = x; }
ALWAYS_INLINE void st_bf16(uint16_t *p, float x) { *p = f32_to_bf16(x); }

/* p[i] as a float; p[i] = x rounded to dt */
ALWAYS_INLINE float ld(const void *p, int64_t i, const int dt) {
    return dt == BF16 ? ld_bf16((const uint16_t *)p + i) : ld_f32((const float *)p + i);
}
ALWAYS_INLINE void st(void *p, int64_t i, float x, const int dt) {
    if (dt == BF16) st_bf16((uint16_t *)p + i, x);
    else st_f32((float *)p + i, x);
}
/* x rounded to dt and back (identity for F32) */
ALWAYS_INLINE float round_to(float x, const int dt) { return dt == BF16 ? bf16_to_f32(f32_to_bf16(x)) : x; }

#if HAVE_AVX512
/* exp(x), used for x <= 0 (scores minus their max) and for silu: 2^(x log2 e) = 2^n * e^(f ln 2), |f| <= 1/2, with
 * e^u (|u| <= 0.35) by its degree-7 Taylor polynomial (Horner, error < 1e-8) and 2^n by scalef, which
 * underflows cleanly to 0 for very negative x. */
static inline __m512 exp_ps(__m512 x) {
    const __m512 y = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _mm512_set1_ps(-200.0f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 u = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147180559945309f));
    const float c[7] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    __m512 r = _mm512_set1_ps(1.0f / 5040.0f);
    for (int i = 0; i < 7; i++) r = _mm512_fmadd_ps(r, u, _mm512_set1_ps(c[i]));
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
enum { VW = 16 };
ALWAYS_INLINE vf vzero(void) { return _mm512_setzero_ps(); }
ALWAYS_INLINE vf vset1(float x) { return _mm512_set1_ps(x); }
ALWAYS_INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
ALWAYS_INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
ALWAYS_INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
ALWAYS_INLINE vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
ALWAYS_INLINE vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS_INLINE vf vfmsub(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }
ALWAYS_INLINE float vhsum(vf v) { return _mm512_reduce_add_ps(v); }
ALWAYS_INLINE vf vexp(vf v) { return exp_ps(v); }
ALWAYS_INLINE vf vld_f32(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE void vst_f32(float *p, vf v) { _mm512_storeu_ps(p, v); }
ALWAYS_INLINE vf vld_bf16(const uint16_t *p) { return bf16x16_to_ps(_mm256_loadu_si256((const __m256i *)p)); }
ALWAYS_INLINE void vst_bf16(uint16_t *p, vf v) { _mm256_storeu_si256((__m256i *)p, ps_to_bf16x16(v)); }
ALWAYS_INLINE vf vround_bf16(vf v) { return bf16x16_to_ps(ps_to_bf16x16(v)); }

/* 32 elements at p[i] as two vectors in "pair order", and back: the order is what converts fastest
 * (bf16: evens, then odds; f32: as in memory), and dot products and element-wise sums do not care
 * which it is. */
ALWAYS_INLINE void vld2(const void *p, int64_t i, __m512 *a, __m512 *b, const int dt) {
    if (dt == BF16) {
        bf16x32_to_ps_pairs((const uint16_t *)p + i, a, b);
    } else {
        *a = _mm512_loadu_ps((const float *)p + i);
        *b = _mm512_loadu_ps((const float *)p + i + 16);
    }
}
ALWAYS_INLINE void vst2(void *p, int64_t i, __m512 a, __m512 b, const int dt) {
    if (dt == BF16) {
        ps_pairs_to_bf16x32((uint16_t *)p + i, a, b);
    } else {
        _mm512_storeu_ps((float *)p + i, a);
        _mm512_storeu_ps((float *)p + i + 16, b);
    }
}

#elif HAVE_AVX2

/* exp(x) as exp_ps above, 8 at a time, for x in [-87, 88] (clamped there: e^-87 is as good as 0
 * next to a softmax's 1, and silu's e^-x only grows); 2^n built in the exponent bits. */
static inline __m256 exp256_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 u = _mm256_mul_ps(_mm256_sub_ps(y, n), _mm256_set1_ps(0.693147180559945309f));
    const float c[7] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    __m256 r = _mm256_set1_ps(1.0f / 5040.0f);
    for (int i = 0; i < 7; i++) r = _mm256_fmadd_ps(r, u, _mm256_set1_ps(c[i]));
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
enum { VW = 8 };
ALWAYS_INLINE vf vzero(void) { return _mm256_setzero_ps(); }
ALWAYS_INLINE vf vset1(float x) { return _mm256_set1_ps(x); }
ALWAYS_INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
ALWAYS_INLINE vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
ALWAYS_INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
ALWAYS_INLINE vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
ALWAYS_INLINE vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
ALWAYS_INLINE vf vfmsub(vf a, vf b, vf c) { return _mm256_fmsub_ps(a, b, c); }
ALWAYS_INLINE float vhsum(vf v) { return hsum256(v); }
ALWAYS_INLINE vf vexp(vf v) { return exp256_ps(v); }
ALWAYS_INLINE vf vld_f32(const float *p) { return _mm256_loadu_ps(p); }
ALWAYS_INLINE void vst_f32(float *p, vf v) { _mm256_storeu_ps(p, v); }
ALWAYS_INLINE vf vld_bf16(const uint16_t *p) { return bf16x8_to_ps(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS_INLINE void vst_bf16(uint16_t *p, vf v) { _mm_storeu_si128((__m128i *)p, ps_to_bf16x8(v)); }
ALWAYS_INLINE vf vround_bf16(vf v) { return bf16x8_to_ps(ps_to_bf16x8(v)); }
#endif

#if HAVE_SIMD
/* VW elements at p[i] as fp32; VW floats rounded to dt into p[i]; v rounded to dt and back */
ALWAYS_INLINE vf vld(const void *p, int64_t i, const int dt) {
    return dt == BF16 ? vld_bf16((const uint16_t *)p + i) : vld_f32((const float *)p + i);
}
ALWAYS_INLINE void vst(void *p, int64_t i, vf v, const int dt) {
    if (dt == BF16) vst_bf16((uint16_t *)p + i, v);
    else vst_f32((float *)p + i, v);
}
ALWAYS_INLINE vf vround(vf v, const int dt) { return dt == BF16 ? vround_bf16(v) : v; }
#endif

#endif /* BATCHGEN_ISA_H */
