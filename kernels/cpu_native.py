"""Native CPU kernels: C sources in kernels/csrc, compiled once with the system C compiler into the
batchgen cache and loaded with ctypes (no torch headers, so a build takes about a second).

The kernels (fp32): paged decode attention, which reads keys and values in place from the
block-paged cache instead of gathering them (the gather was ~16% of a decode step on 2 cores), and
the elementwise ops of a layer (RMSNorm with the residual add, rotary, SiLU-and-mul), each one
pass instead of several torch ops and their temporaries. Threads come from torch's own OpenMP pool.
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

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
# -fassociative-math lets the compiler vectorise the dot-product reductions; no -ffinite-math-only
CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math",
          "-fno-signed-zeros", "-fno-trapping-math", "-fopenmp"]
# tried in order: a compiler without OpenMP (clang with no libomp) still gets single-threaded
# kernels, one that does not know -march=native (some clang targets) still gets portable ones
FALLBACK_DROPS = [(), ("-fopenmp",), ("-fopenmp", "-march=native")]
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


def build(cc: str, out_dir: Path, flags: list[str] | None = None) -> Path:
    """Compile SOURCE into out_dir (named by a hash of source, flags and CPU); returns the .so path.
    The file appears atomically, so concurrent workers may build at once."""
    flags = CFLAGS if flags is None else flags
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join([cc, *flags]).encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    target = out_dir / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build_with_fallbacks(cc: str, out_dir: Path) -> Path:
    """build() with CFLAGS, then without what FALLBACK_DROPS names; the first error if all fail."""
    first: Exception | None = None
    for drop in FALLBACK_DROPS:
        try:
            path = build(cc, out_dir, [f for f in CFLAGS if f not in drop])
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            first = first or exc
            continue
        if drop:
            why = (str(first).splitlines() or [""])[0]
            log.warning("native CPU kernels built without %s (%s)", " ".join(drop), why)
        return path
    raise first


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
            lib = ctypes.CDLL(str(build_with_fallbacks(cc, _cache_root())))
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            _why_not = str(exc)
        else:
            i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
            signatures = {
                "paged_decode_attention_f32": (ctypes.c_int, [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr,
                                                              i64, i32, i32, i32, i32, f32, i32]),
                "rms_norm_f32": (None, [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, f32, i32]),
                "rotary_f32": (None, [ptr, ptr, i64, i64, i32, ptr, i64, i64, i32, ptr, i64, i64, i32]),
                "silu_and_mul_f32": (None, [ptr, i64, ptr, i64, i64, i32]),
                "store_kv_cache_f32": (i64, [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64]),
            }
            for name, (restype, argtypes) in signatures.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
            _lib = lib
    if _lib is None:
        log.warning("native CPU kernels unavailable, using the torch path: %s", _why_not)
    return _lib


def why_unavailable() -> str:
    """Why load() returned None ('' when it did not, or was not called)."""
    return _why_not


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels apply: enabled, fp32 CPU tensors whose last dims are contiguous, a
    loadable library. Anything else takes the torch path."""
    return (enabled() and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1
                              for t in tensors)
            and load() is not None)


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


def _rows(x: torch.Tensor, name: str) -> int:
    """Row stride of a 2-D fp32 tensor whose last dim is contiguous."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"native {name}: need a 2-D tensor with a contiguous last dim, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    return x.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight * rms-normalised r, r) with r = x + residual, or r = x (returned as None) without one.
    x (T, D); the same contract as kernels.rms_norm's references."""
    stride = _rows(x, "rms_norm")
    rows, dim = x.shape
    if weight.numel() != dim or (residual is not None and residual.shape != x.shape):
        got = "" if residual is None else f", residual {tuple(residual.shape)}"
        raise ValueError(f"native rms_norm: x {tuple(x.shape)} needs a weight of {dim} and a residual of its "
                         f"shape; got weight {weight.numel()}{got}")
    out = torch.empty((rows, dim), dtype=x.dtype)
    residual_out = None
    if residual is not None:
        residual = residual.contiguous()
        residual_out = torch.empty((rows, dim), dtype=x.dtype)
    weight = weight.contiguous()
    load().rms_norm_f32(x.data_ptr(), stride, None if residual is None else residual.data_ptr(),
                        weight.data_ptr(), out.data_ptr(),
                        None if residual_out is None else residual_out.data_ptr(), rows, dim, eps,
                        torch.get_num_threads())
    return out, residual_out


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, Hq, D) and k (T, Hkv, D) in place; head dims contiguous, any other strides."""
    if q.stride(2) != 1 or k.stride(2) != 1 or not cos_sin_cache.is_contiguous():
        raise ValueError("native rotary: q and k need contiguous head dims, cos_sin_cache contiguity")
    positions = positions.to(torch.int64).contiguous()
    rows, dim = q.shape[0], q.shape[2]
    if k.shape[0] != rows or k.shape[2] != dim or positions.numel() != rows or cos_sin_cache.shape[-1] != dim:
        raise ValueError(f"native rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, positions "
                         f"{tuple(positions.shape)}, cos_sin_cache {tuple(cos_sin_cache.shape)} do not fit")
    lo, hi = (int(positions.min()), int(positions.max())) if rows else (0, 0)
    if not 0 <= lo <= hi < cos_sin_cache.shape[0]:
        raise IndexError(f"native rotary: positions {lo}..{hi} outside the rotary cache's "
                         f"{cos_sin_cache.shape[0]} positions")
    load().rotary_f32(positions.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), q.shape[1],
                      k.data_ptr(), k.stride(0), k.stride(1), k.shape[1], cos_sin_cache.data_ptr(), rows, dim,
                      torch.get_num_threads())
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) = [gate | up] -> silu(gate) * up, (T, I)."""
    stride = _rows(x, "silu_and_mul")
    if x.shape[1] % 2:
        raise ValueError(f"native silu_and_mul: x needs [gate | up] halves, got an odd width {x.shape[1]}")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype)
    load().silu_and_mul_f32(x.data_ptr(), stride, out.data_ptr(), rows, inter, torch.get_num_threads())
    return out


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write key/value (T, Hkv, D) into k_cache/v_cache (num_blocks, block_size, Hkv, D) at flat slots
    slot_mapping (T,); slot -1 skips. Rows may be strided (views of the qkv GEMM's output)."""
    rows, heads, dim = key.shape
    for name, x in (("key", key), ("value", value)):
        if x.stride(2) != 1 or x.stride(1) != dim:
            raise ValueError(f"native store_kv_cache: {name} needs contiguous heads and head dim")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape:
        raise ValueError("native store_kv_cache: caches must be contiguous and of one shape")
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bad = load().store_kv_cache_f32(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                    k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), rows,
                                    heads * dim, num_slots)
    if bad:
        raise IndexError(f"store_kv_cache: token {bad - 1} has slot {int(slots[bad - 1])}, outside the "
                         f"cache's {num_slots} slots")
