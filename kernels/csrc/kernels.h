/* What the units of the native library call in one another: each op's dtype-taking form (dt F32 or
 * BF16, isa.h; its exported name_f32 and name_bf16 wrap it), the GEMM's epilogues and the AMX
 * switch. Hidden: the library exports only the wrappers kernels/cpu_native.py binds. */
#ifndef BATCHGEN_KERNELS_H
#define BATCHGEN_KERNELS_H

#include <stdint.h>

#include "isa.h"

/* common.c: whether the kernels use AMX tiles (asking Linux for them once), and the calling thread's
 * tile shapes: rows and bytes a row of tiles 0-7 (0 rows: unused) */
INTERNAL int amx_on(void);
INTERNAL void amx_shapes(const int rows[8], const int colsb[8]);

/* attention.c */
INTERNAL int paged_decode_attention(const void *q, int64_t q_seq_stride, int64_t q_head_stride,
                                    const void *k_cache, const void *v_cache, const int32_t *block_tables,
                                    int64_t block_table_stride, const int32_t *context_lens, void *out,
                                    int64_t num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                                    int block_size, float scale, int num_threads, int dt);
int64_t store_kv_cache(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                       char *k_cache, char *v_cache, const int64_t *slot_mapping, int64_t rows,
                       int64_t row_bytes, int64_t num_slots);

/* attention_prefill.c: prefill attention in fp32 vector tiles, for either storage type (2: shapes it
 * does not take) */
INTERNAL int prefill_attention_vec(const void *q, int64_t q_tok_stride, int64_t q_head_stride, const void *k_cache,
                                   const void *v_cache, const int32_t *block_tables, int64_t block_table_stride,
                                   const int32_t *query_starts, const int32_t *context_lens, void *out,
                                   int64_t num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                                   int block_size, float scale, int num_threads, int dt);

/* norms_rotary.c */
INTERNAL void rms_norm(const void *x, int64_t x_stride, const void *residual, const void *weight, void *out,
                       void *residual_out, int64_t rows, int64_t dim, float eps, int num_threads, int dt);
INTERNAL int64_t rotary(const int64_t *positions, void *q, int64_t q_tok_stride, int64_t q_head_stride, int nq,
                        void *k, int64_t k_tok_stride, int64_t k_head_stride, int nk, const void *cos_sin,
                        int64_t max_len, int64_t rows, int64_t dim, int num_threads, int dt);

/* gemm.c: the panel GEMM (its comment says what epi selects) */
enum {
    GEMM_NR = 64,     /* output columns a panel */
    GEMM_SILU = 1,    /* epilogue: silu(gate) * up of a gate/up panel pair */
    GEMM_F32_OUT = 2, /* epilogue: a bf16 product written as fp32 (the logits) */
};
INTERNAL int gemm(const void *x, int64_t xs, int64_t m, int64_t k, const void *w, int64_t n, void *out, int64_t os,
                  const void *res, int64_t rs, int epi, int num_threads, int dt);

#endif /* BATCHGEN_KERNELS_H */
