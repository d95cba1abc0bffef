"""The SiLU-and-multiply Triton kernel against its torch reference."""

import pytest
import torch

from tests.kernels.cases import DTYPES, assert_close, require_triton

require_triton()

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,inter", [(1, 8), (3, 1536), (17, 33), (2, 2500)])
def test_silu_and_mul(num_tokens, inter, dtype):
    x = (3 * torch.randn(num_tokens, 2 * inter, generator=torch.Generator().manual_seed(inter))).to(dtype)
    out = silu_and_mul_triton(x)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    assert_close(out, silu_and_mul_ref(x), dtype)


def test_silu_and_mul_handles_no_tokens_and_rejects_odd_widths():
    assert silu_and_mul_triton(torch.empty(0, 16)).shape == (0, 8)
    with pytest.raises(ValueError, match=r"\(T, 2I\)"):
        silu_and_mul_triton(torch.randn(2, 7))
