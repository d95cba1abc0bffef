"""A decode step's layers in one native call (kernels/decode_layers.py, csrc/decode_layers.c): the same
results, bit for bit, as the per-op path; every step it does not take falls back to that path."""

from __future__ import annotations

import pytest
import torch

from engine.model import PRESETS, Transformer
from kernels import cpu_gemm, cpu_native, decode_layers, ops, options
from kernels.metadata import build_attention_metadata

PANEL_NEEDS = {torch.float32: cpu_native.FEATURE_GEMM_F32, torch.bfloat16: cpu_native.FEATURE_GEMM_BF16}
BLOCK, NUM_BLOCKS = 16, 24


def _model(dtype, seed=0):
    if not cpu_native.features() & PANEL_NEEDS[dtype]:
        pytest.skip(f"the panel GEMM has no {dtype} code in the {cpu_native.variant()} build "
                    "(it needs AVX2 and FMA, or AVX-512; bf16 on AVX-512 needs AVX512-BF16)")
    torch.manual_seed(seed)
    model = Transformer(PRESETS["tiny"]).eval().to(dtype)
    with torch.no_grad():
        for layer in model.layers:  # norms away from 1, so a norm wired wrong shows
            layer.input_layernorm.add_(torch.randn_like(layer.input_layernorm) * 0.2)
            layer.post_attention_layernorm.add_(torch.randn_like(layer.post_attention_layernorm) * 0.2)
    model.init_rope(512)
    model.pack_weights()  # the 259-row head may stay plain (oneDNN packs no bf16 on AVX2): not a layer's
    layers = [m for layer in model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(cpu_gemm.is_panels(m.weight) for m in layers)
    return model


def _caches(model, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK, model.args.n_kv_heads, model.args.head_dim)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in model.layers]


