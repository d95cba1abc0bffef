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

from kernels.cpu_gemm import PACKED_DTYPES, linear, pack_onednn, pack_panels, panels_apply

PATHS = {  # the GEMM paths main() compares: how each packs a weight (None: it does not apply)
    "F.linear": lambda w: w,
    "oneDNN packed": pack_onednn,
    "panels": lambda w: pack_panels(w) if panels_apply(w) else None,
}


def flops_per_s(m: int, k: int, n: int, path: str, seconds: float = 0.3,
                dtype: torch.dtype = torch.float32) -> float:
    """Measured FLOP/s of one (m, k) x (k, n) product on the CPU through one of PATHS (0 where it
    does not apply)."""
    x, w = torch.randn(m, k, dtype=dtype), PATHS[path](torch.randn(n, k, dtype=dtype))
    if w is None:
        return 0.0
    linear(x, w)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        linear(x, w)
        reps += 1
    return 2 * m * k * n * reps / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    """Print GF/s of every path for SmolLM2-135M's decode and prefill shapes, fp32 and bf16."""
    argparse.ArgumentParser(prog="batchgen bench gemm", description=__doc__.splitlines()[0]).parse_args(argv)
    print(f"{'m x k x n':>18} {'dtype':>9}" + "".join(f" {name + ' GF/s':>18}" for name in PATHS))
    for dtype in PACKED_DTYPES:
        for m, k, n in [(8, 576, 960), (64, 576, 960), (128, 576, 3072), (128, 1536, 576),
                        (128, 576, 49152), (2048, 576, 3072), (1024, 1024, 1024)]:
            rates = (flops_per_s(m, k, n, path, dtype=dtype) / 1e9 for path in PATHS)
            print(f"{f'{m}x{k}x{n}':>18} {str(dtype)[6:]:>9}" + "".join(f" {r:18.0f}" for r in rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
