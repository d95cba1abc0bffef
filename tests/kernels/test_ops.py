"""kernels.ops: backend selection, and one attention layer step equal on both backends."""

import pytest
import torch

from kernels import cpu_native, ops, options
from kernels.options import KernelOptions
from kernels.testing import make_paged_inputs
from tests.kernels.cases import ATTENTION_BATCHES, assert_close, require_triton


@pytest.fixture(autouse=True)
def default_options():
    before = options.current()
    ops.configure(KernelOptions())
    yield
    ops.configure(before)


def test_cpu_tensors_use_cpu_native_unless_forced():
    x = torch.zeros(1)
    assert ops.get_backend(x) == "cpu-native"
    for name, want in (("auto", "cpu-native"), ("torch", "torch"), ("cpu-native", "cpu-native")):
        ops.configure(KernelOptions(backend=name))
        assert ops.get_backend(x) == want
        ops.set_backend(None)
        assert ops.get_backend(x) == "cpu-native"


def test_every_op_has_every_backend_and_cpu_native_falls_back_per_call():
    assert all(set(row) == {"torch", "triton", "cpu-native"} for row in ops.KERNELS.values())
    ops.set_backend("cpu-native")
    x, w = torch.randn(3, 8), torch.ones(8)
    assert ops._pick("rms_norm", x, w) is ops.KERNELS["rms_norm"]["cpu-native"]
    assert ops._pick("rms_norm", x.double(), w.double()) is ops.KERNELS["rms_norm"]["torch"]  # fp32 only
    assert ops._pick("rms_norm", x, w, fits=False) is ops.KERNELS["rms_norm"]["torch"]


def test_the_environment_is_not_read(monkeypatch):
    """The old switches (BATCHGEN_KERNELS and the variant switches) do nothing now: the options object
    is the one way in."""
    from kernels import cpu_gemm, decode_layers

    old = {"BATCHGEN_KERNELS": "torch", "BATCHGEN_NATIVE": "0", "BATCHGEN_ONEDNN": "0",
           "BATCHGEN_GEMM": "onednn", "BATCHGEN_PREFILL_GEMM": "panels", "BATCHGEN_FUSED_ARGMAX": "0",
           "BATCHGEN_FUSED_DECODE": "0", "BATCHGEN_AMX": "0", "BATCHGEN_ATTN_STREAM": "0"}
    for name, value in old.items():
        monkeypatch.setenv(name, value)
    ops.set_backend(None)
    assert ops.get_backend(torch.zeros(1)) == "cpu-native" and options.current() == KernelOptions()
    assert cpu_native.enabled() and cpu_gemm.enabled() and decode_layers.enabled()
    ops.configure(KernelOptions(native=False, onednn=False, fused_decode=False))
    assert not (cpu_native.enabled() or cpu_gemm.enabled() or decode_layers.enabled())


def test_set_backend_changes_only_the_backend():
    require_triton()
    ops.configure(KernelOptions(backend="torch", fused_decode=False))
    ops.set_backend("triton")
    assert ops.get_backend(torch.zeros(1)) == "triton"
    assert options.current() == KernelOptions(backend="triton", fused_decode=False)


def test_an_engine_config_with_kernel_options_sets_them_when_it_is_built():
    from engine.llm import LLM

    LLM(model="tiny-random", num_kv_blocks=16, block_size=4, kernel_options=KernelOptions(backend="torch"))
    assert options.current() == KernelOptions(backend="torch")
    LLM(model="tiny-random", num_kv_blocks=16, block_size=4)  # None: the process's options stay
    assert options.current() == KernelOptions(backend="torch")


def test_bad_backend_names_and_options_are_refused():
    with pytest.raises(ValueError, match="kernel backend must be one of"):
        ops.set_backend("cuda")
    with pytest.raises(ValueError, match="kernel backend must be one of.*'trition'"):
        KernelOptions(backend="trition")
    with pytest.raises(ValueError, match="fused_decode must be true or false"):
        KernelOptions(fused_decode="0")
    with pytest.raises(TypeError, match="expected KernelOptions"):
        ops.configure({"backend": "torch"})


def test_options_parse_a_benchmarks_arguments():
    assert KernelOptions.parse(["fused-decode=off", "amx=0", "backend=torch", "attn_stream=on"]) == \
        KernelOptions(backend="torch", fused_decode=False, amx=False, attn_stream=True)
    base = KernelOptions(attn_stream=False)
    assert KernelOptions.parse(["attn_stream=auto"], base) == KernelOptions()
    for bad, says in (("fused_decode", "NAME=VALUE"), ("nope=1", "NAME=VALUE"), ("amx=maybe", "on or off"),
                      ("backend=cuda", "kernel backend must be one of")):
        with pytest.raises(ValueError, match=says):
            KernelOptions.parse([bad])


def test_override_restores_the_options_it_changed():
    with options.override(fused_argmax=False) as inside:
        assert options.current() is inside and not inside.fused_argmax
    assert options.current() == KernelOptions()


def test_triton_on_cpu_without_the_interpreter_says_how_to_fix_it(monkeypatch):
    require_triton()
    ops.set_backend("triton")
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
