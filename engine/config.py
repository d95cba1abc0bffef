"""Engine configuration: one dataclass, vLLM names, validated on construction.

Fields left at None (or dtype "auto") take the defaults of the device they run on: the CPU's were
measured on 2 cores (the sweep's knee), the GPU's are sized for one large GPU (bf16, the batch and
token budget nano-vllm and vLLM use). dtype "auto" on the CPU is bf16 where the CPU has native bf16
(AVX512-BF16 or AMX), else fp32 (kernels/cpu_features.py); `dtype_reason` says why. After
construction every such field holds its resolved value, so what a config says is what the engine runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_DTYPES = ("float32", "float16", "bfloat16")
_POLICIES = ("fcfs", "priority")

# device kind -> (max_num_seqs, max_num_batched_tokens, dtype)
DEVICE_DEFAULTS = {
    "cpu": (128, 8192, "auto"),  # the sweep's best on 2 cores; dtype from the CPU's features
    "cuda": (256, 16384, "bfloat16"),
}


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"  # registry name, HF directory, GGUF file, or Hub id
    max_num_seqs: int | None = None  # sequence cap per iteration batch; None = the device's default
    max_num_batched_tokens: int | None = None  # token budget per iteration; None = the device's default
    max_model_len: int | None = None  # prompt + output tokens per sequence; None = the model's
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV blocks; None = sized from memory (below)
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU's memory for weights, activations and KV
    kv_cache_memory_gb: float | None = None  # CPU: KV cache GiB; None = a share of the free RAM
    enable_chunked_prefill: bool = True  # split long prompts across iterations
    enable_prefix_caching: bool = False  # reuse full KV blocks with the same token prefix
    scheduling_policy: str = "fcfs"  # fcfs | priority
    dtype: str = "auto"  # weights, KV cache and activations; auto = the device's default
    device: str = "cpu"  # cpu | cuda | cuda:N
    enforce_eager: bool = False  # no CUDA graphs / padded decode buckets: every step runs as it comes
    seed: int = 0  # seeds requests that give no seed of their own
    dtype_reason: str = ""  # set on construction: "given", or why "auto" resolved to dtype

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device == "cuda"
                or (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        seqs, tokens, dtype = DEVICE_DEFAULTS[self.device_kind]
        if self.max_num_seqs is None:
            self.max_num_seqs = seqs
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = tokens
        if self.dtype == "auto":
            self.dtype, self.dtype_reason = self._auto_dtype(dtype)
        self.dtype_reason = self.dtype_reason or "given"
        self._validate()

    def _auto_dtype(self, default: str) -> tuple[str, str]:
        if default != "auto":
            return default, f"auto: the {self.device_kind} default"
        from kernels.cpu_features import auto_dtype

        dtype, why = auto_dtype()
        return dtype, f"auto: {why}"

    @property
    def device_kind(self) -> str:
        return "cuda" if self.device.startswith("cuda") else "cpu"

    def _validate(self) -> None:
        _check_range("max_num_seqs", self.max_num_seqs, 1, 65536)
        _check_range("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 20)
        if self.max_model_len is not None:
            _check_range("max_model_len", self.max_model_len, 1, 1 << 20)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.num_kv_blocks is not None:
            _check_range("num_kv_blocks", self.num_kv_blocks, 1, 1 << 24)
        if not (isinstance(self.gpu_memory_utilization, int | float)
                and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory_gb is not None and not (
                isinstance(self.kv_cache_memory_gb, int | float) and math.isfinite(self.kv_cache_memory_gb)
                and self.kv_cache_memory_gb > 0):
            raise ValueError(f"kv_cache_memory_gb must be a number of GiB > 0, "
                             f"got {self.kv_cache_memory_gb!r}")
        if self.scheduling_policy not in _POLICIES:
            raise ValueError(f"scheduling_policy must be one of {_POLICIES}, got {self.scheduling_policy!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {_DTYPES}, got {self.dtype!r}")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_model_len > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is off: a whole prompt must fit "
                "in one iteration"
            )


def _check_range(name: str, value: int, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
