"""The cpu-native backend's library: C sources in kernels/csrc, compiled once with the system C
compiler into the batchgen cache and loaded with ctypes (no torch headers, so a build takes about a
second). Each kernel's Python launcher (`*_native`) lives in its kernel's file beside the torch
reference it is tested against; kernels.ops chooses between them.

The kernels, for fp32 and bf16 tensors (fp32 arithmetic either way): paged decode attention, which
reads keys and values in place from the block-paged cache instead of gathering them (the gather was
~16% of a decode step on 2 cores), the elementwise ops of a layer (RMSNorm with the residual add,
rotary, SiLU-and-mul), each one pass instead of several torch ops and their temporaries, the KV
store, the sampler's row-wise argmax and the projections' GEMM over weights packed in panels of 64
columns (csrc/gemm.c; kernels/cpu_gemm.py packs them). Threads come from torch's own OpenMP pool.
The library is built per ISA variant (VARIANTS: avx2, avx512, avx512bf16, amx), each with explicit
target flags, and a process loads the best its CPU executes (use() picks another it executes).
When no compiler is found or the build fails, `load()` returns None, says why once in the log and
the torch path runs instead; KernelOptions(native=False) (kernels/options.py) turns the native path off.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kernels import cpu_features, options

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# the library's units, each compiled alone (tests/kernels/test_c_units.py), linked into one .so
# (the decode attention's two dtypes first: each is about half of the build, and they compile in parallel)
UNITS = [CSRC / name for name in ("attention_decode_f32.c", "attention_decode_bf16.c", "common.c",
                                  "attention.c", "attention_prefill.c", "norms_rotary.c", "gemm.c",
                                  "decode_layers.c")]
# included by the units (isa.h: the ISA helpers; kernels.h: what the units call in one another;
# attention_decode.h: the decode attention's bodies): part of the build's key
HEADERS = [CSRC / name for name in ("isa.h", "kernels.h", "attention_decode.h")]
# the storage types the typed kernels are built for, and their functions' name suffixes
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# -fassociative-math lets the compiler vectorise the dot-product reductions; no -ffinite-math-only.
# -mtune=native only schedules for this CPU: the instructions are the variant's (VARIANTS).
BASE_CFLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
               "-fno-trapping-math", "-fopenmp"]

# The ISA variants of the library, built side by side with explicit target flags (as oneDNN and
# llama.cpp carry theirs), so that one machine runs, and tests, every variant its CPU can execute,
# not only the one -march=native would give it: name -> (compiler flags, the /proc/cpuinfo flags a
# CPU needs to run it), worst first. The process runs the best one its CPU has (choose(); use()
# switches). NATIVE (-march=native, the compiler's own pick) serves CPUs none fits: not x86, or
# without AVX2 and FMA.
_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})  # x86-64-v3 (Haswell, Zen 1)
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4 (Skylake-X, Zen 4)
VARIANTS: dict[str, tuple[list[str], frozenset[str]]] = {
    "avx2": (["-march=x86-64-v3"], _V3),
    "avx512": (["-march=x86-64-v4"], _V4),
    "avx512bf16": (["-march=x86-64-v4", "-mavx512bf16"], _V4 | {"avx512_bf16"}),
    "amx": (["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
            _V4 | {"avx512_bf16", "amx_tile", "amx_bf16"}),
}
NATIVE = "native"
NATIVE_FLAGS = ["-march=native"]
# tried in order: a compiler without OpenMP (clang with no libomp) still gets single-threaded
# kernels, one that does not know -march=native (some clang targets) still gets portable ones
FALLBACK_DROPS = [(), ("-fopenmp",), ("-fopenmp", "-march=native")]
BUILD_TIMEOUT_S = 300  # ~30 s is usual on 2 cores (the attention's specialisations, both dtypes)

_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""
_wanted: str | None = None  # use()'s variant; None: choose()
_variant = ""  # the loaded library's variant
_features = 0  # ... and its cpu_kernels_features(), read once (cpu_gemm asks for every product)
_opened: dict[str, ctypes.CDLL] = {}  # .so path -> its handle (a variant switched back to is not reopened)


def enabled() -> bool:
    return options.current().native


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def runnable(flags: frozenset[str] | None = None, x86: bool | None = None) -> list[str]:
    """The VARIANTS a CPU with these /proc/cpuinfo flags (this one's by default) executes, worst first;
    NATIVE where none fits."""
    flags = cpu_features.cpu_flags() if flags is None else flags
    x86 = _x86() if x86 is None else x86
    names = [name for name, (_, need) in VARIANTS.items() if x86 and need <= flags]
    return names or [NATIVE]


def choose(flags: frozenset[str] | None = None, x86: bool | None = None) -> str:
    """The variant a process runs on a CPU with these flags: the best it executes."""
    return runnable(flags, x86)[-1]


def cflags(variant: str) -> list[str]:
    """The compiler flags of one variant (NATIVE included)."""
    if variant == NATIVE:
        return BASE_CFLAGS + NATIVE_FLAGS
    return BASE_CFLAGS + VARIANTS[variant][0] + ["-mtune=native"]


def use(variant: str | None) -> None:
    """Run the kernels of this variant from now on (None: choose()'s); a ValueError naming the CPU
    flags it lacks where this CPU cannot execute it (its instructions would fault). Weights already
    packed stay valid between variants of one panel layout: strips for avx2, rows of 64 for the
    others (kernels/cpu_gemm.py pack_panels); panels of the other layout are refused by name, never
    read wrong."""
    global _wanted, _lib, _tried, _why_not
    if variant is not None and variant != NATIVE:
        if variant not in VARIANTS:
            known = ", ".join([*VARIANTS, NATIVE])
            raise ValueError(f"unknown CPU kernel variant {variant!r} (one of {known})")
        missing = VARIANTS[variant][1] - cpu_features.cpu_flags()
        if missing or not _x86():
            lacks = ", ".join(sorted(missing)) or "x86-64"
            raise ValueError(f"this CPU cannot run the {variant} kernels: it lacks {lacks}")
    _wanted, _lib, _tried, _why_not = variant, None, False, ""


def use_isa(isa: str) -> None:
    """KernelOptions.isa applied: use() that variant, unless it is the one asked for already (a loaded
    library stays loaded); "auto" leaves the process's variant as it is (choose()'s unless use() picked
    another). A ValueError names the option where this CPU cannot run the variant."""
    if isa == "auto" or isa == _wanted:
        return
    try:
        use(isa)
    except ValueError as exc:
        raise ValueError(f"kernel option isa={isa}: {exc}") from None


def variant() -> str:
    """The loaded library's variant ('' when none is loaded)."""
    load()
    return _variant if _lib is not None else ""


def _cache_root() -> Path:
    return Path(os.environ.get("BATCHGEN_CACHE_DIR") or "~/.cache/batchgen").expanduser() / "native"


def _cpu_signature() -> str:
    """What -march=native and -mtune=native depend on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(cc: str, out_dir: Path, flags: list[str] | None = None, units: list[Path] | None = None,
          headers: list[Path] | None = None) -> Path:
    """Compile the units (UNITS) into one library in out_dir, named by a hash of the units and headers
    (HEADERS), the flags and the CPU; returns the .so path. The file appears atomically, and a lock
    file makes concurrent builders of one key wait for the first."""
    flags = cflags(NATIVE) if flags is None else flags
    units = UNITS if units is None else units
    headers = HEADERS if headers is None else headers
    source = b"".join(path.name.encode() + b"\0" + path.read_bytes() for path in [*units, *headers])
    key = hashlib.sha256(b"\0".join([source, " ".join([cc, *flags]).encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    target = out_dir / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # one compile per key at a time: the workers a run starts at once wait for the first one's
    # library instead of each compiling (tens of seconds each on 2 cores, slower together)
    with open(out_dir / f"cpu_kernels-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            with tempfile.TemporaryDirectory(dir=out_dir) as objs:
                _compile_and_link(cc, flags, units, Path(objs), tmp)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _compile_and_link(cc: str, flags: list[str], units: list[Path], objs: Path, out: str) -> None:
    """Each unit into an object in objs, as many compilers at once as this process has CPUs, then
    the objects linked into out; a RuntimeError naming the first unit that failed (or the link)."""
    compile_flags = [f for f in flags if f != "-shared"]
    started = time.monotonic()

    def compile_one(index_path: tuple[int, Path]) -> tuple[Path, str | None]:
        index, path = index_path
        obj = objs / f"{index}-{path.stem}.o"
        left = max(1.0, BUILD_TIMEOUT_S - (time.monotonic() - started))
        proc = subprocess.run([cc, *compile_flags, "-c", "-o", str(obj), str(path)], capture_output=True,
                              text=True, timeout=left)
        why = f"{cc} failed on {path.name}: {proc.stderr.strip()[-2000:]}"
        return obj, None if proc.returncode == 0 else why

    workers = max(1, min(len(units), cpu_features.usable_cpus()))
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(compile_one, enumerate(units)))
    failed = [why for _, why in results if why]
    if failed:
        raise RuntimeError(failed[0])
    left = max(1.0, BUILD_TIMEOUT_S - (time.monotonic() - started))
    proc = subprocess.run([cc, *flags, "-o", out, *(str(obj) for obj, _ in results), "-lm"],
                          capture_output=True, text=True, timeout=left)
    if proc.returncode != 0:
        raise RuntimeError(f"{cc} failed linking {', '.join(path.name for path in units)}: "
                           f"{proc.stderr.strip()[-2000:]}")


def build_with_fallbacks(cc: str, out_dir: Path, variant: str = NATIVE) -> Path:
    """build() with the variant's flags, then without what FALLBACK_DROPS names (an explicit variant
    keeps its target flags: without them it would be another variant); the first error if all fail."""
    first: Exception | None = None
    flags = cflags(variant)
    for drop in FALLBACK_DROPS:
        if variant != NATIVE and "-march=native" in drop:
            continue
        try:
            path = build(cc, out_dir, [f for f in flags if f not in drop])
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            first = first or exc
            continue
        if drop:
            why = (str(first).splitlines() or [""])[0]
            log.warning("native CPU kernels built without %s (%s)", " ".join(drop), why)
        return path
    raise first


def _open(cc: str) -> tuple[ctypes.CDLL, str]:
    """The library of use()'s variant, or of the best one this CPU runs that builds (then the next
    best: a compiler too old for one's flags), opened; the first error if none does."""
    names = [_wanted] if _wanted else list(reversed(runnable()))
    if not _wanted and names != [NATIVE]:
        names.append(NATIVE)
    first: Exception | None = None
    for name in names:
        try:
            path = str(build_with_fallbacks(cc, _cache_root(), name))
            if path not in _opened:
                _opened[path] = ctypes.CDLL(path)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            first = first or exc
            continue
        if first is not None:
            log.warning("native CPU kernels: the %s variant (%s)", name, (str(first).splitlines() or [""])[0])
        return _opened[path], name
    raise first


