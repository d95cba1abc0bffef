/* A decode step's decoder layers in one call (kernels/decode_layers.py): the same kernels, with the
 * same arguments and in the same order as engine/model.py's DecoderLayer calls them one by one
 * through kernels.ops, so the results are bit-identical; what goes is the Python between them
 * (~150 us a layer: checks, allocations, ctypes' argument conversion), during which the other
 * threads of the OpenMP team only waited. The kernels are the other units' (kernels.h).
 *
 * Per layer, rows = the step's sequences (one query token each):
 *   h, res   = rms_norm(x) and res = x (layer 0), else fused add + rms_norm(x, res) (res in place)
 *   qkv      = h . Wqkv                    q, k rotated in place, k and v stored into the caches
 *   attn     = paged decode attention(q, caches)
 *   h, res   = fused add + rms_norm(attn . Wo, res)
 *   x        = silu-and-mul(h . Wgate_up) . Wdown
 * Returns 0, or (layer + 1) * 8 + the failing step (DECODE_ERR_*): the caller then runs the step
 * through the per-op path, which raises that op's own error (every write here is one that path
 * makes again, so nothing it reads is left half done). */
#include "kernels.h"

typedef struct {
    const void *qkv, *o, *gate_up, *down; /* panels (gemm.c) */
    const void *input_norm, *post_norm;  /* (dim,) */
    void *k_cache, *v_cache;             /* (num_blocks, block_size, n_kv_heads, head_dim) */
} DecodeLayer;

typedef struct {
    int64_t rows, dim, n_heads, n_kv_heads, head_dim, qkv_n, inter, block_size, num_slots,
        max_len, block_table_stride;
    float eps, scale;
    int num_threads;
    const int64_t *positions, *slots;          /* (rows,) */
    const int32_t *block_tables, *context_lens; /* (rows, nb), (rows,) */
    const void *cos_sin;                        /* (max_len, head_dim) */
    /* workspace, rows x: x_in (dim, the embeddings; read only), x (dim, the last layer's output), res
     * (dim), h (dim), qkv (qkv_n), attn (n_heads * head_dim), o (dim), g (inter) */
    const void *x_in;
    void *x, *res, *h, *qkv, *attn, *o, *g;
} DecodeStep;

enum { DECODE_ERR_GEMM = 1, DECODE_ERR_ROTARY = 2, DECODE_ERR_STORE = 3, DECODE_ERR_ATTENTION = 4 };

static int64_t decode_layers(const DecodeStep *s, const DecodeLayer *layers, int64_t n_layers, int dt) {
    const int64_t rows = s->rows, dim = s->dim, hd = s->head_dim, q_size = s->n_heads * hd;
    const int64_t kv_size = s->n_kv_heads * hd, nt = s->num_threads, esize = dt_size(dt);
    void *const res = s->res, *const h = s->h, *const qkv = s->qkv, *const attn = s->attn, *const o = s->o;
    void *const g = s->g, *const x = s->x;
    void *const k = elem_w(qkv, q_size, dt), *const v = elem_w(qkv, q_size + kv_size, dt);
    for (int64_t i = 0; i < n_layers; i++) {
        const DecodeLayer *L = layers + i;
        const int64_t fail = (i + 1) * 8;
        if (i == 0) /* the embeddings are the residual; rms_norm without one */
            rms_norm(s->x_in, dim, NULL, L->input_norm, h, NULL, rows, dim, s->eps, (int)nt, dt);
        else
            rms_norm(x, dim, res, L->input_norm, h, res, rows, dim, s->eps, (int)nt, dt);
        if (gemm(h, dim, rows, dim, L->qkv, s->qkv_n, qkv, s->qkv_n, NULL, 0, 0, (int)nt, dt))
            return fail + DECODE_ERR_GEMM;
        if (rotary(s->positions, qkv, s->qkv_n, hd, (int)s->n_heads, k, s->qkv_n, hd, (int)s->n_kv_heads, s->cos_sin,
                   s->max_len, rows, hd, (int)nt, dt))
            return fail + DECODE_ERR_ROTARY;
        if (store_kv_cache(k, s->qkv_n * esize, v, s->qkv_n * esize, L->k_cache, L->v_cache, s->slots, rows,
                           kv_size * esize, s->num_slots))
            return fail + DECODE_ERR_STORE;
        if (paged_decode_attention(qkv, s->qkv_n, hd, L->k_cache, L->v_cache, s->block_tables, s->block_table_stride,
                                   s->context_lens, attn, rows, (int)s->n_heads, (int)s->n_kv_heads, (int)hd,
                                   (int)s->block_size, s->scale, (int)nt, dt))
            return fail + DECODE_ERR_ATTENTION;
        if (gemm(attn, q_size, rows, q_size, L->o, dim, o, dim, NULL, 0, 0, (int)nt, dt))
            return fail + DECODE_ERR_GEMM;
        rms_norm(o, dim, i == 0 ? s->x_in : res, L->post_norm, h, res, rows, dim, s->eps, (int)nt, dt);
        if (gemm(h, dim, rows, dim, L->gate_up, s->inter, g, s->inter, NULL, 0, GEMM_SILU, (int)nt, dt))
            return fail + DECODE_ERR_GEMM;
        if (gemm(g, s->inter, rows, s->inter, L->down, dim, x, dim, NULL, 0, 0, (int)nt, dt))
            return fail + DECODE_ERR_GEMM;
    }
    return 0;
}

int64_t decode_layers_f32(const DecodeStep *s, const DecodeLayer *layers, int64_t n_layers) {
    return decode_layers(s, layers, n_layers, F32);
}

int64_t decode_layers_bf16(const DecodeStep *s, const DecodeLayer *layers, int64_t n_layers) {
    return decode_layers(s, layers, n_layers, BF16);
}
