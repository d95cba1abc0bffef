#!/usr/bin/env python3
"""`make gpu-check`: the GPU path end to end on one CUDA device, unattended, printed as one table.

Runs from a source checkout with nothing installed but torch, triton, numpy, click, jinja2,
tokenizers and safetensors (`PYTHONPATH=.`); nothing is downloaded: the models are random-weight
Llamas of SmolLM2-135M's shape and of a 0.6B model's shape, built here. Sections, each of which
reports its own failure and lets the rest run, under one deadline (default 7 minutes):

1. every Triton kernel against its torch reference at serving shapes: max error, time, and a
   roofline line (bytes / time against the HBM bandwidth, FLOPs / time against the bf16 peak);
2. decode attention's achieved HBM GB/s at 256 sequences x 1k and 4k contexts;
3. tile sizes tuned on this GPU for decode and prefill attention, written to
   kernels/configs/<gpu>.json (and $OUT) and used by everything after;
4. per model shape: engine start-up (KV blocks, CUDA graph capture time), replay time per decode
   bucket, a pure decode step at 256 sequences (ms, host syncs per step, share of the step the GPU
   is idle), nano-vllm's benchmark (256 requests, prompt and output lengths uniform in 100-1024,
   ignore_eos) greedy and at temperature 0.6, and Triton compiles during the timed runs.

`--device cpu --quick` runs the same code at toy sizes through the Triton interpreter (CI keeps the
script working that way); the numbers then mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# HBM bandwidth and dense bf16 tensor-core peak per GPU (datasheet numbers; the H200 is the target)
GPU_PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12)}
DEFAULT_PEAKS = GPU_PEAKS["H200"]

# model shapes as Hugging Face Llama configs: SmolLM2-135M's, and Qwen3-0.6B's (as a plain Llama)
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
                       rope_theta=1000000.0, tie_word_embeddings=True),
    "toy": dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96, vocab_size=300, max_position_embeddings=512,
                rope_theta=10000.0, tie_word_embeddings=True),
}
for _cfg in SHAPES.values():
    _cfg.update(model_type="llama", rms_norm_eps=1e-6)


@dataclass
class Row:
    """One line of the result table."""

    section: str
    item: str
    value: str
    note: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    data: dict = field(default_factory=dict)  # machine-readable results, written as JSON
    failures: int = 0

    def add(self, section: str, item: str, value, note: str = "") -> None:
        row = Row(section, item, value if isinstance(value, str) else _fmt(value), note)
        self.rows.append(row)
        print(f"[{section}] {item}: {row.value} {note}".rstrip(), file=sys.stderr, flush=True)

    def table(self) -> str:
        lines = ["| section | item | value | note |", "|---|---|---|---|"]
        lines += [f"| {r.section} | {r.item} | {r.value} | {r.note} |" for r in self.rows]
        return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run_section(report: Report, deadline: Deadline, name: str, needs_s: float,
                fn: Callable[[], None]) -> None:
    """Run one section; a failure or a missed deadline is a row of the table, not the end of the run."""
    if deadline.left() < needs_s:
        report.add(name, "skipped", "-",
                   f"{deadline.left():.0f} s left of the deadline, needs ~{needs_s:.0f} s")
        return
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - report and go on: the run is unattended
        report.failures += 1
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        report.add(name, "FAILED", f"{type(exc).__name__}: {first}")
        traceback.print_exc()
    report.add(name, "section time", f"{time.monotonic() - t0:.1f} s")


# ---------------------------------------------------------------- timing helpers

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds per call: CUDA events on a GPU, the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def triton_compiles() -> int | None:
    """Kernels Triton has compiled so far in this process, over every @triton.jit of kernels/."""
    try:
        from triton.runtime.jit import JITFunction

        from kernels import activation, attention_decode, attention_prefill, kv_cache, rms_norm, rotary
    except ImportError:
        return None
    total = 0
    for module in (activation, attention_decode, attention_prefill, kv_cache, rms_norm, rotary):
        for fn in vars(module).values():
            if isinstance(fn, JITFunction):
                caches = getattr(fn, "device_caches", None) or {}
                total += sum(len(entry[0]) for entry in caches.values())
    return total


class SyncCounter:
    """Counts the host syncs torch flags (torch.cuda.set_sync_debug_mode('warn')) inside a block."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.count = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            self._caught = warnings.catch_warnings(record=True)
            self._log = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            self.count = sum("synchroniz" in str(w.message) for w in self._log)
            self._caught.__exit__(*exc)
        return False