def bind(lib: ctypes.CDLL) -> None:
    """Set the argument and result types of the library's exported functions."""
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    typed = {
        "paged_decode_attention": (ctypes.c_int, [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr,
                                                  i64, i32, i32, i32, i32, f32, i32]),
        "paged_prefill_attention": (ctypes.c_int, [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr,
                                                   i64, i32, i32, i32, i32, f32, i32]),
        "rms_norm": (None, [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, f32, i32]),
        "rotary": (i64, [ptr, ptr, i64, i64, i32, ptr, i64, i64, i32, ptr, i64, i64, i64, i32]),
        "silu_and_mul": (None, [ptr, i64, ptr, i64, i64, i32]),
        "gemm": (i32, [ptr, i64, i64, i64, ptr, i64, ptr, i64, ptr, i64, i32, i32]),
        "gemm_argmax": (i32, [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i32]),
    }
    signatures = {f"{name}_{sfx}": sig for name, sig in typed.items() for sfx in SUFFIXES.values()}
    signatures["store_kv_cache"] = (i64, [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64])
    signatures["argmax_rows_f32"] = (None, [ptr, i64, i64, i64, ptr, i32])
    signatures["argmax_scratch_floats"] = (i64, [i64])
    signatures["cpu_kernels_features"] = (i32, [])
    signatures["batchgen_amx"] = (i32, [i32])
    signatures["batchgen_attention_stream"] = (i32, [i32])
    signatures["batchgen_prefill_threads"] = (i32, [])
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


