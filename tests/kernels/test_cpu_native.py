"""The cpu-native kernels (built by kernels/cpu_native.py; launchers beside each reference) against
the naive float64 loop and the torch path, and their fallback when they cannot be built."""

from __future__ import annotations

import logging
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kernels import cpu_native, ops
from kernels.activation import silu_and_mul_native
from kernels.argmax import argmax_native
from kernels.attention_decode import paged_decode_attention_native, paged_decode_attention_ref
from kernels.attention_prefill import paged_prefill_attention_ref
from kernels.kv_cache import store_kv_cache_native
from kernels.rms_norm import rms_norm_native
from kernels.rotary import rotary_embedding_native
from kernels.testing import make_paged_inputs
from tests.kernels import naive
from tests.kernels.cases import HEADS

DECODE_LENS = [1, 15, 16, 17, 100, 257]


@pytest.fixture(autouse=True)
def native_built():
    if cpu_native.load() is None:  # the machines this runs on have gcc: say so loudly if not
        pytest.fail(f"native kernels did not build: {cpu_native.why_unavailable()}")


# (query heads, KV heads, head dim): the specialised AVX-512 kernels, then shapes without one
# (head dim 16 or 48, 12 query heads per KV head), which take the generic kernel
DECODE_SHAPES = [(h, kv, 64) for h, kv in HEADS] + [(4, 4, 64), (4, 2, 16), (12, 1, 64), (3, 3, 48)]


# fp32 matches the float64 loop closely; bf16 (fp32 arithmetic over bf16 inputs, the output rounded
# to bf16: relative steps of 2^-8) within a few of its steps
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = list(TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", DECODE_SHAPES)
def test_decode_matches_naive_loop_and_reads_only_its_context(num_q_heads, num_kv_heads, head_dim,
                                                              block_size, dtype, cpu_variant):
    # nan outside every context: a read outside one would poison the output
    inputs = make_paged_inputs([1] * len(DECODE_LENS), DECODE_LENS, num_q_heads, num_kv_heads, head_dim,
                               block_size, dtype=dtype, garbage=float("nan"))
    meta = inputs.meta
    out = paged_decode_attention_native(inputs.q, inputs.k_cache, inputs.v_cache, meta.block_tables,
                                            meta.context_lens, inputs.scale)
    assert out.dtype == dtype
    want = naive.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, meta.block_tables.tolist(),
                                 [1] * len(DECODE_LENS), DECODE_LENS, inputs.scale)
    torch.testing.assert_close(out.double(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("num_threads", [1, 2, 3, 7, 32])  # 32: more threads than work items
def test_any_thread_count_gives_the_same_answer(num_threads):
    lens = [5, 300, 1, 64, 65, 129, 2, 40]
    inputs = make_paged_inputs([1] * len(lens), lens, 9, 3, 64, 16, garbage=None)
    meta = inputs.meta
    one = paged_decode_attention_native(inputs.q, inputs.k_cache, inputs.v_cache, meta.block_tables,
                                            meta.context_lens, inputs.scale, num_threads=1)
    many = paged_decode_attention_native(inputs.q, inputs.k_cache, inputs.v_cache, meta.block_tables,
                                             meta.context_lens, inputs.scale, num_threads=num_threads)
    assert torch.equal(one, many)  # each (sequence, KV head) is computed by one thread, in one order
    ref = paged_decode_attention_ref(inputs.q, inputs.k_cache, inputs.v_cache, meta.block_tables,
                                     meta.context_lens, inputs.scale)
    torch.testing.assert_close(many, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_gives_the_same_answer_with_and_without_its_l2_stream(dtype, cpu_variant):
    """The stream only prefetches: switching it (attn_stream) leaves every output bit as it was."""
    lens = [5, 300, 1, 64, 65, 129, 2, 40]
    inputs = make_paged_inputs([1] * len(lens), lens, 9, 3, 64, 16, dtype=dtype, garbage=float("nan"))
    meta = inputs.meta
    lib = cpu_native.library()
    before = lib.batchgen_attention_stream(-1)
    outs = []
    try:
        for on in (1, 0):
            assert lib.batchgen_attention_stream(on) == on
            for threads in (1, 2):
                outs.append(paged_decode_attention_native(inputs.q, inputs.k_cache, inputs.v_cache,
                                                          meta.block_tables, meta.context_lens, inputs.scale,
                                                          num_threads=threads))
    finally:
        lib.batchgen_attention_stream(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:]) and not outs[0].isnan().any()


def test_the_l2_stream_is_on_unless_the_options_say(kernel_options):
    import subprocess
    import sys

    def run(stream):  # a fresh process: the options given before the library loads, then changed
        probe = ("from kernels import cpu_native, ops; from kernels.options import KernelOptions; "
                 f"ops.configure(KernelOptions(attn_stream={stream})); "
                 "a = int(cpu_native.attention_stream()); "
                 "ops.configure(KernelOptions()); print(a, int(cpu_native.attention_stream()))")
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              check=True).stdout.split()

    assert run(None) == ["1", "1"]
    assert run(False) == ["0", "1"]
    assert run(True) == ["1", "1"]
    assert not kernel_options(attn_stream=False).attn_stream and not cpu_native.attention_stream()
    kernel_options(attn_stream=None)
    assert cpu_native.attention_stream()  # the library's own choice again


def test_strided_queries_from_the_fused_projection():
    """The model hands attention q as a view of the qkv GEMM's output: rows are strided."""
    lens = [3, 40, 17]
    inputs = make_paged_inputs([1] * 3, lens, 9, 3, 64, 16)
    qkv = torch.randn(3, (9 + 6) * 64)
    q = qkv[:, : 9 * 64].view(3, 9, 64)
    assert not q.is_contiguous()
    meta = inputs.meta
    out = paged_decode_attention_native(q, inputs.k_cache, inputs.v_cache, meta.block_tables,
                                            meta.context_lens, inputs.scale)
    ref = paged_decode_attention_ref(q, inputs.k_cache, inputs.v_cache, meta.block_tables, meta.context_lens,
                                     inputs.scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_mixed_step_uses_native_decodes_and_matches_the_pure_torch_path(kernel_options):
    query_lens, context_lens = [1, 1, 1, 16, 5], [300, 17, 1, 16, 100]
    inputs = make_paged_inputs(query_lens, context_lens, 9, 3, 64, 16)
    ops.set_backend("cpu-native")
    try:
        native = ops.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.meta, inputs.scale)
        assert inputs.meta.torch_decode_plan is None  # the native kernel needs no gather plan
        kernel_options(native=False)  # cpu-native falls back to torch, call by call
        plain = ops.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.meta, inputs.scale)
        assert inputs.meta.torch_decode_plan is not None
    finally:
        ops.set_backend(None)
    torch.testing.assert_close(native, plain, atol=1e-5, rtol=1e-5)


