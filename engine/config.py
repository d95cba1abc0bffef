"""Engine configuration: one dataclass, vLLM names, validated on construction.

Fields left at None (or dtype "auto") take the defaults of the device they run on: the CPU's were
measured on 2 cores (the sweep's knee), the GPU's are sized for one large GPU (bf16, the batch and
token budget nano-vllm and vLLM use). dtype "auto" on the CPU is bf16 where the CPU has native bf16
(AVX512-BF16 or AMX), else fp32 (kernels/cpu_features.py); `dtype_reason` says why. After
construction every such field holds its resolved value, so what a config says is what the engine runs;
the one exception is cpu_threads, which belongs to the process that runs the engine (the CPUs it may
use), not to a job: the engine resolves it (LLMEngine.cpu_threads), so a recorded config stays portable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kernels.options import KernelOptions

_DTYPES = ("float32", "float16", "bfloat16")
_POLICIES = ("fcfs", "priority")

# device kind -> (max_num_seqs, max_num_batched_tokens, dtype)
DEVICE_DEFAULTS = {
    "cpu": (128, 8192, "auto"),  # the sweep's best on 2 cores; dtype from the CPU's features
    "cuda": (256, 16384, "bfloat16"),
}


def _flag(help: str, **extra) -> dict:
    """A field's command-line flag: its help, and where needed its name ("flag") or "choices".
    engine.cli_options derives every engine flag from these."""
    return {"help": help, **extra}


@dataclass
class EngineConfig:
    """The one list of engine settings (vLLM names). Fields with `_flag` metadata are the engine flags
    of run, worker, bench and sweep (engine.cli_options); a worker serves one such configuration."""

    model: str = field(default="smollm2-135m", metadata=_flag(
        "Registry name, Hugging Face directory, GGUF file or Hub id (default smollm2-135m)."))
    max_num_seqs: int | None = field(default=None, metadata=_flag(
        "Sequence cap per iteration (default 128 on CPU, 256 on CUDA)."))
    max_num_batched_tokens: int | None = field(default=None, metadata=_flag(
        "Token budget per iteration (default 8192 on CPU, 16384 on CUDA)."))
    max_model_len: int | None = field(default=None, metadata=_flag(
        "Prompt + output tokens per sequence (default: the model's)."))
    block_size: int = field(default=16, metadata=_flag("Tokens per KV block (default 16)."))
    num_kv_blocks: int | None = field(default=None, metadata=_flag(
        "KV blocks (default: sized from memory, see --gpu-memory-utilization / --kv-cache-memory)."))
    gpu_memory_utilization: float = field(default=0.9, metadata=_flag(
        "CUDA: share of the GPU's memory for weights, activations and KV (default 0.9)."))
    kv_cache_memory_gb: float | None = field(default=None, metadata=_flag(
        "CPU: GiB for the KV cache (default: a share of the free RAM).", flag="--kv-cache-memory"))
    enable_chunked_prefill: bool = field(default=True, metadata=_flag(
        "Split long prompts across iterations (default on)."))
    enable_prefix_caching: bool = field(default=False, metadata=_flag("Reuse shared prefixes' KV."))
    scheduling_policy: str = field(default="fcfs", metadata=_flag("Default fcfs.", choices=_POLICIES))
    dtype: str = field(default="auto", metadata=_flag(
        "Weights, KV cache and activations; auto (default): bfloat16 on CUDA and on CPUs with native "
        "bf16 (AVX512-BF16, AMX), else float32.",
        choices=("auto", *_DTYPES)))
    device: str = field(default="cpu", metadata=_flag("cpu, cuda or cuda:N (default cpu)."))
    enforce_eager: bool = field(default=False, metadata=_flag(
        "No CUDA graphs: every step runs eagerly (on CPU, decode steps skip the static buffers too)."))
    async_scheduling: bool = field(default=True, metadata=_flag(
        "Prepare the next step while the device runs this one (default on; same tokens either way)."))
    cpu_threads: int | None = field(default=None, metadata=_flag(
        "CPU: threads an engine step runs on, whichever thread steps it (default: $OMP_NUM_THREADS if "
        "set, else every CPU this process may run on)."))
    seed: int = 0  # seeds requests that give no seed of their own (jobs set it per row: --seed)
    # the kernels' variants (kernels/options.py), set when the engine is built; None leaves the process's
    # as they are. Not a flag: only the benchmarks and the tests choose another variant than the default
    kernel_options: KernelOptions | None = None
    dtype_reason: str = field(default="", compare=False)  # set on construction: "given", or why "auto"
    # resolved to dtype (derived, so no flag and not compared)

    def __post_init__(self) -> None:
        if isinstance(self.kernel_options, dict):  # a recorded config (asdict) read back
            self.kernel_options = KernelOptions(**self.kernel_options)
        if self.kernel_options is not None and not isinstance(self.kernel_options, KernelOptions):
            raise ValueError(f"kernel_options must be KernelOptions or None, got {self.kernel_options!r}")
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
        if self.cpu_threads is not None:
            _check_range("cpu_threads", self.cpu_threads, 1, 4096)
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
