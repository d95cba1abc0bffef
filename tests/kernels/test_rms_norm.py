"""The RMSNorm Triton kernel (plain and fused residual add) against its torch reference."""

import pytest
import torch

from tests.kernels.cases import DTYPES, assert_close, require_triton

require_triton()

from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref, rms_norm_triton  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (3, 576), (17, 100), (5, 1000)])
def test_rms_norm(num_tokens, hidden, dtype):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weight = (1 + torch.randn(hidden, generator=gen) / 10).to(dtype)
    out, residual_out = rms_norm_triton(x, weight, 1e-6)
    assert residual_out is None and out.dtype == dtype
    assert_close(out, rms_norm_ref(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (7, 576), (16, 33)])
def test_fused_add_rms_norm(num_tokens, hidden, dtype):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    out, residual_out = rms_norm_triton(x, weight, 1e-5, residual)
    want_out, want_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(residual_out, want_residual)  # one rounding of the same sum
    assert_close(out, want_out, dtype)


def test_rms_norm_reads_strided_rows():
    x = torch.randn(6, 200)[:, :100]  # every row strided by 200
    weight = torch.randn(100)
    assert_close(rms_norm_triton(x, weight, 1e-6)[0], rms_norm_ref(x, weight, 1e-6), torch.float32)


def test_rms_norm_rejects_a_wrong_weight():
    with pytest.raises(ValueError, match=r"weight must be \(64,\)"):
        rms_norm_triton(torch.randn(2, 64), torch.randn(32), 1e-6)