def test_inputs_it_cannot_take_are_refused_with_the_reason():
    inputs = make_paged_inputs([1, 1], [5, 9], 9, 3, 64, 16)
    meta = inputs.meta
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention_native(inputs.q, inputs.k_cache, inputs.v_cache, meta.block_tables.long(),
                                          meta.context_lens, inputs.scale)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode_attention_native(inputs.q[:, :8], inputs.k_cache, inputs.v_cache, meta.block_tables,
                                          meta.context_lens, inputs.scale)
    assert not cpu_native.supports(inputs.q.half(), inputs.k_cache.half())  # fp32, bf16 only: fp16 is torch
    assert not cpu_native.supports(inputs.q, inputs.k_cache.bfloat16())  # one dtype per call
    with pytest.raises(ValueError, match="share one dtype"):
        paged_decode_attention_native(inputs.q, inputs.k_cache.bfloat16(), inputs.v_cache.bfloat16(),
                                      meta.block_tables, meta.context_lens, inputs.scale)
    with pytest.raises(ValueError, match="float16 is not one of the native dtypes"):
        paged_decode_attention_native(inputs.q.half(), inputs.k_cache.half(), inputs.v_cache.half(),
                                      meta.block_tables, meta.context_lens, inputs.scale)


def _fresh_build_with(monkeypatch, tmp_path, script: str) -> None:
    """Forget the loaded library; the next load() builds into tmp_path with this compiler script."""
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setattr(cpu_native, "_why_not", "")
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n" + script)
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))


def test_concurrent_builders_of_one_library_compile_it_once(tmp_path):
    """Workers started together wait on the build lock for the first one's library (a fake compiler that
    counts its runs and writes a placeholder, slowly enough that all four builders overlap): one
    build, a compile of each unit and a link."""
    runs = tmp_path / "runs"
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\necho run >> "' + str(runs) + '"\nsleep 0.5\n'
                  'while [ "$1" != -o ]; do shift; done\necho fake > "$2"\n')
    cc.chmod(0o755)
    out = tmp_path / "native"
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: cpu_native.build(str(cc), out), range(4)))
    assert len(set(paths)) == 1 and paths[0].read_text() == "fake\n"
    assert runs.read_text().splitlines() == ["run"] * (len(cpu_native.UNITS) + 1)  # the units, then the link
    assert sorted(p.suffix for p in out.iterdir()) == [".lock", ".so"]  # no temporaries left


