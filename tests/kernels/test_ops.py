"""kernels.ops: backend selection, and one attention layer step equal on both backends."""

import pytest
import torch

from kernels import ops
from kernels.testing import make_paged_inputs
from tests.kernels.cases import ATTENTION_BATCHES, assert_close, require_triton


@pytest.fixture(autouse=True)
def no_forced_backend(monkeypatch):
    monkeypatch.delenv("BATCHGEN_KERNELS", raising=False)
    ops.set_backend(None)
    yield
    ops.set_backend(None)


def test_cpu_tensors_use_cpu_native_unless_forced(monkeypatch):
    x = torch.zeros(1)
    assert ops.get_backend(x) == "cpu-native"
    for name, want in (("auto", "cpu-native"), ("torch", "torch"), ("cpu-native", "cpu-native")):
        monkeypatch.setenv("BATCHGEN_KERNELS", name)
        ops.set_backend(None)  # the environment is read once, and again here
        assert ops.get_backend(x) == want
    monkeypatch.setenv("BATCHGEN_KERNELS", "cuda")
    ops.set_backend(None)
    with pytest.raises(ValueError, match="BATCHGEN_KERNELS must be one of"):
        ops.get_backend(x)


def test_every_op_has_every_backend_and_cpu_native_falls_back_per_call():
    assert all(set(row) == {"torch", "triton", "cpu-native"} for row in ops.KERNELS.values())
    ops.set_backend("cpu-native")
    x, w = torch.randn(3, 8), torch.ones(8)
    assert ops._pick("rms_norm", x, w) is ops.KERNELS["rms_norm"]["cpu-native"]
    assert ops._pick("rms_norm", x.double(), w.double()) is ops.KERNELS["rms_norm"]["torch"]  # fp32 only
    assert ops._pick("rms_norm", x, w, fits=False) is ops.KERNELS["rms_norm"]["torch"]


def test_the_environment_is_read_once_not_per_call(monkeypatch):
    require_triton()
    monkeypatch.setenv("BATCHGEN_KERNELS", "triton")
    ops.set_backend(None)
    monkeypatch.setenv("BATCHGEN_KERNELS", "torch")
    assert ops.get_backend(torch.zeros(1)) == "triton"


def test_set_backend_wins_over_the_environment(monkeypatch):
    require_triton()
    monkeypatch.setenv("BATCHGEN_KERNELS", "torch")
    ops.set_backend(None)
    ops.set_backend("triton")
    assert ops.get_backend(torch.zeros(1)) == "triton"
    ops.set_backend("auto")  # back to the environment's
    assert ops.get_backend(torch.zeros(1)) == "torch"


def test_bad_backend_names_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="kernel backend must be one of"):
        ops.set_backend("cuda")
    monkeypatch.setenv("BATCHGEN_KERNELS", "trition")
    ops.set_backend(None)
    with pytest.raises(ValueError, match="BATCHGEN_KERNELS must be one of.*'trition'"):
        ops.rms_norm(torch.ones(1, 4), torch.ones(4), 1e-6)


def test_triton_on_cpu_without_the_interpreter_says_how_to_fix_it(monkeypatch):
    require_triton()
    monkeypatch.setenv("BATCHGEN_KERNELS", "triton")
    ops.set_backend(None)
    monkeypatch.setattr(ops, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ops.silu_and_mul(torch.ones(1, 4))


def _layer_step(inputs, positions, cache):
    """What the model does per layer, on views into one fused qkv projection as the model has them:
    rotate q/k, store k/v, attend, then the norms and the MLP gate."""
    num_tokens, num_q_heads, head_dim = inputs.q.shape
    num_kv_heads = inputs.key.shape[1]
    qkv = torch.cat([inputs.q.flatten(1), inputs.key.flatten(1), inputs.value.flatten(1)], dim=1)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    q = q.view(num_tokens, num_q_heads, head_dim)  # strided views, as in engine/model.py
    k, v = k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)
    q, k = ops.rotary_embedding(positions, q, k, cache)
    k_cache, v_cache = torch.zeros_like(inputs.k_cache), torch.zeros_like(inputs.v_cache)
    ops.store_kv_cache(k, v, k_cache, v_cache, inputs.meta.slot_mapping)
    attn = ops.paged_attention(q, k_cache, v_cache, inputs.meta, inputs.scale)  # (T, Hq, D)
    hidden = attn.flatten(1)
    normed, residual = ops.fused_add_rms_norm(hidden, hidden.flip(0), torch.ones(hidden.shape[1]), 1e-6)
    gated = ops.silu_and_mul(ops.rms_norm(normed, torch.full((normed.shape[1],), 0.5), 1e-6))
    return gated, residual, k_cache, qkv  # qkv: q and k rotated in place, v untouched


@pytest.mark.parametrize("batch", ["decodes", "mixed"])
def test_one_layer_step_is_the_same_on_both_backends(batch, monkeypatch):
    require_triton()
    query_lens, context_lens = ATTENTION_BATCHES[batch]
    inputs = make_paged_inputs(query_lens, context_lens, 9, 3, 64, 16)
    pairs = zip(query_lens, context_lens, strict=True)
    positions = torch.tensor([c - q + i for q, c in pairs for i in range(q)])
    cache = ops.make_cos_sin_cache(64, 128, 10000.0, torch.float32, "cpu")
    want = _layer_step(inputs, positions, cache)
    ops.set_backend("triton")
    got = _layer_step(inputs, positions, cache)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, torch.float32)
