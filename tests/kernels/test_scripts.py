"""The two GPU-side scripts still run here: the bench at toy shapes through the interpreter, and a
build of every kernel for sm_90 (what only the compiler checks: types, layouts, shared memory)."""

import os
import subprocess
import sys

from tests.kernels.cases import require_triton

require_triton()


def _run(args: list[str], interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "BATCHGEN_KERNELS")}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=300)


def test_bench_runs_end_to_end_on_cpu():
    result = _run(["kernels.bench", "--device", "cpu", "--quick"], interpret=True)
    assert result.returncode == 0, result.stdout + result.stderr
    header, rule, *rows = result.stdout.splitlines()
    assert header.split()[:3] == ["kernel", "workload", "dtype"] and set(rule) == {"-"}
    ops = {row.split()[0] for row in rows[:-1]}
    assert ops == {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "store_kv_cache",
                   "decode_attention", "prefill_attention", "fused_moe"}
    assert rows[-1] == f"{len(rows) - 1}/{len(rows) - 1} kernels match their torch reference"


def test_bench_times_the_moe_cpu_path_without_triton_s_interpreter():
    result = _run(["kernels.bench", "--moe-cpu", "--quick", "--reps", "1"], interpret=False)
    assert result.returncode == 0, result.stdout + result.stderr
    header, _, *rows = result.stdout.splitlines()
    assert "cpu ms" in header and len(rows) == 5 and all(row.startswith("fused_moe ") for row in rows[:-1])
    assert rows[-1] == "4/4 kernels match their torch reference"


def test_bench_refuses_cpu_without_the_interpreter():
    result = _run(["kernels.bench", "--device", "cpu", "--quick"], interpret=False)
    assert result.returncode == 2 and "TRITON_INTERPRET=1" in result.stderr


def test_every_kernel_compiles_for_sm90_without_spilling():
    args = ["kernels.compile_check", "--arch", "90", "--dtypes", "bfloat16", "float32"]
    result = _run(args, interpret=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "34 kernel builds ok, 0 failed" in result.stdout
    builds = result.stdout.splitlines()[:-1]
    assert all(" spill=0B " in line for line in builds), result.stdout  # cuobjdump ships with Triton