def test_a_compiler_without_openmp_still_gets_serial_kernels(monkeypatch, tmp_path, caplog):
    real = shutil.which("gcc") or shutil.which("cc")
    # -O1 last (the last -O wins): this whole-library build checks the fallback and the serial kernels'
    # results, not the optimiser, and builds in a fraction of -O3's time
    _fresh_build_with(monkeypatch, tmp_path, 'for a in "$@"; do [ "$a" = -fopenmp ] && '
                      '{ echo "unsupported option -fopenmp" >&2; exit 1; }; done\n'
                      'exec ' + real + ' "$@" -O1\n')
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_native"):
        assert cpu_native.load() is not None
    assert "built without -fopenmp (" in caplog.text and "unsupported option -fopenmp" in caplog.text
    inputs = make_paged_inputs([1] * 4, [5, 40, 17, 100], 9, 3, 64, 16)
    meta = inputs.meta
    out = paged_decode_attention_native(inputs.q, inputs.k_cache, inputs.v_cache, meta.block_tables,
                                            meta.context_lens, inputs.scale, num_threads=2)
    ref = paged_decode_attention_ref(inputs.q, inputs.k_cache, inputs.v_cache, meta.block_tables,
                                     meta.context_lens, inputs.scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_failed_build_falls_back_to_torch_and_says_why(monkeypatch, tmp_path, caplog):
    _fresh_build_with(monkeypatch, tmp_path, "echo 'cc: internal error' >&2\nexit 1\n")
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_native"):
        assert cpu_native.load() is None
    assert "internal error" in cpu_native.why_unavailable()
    assert "using the torch path" in caplog.text
    inputs = make_paged_inputs([1, 1], [5, 40], 9, 3, 64, 16)
    assert not cpu_native.supports(inputs.q, inputs.k_cache)
    ops.set_backend("torch")
    try:
        out = ops.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.meta, inputs.scale)
    finally:
        ops.set_backend(None)
    assert inputs.meta.torch_decode_plan is not None  # the torch path ran
    assert torch.isfinite(out).all()


def test_elementwise_kernels_match_the_torch_references_on_strided_inputs(cpu_variant):
    from kernels.activation import silu_and_mul_ref
    from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
    from kernels.rotary import make_cos_sin_cache, rotary_embedding_ref

    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(37, 2 * 576, generator=gen) * 3
    x, weight, residual = wide[:, :576], torch.randn(576, generator=gen), torch.randn(37, 576, generator=gen)
    assert not x.is_contiguous()
    torch.testing.assert_close(rms_norm_native(x, weight, 1e-5)[0], rms_norm_ref(x, weight, 1e-5))
    normed, res_out = rms_norm_native(x, weight, 1e-5, residual)
    want_normed, want_res = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(normed, want_normed)
    assert torch.equal(res_out, want_res)

    gate_up = torch.randn(37, 2 * 1536 + 8, generator=gen)[:, : 2 * 1536] * 30  # large |gate| too
    want = silu_and_mul_ref(gate_up)
    torch.testing.assert_close(silu_and_mul_native(gate_up), want, atol=1e-5, rtol=1e-5)

    qkv = torch.randn(37, 15 * 64, generator=gen)
    positions = torch.randint(0, 500, (37,), generator=gen)
    cos_sin = make_cos_sin_cache(64, 512, 100000.0, torch.float32, "cpu")
    q, k = qkv[:, : 9 * 64].view(37, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(37, 3, 64)
    want_q, want_k = rotary_embedding_ref(positions, q.clone(), k.clone(), cos_sin)
    v_before = qkv[:, 12 * 64 :].clone()
    rotary_embedding_native(positions, q, k, cos_sin)  # in place, through the views
    torch.testing.assert_close(qkv[:, : 9 * 64].view(37, 9, 64), want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, 9 * 64 : 12 * 64].view(37, 3, 64), want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, 12 * 64 :], v_before)  # v untouched


