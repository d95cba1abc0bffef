"""The paged attention Triton kernels (decode, and varlen prefill/mixed) against the torch references.

Cache slots outside every context hold NaN, so a kernel that reads past a context length or
through a padded block-table entry fails loudly.
"""

import pytest
import torch

from kernels.testing import make_paged_inputs
from tests.kernels.cases import (
    ATTENTION_BATCHES,
    BLOCK_SIZES,
    DTYPES,
    HEAD_DIM,
    HEADS,
    assert_close,
    require_triton,
)

require_triton()

from kernels.attention_decode import paged_decode_attention_ref, paged_decode_attention_triton  # noqa: E402
from kernels.attention_prefill import (  # noqa: E402
    paged_prefill_attention_ref,
    paged_prefill_attention_triton,
)


def _inputs(batch, heads, block_size, dtype, garbage):
    query_lens, context_lens = ATTENTION_BATCHES[batch]
    return make_paged_inputs(query_lens, context_lens, *heads, HEAD_DIM, block_size, dtype, garbage=garbage)


@pytest.mark.parametrize("num_splits", [1, 3, 8])  # one program per sequence, and splits merged
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_paged_decode_attention(heads, block_size, dtype, num_splits):
    clean = _inputs("decodes", heads, block_size, dtype, garbage=0.0)
    inputs = _inputs("decodes", heads, block_size, dtype, garbage=float("nan"))
    meta = inputs.meta
    want = paged_decode_attention_ref(clean.q, clean.k_cache, clean.v_cache, meta.block_tables,
                                      meta.context_lens, inputs.scale)
    out = paged_decode_attention_triton(inputs.q, inputs.k_cache, inputs.v_cache, meta.block_tables,
                                        meta.context_lens, inputs.scale, num_splits=num_splits)
    assert out.dtype == dtype
    assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("batch", list(ATTENTION_BATCHES))
def test_paged_prefill_attention_varlen_batch(batch, heads, block_size, dtype):
    clean = _inputs(batch, heads, block_size, dtype, garbage=0.0)
    inputs = _inputs(batch, heads, block_size, dtype, garbage=float("nan"))
    meta = inputs.meta
    want = paged_prefill_attention_ref(clean.q, clean.k_cache, clean.v_cache, meta.block_tables,
                                       meta.query_lens_cpu, meta.context_lens_cpu, inputs.scale)
    out = paged_prefill_attention_triton(inputs.q, inputs.k_cache, inputs.v_cache, meta.block_tables,
                                         meta.query_start_loc, meta.context_lens, meta.max_query_len,
                                         inputs.scale)
    assert out.dtype == dtype
    assert_close(out, want, dtype)


def test_prefill_tiles_smaller_than_the_head_group():
    """64 query heads on one KV head: a tile of 64 rows holds a single token."""
    inputs = make_paged_inputs([1, 3], [5, 20], 64, 1, 16, 16)
    meta = inputs.meta
    want = paged_prefill_attention_ref(inputs.q, inputs.k_cache, inputs.v_cache, meta.block_tables,
                                       meta.query_lens_cpu, meta.context_lens_cpu, inputs.scale)
    out = paged_prefill_attention_triton(inputs.q, inputs.k_cache, inputs.v_cache, meta.block_tables,
                                         meta.query_start_loc, meta.context_lens, meta.max_query_len,
                                         inputs.scale)
    assert_close(out, want, torch.float32)


def test_attention_rejects_heads_that_do_not_group():
    inputs = make_paged_inputs([1], [4], 9, 3, HEAD_DIM, 16)
    meta = inputs.meta
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention_triton(inputs.q[:, :8], inputs.k_cache, inputs.v_cache, meta.block_tables,
                                      meta.context_lens, inputs.scale)
