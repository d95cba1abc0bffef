"""Triton when it is installed; otherwise stand-ins so kernel files still import.

The torch references (the CPU production path) must work on a machine without Triton, and they
live beside their kernels. Without Triton, `triton.jit` returns a kernel that refuses to launch
with a message saying why, and `tl.constexpr` exists so kernel signatures still evaluate.
"""

from __future__ import annotations

import os

# Triton 3.9 warns on every compile unless this is set; keep its current default (fusion on).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError as exc:  # the torch path needs no Triton
    HAS_TRITON = False
    _WHY = f"Triton kernels need the `triton` package ({exc}); install batchgen[triton]"

    class _UnavailableKernel:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError(f"cannot launch {self.fn.__name__}: {_WHY}")

    class _MissingTriton:
        @staticmethod
        def jit(fn=None, **_kwargs):
            return _UnavailableKernel(fn) if fn is not None else _UnavailableKernel

        def __getattr__(self, name):
            raise RuntimeError(_WHY)

    class _MissingLanguage:
        constexpr = object  # only evaluated as an annotation in kernel signatures

        def __getattr__(self, name):
            raise RuntimeError(_WHY)

    triton = _MissingTriton()
    tl = _MissingLanguage()



def interpreting() -> bool:
    """Whether @triton.jit kernels were defined under the interpreter (TRITON_INTERPRET=1)."""
    return HAS_TRITON and bool(triton.knobs.runtime.interpret)


__all__ = ["HAS_TRITON", "interpreting", "triton", "tl"]
