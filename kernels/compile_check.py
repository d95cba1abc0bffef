"""Compile every Triton kernel for a CUDA architecture without a GPU: `python -m kernels.compile_check`.

The interpreter tests check the kernels' arithmetic; they cannot see what only the compiler
rejects (types, layouts, shared memory). This runs each launcher on small CPU tensors with its
kernels replaced by recorders, then hands the recorded arguments to `triton.compile` for the
target (ptxas ships with Triton), so the exact launches the engine makes are built down to cubin:
the attention kernels once per tile config the tuner may pick (kernels.tuning.CANDIDATES), at the
head shapes of SmolLM2-135M, Qwen3-0.6B and Llama-3-8B. Builds run `--jobs` at a time (Triton's
on-disk cache makes a second run quick). Run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from kernels import activation, attention_decode, attention_prefill, fused_moe, kv_cache, rms_norm, rotary
from kernels.testing import make_paged_inputs

KERNEL_MODULES = (rms_norm, activation, rotary, kv_cache, attention_decode, attention_prefill, fused_moe)
# dynamic shared memory per block (bytes) of the architectures we target
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
LAUNCH_OPTIONS = ("num_warps", "num_stages")  # launch keywords that are compiler options, not arguments
_SIG_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
               torch.int32: "i32", torch.int64: "i64"}


def record_launches(launch: Callable[[], object]) -> list[tuple[object, tuple, dict]]:
    """Run `launch` with every kernel of KERNEL_MODULES recording (kernel, args, kwargs) instead."""
    calls: list[tuple[object, tuple, dict]] = []
    with _recording(calls):
        launch()
    return calls


class _Recorder:
    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, kwargs))


@contextmanager
def _recording(calls: list):
    from triton.runtime.jit import JITFunction

    saved = [(module, name, kernel) for module in KERNEL_MODULES
             for name, kernel in vars(module).items() if isinstance(kernel, JITFunction)]
    try:
        for module, name, kernel in saved:
            setattr(module, name, _Recorder(kernel, calls))
        yield
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


def signature(kernel, args: tuple, kwargs: dict) -> tuple[dict[str, str], dict[str, object], dict]:
    """Triton's (signature, constexprs, options) for one recorded launch: tensors become typed
    pointers, keyword arguments constexprs, except the launch options (num_warps, ...)."""
    sig, constexprs = {}, {}
    options = {name: kwargs.pop(name) for name in LAUNCH_OPTIONS if name in kwargs}
    for name, value in zip(kernel.arg_names, args, strict=False):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _SIG_DTYPES[value.dtype]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
    for name, value in kwargs.items():
        sig[name], constexprs[name] = "constexpr", value
    return sig, constexprs, options


# (query heads, KV heads, head dim) of the attention shapes built: SmolLM2-135M, Qwen3-0.6B, Llama-3-8B
HEAD_SHAPES = {"smollm2": (9, 3, 64), "qwen3-0.6b": (16, 8, 128), "llama8b": (32, 8, 128)}


def example_launches(dtype: torch.dtype, heads: str, configs: str = "all"
                     ) -> dict[str, Callable[[], object]]:
    """One small call of every launcher (and both decode paths) in `dtype`, attention shaped `heads`;
    the attention kernels once per tuning candidate (`configs` "all") or with their defaults only."""
    from kernels import tuning

    num_q_heads, num_kv_heads, head_dim = HEAD_SHAPES[heads]
    x, w = torch.randn(4, 576, dtype=dtype), torch.randn(576, dtype=dtype)
    paged = make_paged_inputs([1, 1, 7], [20, 700, 7], num_q_heads, num_kv_heads, head_dim, 16, dtype)
    meta, q = paged.meta, paged.q
    cache = rotary.make_cos_sin_cache(head_dim, 1024, 10000.0, dtype, "cpu")
    positions = torch.arange(q.shape[0])
    decode_args = (q[:2], paged.k_cache, paged.v_cache, meta.block_tables[:2], meta.context_lens[:2])
    launches = {
        "rms_norm": lambda: rms_norm.rms_norm_triton(x, w, 1e-6),
        "fused_add_rms_norm": lambda: rms_norm.rms_norm_triton(x, w, 1e-6, x.clone()),
        "silu_and_mul": lambda: activation.silu_and_mul_triton(torch.randn(4, 3072, dtype=dtype)),
        "rotary_embedding": lambda: rotary.rotary_embedding_triton(positions, q, paged.key, cache),
        "store_kv_cache": lambda: kv_cache.store_kv_cache_triton(
            paged.key, paged.value, paged.k_cache, paged.v_cache, meta.slot_mapping),
        # the MoE GEMMs at both tile configs: 1 pair per expert (BLOCK_M 16), 128 per expert (BLOCK_M 64)
        "fused_moe_decode": lambda: fused_moe.fused_moe_triton(*_moe_inputs(4, dtype)),
        "fused_moe_prefill": lambda: fused_moe.fused_moe_triton(*_moe_inputs(512, dtype)),
    }
    candidates = tuning.CANDIDATES if configs == "all" else {k: [v] for k, v in tuning.DEFAULTS.items()}
    for cfg in candidates["decode"]:
        label = _label(cfg)
        for name, splits in (("decode_attention", 1), ("decode_attention_split", 8)):
            launches[f"{name} {label}"] = lambda cfg=cfg, splits=splits: \
                attention_decode.paged_decode_attention_triton(*decode_args, paged.scale, num_splits=splits,
                                                               config=cfg)
    for cfg in candidates["prefill"]:
        launches[f"prefill_attention {_label(cfg)}"] = lambda cfg=cfg: \
            attention_prefill.paged_prefill_attention_triton(
                q, paged.k_cache, paged.v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                meta.max_query_len, paged.scale, config=cfg)
    return launches


def _moe_inputs(num_tokens: int, dtype: torch.dtype, hidden: int = 256, inter: int = 96, experts: int = 8):
    """x, w13, w2 and a top-2 routing over `experts` for num_tokens tokens."""
    x = torch.randn(num_tokens, hidden, dtype=dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=dtype)
    w2 = torch.randn(experts, hidden, inter, dtype=dtype)
    return (x, w13, w2, *fused_moe.select_experts(torch.randn(num_tokens, experts), 2, True))


def _label(cfg: dict) -> str:
    short = {"BLOCK_M": "m", "BLOCK_N": "n", "num_warps": "w", "num_stages": "s"}
    return "".join(f"{short.get(k, k)}{v}" for k, v in cfg.items())


def compile_all(arch: int, dtypes: list[torch.dtype], heads: list[str], configs: str = "all",
                jobs: int = 1, only: str | None = None) -> list[str]:
    """Compile every kernel launch (whose name matches `only`, a regex, when given) for sm_<arch>,
    each distinct build once, `jobs` at a time; one line per build, 'FAIL' on failures."""
    builds: dict[tuple, str] = {}  # what triton.compile gets -> the line's label
    for dtype in dtypes:
        for shape in heads:
            for op, launch in example_launches(dtype, shape, configs).items():
                if (shape != heads[0] and "attention" not in op) or (only and not re.search(only, op)):
                    continue  # only attention depends on the head shape
                for kernel, args, kwargs in record_launches(launch):
                    sig, constexprs, options = signature(kernel, args, dict(kwargs))
                    key = (kernel.__module__, kernel.__name__, *map(_frozen, (sig, constexprs, options)))
                    label = f"sm_{arch} {str(dtype):15} {shape:10} {op:36} {kernel.__name__:24} "
                    builds.setdefault(key, label)
    fork = multiprocessing.get_context("fork")  # nothing here touches a GPU
    with concurrent.futures.ProcessPoolExecutor(max(1, jobs), mp_context=fork) as pool:
        results = pool.map(_build, [(arch, *key) for key in builds], chunksize=4)
        lines = [label + result for label, result in zip(builds.values(), results, strict=True)]
    return [("FAIL " if "FAIL" in line else "ok   ") + line for line in lines]


def _frozen(d: dict) -> tuple:
    return tuple(sorted(d.items()))


def _build(job: tuple) -> str:
    """Compile one launch; its resources (shared memory, warps, registers, spills) or FAIL: why."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    arch, module, name, sig, constexprs, options = job
    kernel = getattr(importlib.import_module(module), name)
    target = GPUTarget("cuda", arch, 32)
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(kernel, dict(sig), dict(constexprs)), target=target,
                                  options=dict(options))
    except Exception as exc:  # report every failure, not just the first
        lines = str(exc).strip().splitlines()
        return f"FAIL {type(exc).__name__}: {lines[-1] if lines else ''}"
    shared, limit = compiled.metadata.shared, MAX_SHARED.get(target.arch, 101376)
    verdict = f" FAIL: over the {limit} B of shared memory" if shared > limit else ""
    return (f"shared={shared:6d}B warps={compiled.metadata.num_warps} {_registers(compiled.asm['cubin'])} "
            f"{time.perf_counter() - start:5.1f}s{verdict}")