def _decode_step(model, context_lens, seed=2):
    """Inputs of a decode step: one new token per sequence, each sequence its own blocks."""
    g = torch.Generator().manual_seed(seed)
    tables, start = [], 0
    for n in context_lens:
        blocks = -(-n // BLOCK)
        tables.append(list(range(start, start + blocks)))
        start += blocks
    assert start <= NUM_BLOCKS
    meta = build_attention_metadata([1] * len(context_lens), context_lens, tables, BLOCK)
    ids = torch.randint(0, model.args.vocab_size, (len(context_lens),), generator=g)
    positions = torch.tensor([n - 1 for n in context_lens], dtype=torch.int64)
    return ids, positions, meta


def _per_op(model, ids, positions, caches, meta):
    with options.override(fused_decode=False), torch.inference_mode():
        return model(ids, positions, caches, meta)


CONTEXTS = [[1], [1, 17, 33, 5, 60, 16, 32], [100, 2, 64]]


@pytest.mark.parametrize("context_lens", CONTEXTS, ids=lambda c: f"{len(c)}seqs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_decode_is_bit_identical_to_the_per_op_path(dtype, context_lens, cpu_variant):
    model = _model(dtype)
    ids, positions, meta = _decode_step(model, context_lens)
    fused_caches, op_caches = _caches(model, dtype), _caches(model, dtype)
    with torch.inference_mode():
        x = model.embed_tokens(ids)
        got = model.decode_layers.run(x, positions, fused_caches, meta)
        assert got is not None and model.decode_layers.last_error == 0  # the fused path ran
        hidden = model(ids, positions, fused_caches, meta)
    residual = None
    with options.override(fused_decode=False), torch.inference_mode():
        for layer, kv in zip(model.layers, op_caches, strict=True):
            x, residual = layer(x, residual, positions, model.cos_sin, kv, meta)
    assert torch.equal(got[0], x) and torch.equal(got[1], residual)
    assert torch.equal(hidden, _per_op(model, ids, positions, _caches(model, dtype), meta))
    for (kf, vf), (ko, vo) in zip(fused_caches, op_caches, strict=True):
        assert torch.equal(kf, ko) and torch.equal(vf, vo)  # the same keys and values stored


def _fused_fp32_step(context_lens=(5, 9)):
    """An fp32 model, its caches and a decode step's inputs that the fused path has just taken."""
    model = _model(torch.float32)
    caches = _caches(model, torch.float32)
    ids, positions, meta = _decode_step(model, list(context_lens))
    with torch.inference_mode():
        x = model.embed_tokens(ids)
        assert model.decode_layers.run(x, positions, caches, meta) is not None
    return model, caches, x, positions, meta


def test_steps_it_does_not_take_go_op_by_op():
    model, caches, x, positions, meta = _fused_fp32_step()
    with torch.inference_mode():
        # a prefill chunk in the step
        mixed = build_attention_metadata([1, 3], [5, 9], [[0], [1]], BLOCK)
        x3 = model.embed_tokens(torch.tensor([1, 2, 3, 4]))
        assert model.decode_layers.run(x3, torch.tensor([4, 6, 7, 8]), caches, mixed) is None
        with options.override(fused_decode=False):  # switched off
            assert model.decode_layers.run(x, positions, caches, meta) is None
        with options.override(native=False):  # the native kernels off
            assert model.decode_layers.run(x, positions, caches, meta) is None
        ops.set_backend("torch")
        try:
            assert model.decode_layers.run(x, positions, caches, meta) is None
        finally:
            ops.set_backend(None)
        # a dtype the layers were not built for
        assert model.decode_layers.run(x.double(), positions, caches, meta) is None
        assert model.decode_layers.run(x, positions, caches, meta) is not None  # rebuilt for fp32 again


def test_weights_not_in_panels_go_op_by_op(kernel_options):
    model = _model(torch.float32)
    caches = _caches(model, torch.float32)
    ids, positions, meta = _decode_step(model, [5, 9])
    ops.unpack_linears(model)
    with torch.inference_mode():
        assert model.decode_layers.run(model.embed_tokens(ids), positions, caches, meta) is None
        assert not model.decode_layers.ok
    kernel_options(panel_gemm=False)  # oneDNN's packing instead of panels
    assert model.pack_weights() and not cpu_gemm.is_panels(model.layers[0].mlp.down_proj.weight)
    with torch.inference_mode():
        assert model.decode_layers.run(model.embed_tokens(ids), positions, caches, meta) is None


def test_new_weights_are_picked_up():
    """Repacked weights move: the fused path follows them instead of reading the old ones."""
    model = _model(torch.float32)
    ids, positions, meta = _decode_step(model, [7, 20])
    with torch.inference_mode():
        model(ids, positions, _caches(model, torch.float32), meta)
        ops.unpack_linears(model)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        assert model.pack_weights()
        got = model(ids, positions, _caches(model, torch.float32), meta)
    assert model.decode_layers.ok
    assert torch.equal(got, _per_op(model, ids, positions, _caches(model, torch.float32), meta))


def test_a_failing_kernel_hands_the_step_to_the_per_op_path_and_its_error(caplog):
    """A slot past the cache: the C call stops, names the layer and op, and the per-op path raises
    store_kv_cache's own error."""
    model = _model(torch.float32)
    caches = _caches(model, torch.float32)
    ids, positions, meta = _decode_step(model, [5, 9])
    meta.slot_mapping[1] = NUM_BLOCKS * BLOCK  # one past the last slot
    with torch.inference_mode(), caplog.at_level("DEBUG", logger="kernels.decode_layers"):
        assert model.decode_layers.run(model.embed_tokens(ids), positions, caches, meta) is None
        assert model.decode_layers.last_error == 1 * 8 + 3  # layer 0, DECODE_ERR_STORE
        assert decode_layers.ERRORS[model.decode_layers.last_error % 8] == "store_kv_cache"
        assert "layer 0's store_kv_cache stopped; the step runs op by op" in caplog.text
        with pytest.raises(IndexError, match="token 1 has slot 384, outside the cache's 384 slots"):
            model(ids, positions, caches, meta)


def test_a_weight_that_changes_form_in_place_is_not_read_as_panels():
    """The same memory seen as a plain (N, K) weight: the shape is part of what is checked, not only
    where the tensor is."""
    model, caches, x, positions, meta = _fused_fp32_step()
    with torch.inference_mode():
        proj = model.layers[1].mlp.down_proj
        plain = proj.weight.reshape(model.args.dim, model.args.intermediate_size)
        assert plain.data_ptr() == proj.weight.data_ptr() and not cpu_gemm.is_panels(plain)
        proj.weight = torch.nn.Parameter(plain, requires_grad=False)
        assert model.decode_layers.run(x, positions, caches, meta) is None and not model.decode_layers.ok


def test_panels_of_the_other_layout_go_op_by_op(monkeypatch):
    """Weights packed in the layout the loaded library does not read (strips for AVX2, rows of 64 for
    AVX-512: cpu_native.use() switched after packing) are not handed to the fused call."""
    model, caches, x, positions, meta = _fused_fp32_step()
    strips = cpu_gemm.strips()
    monkeypatch.setattr(cpu_gemm, "strips", lambda: not strips)
    model.decode_layers.key = None  # as a variant switch does (the key holds the variant)
    with torch.inference_mode():
        assert model.decode_layers.run(x, positions, caches, meta) is None and not model.decode_layers.ok


def test_the_log_says_once_that_decode_steps_take_one_call(caplog):
    model = _model(torch.bfloat16 if cpu_native.features() & cpu_native.FEATURE_GEMM_BF16 else torch.float32)
    dtype = model.embed_tokens.weight.dtype
    caches = _caches(model, dtype)
    ids, positions, meta = _decode_step(model, [3, 4])
    with caplog.at_level("INFO", logger="kernels.decode_layers"), torch.inference_mode():
        for _ in range(3):
            model(ids, positions, caches, meta)
    said = [r.getMessage() for r in caplog.records if r.name == "kernels.decode_layers"]
    assert said == [f"CPU decode steps ({dtype}): the 2 layers in one native call (fused_decode=off: op by "
                    "op)"]