def test_elementwise_kernels_in_bf16_round_once_as_the_references_do(cpu_variant):
    """bf16 in and out, fp32 inside: the residual sum and RMSNorm round where Hugging Face's Llama
    rounds (so they equal the references bit for bit); SiLU-and-mul and rotary round once at the end,
    within a step of bf16 of the fp32 computation."""
    from kernels.activation import silu_and_mul_ref
    from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
    from kernels.rotary import make_cos_sin_cache, rotary_embedding_ref

    gen = torch.Generator().manual_seed(5)
    bf = torch.bfloat16
    wide = (torch.randn(37, 2 * 576 + 3, generator=gen) * 3).to(bf)
    x, weight = wide[:, :576], torch.randn(576, generator=gen).to(bf)  # strided rows
    residual = torch.randn(37, 576, generator=gen).to(bf)
    assert torch.equal(rms_norm_native(x, weight, 1e-5)[0], rms_norm_ref(x, weight, 1e-5))
    normed, res_out = rms_norm_native(x, weight, 1e-5, residual)
    want_normed, want_res = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(res_out, want_res) and torch.equal(normed, want_normed)

    gate_up = (torch.randn(37, 2 * 1536 + 8, generator=gen) * 30).to(bf)[:, : 2 * 1536]
    got = silu_and_mul_native(gate_up)
    assert got.dtype == bf
    torch.testing.assert_close(got.float(), silu_and_mul_ref(gate_up.float()), atol=1e-3, rtol=2**-8)

    qkv = torch.randn(37, 15 * 64, generator=gen).to(bf)
    positions = torch.randint(0, 500, (37,), generator=gen)
    cos_sin = make_cos_sin_cache(64, 512, 100000.0, bf, "cpu")
    q, k = qkv[:, : 9 * 64].view(37, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(37, 3, 64)
    want_q, want_k = rotary_embedding_ref(positions, q.float(), k.float(), cos_sin.float())
    rotary_embedding_native(positions, q, k, cos_sin)
    torch.testing.assert_close(q.float(), want_q, atol=1e-3, rtol=2**-8)
    torch.testing.assert_close(k.float(), want_k, atol=1e-3, rtol=2**-8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ops_send_cpu_work_to_the_native_kernels(kernel_options, monkeypatch, dtype):
    def refuse(*args, **kwargs):
        raise AssertionError("the torch reference ran although the native kernel applies")

    for op in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "store_kv_cache",
               "decode_attention", "prefill_attention", "argmax"):
        monkeypatch.setitem(ops.KERNELS[op], "torch", refuse)
    x = torch.randn(4, 64, dtype=dtype)
    ops.rms_norm(x, torch.ones(64, dtype=dtype), 1e-5)
    ops.fused_add_rms_norm(x, x.clone(), torch.ones(64, dtype=dtype), 1e-5)
    ops.silu_and_mul(torch.randn(4, 32, dtype=dtype))
    cos_sin = torch.randn(16, 64, dtype=dtype)
    ops.rotary_embedding(torch.arange(4), torch.randn(4, 9, 64, dtype=dtype),
                         torch.randn(4, 3, 64, dtype=dtype), cos_sin)
    inputs = make_paged_inputs([1, 1], [5, 40], 9, 3, 64, 16, dtype=dtype)
    ops.store_kv_cache(inputs.key, inputs.value, inputs.k_cache, inputs.v_cache, inputs.meta.slot_mapping)
    ops.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.meta, inputs.scale)
    mixed = make_paged_inputs([1, 4, 3], [5, 4, 40], 9, 3, 64, 16, dtype=dtype)  # a decode, then prefills
    ops.paged_attention(mixed.q, mixed.k_cache, mixed.v_cache, mixed.meta, mixed.scale)
    ops.argmax(torch.randn(4, 100))  # logits are fp32 in either model dtype
    kernel_options(native=False)
    with pytest.raises(AssertionError, match="torch reference ran"):
        ops.silu_and_mul(torch.randn(4, 32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_cache_writes_strided_rows_skips_minus_one_and_refuses_bad_slots(dtype):
    from kernels.kv_cache import store_kv_cache_ref

    qkv = torch.randn(5, 15 * 64).to(dtype)
    key, value = qkv[:, 9 * 64 : 12 * 64].view(5, 3, 64), qkv[:, 12 * 64 :].view(5, 3, 64)
    slots = torch.tensor([7, -1, 0, 33, 12])
    caches = [torch.zeros(3, 16, 3, 64, dtype=dtype) for _ in range(4)]
    store_kv_cache_native(key, value, caches[0], caches[1], slots)
    store_kv_cache_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(IndexError, match="token 1 has slot 48, outside the cache's 48 slots"):
        store_kv_cache_native(key, value, caches[0], caches[1], torch.tensor([0, 48, 1, 2, 3]))
    with pytest.raises(ValueError, match="must share one dtype"):
        store_kv_cache_native(key.float(), value.float(), caches[0].half(), caches[1].half(), slots)


@pytest.mark.parametrize("cols", [1, 7, 16, 17, 100, 49152])
def test_argmax_matches_torch_first_maximum_and_first_nan(cols, cpu_variant):
    """Ties go to the first index, a NaN anywhere wins (the first one), rows may be strided; the
    NaNs sit in the first 16-wide chunk, a later one and the scalar tail."""
    gen = torch.Generator().manual_seed(cols)
    x = torch.randint(-3, 4, (40, cols + 5), generator=gen).float()[:, :cols]  # many ties
    x[1] = -float("inf")
    for row, col in [(2, 0), (3, cols // 2), (4, cols - 1), (5, min(20, cols - 1))]:
        x[row, col] = float("nan")
    x[6, :] = float("nan")
    assert not x.is_contiguous()
    torch.testing.assert_close(argmax_native(x), x.argmax(dim=-1), rtol=0, atol=0)
    logits = torch.randn(64, cols, generator=gen)
    assert torch.equal(argmax_native(logits), logits.argmax(dim=-1))


def test_argmax_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="float32"):
        argmax_native(torch.randn(3, 40).bfloat16())
    with pytest.raises(ValueError, match="rows of 1"):
        argmax_native(torch.randn(3, 0))
    with pytest.raises(ValueError, match="contiguous last dim"):
        argmax_native(torch.randn(40, 3).t())



def test_elementwise_inputs_that_do_not_fit_are_refused_before_any_memory_is_touched():
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="needs a weight of 64"):
        rms_norm_native(x, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_native(x, torch.ones(64), 1e-5, torch.randn(2, 64))
    with pytest.raises(ValueError, match="odd width"):
        silu_and_mul_native(torch.randn(3, 7))
    q, k = torch.randn(3, 9, 64), torch.randn(3, 3, 64)
    before = q.clone(), k.clone()
    with pytest.raises(IndexError, match="token 2 has position 16, outside the rotary cache's 16 positions"):
        rotary_embedding_native(torch.tensor([0, 5, 16]), q, k, torch.randn(16, 64))
    with pytest.raises(IndexError, match="token 1 has position -1"):
        rotary_embedding_native(torch.tensor([0, -1, 3]), q, k, torch.randn(16, 64))
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])  # refused before any row was rotated
    with pytest.raises(ValueError, match="do not fit"):
        rotary_embedding_native(torch.tensor([0, 1, 2]), q, k, torch.randn(16, 32))


def test_inputs_with_a_strided_last_dim_take_the_torch_path():
    x = torch.randn(64, 6).t()  # (6, 64), last dim strided
    assert not cpu_native.supports(x)
    torch.testing.assert_close(ops.silu_and_mul(x), torch.nn.functional.silu(x[:, :32]) * x[:, 32:])


def test_a_bf16_model_step_on_the_native_kernels_matches_the_torch_path(cpu_variant):
    """A whole mixed step (two decodes, one prefill chunk) of a bf16 model: every op the native
    kernels take (norms, rotary, KV store, decode attention, SiLU) against the torch references."""
    from engine.model import PRESETS, Transformer
    from kernels.metadata import build_attention_metadata

    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).to(torch.bfloat16).eval()
    model.init_rope(256)
    args, block_size = model.args, 16
    query_lens, context_lens = [1, 1, 7], [40, 3, 7]
    tables = [[0, 1, 2], [3], [4]]
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size)
    shape = (6, block_size, args.n_kv_heads, args.head_dim)
    caches = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(args.n_layers)]
    input_ids = torch.randint(0, args.vocab_size, (sum(query_lens),))
    positions = torch.tensor([39, 2, 0, 1, 2, 3, 4, 5, 6])
    outs = {}
    for backend in ("cpu-native", "torch"):
        ops.set_backend(backend)
        try:
            with torch.inference_mode():
                kv = [(k.clone(), v.clone()) for k, v in caches]
                meta.torch_decode_plan = None
                outs[backend] = (model(input_ids, positions, kv, meta), kv)
        finally:
            ops.set_backend(None)
    (native, native_kv), (plain, plain_kv) = outs["cpu-native"], outs["torch"]
    assert native.dtype == torch.bfloat16
    torch.testing.assert_close(native.float(), plain.float(), atol=5e-2, rtol=5e-2)
    for (nk, nv), (pk, pv) in zip(native_kv, plain_kv, strict=True):  # this step's keys, stored alike
        torch.testing.assert_close(nk.float(), pk.float(), atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(nv.float(), pv.float(), atol=5e-2, rtol=5e-2)


def _tiled_prefill(inputs, num_threads=None, q=None):
    from kernels.attention_prefill import paged_prefill_attention_native

    meta = inputs.meta
    nd = meta.num_decodes
    return paged_prefill_attention_native(q if q is not None else inputs.q[meta.num_decode_tokens:],
                                          inputs.k_cache, inputs.v_cache, meta.block_tables[nd:],
                                          meta.prefill_query_start_loc, meta.context_lens[nd:], inputs.scale,
                                          num_threads)


def _dp_bf16() -> bool:
    """Whether the library was built with AVX512-BF16 (the tiled prefill's instructions)."""
    return bool(cpu_native.features() & cpu_native.FEATURE_DP_BF16)


def test_each_variant_is_built_for_the_vector_units_it_names(cpu_variant):
    """The library a variant loads uses its ISA, whatever the CPU has beyond it (an AVX-512 machine
    runs the AVX2 code too), and its panel GEMM takes both dtypes."""
    got = cpu_native.features()
    avx512 = cpu_variant in ("avx512", "avx512bf16", "amx")
    assert bool(got & cpu_native.FEATURE_AVX512) == avx512
    assert bool(got & cpu_native.FEATURE_AVX2) == (cpu_variant == "avx2")
    assert bool(got & cpu_native.FEATURE_DP_BF16) == (cpu_variant in ("avx512bf16", "amx"))
    assert got & cpu_native.FEATURE_GEMM_F32
    assert bool(got & cpu_native.FEATURE_GEMM_BF16) == (cpu_variant != "avx512")
    assert cpu_variant == "amx" or not cpu_native.amx()  # tiles only there (where Linux grants them)


AVX2_CPU = frozenset("fpu sse sse2 avx avx2 fma f16c bmi1 bmi2 movbe".split())  # Zen 3, no AVX-512
ZEN4 = AVX2_CPU | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16"}


def test_the_process_runs_the_best_variant_its_cpu_executes():
    assert cpu_native.runnable(AVX2_CPU, x86=True) == ["avx2"]
    assert cpu_native.choose(AVX2_CPU, x86=True) == "avx2"
    assert cpu_native.choose(ZEN4 - {"avx512_bf16"}, x86=True) == "avx512"  # Skylake-X, Ice Lake
    assert cpu_native.runnable(ZEN4, x86=True) == ["avx2", "avx512", "avx512bf16"]
    assert cpu_native.choose(ZEN4 | {"amx_tile", "amx_bf16"}, x86=True) == "amx"  # Sapphire Rapids
    assert cpu_native.choose(AVX2_CPU - {"fma"}, x86=True) == cpu_native.NATIVE  # older than Haswell
    assert cpu_native.choose(ZEN4, x86=False) == cpu_native.NATIVE  # aarch64: the compiler's pick
    assert cpu_native.choose() == cpu_native.runnable()[-1]


def test_a_cpu_without_avx512_never_loads_the_avx512_library(monkeypatch):
    """On an AVX2-only CPU the library built and loaded is the avx2 one (-march=x86-64-v3, no
    AVX-512 code), and asking for an AVX-512 variant is refused, naming what the CPU lacks, before
    anything is built or loaded."""
    from kernels import cpu_features

    built = []
    real_build = cpu_native.build
    monkeypatch.setattr(cpu_native, "build",
                        lambda cc, out, flags=None: built.append(flags) or real_build(cc, out, flags))
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: AVX2_CPU)
    monkeypatch.setattr(cpu_native, "_x86", lambda: True)
    for name, value in (("_lib", None), ("_tried", False), ("_why_not", ""), ("_wanted", None)):
        monkeypatch.setattr(cpu_native, name, value)  # forgotten; the avx2 library may come from the cache
    assert cpu_native.load() is not None and cpu_native.variant() == "avx2"
    assert built == [cpu_native.cflags("avx2")] and "-march=x86-64-v3" in built[0]
    assert not any("avx512" in f or "x86-64-v4" in f for f in built[0])
    assert cpu_native.features() & cpu_native.FEATURE_AVX2
    assert not cpu_native.features() & cpu_native.FEATURE_AVX512
    for name in ("avx512", "avx512bf16", "amx"):
        with pytest.raises(ValueError, match=f"cannot run the {name} kernels: it lacks .*avx512bw"):
            cpu_native.use(name)
    with pytest.raises(ValueError, match="unknown CPU kernel variant 'avx9'"):
        cpu_native.use("avx9")
    assert built == [cpu_native.cflags("avx2")]
    cpu_native.use(None)


