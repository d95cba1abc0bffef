/* The element-wise ops of a layer, each one pass instead of several torch ops and their
 * temporaries: (fused add +) RMSNorm, rotary embedding and SiLU-and-mul, for fp32 and bf16 tensors
 * (fp32 arithmetic either way; isa.h says how one body serves both). */
#include "kernels.h"

/* One row of rms_norm (below). */
ALWAYS_INLINE void rms_norm_row(const void *x, int64_t x_stride, const void *residual, const void *weight, void *out,
                                void *residual_out, int64_t t, int64_t dim, float eps, const int dt) {
    const void *xr = elem(x, t * x_stride, dt);
    const void *r = xr;
    int64_t d = 0;
    float ss = 0.0f;
#if HAVE_SIMD
    vf ssv = vzero();
#endif
    if (residual) {
        void *ro = elem_w(residual_out, t * dim, dt);
        const void *rr = elem(residual, t * dim, dt);
#if HAVE_SIMD
        for (; d + VW <= dim; d += VW) {
            const vf sum = vround(vadd(vld(xr, d, dt), vld(rr, d, dt)), dt);
            vst(ro, d, sum, dt);
            ssv = vfmadd(sum, sum, ssv);
        }
#endif
        for (; d < dim; d++) {
            st(ro, d, ld(xr, d, dt) + ld(rr, d, dt), dt);
            ss += ld(ro, d, dt) * ld(ro, d, dt);
        }
        r = ro;
    } else {
#if HAVE_SIMD
        for (; d + VW <= dim; d += VW) {
            const vf v = vld(xr, d, dt);
            ssv = vfmadd(v, v, ssv);
        }
#endif
        for (; d < dim; d++) ss += ld(xr, d, dt) * ld(xr, d, dt);
    }
#if HAVE_SIMD
    ss += vhsum(ssv);
#endif
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    void *o = elem_w(out, t * dim, dt);
    d = 0;
#if HAVE_SIMD
    const vf invv = vset1(inv);
    for (; d + VW <= dim; d += VW) vst(o, d, vmul(vld(weight, d, dt), vround(vmul(vld(r, d, dt), invv), dt)), dt);
#endif
    for (; d < dim; d++) {
        const float normed = round_to(ld(r, d, dt) * inv, dt);
        st(o, d, ld(weight, d, dt) * normed, dt);
    }
}

/* out = weight * round(r / sqrt(mean(r^2) + eps)) with r = round(x + residual) (written to
 * residual_out) or, when residual is NULL, r = x; round() is to the storage type, as Hugging Face's
 * Llama casts before scaling. Rows of x may be strided; every other array is contiguous. */
void rms_norm(const void *x, int64_t x_stride, const void *residual, const void *weight, void *out,
              void *residual_out, int64_t rows, int64_t dim, float eps, int num_threads, int dt) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        if (dt == BF16) rms_norm_row(x, x_stride, residual, weight, out, residual_out, t, dim, eps, BF16);
        else rms_norm_row(x, x_stride, residual, weight, out, residual_out, t, dim, eps, F32);
    }
}

void rms_norm_f32(const float *x, int64_t x_stride, const float *residual, const float *weight, float *out,
                  float *residual_out, int64_t rows, int64_t dim, float eps, int num_threads) {
    rms_norm(x, x_stride, residual, weight, out, residual_out, rows, dim, eps, num_threads, F32);
}

void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, const uint16_t *weight,
                   uint16_t *out, uint16_t *residual_out, int64_t rows, int64_t dim, float eps, int num_threads) {
    rms_norm(x, x_stride, residual, weight, out, residual_out, rows, dim, eps, num_threads, BF16);
}

/* One token of rotary (below). */
ALWAYS_INLINE void rotary_row(const int64_t *positions, void *q, int64_t q_tok_stride, int64_t q_head_stride, int nq,
                              void *k, int64_t k_tok_stride, int64_t k_head_stride, int nk, const void *cos_sin,
                              int64_t t, int64_t dim, const int dt) {
    const int64_t half = dim / 2;
    const void *c = elem(cos_sin, positions[t] * dim, dt);
    const void *sn = elem(c, half, dt);
    for (int h = 0; h < nq + nk; h++) {
        void *x = h < nq ? elem_w(q, t * q_tok_stride + h * q_head_stride, dt)
                         : elem_w(k, t * k_tok_stride + (h - nq) * k_head_stride, dt);
        void *x2 = elem_w(x, half, dt);
        int64_t i = 0;
#if HAVE_SIMD
        for (; i + VW <= half; i += VW) {
            const vf a = vld(x, i, dt), b = vld(x2, i, dt), cv = vld(c, i, dt), sv = vld(sn, i, dt);
            vst(x, i, vfmsub(a, cv, vmul(b, sv)), dt);
            vst(x2, i, vfmadd(b, cv, vmul(a, sv)), dt);
        }
#endif
        for (; i < half; i++) {
            const float a = ld(x, i, dt), b = ld(x2, i, dt), cv = ld(c, i, dt), sv = ld(sn, i, dt);
            st(x, i, a * cv - b * sv, dt);
            st(x2, i, b * cv + a * sv, dt);
        }
    }
}

