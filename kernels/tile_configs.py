"""Tile sizes of the attention kernels, per GPU: defaults, and the tuned table a launch reads.

A launch reads its tile config from the table that `BATCHGEN_KERNEL_CONFIGS` names, else from a
table committed as `kernels/configs/<gpu name>.json`, else DEFAULTS (picked from sm_90 register
counts, `python -m kernels.compile_check`, not timings). kernels.tuning measures the candidates and
writes such a table wherever it is told; it is used only when named.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).with_name("configs")
ENV_FILE = "BATCHGEN_KERNEL_CONFIGS"

DEFAULTS = {
    "decode": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    "prefill": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
}
# what the tuner tries (each must compile within sm_90's shared memory for head dims up to 128:
# `python -m kernels.compile_check` builds every one)
CANDIDATES = {
    "decode": [{"BLOCK_N": n, "num_warps": w, "num_stages": s}
               for n in (16, 32, 64, 128) for w in (2, 4, 8) for s in (1, 2, 3)],
    "prefill": [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
                for m in (32, 64, 128) for n in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3)
                if not (m == 128 and n == 128 and s == 3)],
}


def gpu_name(device: torch.device | str) -> str:
    """A file-name-safe name of the GPU behind `device` ('cpu' for anything else)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return _cuda_name(_index(device))


@functools.cache
def _cuda_name(index: int) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(index)).strip("_")


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def config_key(kind: str, head_dim: int, dtype: torch.dtype) -> str:
    """The table entry a launch reads: kernel kind, head dim and dtype."""
    return f"{kind}/d{head_dim}/{str(dtype).removeprefix('torch.')}"


@functools.cache
def _table(name: str) -> dict:
    path = os.environ.get(ENV_FILE) or str(CONFIG_DIR / f"{name}.json")
    try:
        return json.loads(Path(path).read_text())["configs"]
    except (OSError, ValueError, KeyError):
        return {}


def lookup(kind: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> dict:
    """The tuned config for this kernel on this GPU, or the default."""
    if device.type != "cuda":
        return DEFAULTS[kind]
    return _table(gpu_name(device)).get(config_key(kind, head_dim, dtype), DEFAULTS[kind])


def decode_config(device: torch.device, head_dim: int, dtype: torch.dtype) -> dict:
    return lookup("decode", device, head_dim, dtype)


def prefill_config(device: torch.device, head_dim: int, dtype: torch.dtype) -> dict:
    return lookup("prefill", device, head_dim, dtype)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a nominal 8 elsewhere: the interpreter)."""
    if device.type != "cuda":
        return 8
    return _num_sms(_index(device))


def clear_cache() -> None:
    """Forget loaded tables (after writing a new one, or changing BATCHGEN_KERNEL_CONFIGS)."""
    _table.cache_clear()