# prompts (query = context) and chunks of longer contexts (query < context), tiles whole and cut
PREFILL_LENS = ([2, 15, 1, 16, 17, 40, 130], [2, 20, 16, 16, 33, 100, 300])


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim",
                         [(9, 3, 64), (8, 8, 128), (4, 1, 32), (16, 2, 64)])
def test_tiled_prefill_matches_the_reference_and_reads_only_contexts(num_q_heads, num_kv_heads, head_dim,
                                                                     block_size):
    if not _dp_bf16():
        pytest.skip("the library has no AVX512-BF16 (CPU or build flags): prefill takes the row-by-row path")
    query_lens, context_lens = PREFILL_LENS
    inputs = make_paged_inputs(query_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size,
                               dtype=torch.bfloat16, garbage=float("nan"))
    got = _tiled_prefill(inputs)
    assert got is not None
    ref = paged_prefill_attention_ref(inputs.q.float(), inputs.k_cache.float(), inputs.v_cache.float(),
                                      inputs.meta.block_tables, query_lens, context_lens, inputs.scale)
    assert not got.isnan().any()
    # bf16 inputs, probabilities rounded to bf16 before the value product, the output to bf16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiled_prefill_gives_the_same_answer_on_any_thread_count_and_strided_queries(cpu_variant, dtype):
    """Either kernel (the vdpbf16ps tiles, the fp32 vector tiles) on every variant this CPU runs."""
    inputs = make_paged_inputs([37, 5, 64], [37, 70, 64], 9, 3, 64, 16, dtype=dtype, garbage=float("nan"))
    one = _tiled_prefill(inputs, 1)
    assert one is not None and not one.isnan().any()
    for n in (2, 3, 32):
        assert torch.equal(_tiled_prefill(inputs, n), one)
    fused = torch.zeros(inputs.q.shape[0], 15, 64, dtype=dtype)  # q as a view of a wider row
    fused[:, :9] = inputs.q
    assert torch.equal(_tiled_prefill(inputs, 2, q=fused[:, :9]), one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (8, 8, 128, 4), (4, 1, 32, 16), (16, 2, 64, 5), (24, 3, 32, 16),
                          (6, 2, 256, 16)])
