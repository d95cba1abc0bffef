"""Faults of the engine itself, told apart from faults of one request.

A step that raises is either a request's fault (a grammar the sampler cannot apply, a value a kernel
refuses for that request's input) or the engine's: the device ran out of memory, a kernel did not
compile, the device reported an error (on CUDA such errors are sticky: every later launch in the
process fails too). The first kind is pinned on its request by re-running the step in halves
(LLMEngine._run_isolating_faults) and costs that request only. The second kind is no request's
doing: re-running would turn every request of the step into an error row (after ~2S re-runs) and
the engine's state is unknown afterwards, so it stops the engine with an `EngineFault` that whoever
drives the engine must treat as the end of it (a worker hands its shards back to the queue).
"""

from __future__ import annotations

import torch

# words that CUDA, cuBLAS, the caching allocator and the native CPU kernels put in their errors
DEVICE_ERROR_WORDS = (
    "cuda error", "cuda out of memory", "device-side assert", "illegal memory access",
    "illegal instruction", "unspecified launch failure", "cublas_status", "cudnn_status",
    "out of memory", "nccl error", "misaligned address", "triton error",
)
# exception types that are device faults whatever they say
DEVICE_ERROR_TYPES: tuple[type[BaseException], ...] = tuple(
    t for t in (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", None), torch.cuda.CudaError,
                MemoryError) if t is not None)


class EngineFault(RuntimeError):
    """The engine failed, not a request: out of memory, a kernel that does not compile, a device
    error. The engine refuses every later step; `reason` is one line for logs and status pages."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    @classmethod
    def from_exception(cls, exc: BaseException) -> EngineFault:
        return cls(describe(exc))


def is_device_fault(exc: BaseException) -> bool:
    """Whether `exc` is the device's or the compiler's failure rather than a request's: an
    out-of-memory (torch's or the host's), a CUDA/accelerator error, anything Triton raises (a
    kernel that does not compile or does not fit the GPU's resources), or a RuntimeError whose text
    names a device error (DEVICE_ERROR_WORDS)."""
    if isinstance(exc, (EngineFault, *DEVICE_ERROR_TYPES)):
        return True
    if type(exc).__module__.partition(".")[0] == "triton":
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in DEVICE_ERROR_WORDS)


def describe(exc: BaseException) -> str:
    """`Type: first line of the message` (at most 300 characters)."""
    if isinstance(exc, EngineFault):
        return exc.reason
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first.strip()}"[:300] if first else type(exc).__name__
