"""What the CPU can do natively, read once from /proc/cpuinfo (torch's own capability string says
AVX512 or AVX2 but not whether bf16 dot products exist).

The engine picks its `auto` dtype on the CPU from this: bf16 where the CPU multiplies bf16 natively
(AVX512-BF16's `vdpbf16ps`, or AMX tiles), measured ~2x the fp32 GEMM rate through oneDNN; fp32
elsewhere. bf16 given explicitly runs there too, in the AVX2 panel GEMM (bf16 weights widened to
fp32 in registers), at fp32's speed or a little above (one core, SmolLM2-135M, 32 requests: 0.965x
fp32's CPU time), not enough to give up fp32's accuracy by default.
`BATCHGEN_CPU_DTYPE=float32|bfloat16` pins the choice (the test suite pins float32, so its results
do not depend on the machine).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

PIN_ENV = "BATCHGEN_CPU_DTYPE"
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # best first


@functools.cache
def _cpuinfo_field(*names: str) -> str:
    """The value of the first processor's first /proc/cpuinfo line starting with one of names (empty
    where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((ln for ln in text.splitlines() if ln.startswith(names)), "")
    return line.partition(":")[2].strip()


@functools.cache
def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cpu_flags() -> frozenset[str]:
    """The first processor's `flags` line from /proc/cpuinfo (empty where there is none)."""
    return frozenset(_cpuinfo_field("flags", "Features").split())


def cpu_vendor() -> str:
    """The first processor's `vendor_id` from /proc/cpuinfo ('GenuineIntel', 'AuthenticAMD'; empty
    where there is none)."""
    return _cpuinfo_field("vendor_id")


def bf16_feature(flags: frozenset[str] | None = None) -> str | None:
    """The CPU feature that makes bf16 native ('amx_bf16', 'avx512_bf16'), or None."""
    flags = cpu_flags() if flags is None else flags
    return next((f for f in BF16_FLAGS if f in flags), None)


def auto_dtype(flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(dtype, why) for dtype 'auto' on this CPU: the pin, else bf16 with native bf16, else fp32."""
    pinned = os.environ.get(PIN_ENV)
    if pinned:
        if pinned not in ("float32", "bfloat16"):
            raise ValueError(f"{PIN_ENV} must be float32 or bfloat16, got {pinned!r}")
        return pinned, f"pinned by {PIN_ENV}"
    feature = bf16_feature(flags)
    if feature:
        return "bfloat16", f"the CPU has {feature}"
    return "float32", "the CPU has no native bf16 (no avx512_bf16 or amx_bf16)"