# ---------------------------------------------------------------- sections

def section_env(report: Report, device: torch.device, peaks: tuple[float, float]) -> None:
    import triton

    report.add("env", "python / torch / triton", f"{platform.python_version()} / {torch.__version__} / "
               f"{triton.__version__}")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        report.add("env", "gpu", f"{props.name}, {props.multi_processor_count} SMs, "
                   f"{props.total_memory / (1 << 30):.1f} GiB, CUDA {torch.version.cuda}")
    report.add("env", "roofline peaks", f"{peaks[0] / 1e12:.2f} TB/s, {peaks[1] / 1e12:.0f} TFLOP/s bf16",
               "datasheet numbers the roofline % are taken against")


def section_kernels(report: Report, device: torch.device, dtype: torch.dtype, quick: bool,
                    peaks: tuple[float, float]) -> None:
    from kernels import bench as kbench

    cases = kbench.quick_cases(dtype, device) if quick else kbench.serving_cases(dtype, device)
    results = []
    for case in cases:
        row = kbench.run_case(case, dtype, device, reps=1 if quick else 50)
        roof = ""
        if case.bytes_moved:
            roof = f"{case.bytes_moved / (row.triton_ms * 1e-3) / peaks[0]:.0%} of HBM"
        elif case.flops:
            roof = f"{case.flops / (row.triton_ms * 1e-3) / peaks[1]:.0%} of bf16 peak"
        report.add("kernels", f"{row.op} {row.shape} {row.dtype}",
                   f"err {row.max_err:.1e} {'ok' if row.ok else 'MISMATCH'}; {row.triton_ms:.3f} ms "
                   f"(torch {row.torch_ms:.3f}); {row.rate.strip()}", roof)
        results.append(asdict(row))
        if not row.ok:
            report.failures += 1
    report.data["kernels"] = results


def decode_gbps(device: torch.device, dtype: torch.dtype, heads: tuple[int, int, int], batch: int, ctx: int,
                reps: int) -> tuple[float, float]:
    """(ms, GB/s) of decode attention over `batch` sequences of exactly `ctx` tokens each."""
    from kernels.attention_decode import paged_decode_attention_triton
    from kernels.testing import make_paged_inputs

    p = make_paged_inputs([1] * batch, [ctx] * batch, *heads, 16, dtype, device, garbage=None)
    size = torch.empty(0, dtype=dtype).element_size()
    moved = 2 * batch * ctx * heads[1] * heads[2] * size + 2 * batch * heads[0] * heads[2] * size
    ms = time_ms(lambda: paged_decode_attention_triton(p.q, p.k_cache, p.v_cache, p.meta.block_tables,
                                                       p.meta.context_lens, p.scale), device, reps)
    return ms, moved / (ms * 1e-3) / 1e9


def section_decode_bandwidth(report: Report, device: torch.device, dtype: torch.dtype, quick: bool,
                             peaks: tuple[float, float]) -> None:
    batch, contexts = (4, (40, 100)) if quick else (256, (1024, 4096))
    out = {}
    for shape in ("smollm2-135m", "llama-0.6b"):
        cfg = SHAPES[shape]
        heads = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
        for ctx in contexts:
            ms, gbps = decode_gbps(device, dtype, heads, batch, ctx, 2 if quick else 30)
            report.add("decode attention", f"{shape} heads {heads}, {batch} seqs x {ctx}",
                       f"{ms:.3f} ms, {gbps:.0f} GB/s", f"{gbps * 1e9 / peaks[0]:.0%} of HBM")
            out[f"{shape}/{batch}x{ctx}"] = {"ms": ms, "GB/s": gbps}
    report.data["decode_bandwidth"] = out