def load() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None (once logged) when unavailable."""
    global _lib, _tried, _why_not, _variant, _stream_default, _features
    if _tried:
        return _lib
    _tried = True
    cc = compiler()
    if cc is None:
        _why_not = "no C compiler (cc, gcc or clang) on PATH"
    else:
        try:
            lib, chosen = _open(cc)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            _why_not = str(exc)
        else:
            bind(lib)
            _stream_default = lib.batchgen_attention_stream(-1)
            _lib, _variant, _features = lib, chosen, lib.cpu_kernels_features()
            apply_options()  # AMX off from the start, not only once amx() is asked
    if _lib is None:
        log.warning("native CPU kernels unavailable, using the torch path: %s", _why_not)
    return _lib


FEATURE_AVX512, FEATURE_AVX2, FEATURE_DP_BF16 = 1, 2, 4  # cpu_kernels_features() bits: the ISA
FEATURE_GEMM_F32, FEATURE_GEMM_BF16 = 8, 16  # ... and the dtypes its panel GEMM (csrc/gemm.c) takes


_stream_default = 1  # the library's own choice of the L2 stream, read when it loads


def apply_options() -> None:
    """Hand the current KernelOptions' library-wide switches (amx, attn_stream) to a loaded library
    (kernels.ops.configure calls it; load() once it has loaded)."""
    if _lib is None:
        return
    opts = options.current()
    _lib.batchgen_amx(1 if opts.amx else 0)
    _lib.batchgen_attention_stream(_stream_default if opts.attn_stream is None else int(opts.attn_stream))


def attention_stream() -> bool:
    """Whether decode attention runs its own L2 prefetch stream (csrc/attention.c): the library's
    choice, unless KernelOptions.attn_stream says otherwise."""
    lib = load()
    return lib is not None and bool(lib.batchgen_attention_stream(-1))


def amx() -> bool:
    """Whether the bf16 GEMM runs on AMX tiles: a library built with AMX (the compiler knows the
    CPU's amx_bf16), Linux granting the tiles, and KernelOptions.amx on (the library is switched to
    match)."""
    lib = load()
    return lib is not None and bool(lib.batchgen_amx(1 if options.current().amx else 0))


def features() -> int:
    """What the loaded library was built to use (FEATURE_* bits); 0 when it is unavailable."""
    return _features if load() is not None else 0


def why_unavailable() -> str:
    """Why load() returned None ('' when it did not, or was not called)."""
    return _why_not


def library() -> ctypes.CDLL:
    """load(), or a RuntimeError saying why not (for a native kernel called directly)."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"native CPU kernels unavailable: {_why_not}")
    return lib


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels apply: enabled, CPU tensors of one dtype they are built for (fp32,
    bf16) whose last dims are contiguous, a loadable library. Anything else takes the torch path."""
    dtype = tensors[0].dtype
    if dtype not in SUFFIXES or not enabled():
        return False
    for t in tensors:  # a plain loop and is_cpu: this runs for every op of every layer (~2 us saved)
        if not t.is_cpu or t.dtype != dtype or t.stride(-1) != 1:
            return False
    return load() is not None


def kernel(name: str, dtype: torch.dtype):
    """The typed C function `name` for tensors of dtype (fp32, bf16); a ValueError naming the dtype
    for any other, a RuntimeError saying why when the library is unavailable."""
    if dtype not in SUFFIXES:
        raise ValueError(f"native {name}: {dtype} is not one of the native dtypes "
                         f"({', '.join(str(d) for d in SUFFIXES)})")
    return getattr(library(), f"{name}_{SUFFIXES[dtype]}")


def row_stride(x: torch.Tensor, name: str) -> int:
    """Row stride of a 2-D tensor whose last dim is contiguous."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"native {name}: need a 2-D tensor with a contiguous last dim, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    return x.stride(0)