def _registers(cubin: bytes) -> str:
    """'regs=N spill=B' from cuobjdump (shipped with Triton), or '' where it is missing."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*LOCAL:(\d+)", usage)
    return f"regs={found[1]:>3} spill={found[2]}B" if found else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90],
                        help="CUDA compute capabilities, e.g. 80 90")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"],
                        choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--heads", nargs="+", default=list(HEAD_SHAPES), choices=list(HEAD_SHAPES),
                        help="attention head shapes to build")
    parser.add_argument("--configs", choices=["all", "default"], default="all",
                        help="attention tile configs: every tuning candidate (default) or the defaults only")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="builds at a time")
    parser.add_argument("--only", default=None, help="build only the launches whose name matches this regex")
    args = parser.parse_args(argv)
    from kernels._triton import interpreting

    if interpreting():
        print("compile_check: unset TRITON_INTERPRET; the interpreter compiles nothing", file=sys.stderr)
        return 2
    dtypes = [getattr(torch, name) for name in args.dtypes]
    lines = [line for arch in args.arch
             for line in compile_all(arch, dtypes, args.heads, args.configs, args.jobs, args.only)]
    print("\n".join(lines))
    failed = sum(line.startswith("FAIL") for line in lines)
    print(f"{len(lines) - failed} kernel builds ok, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
