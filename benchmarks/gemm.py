"""The CPU GEMM paths side by side at the model's shapes: `batchgen bench gemm`.

F.linear (torch's own: MKL or oneDNN as the build has it), oneDNN over its packed layout and
batchgen's panel kernel (kernels/cpu_gemm.py), each in GFLOP/s for SmolLM2-135M's decode and
prefill shapes, fp32 and bf16; a path that does not apply to the dtype or CPU shows 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kernels import cpu_native
from kernels.cpu_gemm import PACKED_DTYPES, linear, pack_onednn, pack_panels, panels_apply

PATHS = {  # the GEMM paths main() compares: how each packs a weight (None: it does not apply)
    "F.linear": lambda w: w,
    "oneDNN packed": pack_onednn,
    "panels": lambda w: pack_panels(w) if panels_apply(w) else None,
}


def flops_per_s(m: int, k: int, n: int, path: str, seconds: float = 0.3,
                dtype: torch.dtype = torch.float32, cpu_time: bool = False) -> float:
    """Measured FLOP/s of one (m, k) x (k, n) product on the CPU through one of PATHS (0 where it
    does not apply): over wall time, or over the calling thread's CPU time (cpu_time; meaningful with
    one torch thread, where the product runs on the calling thread)."""
    x, w = torch.randn(m, k, dtype=dtype), PATHS[path](torch.randn(n, k, dtype=dtype))
    if w is None:
        return 0.0
    clock = time.thread_time if cpu_time else time.perf_counter
    linear(x, w)
    reps, t0, wall0 = 0, clock(), time.perf_counter()
    while time.perf_counter() - wall0 < seconds:
        linear(x, w)
        reps += 1
    return 2 * m * k * n * reps / (clock() - t0)


SHAPES = [(8, 576, 960), (64, 576, 960), (128, 576, 3072), (128, 1536, 576),
          (128, 576, 49152), (2048, 576, 3072), (1024, 1024, 1024)]


def parse_shape(text: str) -> tuple[int, int, int]:
    """'MxKxN' as (m, k, n); an argparse error naming the value otherwise."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected MxKxN of positive integers, "
                                         "e.g. 64x576x960")
    m, k, n = (int(p) for p in parts)
    return m, k, n


def main(argv: list[str] | None = None) -> int:
    """Print GF/s of every path for SmolLM2-135M's decode and prefill shapes, fp32 and bf16."""
    parser = argparse.ArgumentParser(prog="batchgen bench gemm", description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=[cpu_native.NATIVE, *cpu_native.VARIANTS],
                        help="the native library's ISA variant the panels run on (default: the best this "
                             "CPU executes); to compare oneDNN on the same ISA, set ONEDNN_MAX_CPU_ISA "
                             "(e.g. AVX2) in the environment")
    parser.add_argument("--threads", type=int, help="torch and kernel threads (default: torch's)")
    parser.add_argument("--shape", type=parse_shape, action="append",
                        help="MxKxN to measure (repeatable; default: SmolLM2-135M's decode and prefill "
                             "shapes)")
    parser.add_argument("--seconds", type=float, default=0.3, help="time each measurement this long")
    parser.add_argument("--cpu-time", action="store_true",
                        help="rates over the thread's CPU time, not wall time (needs --threads 1): other "
                             "processes' load moves it far less on a shared machine")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads {args.threads}: must be at least 1")
        torch.set_num_threads(args.threads)
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time needs --threads 1 (with more threads the work is not the calling thread's)")
    if args.variant is not None:
        try:
            cpu_native.use(args.variant)
        except ValueError as e:
            parser.error(f"--variant {args.variant}: {e}")
    print(f"panels on the {cpu_native.variant() or cpu_native.choose()} variant, {torch.get_num_threads()} "
          f"thread(s), GF/s over {'CPU' if args.cpu_time else 'wall'} time")
    print(f"{'m x k x n':>18} {'dtype':>9}" + "".join(f" {name + ' GF/s':>18}" for name in PATHS))
    for dtype in PACKED_DTYPES:
        for m, k, n in args.shape or SHAPES:
            rates = (flops_per_s(m, k, n, path, args.seconds, dtype, args.cpu_time) / 1e9 for path in PATHS)
            print(f"{f'{m}x{k}x{n}':>18} {str(dtype)[6:]:>9}" + "".join(f" {r:18.0f}" for r in rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