def section_tune(report: Report, device: torch.device, dtype: torch.dtype, quick: bool,
                 out_dir: Path) -> None:
    """Time every candidate tile config of the attention kernels; write the winners."""
    from kernels import tuning
    from kernels.attention_decode import paged_decode_attention_triton
    from kernels.attention_prefill import paged_prefill_attention_triton
    from kernels.testing import make_paged_inputs

    name = tuning.gpu_name(device)
    configs, notes = {}, {}
    candidates = {kind: tuning.CANDIDATES[kind][:2] if quick else tuning.CANDIDATES[kind]
                  for kind in ("decode", "prefill")}
    for shape in ("smollm2-135m", "llama-0.6b"):
        cfg = SHAPES[shape]
        heads = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
        batch, ctx, plen = (2, 40, 24) if quick else (256, 2048, 2048)
        d = make_paged_inputs([1] * batch, [ctx] * batch, *heads, 16, dtype, device, garbage=None)
        p = make_paged_inputs([plen] * 4, [plen] * 4, *heads, 16, dtype, device, garbage=None)
        timer = lambda fn: time_ms(fn, device, reps=2 if quick else 10, warmup=1)  # noqa: E731
        runs = {
            "decode": lambda c, d=d: _decode_with(paged_decode_attention_triton, d, c),
            "prefill": lambda c, p=p: paged_prefill_attention_triton(
                p.q, p.k_cache, p.v_cache, p.meta.block_tables, p.meta.query_start_loc, p.meta.context_lens,
                p.meta.max_query_len, p.scale, config=c),
        }
        for kind, run in runs.items():
            best, timings = tuning.tune(kind, candidates[kind], run, timer,
                                        log=lambda m: print(m, file=sys.stderr))
            key = tuning.config_key(kind, cfg["head_dim"], dtype)
            configs[key] = best
            default_ms = next((ms for c, ms in timings if c == tuning.DEFAULTS[kind]), None)
            best_ms = min((ms for _, ms in timings), default=float("nan"))
            notes[key] = {"best_ms": best_ms, "default_ms": default_ms, "tried": len(timings)}
            default = "-" if default_ms is None else f"{default_ms:.3f}"
            report.add("tuning", f"{kind} {shape} d{cfg['head_dim']}", json.dumps(best),
                       f"{best_ms:.3f} ms vs default {default} ms, {len(timings)} configs timed")
    copy = out_dir / f"{name}.json"
    if device.type == "cuda":  # into the checkout, where every later launch on this GPU reads it
        path = tuning.write_table(name, configs, notes=notes)
        copy.write_text(path.read_text())
        report.add("tuning", "written", str(path.relative_to(ROOT)), f"and {copy}")
    else:  # a dry run: nothing in the checkout changes
        tuning.write_table(name, configs, path=copy, notes=notes)
        report.add("tuning", "written", str(copy))
    report.data["tuning"] = {"gpu": name, "configs": configs, "notes": notes}


def _decode_with(launch, p, config: dict):
    """Decode attention with the tile config under test (tuning reads the table, so patch it)."""
    from kernels import tuning

    saved = tuning.decode_config
    tuning.decode_config = lambda *_: config
    try:
        return launch(p.q, p.k_cache, p.v_cache, p.meta.block_tables, p.meta.context_lens, p.scale)
    finally:
        tuning.decode_config = saved


@dataclass
class _Checkpoint:
    config: dict
    weights: dict
    tokenizer: object = None
    generation_config: dict = field(default_factory=dict)
    source: str = "random"


def build_llm(shape: str, device: torch.device, dtype: str, quick: bool, **overrides):
    from engine.llm import LLM
    from engine.loader import random_weights

    config = dict(SHAPES[shape])
    weights = random_weights(config, seed=0, dtype=getattr(torch, dtype), device=device)
    limits = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128) if quick else \
        dict(max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=2048)
    limits.update(overrides)
    return LLM(shape, checkpoint=_Checkpoint(config, weights), device=str(device), dtype=dtype, **limits)


