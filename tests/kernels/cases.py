"""Shapes and tolerances shared by the kernel tests (small: the Triton interpreter is slow)."""

from __future__ import annotations

import pytest
import torch

# dtype -> (atol, rtol). bf16 is left out on purpose: the Triton interpreter computes it wrongly.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 4e-3)}
DTYPES = list(TOLERANCES)

HEADS = [(9, 3), (8, 1)]  # (query heads, KV heads): SmolLM2's 9/3 and multi-query 8/1
BLOCK_SIZES = [16, 32]
HEAD_DIM = 64

# (query_lens, context_lens), decodes first: contexts 1, 15, 16, 17 and 100 straddle block edges
ATTENTION_BATCHES = {
    "decodes": ([1, 1, 1, 1, 1], [1, 15, 16, 17, 100]),
    "whole_prompts": ([15, 17, 1], [15, 17, 1]),
    "mixed": ([1, 1, 16, 5, 1, 17], [17, 100, 16, 100, 15, 33]),
    "long_chunks": ([100, 40], [100, 77]),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Compare in float64 with the tolerance of `dtype` from TOLERANCES."""
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


def require_triton() -> None:
    """Skip the calling test module, saying why, when Triton cannot be imported."""
    pytest.importorskip("triton", reason="triton is not importable: the Triton kernel tests need it")
