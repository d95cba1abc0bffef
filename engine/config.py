"""Engine configuration: one dataclass, vLLM names, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("float32", "float16", "bfloat16")
_POLICIES = ("fcfs", "priority")


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"  # registry name, HF directory, GGUF file, or Hub id
    max_num_seqs: int = 128  # sequence cap per iteration batch (the sweep knee, 2 cores)
    max_num_batched_tokens: int = 8192  # token budget: prefill + decode tokens per iteration
    max_model_len: int | None = None  # prompt + output tokens per sequence; None = the model's
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV blocks; None = derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0  # KV budget used when num_kv_blocks is None
    enable_chunked_prefill: bool = True  # split long prompts across iterations
    enable_prefix_caching: bool = False  # reuse full KV blocks with the same token prefix
    scheduling_policy: str = "fcfs"  # fcfs | priority
    dtype: str = "float32"  # weights, KV cache and activations
    device: str = "cpu"  # cpu | cuda | cuda:N
    seed: int = 0  # seeds requests that give no seed of their own

    def __post_init__(self) -> None:
        _check_range("max_num_seqs", self.max_num_seqs, 1, 65536)
        _check_range("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 20)
        if self.max_model_len is not None:
            _check_range("max_model_len", self.max_model_len, 1, 1 << 20)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.num_kv_blocks is not None:
            _check_range("num_kv_blocks", self.num_kv_blocks, 1, 1 << 24)
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.scheduling_policy not in _POLICIES:
            raise ValueError(f"scheduling_policy must be one of {_POLICIES}, got {self.scheduling_policy!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
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