def section_engine(report: Report, device: torch.device, dtype: str, shape: str, quick: bool,
                   deadline: Deadline) -> None:
    from engine.bench import make_workload, run_engine

    t0 = time.perf_counter()
    llm = build_llm(shape, device, dtype, quick)
    runner = llm.engine.runner
    report.add(f"engine {shape}", "start-up", f"{time.perf_counter() - t0:.1f} s",
               f"KV {llm.engine.block_manager.num_blocks} blocks of {llm.config.block_size}; "
               f"{len(runner.graphs)} CUDA graphs captured in {runner.graph_capture_s:.1f} s")
    data = {"kv_blocks": llm.engine.block_manager.num_blocks, "graphs": len(runner.graphs),
            "graph_capture_s": runner.graph_capture_s}
    data["replay_ms"] = replay_times(report, shape, runner, device, quick)
    data["decode_step"] = decode_step(report, shape, llm, device, quick)
    vocab = llm.engine.model_args.vocab_size
    n, lens = (3, (4, 10)) if quick else (256, (100, 1024))
    workload = make_workload(n, lens, lens, vocab, seed=0)
    for temperature in (0.0, 0.6):
        if deadline.left() < (5 if quick else 60):
            report.add(f"engine {shape}", f"bench temperature {temperature}", "skipped", "deadline")
            continue
        compiles = triton_compiles()
        result = run_engine(llm, workload, peak=0.0, name=f"{shape} t={temperature}", temperature=temperature)
        compiled = None if compiles is None else triton_compiles() - compiles
        stats = llm.iteration_stats
        step_ms = statistics.fmean(s.duration_s for s in stats) * 1e3 if stats else 0.0
        report.add(f"engine {shape}", f"nano-vllm bench, temperature {temperature}",
                   f"{result.output_tokens_per_s:.0f} output tok/s",
                   f"{n} requests, {result.output_tokens} output tokens in {result.elapsed_s:.1f} s; "
                   f"{len(stats)} steps, mean {step_ms:.2f} ms; TTFT p50 {result.ttft_p50_s:.2f} s; "
                   f"ITL p50 {result.itl_p50_s * 1e3:.1f} ms; Triton compiles during the run: {compiled}")
        data[f"bench_t{temperature}"] = {**asdict(result), "steps": len(stats), "mean_step_ms": step_ms,
                                         "triton_compiles": compiled}
    report.data[f"engine/{shape}"] = data
    del llm
    if device.type == "cuda":
        torch.cuda.empty_cache()


def replay_times(report: Report, shape: str, runner, device: torch.device, quick: bool) -> dict:
    """Replay time of each decode bucket's graph over padding inputs (one key each: the launch- and
    GEMM-bound floor of a decode step of that size)."""
    out = {}
    if not runner.graphs:
        report.add(f"engine {shape}", "graph replay", "-", "no CUDA graphs (eager or not on CUDA)")
        return out
    for size in [b for b in runner.buckets if b in (1, 8, 32, 64, 128, 256) or b == runner.buckets[-1]]:
        runner._stage_padding(size)
        graph = runner.graphs[size][0]
        out[size] = time_ms(graph.replay, device, reps=20)
    report.add(f"engine {shape}", "graph replay ms by batch size",
               ", ".join(f"{b}: {ms:.3f}" for b, ms in out.items()), "padding inputs: one key per sequence")
    return out


