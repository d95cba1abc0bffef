"""Native CPU kernels: C sources in kernels/csrc, compiled once with the system C compiler into the
batchgen cache and loaded with ctypes (no torch headers, so a build takes about a second).

Today one kernel: paged decode attention in fp32, which reads keys and values in place from the
block-paged cache instead of gathering them (the gather was ~16% of a decode step on 2 cores).
When no compiler is found or the build fails, `load()` returns None, says why once in the log and
the torch path runs instead; `BATCHGEN_NATIVE=0` turns the native path off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.c"
# -fassociative-math lets the compiler vectorise the dot-product reductions; no -ffinite-math-only
CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math",
          "-fno-signed-zeros", "-fno-trapping-math", "-fopenmp"]
ENV_SWITCH = "BATCHGEN_NATIVE"

_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _cache_root() -> Path:
    return Path(os.environ.get("BATCHGEN_CACHE_DIR") or "~/.cache/batchgen").expanduser() / "native"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(cc: str, out_dir: Path) -> Path:
    """Compile SOURCE into out_dir (named by a hash of source, flags and CPU); returns the .so path.
    The file appears atomically, so concurrent workers may build at once."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join([cc, *CFLAGS]).encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    target = out_dir / f"paged_attention_cpu-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None (once logged) when unavailable."""
    global _lib, _tried, _why_not
    if _tried:
        return _lib
    _tried = True
    cc = compiler()
    if cc is None:
        _why_not = "no C compiler (cc, gcc or clang) on PATH"
    else:
        try:
            lib = ctypes.CDLL(str(build(cc, _cache_root())))
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            _why_not = str(exc)
        else:
            fn = lib.paged_decode_attention_f32
            fn.restype = ctypes.c_int
            i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
            fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i32, i32, i32, i32,
                           ctypes.c_float, i32]
            _lib = lib
    if _lib is None:
        log.warning("native CPU kernels unavailable, using the torch path: %s", _why_not)
    return _lib


def why_unavailable() -> str:
    """Why load() returned None ('' when it did not, or was not called)."""
    return _why_not


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the native decode attention applies: enabled, fp32 CPU tensors, a loadable library."""
    return (enabled() and q.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype == torch.float32 and load() is not None)


_ERRORS = {1: "out of memory", 2: "more than 64 query heads per KV head"}


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
) -> torch.Tensor:
    """q (S, Hq, D) fp32, one query token per sequence, attends to its context_lens[s] cached keys
    in k_cache/v_cache (num_blocks, block_size, Hkv, D) through block_tables (>= S, nb) int32
    -> (S, Hq, D). The same contract as kernels.attention_decode.paged_decode_attention_ref."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"native CPU kernels unavailable: {_why_not}")
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or kv_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"native paged attention: q {tuple(q.shape)} does not fit caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or q.stride(-1) != 1:
        raise ValueError("native paged attention: needs contiguous caches and a contiguous q head dim")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("native paged attention: block_tables and context_lens must be int32")
    if block_tables.stride(-1) != 1 or not context_lens.is_contiguous() or len(context_lens) < num_seqs:
        raise ValueError("native paged attention: block_tables rows and context_lens must be contiguous")
    out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=q.dtype)
    status = lib.paged_decode_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(),
        num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, scale,
        num_threads or torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"native paged attention failed: {_ERRORS.get(status, status)}")
    return out
