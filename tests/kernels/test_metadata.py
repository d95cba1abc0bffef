"""build_attention_metadata, and the torch path on a machine without Triton."""

import subprocess
import sys

import pytest
import torch

from kernels.metadata import build_attention_metadata


def test_metadata_from_host_lists():
    meta = build_attention_metadata([1, 1, 3], [17, 5, 3], [[4, 9], [2], [7]], block_size=16)
    assert meta.slot_mapping.tolist() == [9 * 16 + 0, 2 * 16 + 4, 7 * 16, 7 * 16 + 1, 7 * 16 + 2]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 5] and meta.query_start_loc.dtype == torch.int32
    assert meta.block_tables.tolist() == [[4, 9], [2, 0], [7, 0]] and meta.block_tables.dtype == torch.int32
    assert meta.context_lens.tolist() == [17, 5, 3]
    assert (meta.num_decodes, meta.num_decode_tokens) == (2, 2)
    assert (meta.max_query_len, meta.max_context_len) == (3, 17)
    assert meta.query_lens_cpu == [1, 1, 3] and meta.num_seqs == 3


def test_prefill_rows_give_each_chunk_token_its_sequence_and_position():
    # a decode, a whole prompt of 3, then a chunk of 2 tokens ending at position 17 of its sequence
    meta = build_attention_metadata([1, 3, 2], [17, 3, 18], [[4, 9], [7], [1, 2]], block_size=16)
    tables, lens = meta.prefill_rows()
    assert tables.tolist() == [[7, 0]] * 3 + [[1, 2]] * 2 and tables.dtype == torch.int32
    assert lens.tolist() == [1, 2, 3, 17, 18] and lens.dtype == torch.int32
    assert meta.prefill_rows()[0] is tables  # built once per step, shared by the layers


def test_a_trailing_chunk_of_one_is_not_a_decode():
    meta = build_attention_metadata([4, 1], [4, 9], [[0], [1]], block_size=16)
    assert meta.num_decodes == 0


@pytest.mark.parametrize(
    "query_lens,context_lens,tables,message",
    [
        ([1, 1], [3], [[0]], "one entry per sequence"),
        ([0], [3], [[0]], "sequence 0: need 1 <= query_len <= context_len"),
        ([1, 5], [3, 4], [[0], [1]], "sequence 1: need 1 <= query_len <= context_len, got 5 and 4"),
        ([1], [40], [[0, 1]], "sequence 0: 2 blocks of 16 cannot hold context_len 40"),
    ],
)
def test_bad_lengths_name_the_sequence(query_lens, context_lens, tables, message):
    with pytest.raises(ValueError, match=message):
        build_attention_metadata(query_lens, context_lens, tables, block_size=16)


def test_torch_path_works_without_triton():
    script = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
import torch
from kernels import ops
x = torch.randn(3, 8)
assert torch.allclose(ops.silu_and_mul(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
ops.set_backend("triton")
try:
    ops.rms_norm(x, torch.ones(8), 1e-6)
except RuntimeError as exc:
    print(exc)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "`triton` is not importable" in result.stdout