def test_vector_prefill_tiles_match_the_reference_on_every_variant(cpu_variant, dtype, num_q_heads,
                                                                   num_kv_heads, head_dim, block_size):
    """fp32, and bf16 where the library has no AVX512-BF16, in fp32 vector tiles (csrc/attention_prefill.c:
    head dims 32-256, G 1-8, any block size): within fp32 rounding of the reference (bf16: the output's
    rounding), never reading outside a context (nan there)."""
    if dtype == torch.bfloat16 and _dp_bf16():
        pytest.skip(f"the {cpu_variant} library takes bf16 on its vdpbf16ps tiles (tested above)")
    query_lens, context_lens = PREFILL_LENS
    inputs = make_paged_inputs(query_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size,
                               dtype=dtype, garbage=float("nan"))
    got = _tiled_prefill(inputs, 2)
    assert got is not None
    ref = paged_prefill_attention_ref(inputs.q.float(), inputs.k_cache.float(), inputs.v_cache.float(),
                                      inputs.meta.block_tables, query_lens, context_lens, inputs.scale)
    assert not got.isnan().any()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 1, 32), (16, 2, 64)])
def test_prefill_chunks_of_16_queries_on_amx_tiles_match_the_vector_kernel(num_q_heads, num_kv_heads,
                                                                         head_dim, kernel_options):
    """On an AMX CPU a sequence's chunk of 16 or more queries (head dim 32 or 64) runs on tiles, the
    shorter ones and decodes beside it on vector code: both within bf16 rounding of the reference and
    of the vector kernel alone (amx=False), which differs from it (the tiles ran), and never
    reading outside a context (nan there)."""
    from kernels import cpu_gemm

    if not (_dp_bf16() and cpu_gemm.amx_in_use()):
        pytest.skip("no AMX tiles here (CPU, compiler or Linux): the vector kernel, tested above, runs")
    query_lens, context_lens = [1, 15, 16, 17, 40, 130, 64], [9, 20, 16, 33, 100, 300, 64]
    inputs = make_paged_inputs(query_lens, context_lens, num_q_heads, num_kv_heads, head_dim, 16,
                               dtype=torch.bfloat16, garbage=float("nan"))
    tiles = _tiled_prefill(inputs)
    kernel_options(amx=False)
    try:
        assert not cpu_gemm.amx_in_use()
        vector = _tiled_prefill(inputs)
    finally:
        kernel_options(amx=True)
        assert cpu_gemm.amx_in_use()
    ref = paged_prefill_attention_ref(inputs.q.float(), inputs.k_cache.float(), inputs.v_cache.float(),
                                      inputs.meta.block_tables, query_lens, context_lens, inputs.scale)
    ref = ref[inputs.meta.num_decode_tokens:]  # a prefill call's rows: the chunks after the decode
    assert not tiles.isnan().any()
    torch.testing.assert_close(tiles.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(tiles, vector, atol=2e-2, rtol=2e-2)
    assert not torch.equal(tiles, vector)
    assert torch.equal(tiles[:15], vector[:15])  # the 15-query chunk (the decode is not in a prefill's rows)


def test_a_prefill_whose_every_sequence_takes_tiles_runs_on_every_thread():
    """The parallel region's condition counts the AMX work items too: a prefill of two 16+ query
    chunks (all on tiles) once ran on one thread; one 5-query chunk of one KV head (one vector
    item) runs on one."""
    from kernels import cpu_gemm

    if not (_dp_bf16() and cpu_gemm.amx_in_use()):
        pytest.skip("no AMX tiles here (CPU, compiler or Linux): every prefill item is a vector one")
    lib = cpu_native.library()
    inputs = make_paged_inputs([16, 40], [16, 100], 9, 3, 64, 16, dtype=torch.bfloat16)
    assert _tiled_prefill(inputs, 2) is not None
    assert lib.batchgen_prefill_threads() == 2
    assert _tiled_prefill(make_paged_inputs([5], [5], 3, 1, 64, 16, dtype=torch.bfloat16), 2) is not None
    assert lib.batchgen_prefill_threads() == 1


def test_tiled_prefill_declines_what_it_does_not_take_and_ops_fall_back_to_rows(monkeypatch):
    bf = make_paged_inputs([5, 9], [5, 20], 9, 3, 64, 16, dtype=torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):  # D 40, G 12, D 288: neither kernel's
        for heads, kv_heads, dim in [(9, 3, 40), (12, 1, 64), (3, 1, 288)]:
            inputs = make_paged_inputs([5, 9], [5, 20], heads, kv_heads, dim, 16, dtype=dtype)
            assert _tiled_prefill(inputs) is None
    odd_block = make_paged_inputs([5, 9], [5, 20], 9, 3, 64, 5, dtype=torch.bfloat16)
    assert (_tiled_prefill(odd_block) is None) == _dp_bf16()  # the vdpbf16ps tiles take pairs of keys
    # where the tiled kernel declines, the prefill still runs natively, row by row
    from kernels import attention_prefill

    monkeypatch.setattr(ops, "paged_prefill_attention_native", lambda *a, **k: None)
    rows = ops.paged_attention(bf.q, bf.k_cache, bf.v_cache, bf.meta, bf.scale)
    ref = attention_prefill.paged_prefill_attention_ref(bf.q.float(), bf.k_cache.float(), bf.v_cache.float(),
                                                        bf.meta.block_tables, [5, 9], [5, 20], bf.scale)
    torch.testing.assert_close(rows.float(), ref, atol=2e-2, rtol=2e-2)


def test_the_isa_kernel_option_parses_a_variant_and_names_a_bad_one():
    from kernels.options import ISAS, KernelOptions

    assert ISAS == ("auto", *cpu_native.VARIANTS, cpu_native.NATIVE)

    assert KernelOptions.parse(["isa=AVX2"]).isa == "avx2" and KernelOptions().isa == "auto"
    with pytest.raises(ValueError, match="kernel option isa must be one of .*'avx2'.*got 'sse9'"):
        KernelOptions.parse(["isa=sse9"])


_FAIL_ON_GEMM = 'for a in "$@"; do case "$a" in *gemm.c) echo boom >&2; exit 1;; esac; done\n'
_FAIL_ON_LINK = ('link=1\nfor a in "$@"; do [ "$a" = -c ] && link=0; done\n'
                 '[ $link = 1 ] && { echo boom >&2; exit 1; }\n')


@pytest.mark.parametrize("script, named", [(_FAIL_ON_GEMM, "failed on gemm.c: boom"),
                                           (_FAIL_ON_LINK, "failed linking .*common.c.*: boom")])
def test_a_failed_unit_or_link_is_named_and_leaves_nothing(tmp_path, script, named):
    """The units compile one by one (in parallel), then link: whichever fails is named, with what the
    compiler said, and no library or object is left behind."""
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n" + script + 'while [ "$1" != -o ]; do shift; done\necho fake > "$2"\n')
    cc.chmod(0o755)
    out = tmp_path / "native"
    with pytest.raises(RuntimeError, match=named):
        cpu_native.build(str(cc), out)
    assert [p.suffix for p in out.iterdir()] == [".lock"]
