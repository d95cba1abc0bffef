"""The two GPU-side scripts still run here: the bench at toy shapes through the interpreter, and a
build of every kernel for sm_90 (what only the compiler checks: types, layouts, shared memory)."""

import os
import subprocess
import sys

import torch

from tests.kernels.cases import require_triton

require_triton()


def _run(args: list[str], interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=300)


def test_bench_runs_end_to_end_on_cpu():
    result = _run(["benchmarks.kernel_ops", "--device", "cpu", "--quick"], interpret=True)
    assert result.returncode == 0, result.stdout + result.stderr
    header, rule, *rows = result.stdout.splitlines()
    assert header.split()[:3] == ["kernel", "workload", "dtype"] and set(rule) == {"-"}
    ops = {row.split()[0] for row in rows[:-1]}
    assert ops == {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "store_kv_cache",
                   "decode_attention", "prefill_attention", "fused_moe"}
    assert rows[-1] == f"{len(rows) - 1}/{len(rows) - 1} kernels match their torch reference"


def test_bench_times_the_moe_cpu_path_without_triton_s_interpreter():
    result = _run(["benchmarks.kernel_ops", "--moe-cpu", "--quick", "--reps", "1"], interpret=False)
    assert result.returncode == 0, result.stdout + result.stderr
    header, _, *rows = result.stdout.splitlines()
    assert "cpu ms" in header and len(rows) == 5 and all(row.startswith("fused_moe ") for row in rows[:-1])
    assert rows[-1] == "4/4 kernels match their torch reference"


def test_bench_refuses_cpu_without_the_interpreter():
    result = _run(["benchmarks.kernel_ops", "--device", "cpu", "--quick"], interpret=False)
    assert result.returncode == 2 and "TRITON_INTERPRET=1" in result.stderr


def test_every_kernel_compiles_for_sm90_without_spilling():
    """Every launcher with its default tiles, at each head shape (SmolLM2-135M, Qwen3-0.6B, Llama-3-8B)."""
    args = ["kernels.compile_check", "--arch", "90", "--dtypes", "bfloat16", "float32", "--configs",
            "default", "--jobs", "2"]
    result = _run(args, interpret=False)
    assert result.returncode == 0, result.stdout + result.stderr
    # per dtype: 5 elementwise builds, then decode, split decode + its merge, prefill per head shape
    # (Qwen3-0.6B's and Llama-3-8B's merge kernels are one build: head dim 128 both), and the fused MoE's
    # gated and weighted GEMMs at both tile sizes
    assert "40 kernel builds ok, 0 failed" in result.stdout
    builds = result.stdout.splitlines()[:-1]
    assert sum(" qwen3-0.6b " in line for line in builds) == 2 * 4
    assert all(" spill=0B " in line for line in builds), result.stdout  # cuobjdump ships with Triton


def test_compile_check_builds_the_tiles_the_tuner_may_pick():
    """The tuner may pick any candidate: compile_check (default --configs all) launches each one, and
    the largest tiles at the 0.6B head shape build for sm_90 without spilling (the full build:
    `python -m kernels.compile_check`, ~130 builds per dtype and head shape)."""
    from kernels import compile_check, tuning

    launches = compile_check.example_launches(torch.bfloat16, "qwen3-0.6b")
    decode = [op for op in launches if op.startswith("decode_attention ")]
    prefill = [op for op in launches if op.startswith("prefill_attention ")]
    assert len(decode) == len(tuning.CANDIDATES["decode"])
    assert len(prefill) == len(tuning.CANDIDATES["prefill"])
    # decode's and prefill's biggest tiles with the deepest pipelines
    largest = "^decode_attention(_split)? n128w8s3$|^prefill_attention m128n128w8s2$"
    args = ["kernels.compile_check", "--arch", "90", "--dtypes", "bfloat16", "--heads", "qwen3-0.6b",
            "--only", largest, "--jobs", "2"]
    result = _run(args, interpret=False)
    assert result.returncode == 0, result.stdout + result.stderr
    builds = result.stdout.splitlines()[:-1]
    assert "4 kernel builds ok, 0 failed" in result.stdout  # decode, split decode + merge, prefill
    assert all(" spill=0B " in line for line in builds), result.stdout
    assert any("prefill_attention m128n128w8s2" in line and "warps=8" in line for line in builds)
