"""The native library's C units (kernels/csrc): each compiles alone, warning-free, for every ISA
variant's flags; and every exported op gives the same bits as the single-file library they were
split from (revision BEFORE_SPLIT, built from git with the same flags), on the variant this CPU
runs. The split moved code and changed no arithmetic: once an op's numerics change on purpose,
its comparison here goes (git still holds it). The AVX2 build's panels have since changed layout
(strips of 16 columns), not sums: its products are compared over the same weights relaid."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kernels import cpu_native

REPO = Path(__file__).resolve().parents[2]
BEFORE_SPLIT = "c27d35d"  # the last revision with csrc/cpu_kernels.c and its included headers
OLD_FILES = ("cpu_kernels.c", "cpu_kernels_typed.h", "cpu_gemm.h", "cpu_decode.h")
NT = 2  # threads: both libraries split the same work the same way


def _cc() -> str:
    cc = cpu_native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    return cc


@pytest.mark.parametrize("variant", [*cpu_native.VARIANTS, cpu_native.NATIVE, "portable"])
def test_each_unit_and_header_compiles_alone_without_warnings(variant, tmp_path):
    """`-Wall -Wextra -Werror` with the variant's own flags (any x86 compiler emits any variant's
    instructions); "portable": no target flags, the units' code without AVX2 or AVX-512."""
    cc = _cc()
    if variant == cpu_native.NATIVE:
        flags = cpu_native.cflags(variant)
    elif variant == "portable":
        flags = cpu_native.BASE_CFLAGS
    else:
        if not cpu_native._x86():
            pytest.skip("x86 target flags")
        flags = cpu_native.cflags(variant)
    for path in [*cpu_native.UNITS, *cpu_native.HEADERS]:
        lang = ["-x", "c"] if path.suffix == ".h" else []
        proc = subprocess.run([cc, *flags, "-Wall", "-Wextra", "-Werror", "-fsyntax-only", *lang, str(path)],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, f"{path.name} ({variant}):\n{proc.stderr[-3000:]}"


def _bind_decode_layers(lib: ctypes.CDLL) -> None:
    for sfx in cpu_native.SUFFIXES.values():
        fn = getattr(lib, f"decode_layers_{sfx}")
        fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]


