"""Check every Triton kernel against its torch reference and time both: `batchgen bench kernels`.

On CUDA it runs serving shapes in bf16 and fp16 (decode: 64-256 sequences, contexts 512-4096;
prefill: 2k-8k tokens) and prints achieved HBM GB/s for the memory-bound kernels and TFLOP/s for
prefill attention. `--device cpu --quick` runs the same table at toy shapes through the Triton
interpreter (TRITON_INTERPRET=1), which is how CI keeps this script working. `--moe-cpu` times the
MoE layer's CPU path against its torch reference instead (no Triton needed). Exits 1 when any
kernel disagrees with its reference beyond the dtype's tolerance.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import activation, attention_decode, attention_prefill, kv_cache, rms_norm, rotary
from kernels.fused_moe import fused_moe_cpu, fused_moe_ref, fused_moe_triton, select_experts
from kernels.testing import TOLERANCES, PagedInputs, make_paged_inputs

MODELS = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # (query heads, KV heads, head dim)
# (hidden, expert intermediate, experts, top k) of MoE layers: Qwen3-30B-A3B's, the same with D and I / 4
# (the CPU table: the routing as in the model, a quarter of the weights per expert), and a toy one
MOE_SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "qwen3-30b-a3b/4": (512, 192, 128, 8),
              "toy": (40, 24, 6, 2)}


@dataclass
class Case:
    """One kernel at one workload: how to build its inputs, run both sides, and count its work."""

    op: str  # kernel name
    shape: str  # the workload in words
    make: Callable[[], object]  # fresh, seeded inputs
    run_triton: Callable[[object], torch.Tensor]  # the Triton launcher on those inputs
    run_torch: Callable[[object], torch.Tensor]  # the torch reference on those inputs
    bytes_moved: int = 0  # HBM bytes one call must move (0: not reported)
    flops: int = 0  # floating-point operations of one call (0: not reported)


@dataclass
class Row:
    """One printed line of the result table."""

    op: str  # kernel name
    shape: str  # the workload in words
    dtype: str  # activation / cache dtype
    max_err: float  # max |triton - torch|
    ok: bool  # within TOLERANCES[dtype]
    triton_ms: float  # median time of the Triton kernel
    torch_ms: float  # median time of the torch reference
    rate: str  # achieved GB/s or TFLOP/s of the Triton kernel, or ""


def elementwise_cases(tokens: int, hidden: int, inter: int, model: str, dtype, device) -> list[Case]:
    """RMSNorm, fused add RMSNorm, SiLU-and-mul, RoPE and KV store over `tokens` rows."""
    num_q_heads, num_kv_heads, head_dim = MODELS[model]
    size = torch.tensor([], dtype=dtype).element_size()

    def rows(*shape):
        gen = torch.Generator(device=device).manual_seed(sum(shape))
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    def rope_inputs():
        cache = rotary.make_cos_sin_cache(head_dim, 8192, 10000.0, dtype, device)
        positions = torch.arange(tokens, device=device) * 7 % 8192
        return positions, rows(tokens, num_q_heads, head_dim), rows(tokens, num_kv_heads, head_dim), cache

    def store_inputs():
        paged = make_paged_inputs([1] * tokens, [16] * tokens, num_q_heads, num_kv_heads, head_dim, 16,
                                  dtype, device, garbage=None)
        return paged.key, paged.value, torch.zeros_like(paged.k_cache), torch.zeros_like(paged.v_cache), \
            paged.meta.slot_mapping

    qk_bytes = 2 * tokens * (num_q_heads + num_kv_heads) * head_dim * size
    return [
        Case("rms_norm", f"T={tokens} D={hidden}", lambda: (rows(tokens, hidden), rows(hidden)),
             lambda a: rms_norm.rms_norm_triton(a[0], a[1], 1e-6)[0],
             lambda a: rms_norm.rms_norm_ref(a[0], a[1], 1e-6), 2 * tokens * hidden * size),
        Case("fused_add_rms_norm", f"T={tokens} D={hidden}",
             lambda: (rows(tokens, hidden), rows(tokens, hidden) / 2, rows(hidden)),
             lambda a: torch.cat(rms_norm.rms_norm_triton(a[0], a[2], 1e-6, a[1])),
             lambda a: torch.cat(rms_norm.fused_add_rms_norm_ref(a[0], a[1], a[2], 1e-6)),
             4 * tokens * hidden * size),
        Case("silu_and_mul", f"T={tokens} I={inter}", lambda: rows(tokens, 2 * inter),
             activation.silu_and_mul_triton, activation.silu_and_mul_ref, 3 * tokens * inter * size),
        Case("rotary_embedding", f"T={tokens} {model}", rope_inputs,
             lambda a: torch.cat([x.flatten() for x in rotary.rotary_embedding_triton(*a)]),
             lambda a: torch.cat([x.flatten() for x in rotary.rotary_embedding_ref(*a)]), qk_bytes),
        Case("store_kv_cache", f"T={tokens} {model}", store_inputs,
             lambda a: (kv_cache.store_kv_cache_triton(*a), torch.cat([a[2], a[3]]))[1],
             lambda a: (kv_cache.store_kv_cache_ref(*a), torch.cat([a[2], a[3]]))[1],
             2 * tokens * num_kv_heads * head_dim * size * 2),
    ]


def decode_case(batch: int, context: int, model: str, dtype, device, block_size: int = 16) -> Case:
    """Decode attention over `batch` sequences whose contexts spread over [context/2, context]."""
    num_q_heads, num_kv_heads, head_dim = MODELS[model]
    contexts = [context // 2 + (i * 7919) % (context // 2 + 1) for i in range(batch)]
    size = torch.tensor([], dtype=dtype).element_size()
    kv_bytes = 2 * sum(contexts) * num_kv_heads * head_dim * size
    io_bytes = 2 * batch * num_q_heads * head_dim * size

    def make():
        return make_paged_inputs([1] * batch, contexts, num_q_heads, num_kv_heads, head_dim, block_size,
                                 dtype, device, garbage=None)

    def run_triton(p: PagedInputs):
        return attention_decode.paged_decode_attention_triton(
            p.q, p.k_cache, p.v_cache, p.meta.block_tables, p.meta.context_lens, p.scale)

    def run_torch(p: PagedInputs):
        return attention_decode.paged_decode_attention_ref(
            p.q, p.k_cache, p.v_cache, p.meta.block_tables, p.meta.context_lens, p.scale)

    return Case("decode_attention", f"B={batch} ctx<={context} {model}", make, run_triton, run_torch,
                bytes_moved=kv_bytes + io_bytes)


def prefill_case(name: str, query_lens: list[int], context_lens: list[int], model: str, dtype, device,
                 block_size: int = 16) -> Case:
    """Varlen prefill attention (chunks and decodes in one launch) against per-sequence SDPA."""
    num_q_heads, num_kv_heads, head_dim = MODELS[model]
    visible = sum(q * (c - q) + q * (q + 1) // 2 for q, c in zip(query_lens, context_lens, strict=True))

    def make():
        return make_paged_inputs(query_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size,
                                 dtype, device, garbage=None)

    def run_triton(p: PagedInputs):
        return attention_prefill.paged_prefill_attention_triton(
            p.q, p.k_cache, p.v_cache, p.meta.block_tables, p.meta.query_start_loc, p.meta.context_lens,
            p.meta.max_query_len, p.scale)

    def run_torch(p: PagedInputs):
        return attention_prefill.paged_prefill_attention_ref(
            p.q, p.k_cache, p.v_cache, p.meta.block_tables, p.meta.query_lens_cpu, p.meta.context_lens_cpu,
            p.scale)

    return Case("prefill_attention", f"{name} {model}", make, run_triton, run_torch,
                flops=4 * visible * num_q_heads * head_dim)


def moe_case(tokens: int, shape: str, dtype, device, run: Callable = fused_moe_triton) -> Case:
    """The MoE MLP of `tokens` tokens routed by random logits, `run` (the Triton launcher, or the
    CPU path) against the fp32 reference; flops counts the three expert GEMMs of every routed pair."""
    hidden, inter, num_experts, top_k = MOE_SHAPES[shape]

    def make():
        gen = torch.Generator(device=device).manual_seed(tokens)
        x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
        w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) / hidden**0.5
        w2 = torch.randn(num_experts, hidden, inter, generator=gen, device=device) / inter**0.5
        logits = torch.randn(tokens, num_experts, generator=gen, device=device)
        return (x, w13.to(dtype), w2.to(dtype), *select_experts(logits, top_k, renormalize=True))

    return Case("fused_moe", f"T={tokens} {shape}", make, lambda a: run(*a), lambda a: fused_moe_ref(*a),
                flops=6 * tokens * top_k * hidden * inter)


def serving_cases(dtype, device) -> list[Case]:
    """The GPU table: serving shapes for both model shapes."""
    cases = []
    for model, hidden, inter in (("smollm2", 576, 1536), ("llama8b", 4096, 14336)):
        cases += elementwise_cases(8192, hidden, inter, model, dtype, device)
        cases += [decode_case(b, c, model, dtype, device) for b in (64, 256) for c in (512, 4096)]
        cases += [
            prefill_case("4x512 prompts", [512] * 4, [512] * 4, model, dtype, device),
            prefill_case("4x2048 prompts", [2048] * 4, [2048] * 4, model, dtype, device),
            prefill_case("2048 chunk after 6144", [2048], [8192], model, dtype, device),
            prefill_case("128 decodes + 1920 chunk", [1] * 128 + [1920], [1024] * 128 + [1920], model,
                         dtype, device),
        ]
    return cases + [moe_case(tokens, "qwen3-30b-a3b", dtype, device) for tokens in (16, 256, 4096)]


def quick_cases(dtype, device) -> list[Case]:
    """The CI table: the same kernels at toy shapes the interpreter gets through in seconds."""
    return elementwise_cases(8, 64, 48, "smollm2", dtype, device) + [
        decode_case(3, 40, "smollm2", dtype, device),
        decode_case(2, 600, "smollm2", dtype, device),  # 2 sequences: split across programs + merge
        prefill_case("2x12 prompts", [12, 12], [12, 12], "smollm2", dtype, device),
        prefill_case("2 decodes + 9 chunk after 20", [1, 1, 9], [17, 33, 29], "smollm2", dtype, device),
        moe_case(9, "toy", dtype, device),
    ]


def moe_cpu_rows(dtypes: list[torch.dtype], reps: int, shape: str = "qwen3-30b-a3b/4") -> list[Row]:
    """The MoE layer's CPU path against its torch reference at a decode step and a prefill chunk (by
    default Qwen3-30B-A3B's routing, D and I / 4), the two timed in turn so load changes hit both alike."""
    cpu = torch.device("cpu")
    return [_in_turn_row(moe_case(tokens, shape, dtype, cpu, run=fused_moe_cpu), dtype, reps)
            for dtype in dtypes for tokens in (16, 256)]


