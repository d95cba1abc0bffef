/* Decode attention's bf16 work items: attention_decode.h's bodies for BF16, a unit of their own so that
 * the library's build compiles the two dtypes' specialisations in parallel. */
#include "attention_decode.h"

void decode_items_bf16(const Problem *p, int64_t lo, int64_t hi, float *scores, int max_ctx, int use_stream) {
    decode_thread(p, lo, hi, scores, max_ctx, use_stream, BF16);
}