def _old_library(variant: str, src: Path) -> ctypes.CDLL:
    """The library before the split, built from its sources at BEFORE_SPLIT (written to src) with the
    variant's flags, cached by their hash as the current one is."""
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("no git checkout to take the sources before the split from")
    for name in OLD_FILES:
        proc = subprocess.run([git, "-C", str(REPO), "show", f"{BEFORE_SPLIT}:kernels/csrc/{name}"],
                              capture_output=True, timeout=60)
        if proc.returncode != 0:
            pytest.skip(f"revision {BEFORE_SPLIT} not in this checkout (a shallow clone?)")
        (src / name).write_bytes(proc.stdout)
    path = cpu_native.build(_cc(), cpu_native._cache_root() / "before-split", cpu_native.cflags(variant),
                            units=[src / OLD_FILES[0]], headers=[src / name for name in OLD_FILES[1:]])
    lib = ctypes.CDLL(str(path))
    cpu_native.bind(lib)
    _bind_decode_layers(lib)
    return lib


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers (NaNs compare by their payload too)."""
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    return t


def _strips(panels: torch.Tensor, k: int) -> torch.Tensor:
    """Panels in rows of 64 (flat), fp32 [N/64][K][64] or bf16 [N/64][K/2][64][2], as strips, [N/64][4][K][16]
    or [N/64][4][K/2][16][2]."""
    if panels.dtype == torch.bfloat16:
        return panels.reshape(-1, k // 2, 4, 16, 2).transpose(1, 2).contiguous().reshape(panels.shape)
    return panels.reshape(-1, k, 4, 16).transpose(1, 2).contiguous().reshape(panels.shape)


class Pair:
    """The old and the new library, and a count of the comparisons made."""

    def __init__(self, old: ctypes.CDLL, new: ctypes.CDLL) -> None:
        self.old, self.new, self.compared = old, new, 0

    def strips(self) -> bool:
        """Whether the new library reads panels as strips (its AVX2 ones, csrc/gemm.c), where the old
        one read rows of 64: the same sums over another order of the same weights."""
        return bool(self.new.cpu_kernels_features() & cpu_native.FEATURE_AVX2)

    def same(self, name: str, tensors: dict[str, torch.Tensor], *args,
             relaid: dict[str, int] | None = None) -> None:
        """The op called on fresh copies of tensors for each library, with args (a string: that
        tensor's pointer), or args a single call(fn, copies): the same result code and the same bits
        in every tensor afterwards (the outputs, and the inputs left as they were). relaid:
        panels (key -> K) the new library is handed as strips (_strips)."""
        relaid = relaid or {}
        results = []
        for lib in (self.old, self.new):
            copies = {key: _strips(t, relaid[key]) if lib is self.new and key in relaid else t.clone()
                      for key, t in tensors.items()}
            fn = getattr(lib, name)
            if len(args) == 1 and callable(args[0]):
                rc = args[0](fn, copies)
            else:
                rc = fn(*[copies[a].data_ptr() if isinstance(a, str) else a for a in args])
            results.append((rc, copies))
        (rc_old, old), (rc_new, new) = results
        assert rc_old == rc_new, f"{name}: {rc_old} before the split, {rc_new} after"
        for key in tensors:
            was = _strips(old[key], relaid[key]) if key in relaid else old[key]
            diff = (_bits(was) != _bits(new[key])).sum().item()
            assert diff == 0, f"{name}: {key} differs in {diff} of {old[key].numel()} elements"
        self.compared += 1


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """On the variant this CPU runs (the one its users get): building the old library takes a minute or
    two a variant, and the units' other variants are compiled above."""
    new = cpu_native.library()
    _bind_decode_layers(new)
    return _old_library(cpu_native.variant(), tmp_path_factory.mktemp("before-split")), new


@pytest.fixture
def pair(libraries):
    return Pair(*libraries)


def _rand(g: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


SFX = cpu_native.SUFFIXES
DTYPES = list(SFX)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_ops_are_bit_identical_to_before_the_split(pair, dtype):
    g = torch.Generator().manual_seed(0)
    sfx = SFX[dtype]
    for rows, dim, stride in [(3, 64, 64), (5, 100, 130), (1100, 64, 64)]:  # vector only, a tail, threads
        x = _rand(g, rows, stride, dtype=dtype)
        t = {"x": x, "res": _rand(g, rows, dim, dtype=dtype), "w": _rand(g, dim, dtype=dtype, scale=0.3) + 1,
             "out": torch.zeros(rows, dim, dtype=dtype), "res_out": torch.zeros(rows, dim, dtype=dtype)}
        for with_res in (False, True):
            res, res_out = ("res", "res_out") if with_res else (None, None)
            pair.same(f"rms_norm_{sfx}", t, "x", stride, res, "w", "out", res_out, rows, dim, 1e-5, NT)
        t = {"x": _rand(g, rows, 2 * dim + 6, dtype=dtype, scale=3),
             "out": torch.zeros(rows, dim, dtype=dtype)}
        pair.same(f"silu_and_mul_{sfx}", t, "x", 2 * dim + 6, "out", rows, dim, NT)
    for rows, nq, nk, dim in [(3, 4, 2, 64), (7, 3, 1, 40), (700, 8, 4, 64)]:
        max_len = 50
        t = {"pos": torch.randint(0, max_len, (rows,), generator=g),
             "q": _rand(g, rows, nq + 1, dim, dtype=dtype), "k": _rand(g, rows, nk, dim + 8, dtype=dtype),
             "cs": _rand(g, max_len, dim, dtype=dtype)}
        for bad in (False, True):
            if bad:
                t["pos"][rows // 2] = max_len  # refused, nothing touched
            pair.same(f"rotary_{sfx}", t, "pos", "q", (nq + 1) * dim, dim, nq, "k", nk * (dim + 8), dim + 8,
                      nk, "cs", max_len, rows, dim, NT)
    assert pair.compared == 3 * 3 + 3 * 2


def _paged(g, dtype, context_lens, hkv, d, block, extra_blocks=3):
    """Caches with each sequence's blocks scattered, and its block table."""
    nb = max(-(-n // block) for n in context_lens)
    total = nb * len(context_lens) + extra_blocks
    perm = torch.randperm(total, generator=g)
    tables = perm[: nb * len(context_lens)].view(len(context_lens), nb).to(torch.int32).contiguous()
    shape = (total, block, hkv, d)
    return {"k": _rand(g, *shape, dtype=dtype), "v": _rand(g, *shape, dtype=dtype), "tables": tables,
            "ctx": torch.tensor(context_lens, dtype=torch.int32)}


# (Hq, Hkv, D): the specialised kernels' shapes (G 1-8, D 32/64/128), and the generic one's
ATTN_SHAPES = [(4, 4, 32), (6, 2, 64), (9, 3, 64), (8, 1, 64), (8, 2, 128),
               (4, 1, 48), (18, 2, 32), (10, 1, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_is_bit_identical_to_before_the_split(pair, dtype):
    g = torch.Generator().manual_seed(1)
    sfx = SFX[dtype]
    for hq, hkv, d in ATTN_SHAPES:
        for block, contexts in [(16, [1, 17, 33, 5, 60, 16]), (4, [130, 2, 9])]:
            t = _paged(g, dtype, contexts, hkv, d, block)
            n = len(contexts)
            t["q"] = _rand(g, n, hq + 2, d, dtype=dtype)  # strided rows
            t["out"] = torch.zeros(n, hq, d, dtype=dtype)
            pair.same(f"paged_decode_attention_{sfx}", t, "q", (hq + 2) * d, d, "k", "v", "tables",
                      t["tables"].stride(0), "ctx", "out", n, hq, hkv, d, block, d**-0.5, NT)
            # prefill: chunks of the same sequences' last tokens, where the op is still the one split off:
            # the vdpbf16ps tiles (fp32, and bf16 without AVX512-BF16, went row by row before it and take
            # attention_prefill.c's fp32 vector tiles now: tests/kernels/test_cpu_native.py)
            q_lens = [min(c, q) for c, q in zip(contexts, [1, 16, 20, 5, 33, 3], strict=False)]
            starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
            t["starts"], t["qp"] = starts, _rand(g, int(starts[-1]), hq, d, dtype=dtype)
            t["outp"] = torch.zeros(int(starts[-1]), hq, d, dtype=dtype)
            if _bf16_tiles(pair, dtype):
                pair.same(f"paged_prefill_attention_{sfx}", t, "qp", hq * d, d, "k", "v", "tables",
                          t["tables"].stride(0), "starts", "ctx", "outp", n, hq, hkv, d, block, d**-0.5, NT)
    # the KV store (any element type: bytes)
    rows, row_bytes = 9, 3 * 16 * (2 if dtype == torch.bfloat16 else 4)
    t = {"key": _rand(g, rows, row_bytes, dtype=torch.float32).view(torch.uint8)[:, :row_bytes].contiguous(),
         "val": torch.randint(0, 255, (rows, row_bytes), generator=g, dtype=torch.uint8),
         "kc": torch.zeros(20, row_bytes, dtype=torch.uint8),
         "vc": torch.zeros(20, row_bytes, dtype=torch.uint8),
         "slots": torch.tensor([3, -1, 19, 0, 7, 8, -1, 11, 2])}
    for bad in (False, True):
        if bad:
            t["slots"][4] = 20
        pair.same("store_kv_cache", t, "key", row_bytes, "val", row_bytes, "kc", "vc", "slots", rows,
                  row_bytes, 20)
    assert pair.compared == len(ATTN_SHAPES) * 2 * (2 if _bf16_tiles(pair, dtype) else 1) + 2


def _bf16_tiles(pair: Pair, dtype: torch.dtype) -> bool:
    """Whether the prefill attention of dtype is the one before the split: the vdpbf16ps tiles."""
    return dtype == torch.bfloat16 and bool(pair.new.cpu_kernels_features() & cpu_native.FEATURE_DP_BF16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_and_argmax_are_bit_identical_to_before_the_split(pair, dtype):
    g = torch.Generator().manual_seed(2)
    sfx = SFX[dtype]
    for m, k, n in [(1, 64, 128), (5, 96, 100), (13, 64, 192), (64, 128, 64), (300, 64, 130)]:
        relaid = {"w": k} if pair.strips() else None
        for epi in (0, 1, 2, 3):  # none (and a residual), silu, fp32 out, an unknown one (as none)
            width = 32 if epi == 1 else 64
            panels = -(-n // width)
            out_dtype = torch.float32 if epi == 2 else dtype
            t = {"x": _rand(g, m, k + 4, dtype=dtype), "w": _rand(g, panels * 64 * k, dtype=dtype, scale=0.1),
                 "out": torch.zeros(m, n + 3, dtype=out_dtype), "res": _rand(g, m, n, dtype=dtype)}
            res = "res" if epi == 0 else None
            pair.same(f"gemm_{sfx}", t, "x", k + 4, m, k, "w", n, "out", n + 3, res, n, epi, NT,
                      relaid=relaid)
        assert pair.new.argmax_scratch_floats(m) == pair.old.argmax_scratch_floats(m)
        scratch = NT * pair.new.argmax_scratch_floats(m)
        t = {"x": _rand(g, m, k, dtype=dtype), "w": _rand(g, -(-n // 64) * 64 * k, dtype=dtype, scale=0.1),
             "scratch": torch.zeros(scratch), "top": torch.zeros(m), "out": torch.zeros(m, dtype=torch.int64)}
        pair.same(f"gemm_argmax_{sfx}", t, "x", k, m, k, "w", n, "scratch", "top", "out", NT, relaid=relaid)
    x = _rand(g, 40, 1000)
    x[3, 500] = x[3].max() + 1
    x[3, 700] = x[3, 500]  # a tie: the first
    x[5, 9] = float("nan")
    x[6, 999] = float("nan")
    t = {"x": x, "out": torch.zeros(40, dtype=torch.int64)}
    pair.same("argmax_rows_f32", t, "x", 1000, 40, 1000, "out", NT)
    for name in ("cpu_kernels_features", "batchgen_prefill_threads"):
        assert getattr(pair.old, name)() == getattr(pair.new, name)()
    assert pair.compared == 5 * 4 + 5 + 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_layers_are_bit_identical_to_before_the_split(pair, dtype):
    from kernels.decode_layers import _Layer, _Step

    g = torch.Generator().manual_seed(3)
    sfx = SFX[dtype]
    rows, dim, n_heads, n_kv, hd, inter, block, n_layers = 5, 128, 4, 2, 32, 96, 16, 2
    qkv_n, q_size = (n_heads + 2 * n_kv) * hd, n_heads * hd
    contexts = [1, 17, 40, 16, 3]
    caches = _paged(g, dtype, contexts, n_kv, hd, block)
    t = {"tables": caches["tables"], "ctx": caches["ctx"], "pos": caches["ctx"].to(torch.int64) - 1,
         "cos_sin": _rand(g, 64, hd, dtype=dtype), "x_in": _rand(g, rows, dim, dtype=dtype)}
    t["slots"] = torch.tensor([int(t["tables"][s, p // block]) * block + p % block
                               for s, p in enumerate(t["pos"].tolist())])
    for name, cols in [("x", dim), ("res", dim), ("h", dim), ("qkv", qkv_n), ("attn", q_size), ("o", dim),
                       ("g", inter)]:
        t[name] = torch.zeros(rows, cols, dtype=dtype)
    for i in range(n_layers):
        for name, n, k in [("qkv", qkv_n, dim), ("o", dim, q_size), ("down", dim, inter)]:
            t[f"{name}{i}"] = _rand(g, -(-n // 64) * 64 * k, dtype=dtype, scale=0.1)
        t[f"gate_up{i}"] = _rand(g, -(-inter // 32) * 64 * dim, dtype=dtype, scale=0.1)
        t[f"in_norm{i}"] = _rand(g, dim, dtype=dtype, scale=0.2) + 1
        t[f"post_norm{i}"] = _rand(g, dim, dtype=dtype, scale=0.2) + 1
        t[f"kc{i}"], t[f"vc{i}"] = caches["k"].clone(), caches["v"].clone()
    num_slots = caches["k"].shape[0] * block

    def call(fn, t):
        step = _Step(rows=rows, dim=dim, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd, qkv_n=qkv_n,
                     inter=inter, block_size=block, num_slots=num_slots, max_len=64,
                     block_table_stride=t["tables"].stride(0), eps=1e-5, scale=hd**-0.5, num_threads=NT)
        for name, key in [("positions", "pos"), ("slots", "slots"), ("block_tables", "tables"),
                          ("context_lens", "ctx"), ("cos_sin", "cos_sin"), ("x_in", "x_in")]:
            setattr(step, name, t[key].data_ptr())
        for name in ("x", "res", "h", "qkv", "attn", "o", "g"):
            setattr(step, name, t[name].data_ptr())
        layers = (_Layer * n_layers)(*[
            _Layer(qkv=t[f"qkv{i}"].data_ptr(), o=t[f"o{i}"].data_ptr(), gate_up=t[f"gate_up{i}"].data_ptr(),
                   down=t[f"down{i}"].data_ptr(), input_norm=t[f"in_norm{i}"].data_ptr(),
                   post_norm=t[f"post_norm{i}"].data_ptr(), k_cache=t[f"kc{i}"].data_ptr(),
                   v_cache=t[f"vc{i}"].data_ptr()) for i in range(n_layers)])
        return fn(ctypes.byref(step), layers, n_layers)

    relaid = {}
    if pair.strips():
        for i in range(n_layers):
            relaid.update({f"qkv{i}": dim, f"o{i}": q_size, f"gate_up{i}": dim, f"down{i}": inter})
    pair.same(f"decode_layers_{sfx}", t, call, relaid=relaid)
    t["slots"][2] = num_slots  # the store refuses in layer 0: (0 + 1) * 8 + DECODE_ERR_STORE
    pair.same(f"decode_layers_{sfx}", t, call, relaid=relaid)
    assert pair.compared == 2
