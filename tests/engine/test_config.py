"""EngineConfig: device defaults resolved on construction, validation naming the field, and the
engine flags that rebuild a config."""

from __future__ import annotations

from dataclasses import fields

import click
import pytest

from engine.cli_options import ENGINE_FIELDS, engine_config, engine_options
from engine.config import EngineConfig


def test_defaults_follow_the_device():
    cpu = EngineConfig()
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.dtype) == (128, 8192, "float32")
    for device in ("cuda", "cuda:3"):
        gpu = EngineConfig(device=device)
        assert (gpu.max_num_seqs, gpu.max_num_batched_tokens, gpu.dtype) == (256, 16384, "bfloat16")
        assert gpu.device_kind == "cuda" and gpu.gpu_memory_utilization == 0.9
    given = EngineConfig(device="cuda", max_num_seqs=7, dtype="float16")
    assert (given.max_num_seqs, given.max_num_batched_tokens, given.dtype) == (7, 16384, "float16")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("device", "gpu", "device must be"), ("device", "cuda:x", "device must be"),
    ("dtype", "fp8", "dtype must be 'auto' or one of"),
    ("gpu_memory_utilization", 0.0, "gpu_memory_utilization"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
    ("kv_cache_memory_gb", -1.0, "kv_cache_memory_gb"),
    ("kv_cache_memory_gb", float("nan"), "kv_cache_memory_gb"), ("max_num_seqs", 0, "max_num_seqs"),
])
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_the_engine_flags_are_derived_from_engine_config():
    @click.command()
    @engine_options
    def parse(**opts):
        return engine_config(opts)

    # every field is a flag but the per-request seed default (jobs take --seed per row), dtype_reason,
    # which construction derives, and the kernel variants, which only benchmarks and tests choose
    assert set(ENGINE_FIELDS) == {f.name for f in fields(EngineConfig)} - {"seed", "dtype_reason",
                                                                            "kernel_options"}
    assert {p.name for p in parse.params} == set(ENGINE_FIELDS)
    flags = ["--max-num-seqs", "5", "--kv-cache-memory", "2.5", "--enforce-eager", "--dtype", "bfloat16",
             "--gpu-memory-utilization", "0.7", "--no-enable-chunked-prefill",
             "--scheduling-policy", "priority"]
    assert parse.main(flags, standalone_mode=False) == EngineConfig(
        max_num_seqs=5, kv_cache_memory_gb=2.5, enforce_eager=True, dtype="bfloat16",
        gpu_memory_utilization=0.7, enable_chunked_prefill=False, scheduling_policy="priority")
    assert parse.main([], standalone_mode=False) == EngineConfig(), "unset flags keep the device defaults"
    with pytest.raises(click.BadParameter):
        parse.main(["--dtype", "fp8"], standalone_mode=False)


def test_dtype_auto_on_the_command_line():
    assert engine_config({"dtype": "auto"}).dtype == "float32"
    assert engine_config({"dtype": "auto", "device": "cuda"}).dtype == "bfloat16"
    with pytest.raises(click.UsageError, match="gpu_memory_utilization"):
        engine_config({"gpu_memory_utilization": 2.0})


def test_cpu_auto_dtype_follows_native_bf16(monkeypatch):
    from kernels import cpu_features

    monkeypatch.delenv(cpu_features.PIN_ENV, raising=False)
    avx2 = frozenset({"avx2", "fma"})
    assert cpu_features.auto_dtype(avx2) == ("float32",
                                             "the CPU has no native bf16 (no avx512_bf16 or amx_bf16)")
    assert cpu_features.auto_dtype(avx2 | {"avx512_bf16"}) == ("bfloat16", "the CPU has avx512_bf16")
    assert cpu_features.auto_dtype(avx2 | {"avx512_bf16", "amx_bf16"})[1] == "the CPU has amx_bf16"
    monkeypatch.setenv(cpu_features.PIN_ENV, "float32")
    assert cpu_features.auto_dtype(avx2 | {"amx_bf16"}) == ("float32", f"pinned by {cpu_features.PIN_ENV}")
    config = EngineConfig()
    assert (config.dtype, config.dtype_reason) == ("float32", f"auto: pinned by {cpu_features.PIN_ENV}")
    assert EngineConfig(dtype="bfloat16").dtype_reason == "given"
    monkeypatch.setenv(cpu_features.PIN_ENV, "fp8")
    with pytest.raises(ValueError, match="BATCHGEN_CPU_DTYPE must be float32 or bfloat16, got 'fp8'"):
        EngineConfig()


def test_kernel_options_survive_a_recorded_config_and_bad_ones_are_refused():
    from dataclasses import asdict

    from kernels.options import KernelOptions

    config = EngineConfig(kernel_options=KernelOptions(fused_decode=False, amx=False))
    assert EngineConfig(**asdict(config)) == config  # a job's manifest records asdict(config)
    assert EngineConfig(**asdict(EngineConfig())).kernel_options is None
    with pytest.raises(ValueError, match="kernel_options must be KernelOptions or None"):
        EngineConfig(kernel_options="fused_decode=off")
    with pytest.raises(TypeError):
        EngineConfig(kernel_options={"fused_decod": False})
