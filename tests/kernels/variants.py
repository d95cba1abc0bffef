"""The `cpu_variant` fixture: a test that takes it runs once per ISA variant of the native library
(kernels/cpu_native.py VARIANTS), each on its own build, so one machine tests every variant its CPU
executes; a variant this CPU cannot execute skips, naming the flags it lacks. The conftest files of
tests/kernels and tests/engine import it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kernels import cpu_features, cpu_native, ops, options

# -march=native serves only CPUs no explicit variant fits (not x86, or no AVX2): a param there only
NATIVE_ONLY = cpu_native.runnable() == [cpu_native.NATIVE]
PARAMS = [*cpu_native.VARIANTS] + ([cpu_native.NATIVE] if NATIVE_ONLY else [])


@pytest.fixture(params=PARAMS)
def cpu_variant(request):
    name = request.param
    try:
        cpu_native.use(name)
    except ValueError as exc:
        pytest.skip(str(exc))
    before = options.current()
    try:
        if cpu_native.load() is None:
            pytest.fail(f"the {name} kernels did not build: {cpu_native.why_unavailable()}")
        assert cpu_native.variant() == name
        if name != "amx" and "amx_bf16" in cpu_features.cpu_flags():
            # on an AMX CPU a variant without AMX leaves bf16 GEMMs to oneDNN's tiles
            # (cpu_gemm.panels_apply): its own bf16 code runs with amx off, as asked for to compare
            ops.configure(replace(before, amx=False))
        yield name
    finally:
        ops.configure(before)
        cpu_native.use(None)
