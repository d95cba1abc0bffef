/* A decode step's decoder layers in one call (kernels/decode_layers.py): the same kernels, with the
 * same arguments and in the same order as engine/model.py's DecoderLayer calls them one by one
 * through kernels.ops, so the results are bit-identical; what goes is the Python between them
 * (~150 us a layer: checks, allocations, ctypes' argument conversion), during which the other
 * threads of the OpenMP team only waited. Included by cpu_kernels.c after the kernels it calls.
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

typedef struct {
    const void *qkv, *o, *gate_up, *down; /* panels (cpu_gemm.h) */
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

#define DECODE_LAYERS(SFX, T, OUT_T)                                                                   \
    int64_t decode_layers_##SFX(const DecodeStep *s, const DecodeLayer *layers, int64_t n_layers) {     \
        const int64_t rows = s->rows, dim = s->dim, hd = s->head_dim, q_size = s->n_heads * hd;        \
        const int64_t kv_size = s->n_kv_heads * hd, nt = s->num_threads;                              \
        T *const res = (T *)s->res, *const h = (T *)s->h, *const qkv = (T *)s->qkv;                   \
        T *const attn = (T *)s->attn, *const o = (T *)s->o, *const g = (T *)s->g, *const x = (T *)s->x; \
        for (int64_t i = 0; i < n_layers; i++) {                                                      \
            const DecodeLayer *L = layers + i;                                                        \
            const int64_t fail = (i + 1) * 8;                                                         \
            if (i == 0) /* the embeddings are the residual; rms_norm without one */                   \
                rms_norm_##SFX((const T *)s->x_in, dim, NULL, (const T *)L->input_norm, h, NULL, rows, \
                               dim, s->eps, (int)nt);                                                 \
            else                                                                                      \
                rms_norm_##SFX(x, dim, res, (const T *)L->input_norm, h, res, rows, dim, s->eps,       \
                               (int)nt);                                                              \
            if (gemm_##SFX(h, dim, rows, dim, (const T *)L->qkv, s->qkv_n, (OUT_T *)qkv, s->qkv_n, NULL, \
                           0, 0, (int)nt))                                                            \
                return fail + DECODE_ERR_GEMM;                                                        \
            if (rotary_##SFX(s->positions, qkv, s->qkv_n, hd, (int)s->n_heads, qkv + q_size, s->qkv_n,  \
                             hd, (int)s->n_kv_heads, (const T *)s->cos_sin, s->max_len, rows, hd,       \
                             (int)nt))                                                                \
                return fail + DECODE_ERR_ROTARY;                                                      \
            if (store_kv_cache((const char *)(qkv + q_size), s->qkv_n * (int64_t)sizeof(T),           \
                               (const char *)(qkv + q_size + kv_size), s->qkv_n * (int64_t)sizeof(T),  \
                               (char *)L->k_cache, (char *)L->v_cache, s->slots, rows,                 \
                               kv_size * (int64_t)sizeof(T), s->num_slots))                           \
                return fail + DECODE_ERR_STORE;                                                       \
            if (paged_decode_attention_##SFX(qkv, s->qkv_n, hd, (const T *)L->k_cache,                 \
                                             (const T *)L->v_cache, s->block_tables,                   \
                                             s->block_table_stride, s->context_lens, attn, rows,       \
                                             (int)s->n_heads, (int)s->n_kv_heads, (int)hd,             \
                                             (int)s->block_size, s->scale, (int)nt))                   \
                return fail + DECODE_ERR_ATTENTION;                                                   \
            if (gemm_##SFX(attn, q_size, rows, q_size, (const T *)L->o, dim, (OUT_T *)o, dim, NULL, 0, 0, \
                           (int)nt))                                                                  \
                return fail + DECODE_ERR_GEMM;                                                        \
            rms_norm_##SFX(o, dim, i == 0 ? (const T *)s->x_in : res, (const T *)L->post_norm, h, res,  \
                           rows, dim, s->eps, (int)nt);                                               \
            if (gemm_##SFX(h, dim, rows, dim, (const T *)L->gate_up, s->inter, (OUT_T *)g, s->inter, \
                           NULL, 0, GEMM_SILU, (int)nt))                                              \
                return fail + DECODE_ERR_GEMM;                                                        \
            if (gemm_##SFX(g, s->inter, rows, s->inter, (const T *)L->down, dim, (OUT_T *)x, dim, NULL, 0, \
                           0, (int)nt))                                                               \
                return fail + DECODE_ERR_GEMM;                                                        \
        }                                                                                             \
        return 0;                                                                                     \
    }

DECODE_LAYERS(f32, float, float)
DECODE_LAYERS(bf16, uint16_t, void)