def decode_step(report: Report, shape: str, llm, device: torch.device, quick: bool) -> dict:
    """A pure decode step at the full batch: prefill max_num_seqs prompts, then time decode steps
    (engine.step: schedule + graph replay + sample + bookkeeping), count host syncs and the GPU's
    busy share of the step."""
    from engine.sampling_params import SamplingParams

    engine = llm.engine
    batch, vocab = engine.config.max_num_seqs, engine.model_args.vocab_size
    prompt, steps = (8, 2) if quick else (1000, 30)
    for i in range(batch):
        engine.add_request(f"decode-{i}", [(7 * i + j) % (vocab - 1) + 1 for j in range(prompt)],
                           SamplingParams(max_tokens=steps * 3 + 8, temperature=0.0, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or len(engine.scheduler.waiting):
        engine.step()
    for _ in range(1 if quick else 3):  # warm
        engine.step()
    fetches = engine.runner.staging.num_fetches
    compiles = triton_compiles()
    sync(device)
    with SyncCounter(device) as counter:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    explicit = (engine.runner.staging.num_fetches - fetches) / steps
    compiled = None if compiles is None else triton_compiles() - compiles
    busy = gpu_busy_share(engine, device, steps)
    ctx = statistics.fmean(s.num_tokens for s in engine.scheduler.running) if engine.scheduler.running else 0
    report.add(f"engine {shape}", f"pure decode step, {batch} sequences",
               f"{wall_ms:.2f} ms", f"context ~{ctx:.0f}; host syncs/step: {explicit:.1f} fetch + "
               f"{counter.count / steps:.1f} flagged by sync debug mode; GPU busy {busy}; "
               f"Triton compiles: {compiled}")
    engine.abort_request([f"decode-{i}" for i in range(batch)])
    while engine.has_unfinished_requests():
        engine.step()
    return {"ms": wall_ms, "syncs_explicit": explicit, "syncs_flagged": counter.count / steps,
            "gpu_busy": busy, "context": ctx, "triton_compiles": compiled}


def gpu_busy_share(engine, device: torch.device, steps: int) -> str:
    """Share of decode-step wall time covered by GPU kernels (the rest is the host's gaps), from the
    torch profiler over a few steps."""
    if device.type != "cuda":
        return "n/a (not CUDA)"
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(min(steps, 10)):
            engine.step()
        sync(device)
        wall_us = (time.perf_counter() - t0) * 1e6
    kernel_us = 0.0
    for evt in prof.key_averages():
        if "CUDA" in str(getattr(evt, "device_type", "")):  # kernels and copies, not the host ops
            kernel_us += (getattr(evt, "self_device_time_total", None)
                          or getattr(evt, "self_cuda_time_total", 0.0))
    return f"{kernel_us / wall_us:.0%} (profiled)"


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (with --quick, interpreter)")
    parser.add_argument("--quick", action="store_true", help="toy sizes: checks the script, measures nothing")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--deadline-s", type=float, default=420.0, help="stop starting sections after this")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out",
                        help="folder for gpu_check.json, the table and the tuned configs (default $OUT)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["kernels", "bandwidth", "tune", "engine"])
    parser.add_argument("--shapes", nargs="*", default=None, help="model shapes for the engine section")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --device cpu --quick for a dry run", file=sys.stderr)
        return 2
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels are imported
        from kernels import ops

        ops.set_backend("triton")  # the dry run goes through the same kernels as a GPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    peaks = _peaks(device)
    deadline, report = Deadline(args.deadline_s), Report()
    shapes = args.shapes or (["toy"] if args.quick else ["smollm2-135m", "llama-0.6b"])
    quick = args.quick
    run_section(report, deadline, "env", 0, lambda: section_env(report, device, peaks))
    if "kernels" not in args.skip:
        run_section(report, deadline, "kernels", 30,
                    lambda: section_kernels(report, device, dtype, quick, peaks))
    if "bandwidth" not in args.skip:
        run_section(report, deadline, "decode attention", 10,
                    lambda: section_decode_bandwidth(report, device, dtype, quick, peaks))
    if "tune" not in args.skip:
        run_section(report, deadline, "tuning", 60 if not quick else 0,
                    lambda: section_tune(report, device, dtype, quick, out_dir))
    if "engine" not in args.skip:
        for shape in shapes:
            run_section(report, deadline, f"engine {shape}", 90 if not quick else 0,
                        lambda shape=shape: section_engine(report, device, dtype_name, shape, quick,
                                                           deadline))
    table = report.table()
    print(table)
    (out_dir / "gpu_check.md").write_text(table + "\n")
    (out_dir / "gpu_check.json").write_text(json.dumps(report.data, indent=2, default=str) + "\n")
    print(f"\n{report.failures} failure(s); table and JSON in {out_dir}", file=sys.stderr)
    return 1 if report.failures else 0


def _peaks(device: torch.device) -> tuple[float, float]:
    if device.type != "cuda":
        return DEFAULT_PEAKS
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in GPU_PEAKS.items() if k in name), DEFAULT_PEAKS)


if __name__ == "__main__":
    sys.exit(main())
