"""How the kernels are picked: one typed options object, set when an engine is built, never read from
the environment.

The defaults are the product. The other values exist to test each path and to compare variants in
the benchmarks (`batchgen bench throughput --kernel-option fused_decode=off`); no user setting
reaches them. `configure()` sets the process's options (an engine whose EngineConfig carries
kernel_options does so when it is built); kernels read `current()`, a plain attribute read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

BACKENDS = ("auto", "torch", "triton", "cpu-native")
# KernelOptions.isa's values: auto, then kernels.cpu_native's VARIANTS and NATIVE (which imports this
# module; tests/kernels/test_cpu_native.py keeps the two lists the same)
ISAS = ("auto", "avx2", "avx512", "avx512bf16", "amx", "native")


@dataclass(frozen=True)
class KernelOptions:
    # every op through one backend; auto: Triton on CUDA (torch without Triton), cpu-native on the CPU
    backend: str = "auto"
    native: bool = True  # the C kernels (cpu-native falls back to the torch references call by call)
    onednn: bool = True  # weights packed for the CPU GEMMs (oneDNN's layout or the panels); off: F.linear
    panel_gemm: bool = True  # batchgen's panel GEMM where it has code (off: oneDNN there, to compare)
    prefill_unpack: bool = True  # a prefill's plain products through torch.mm on unpacked panels where faster
    fused_argmax: bool = True  # greedy rows' tokens straight from the lm_head's panels (no logits)
    fused_decode: bool = True  # a decode step's layers as one native call (off: op by op)
    amx: bool = True  # bf16 GEMMs on AMX tiles where the CPU has them (off: the vector kernels)
    attn_stream: bool | None = None  # decode attention's own L2 prefetch stream (None: the library's choice)
    # the C library's ISA variant (kernels/cpu_native.py VARIANTS; auto: the process's, the best this CPU
    # runs), e.g. avx2 on an AVX-512 CPU to measure the AVX2 code (oneDNN follows ONEDNN_MAX_CPU_ISA)
    isa: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"kernel backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.isa not in ISAS:
            raise ValueError(f"kernel option isa must be one of {ISAS}, got {self.isa!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            optional = value is None and f.name == "attn_stream"
            if f.name not in ("backend", "isa") and not (isinstance(value, bool) or optional):
                raise ValueError(f"kernel option {f.name} must be true or false, got {value!r}")

    @classmethod
    def parse(cls, items: list[str] | tuple[str, ...], base: KernelOptions | None = None) -> KernelOptions:
        """From NAME=VALUE strings (a benchmark's --kernel-option): on/off, true/false or 1/0 for the
        switches, a backend name for backend, a variant name for isa, auto for attn_stream's and isa's
        defaults."""
        names = {f.name for f in fields(cls)}
        changes: dict[str, object] = {}
        for item in items:
            name, eq, raw = item.partition("=")
            name, raw = name.strip().replace("-", "_"), raw.strip().lower()
            if not eq or name not in names:
                raise ValueError(f"{item!r}: expected NAME=VALUE with NAME one of {sorted(names)}")
            if name in ("backend", "isa"):
                changes[name] = raw
            elif name == "attn_stream" and raw == "auto":
                changes[name] = None
            elif raw in ("1", "on", "true", "yes"):
                changes[name] = True
            elif raw in ("0", "off", "false", "no"):
                changes[name] = False
            else:
                raise ValueError(f"{item!r}: {name} takes on or off")
        return replace(base or cls(), **changes)


_current = KernelOptions()


def current() -> KernelOptions:
    """The options every kernel call of this process follows."""
    return _current


def configure(options: KernelOptions) -> None:
    """Make `options` the process's kernel options (for every engine in it: they share the kernels)."""
    global _current
    if not isinstance(options, KernelOptions):
        raise TypeError(f"expected KernelOptions, got {type(options).__name__}")
    _current = options


@contextlib.contextmanager
def override(**changes) -> Iterator[KernelOptions]:
    """The current options with `changes`, for the duration of a with block (tests, benchmarks)."""
    before = _current
    configure(replace(before, **changes))
    try:
        yield _current
    finally:
        configure(before)