def _in_turn_row(case: Case, dtype: torch.dtype, reps: int) -> Row:
    inputs = case.make()
    got, want = case.run_triton(inputs), case.run_torch(inputs)
    atol, rtol = TOLERANCES[dtype]
    ok = bool(torch.allclose(got.double(), want.double(), atol=atol, rtol=rtol))
    err = (got.double() - want.double()).abs().max().item()
    ms, torch_ms = time_in_turn(lambda: case.run_triton(inputs), lambda: case.run_torch(inputs), reps)
    rate = f"{case.flops / ms / 1e9:8.3f} TFLOP/s"
    return Row(case.op, case.shape, str(dtype).removeprefix("torch."), err, ok, ms, torch_ms, rate)


def time_in_turn(first: Callable[[], object], second: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median milliseconds per call of two functions on the CPU, called alternately after a warm-up."""
    samples: tuple[list[float], list[float]] = ([], [])
    first(), second()
    for _ in range(reps):
        for fn, times in ((first, samples[0]), (second, samples[1])):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples[0]), statistics.median(samples[1])


def time_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median milliseconds per call (triton.testing.do_bench on CUDA, a wall clock elsewhere)."""
    if device.type == "cuda":
        import triton

        return float(triton.testing.do_bench(fn, warmup=10, rep=max(reps, 25), return_mode="median"))
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def run_case(case: Case, dtype: torch.dtype, device: torch.device, reps: int) -> Row:
    """Check the kernel on fresh inputs, then time it and its reference."""
    got, want = case.run_triton(case.make()), case.run_torch(case.make())
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    atol, rtol = TOLERANCES[dtype]
    ok = bool(torch.allclose(got.double(), want.double(), atol=atol, rtol=rtol))
    inputs = case.make()
    triton_ms = time_ms(lambda: case.run_triton(inputs), device, reps)
    torch_ms = time_ms(lambda: case.run_torch(inputs), device, reps)
    rate = ""
    if case.bytes_moved:
        rate = f"{case.bytes_moved / triton_ms / 1e6:8.1f} GB/s"
    elif case.flops:
        rate = f"{case.flops / triton_ms / 1e9:8.2f} TFLOP/s"
    return Row(case.op, case.shape, str(dtype).removeprefix("torch."), err, ok, triton_ms, torch_ms, rate)


def format_table(rows: list[Row], candidate: str = "triton") -> str:
    head = f"{'kernel':20} {'workload':38} {'dtype':9} {'max_err':>9} {'ok':>4} {candidate + ' ms':>10} " \
           f"{'torch ms':>10} {'speedup':>8}  rate"
    lines = [head, "-" * len(head)]
    for r in rows:
        speedup = r.torch_ms / r.triton_ms if r.triton_ms else float("nan")
        lines.append(f"{r.op:20} {r.shape:38} {r.dtype:9} {r.max_err:9.2e} {'yes' if r.ok else 'NO':>4} "
                     f"{r.triton_ms:10.3f} {r.torch_ms:10.3f} {speedup:7.2f}x  {r.rate}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchgen bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu needs TRITON_INTERPRET=1)")
    parser.add_argument("--quick", action="store_true", help="toy shapes (the CPU/CI run)")
    parser.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16", "float32"],
                        help="default: bfloat16 float16 on CUDA, float32 float16 on CPU")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per kernel")
    parser.add_argument("--moe-cpu", action="store_true",
                        help="time the MoE layer's CPU path against its torch reference instead (CPU only)")
    args = parser.parse_args(argv)
    if args.moe_cpu:
        dtypes = [getattr(torch, d) for d in args.dtypes or ["float32", "bfloat16"]]
        shape = "toy" if args.quick else "qwen3-30b-a3b/4"
        return _report(moe_cpu_rows(dtypes, args.reps or 10, shape), "cpu")
    device = torch.device(args.device)
    if error := _unusable(device):
        print(f"benchmarks.kernel_ops: {error}", file=sys.stderr)
        return 2
    dtypes = [getattr(torch, d) for d in args.dtypes or
              (["bfloat16", "float16"] if device.type == "cuda" else ["float32", "float16"])]
    reps = args.reps or (100 if device.type == "cuda" else 1)
    rows = []
    for dtype in dtypes:
        cases = quick_cases(dtype, device) if args.quick else serving_cases(dtype, device)
        for case in cases:
            rows.append(run_case(case, dtype, device, reps))
            print(format_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)  # progress
    return _report(rows, "triton")


def _report(rows: list[Row], candidate: str) -> int:
    print(format_table(rows, candidate))
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} kernels match their torch reference")
    return 1 if failed else 0


def _unusable(device: torch.device) -> str | None:
    from kernels._triton import HAS_TRITON, interpreting

    if not HAS_TRITON:
        return "triton is not importable; install batchgen[triton]"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device here; run with --device cpu --quick under TRITON_INTERPRET=1"
    if device.type == "cpu" and not interpreting():
        return "--device cpu runs Triton through its interpreter: set TRITON_INTERPRET=1"
    return None


if __name__ == "__main__":
    sys.exit(main())