/* In place, for q (T, nq, D) and k (T, nk, D) with any token and head strides (head dim
 * contiguous): each head's halves x1, x2 become x1*cos - x2*sin and x2*cos + x1*sin, with
 * cos_sin (max_len, D) = [cos | sin] at the token's position. Returns the first token whose
 * position is outside 0 .. max_len - 1, plus 1, having touched nothing; else 0. */
int64_t rotary(const int64_t *positions, void *q, int64_t q_tok_stride, int64_t q_head_stride, int nq,
               void *k, int64_t k_tok_stride, int64_t k_head_stride, int nk, const void *cos_sin,
               int64_t max_len, int64_t rows, int64_t dim, int num_threads, int dt) {
    for (int64_t t = 0; t < rows; t++)
        if (positions[t] < 0 || positions[t] >= max_len) return t + 1;
#pragma omp parallel for num_threads(num_threads) if (rows * (nq + nk) * dim >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        if (dt == BF16)
            rotary_row(positions, q, q_tok_stride, q_head_stride, nq, k, k_tok_stride, k_head_stride, nk, cos_sin,
                       t, dim, BF16);
        else
            rotary_row(positions, q, q_tok_stride, q_head_stride, nq, k, k_tok_stride, k_head_stride, nk, cos_sin,
                       t, dim, F32);
    }
    return 0;
}

int64_t rotary_f32(const int64_t *positions, float *q, int64_t q_tok_stride, int64_t q_head_stride, int nq,
                   float *k, int64_t k_tok_stride, int64_t k_head_stride, int nk, const float *cos_sin,
                   int64_t max_len, int64_t rows, int64_t dim, int num_threads) {
    return rotary(positions, q, q_tok_stride, q_head_stride, nq, k, k_tok_stride, k_head_stride, nk, cos_sin,
                  max_len, rows, dim, num_threads, F32);
}

int64_t rotary_bf16(const int64_t *positions, uint16_t *q, int64_t q_tok_stride, int64_t q_head_stride, int nq,
                    uint16_t *k, int64_t k_tok_stride, int64_t k_head_stride, int nk, const uint16_t *cos_sin,
                    int64_t max_len, int64_t rows, int64_t dim, int num_threads) {
    return rotary(positions, q, q_tok_stride, q_head_stride, nq, k, k_tok_stride, k_head_stride, nk, cos_sin,
                  max_len, rows, dim, num_threads, BF16);
}

/* One row of silu_and_mul (below). */
ALWAYS_INLINE void silu_and_mul_row(const void *x, int64_t x_stride, void *out, int64_t t, int64_t inter,
                                    const int dt) {
    const void *g = elem(x, t * x_stride, dt), *u = elem(g, inter, dt);
    void *o = elem_w(out, t * inter, dt);
    int64_t i = 0;
#if HAVE_SIMD
    const vf one = vset1(1.0f);
    for (; i + VW <= inter; i += VW) {
        const vf gv = vld(g, i, dt);
        const vf silu = vdiv(gv, vadd(one, vexp(vsub(vzero(), gv))));
        vst(o, i, vmul(silu, vld(u, i, dt)), dt);
    }
#endif
    for (; i < inter; i++) {
        const float gi = ld(g, i, dt);
        st(o, i, gi / (1.0f + expf(-gi)) * ld(u, i, dt), dt);
    }
}

/* x (T, 2I) rows [gate | up] (row stride x_stride) -> out (T, I) = silu(gate) * up. */
static void silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t inter, int num_threads,
                         int dt) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        if (dt == BF16) silu_and_mul_row(x, x_stride, out, t, inter, BF16);
        else silu_and_mul_row(x, x_stride, out, t, inter, F32);
    }
}

void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t inter, int num_threads) {
    silu_and_mul(x, x_stride, out, rows, inter, num_threads, F32);
}

void silu_and_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t rows, int64_t inter,
                       int num_threads) {
    silu_and_mul(x, x_stride, out, rows, inter, num_threads, BF16);
}
