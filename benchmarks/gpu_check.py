#!/usr/bin/env python3
"""`make gpu-check` (`batchgen bench gpu-check`): the GPU path end to end on one CUDA device, unattended,
as one table.

Runs from a source checkout with nothing installed but the GPU image's packages (torch, triton,
numpy, click, jinja2, tokenizers, safetensors: `PYTHONPATH=. python3 -m benchmarks.gpu_check`);
nothing is downloaded: the models are random-weight Llamas of SmolLM2-135M's shape and of a 0.6B
model's shape, built here.

Every section runs in a process of its own under a hard time limit (killed, with its process
group, when it runs over), all within one budget (default 450 s): whatever hangs, the run ends in
under 8 minutes. The table (gpu_check.md) and gpu_check.json are rewritten in $OUT (or
gpu-check-out/) after every section, so a killed run leaves what it measured. A row is a number
only when the thing measured worked: a kernel that disagrees with its torch reference, a section
that raised or ran out of time, requests that ended in errors, more than one host sync per decode
step, a Triton compile inside a timed run, or a CUDA graph whose replay gives other tokens than
the eager step, is a FAILED row saying why (and the exit code is 1). Sections:

1. env: versions and the GPU;
2. kernels: every Triton kernel against its torch reference at serving shapes: max error, time,
   and roofline (bytes / time against the HBM bandwidth, FLOPs / time against the bf16 peak);
3. decode attention: achieved HBM GB/s at 256 sequences x 1k and 4k contexts;
4. tuning: every candidate tile config of decode and prefill attention compiled over the
   machine's cores, checked against the torch reference and timed, within its share of the
   budget; the winners go to $OUT/<gpu>.json, which the engine sections then name
   (BATCHGEN_KERNEL_CONFIGS): nothing in the checkout changes;
5. per model shape: engine start-up (KV blocks, CUDA graph capture time and memory against what
   the KV sizing reserved for it), graph replays against the eager step, replay time per decode
   bucket, a pure decode step at 256 sequences (ms, host syncs per step, GPU busy share, Triton
   compiles), nano-vllm's benchmark (256 requests, prompt and output lengths uniform in 100-1024,
   ignore_eos) greedy and at temperature 0.6.

`--device cpu --quick` runs the same code at toy sizes through the Triton interpreter (CI keeps the
script working that way, with its time limits and FAILED rows); the numbers then mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
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

BUDGET_S = {"full": 450.0, "quick": 1500.0}  # the whole run, child start-ups included
# each section's hard limit (at most: never past what is left of the budget)
SHARES_S = {
    "full": {"env": 20, "kernels": 75, "decode attention": 40, "tuning": 100, "engine": 110},
    "quick": {"env": 120, "kernels": 300, "decode attention": 150, "tuning": 300, "engine": 600},
}
MIN_SECTION_S = 15.0  # a section with less left than this is SKIPPED
TUNE_COMPILE_SHARE = 0.6  # of the tuning section's time: building candidates; the rest checks and times them
MAX_SYNCS_PER_STEP = 1
WATCHDOG_SLACK_S = 20.0  # past the budget, the run stops itself whatever it is doing


# ---------------------------------------------------------------- rows and files


@dataclass
class Row:
    """One line of the result table."""

    section: str
    item: str
    value: str
    note: str = ""
    status: str = "ok"  # ok | FAILED | SKIPPED: the last two are failures of the run

    def cell(self) -> str:
        return self.value if self.status == "ok" else f"{self.status}: {self.value}"


class Sink:
    """A section's rows and data, appended to a JSON-lines file as they come (in the section's
    process), so whatever it measured survives its being killed."""

    def __init__(self, path: Path, section: str) -> None:
        self.path, self.section = path, section

    def add(self, item: str, value, note: str = "") -> None:
        self._row(Row(self.section, item, value if isinstance(value, str) else _fmt(value), note))

    def fail(self, item: str, why: str, note: str = "") -> None:
        self._row(Row(self.section, item, why, note, "FAILED"))

    def skip(self, item: str, why: str) -> None:
        self._row(Row(self.section, item, why, "", "SKIPPED"))

    def data(self, key: str, value) -> None:
        """Machine-readable results: gpu_check.json["data"][section][key]."""
        self._write({"data": [self.section, key, value]})

    def _row(self, row: Row) -> None:
        print(f"[{row.section}] {row.item}: {row.cell()} {row.note}".rstrip(), file=sys.stderr, flush=True)
        self._write({"row": asdict(row)})

    def _write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


@dataclass
class Results:
    """Everything the run found so far; written out whole after every section."""

    rows: list[Row] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @property
    def failures(self) -> int:
        return sum(r.status != "ok" for r in self.rows)

    def read(self, path: Path) -> None:
        """Take in a section's JSON-lines file."""
        if not path.exists():
            return
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a kill
                continue
            if "row" in record:
                self.rows.append(Row(**record["row"]))
            elif "data" in record:
                section, key, value = record["data"]
                self.data.setdefault(section, {})[key] = value

    def table(self) -> str:
        lines = ["| section | item | value | note |", "|---|---|---|---|"]
        lines += [f"| {r.section} | {r.item} | {r.cell()} | {r.note} |" for r in self.rows]
        return "\n".join(lines)

    def write(self, out_dir: Path, complete: bool) -> None:
        _write_atomic(out_dir / "gpu_check.md", self.table() + "\n")
        body = {**self.meta, "complete": complete, "failures": self.failures,
                "rows": [asdict(r) for r in self.rows], "data": self.data}
        _write_atomic(out_dir / "gpu_check.json", json.dumps(body, indent=2, default=str) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------- device


def resolve_device(name: str) -> torch.device:
    """`cuda` (the current device: 0 in a fresh process), `cuda:N` or `cpu`, as a device with an
    index (torch.cuda.set_device refuses an index-less one). ValueError says what is wrong."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"--device {name!r}: {exc}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {name!r}: gpu_check runs on cuda, cuda:N or cpu (with --quick)")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name!r}: no CUDA device here; run with --device cpu --quick for a "
                         "dry run")
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    if not 0 <= index < count:
        raise ValueError(f"--device {name!r}: this machine has {count} CUDA device(s)")
    return torch.device("cuda", index)


def use_device(device: torch.device) -> None:
    """Make `device` current in this process (Triton launches on the current CUDA device)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _peaks(device: torch.device) -> tuple[float, float]:
    if device.type != "cuda":
        return DEFAULT_PEAKS
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in GPU_PEAKS.items() if k in name), DEFAULT_PEAKS)


# ---------------------------------------------------------------- sections (each in its own process)


@dataclass
class Context:
    """What a section's process is told."""

    device: str  # with an index on CUDA
    dtype: str  # torch dtype name
    quick: bool  # toy sizes (the interpreter)
    out_dir: str
    deadline: float  # time.time() by which the section is killed
    workers: int = 1  # processes it may use (tuning's compiles)
    args: dict = field(default_factory=dict)  # section arguments (the engine section's model shape)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def left(self) -> float:
        return self.deadline - time.time()


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
    """Kernels Triton has compiled (or loaded from its cache) so far in this process, over every
    @triton.jit of kernels/; None under the interpreter, which compiles nothing."""
    from kernels._triton import interpreting

    if interpreting():
        return None
    from triton.runtime.jit import JITFunction

    from kernels import activation, attention_decode, attention_prefill, kv_cache, rms_norm, rotary

    total = 0
    for module in (activation, attention_decode, attention_prefill, kv_cache, rms_norm, rotary):
        for fn in vars(module).values():
            if isinstance(fn, JITFunction):
                caches = getattr(fn, "device_caches", None) or {}
                total += sum(len(entry[0]) for entry in caches.values())
    return total


class SyncCounter:
    """Counts the host syncs torch flags (torch.cuda.set_sync_debug_mode('warn')) inside a block:
    every stream or device synchronize (the staging's fetches and waits among them), every blocking
    copy, every `.item()` or data-dependent shape."""

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


def section_env(out: Sink, ctx: Context) -> None:
    import triton

    device = ctx.torch_device
    versions = (platform.python_version(), torch.__version__, triton.__version__)
    out.add("python / torch / triton", " / ".join(versions))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.add("gpu", f"{device}: {props.name}, sm_{props.major}{props.minor}, "
                f"{props.multi_processor_count} SMs, {props.total_memory / (1 << 30):.1f} GiB, "
                f"CUDA {torch.version.cuda}")
    peaks = _peaks(device)
    out.add("roofline peaks", f"{peaks[0] / 1e12:.2f} TB/s, {peaks[1] / 1e12:.0f} TFLOP/s bf16",
            "datasheet numbers the roofline % are taken against")
    out.add("cores for compiling", os.cpu_count() or 1)


def section_kernels(out: Sink, ctx: Context) -> None:
    from benchmarks import kernel_ops as kbench

    device, dtype, peaks = ctx.torch_device, ctx.torch_dtype, _peaks(ctx.torch_device)
    cases = kbench.quick_cases(dtype, device) if ctx.quick else kbench.serving_cases(dtype, device)
    results = []
    for case in cases:
        row = kbench.run_case(case, dtype, device, reps=1 if ctx.quick else 50)
        item = f"{row.op} {row.shape} {row.dtype}"
        results.append(asdict(row))
        if not row.ok:
            out.fail(item, f"disagrees with the torch reference: max error {row.max_err:.1e}")
            continue
        roof = ""
        if case.bytes_moved:
            roof = f"{case.bytes_moved / (row.triton_ms * 1e-3) / peaks[0]:.0%} of HBM"
        elif case.flops:
            roof = f"{case.flops / (row.triton_ms * 1e-3) / peaks[1]:.0%} of bf16 peak"
        out.add(item, f"err {row.max_err:.1e}; {row.triton_ms:.3f} ms (torch {row.torch_ms:.3f}); "
                f"{row.rate.strip()}", roof)
    out.data("cases", results)


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


def _heads(shape: str) -> tuple[int, int, int]:
    cfg = SHAPES[shape]
    return cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]


def section_decode_bandwidth(out: Sink, ctx: Context) -> None:
    batch, contexts = (4, (40, 100)) if ctx.quick else (256, (1024, 4096))
    peak = _peaks(ctx.torch_device)[0]
    for shape in ("smollm2-135m", "llama-0.6b"):
        for context in contexts:
            ms, gbps = decode_gbps(ctx.torch_device, ctx.torch_dtype, _heads(shape), batch, context,
                                   2 if ctx.quick else 30)
            out.add(f"{shape} heads {_heads(shape)}, {batch} seqs x {context}",
                    f"{ms:.3f} ms, {gbps:.0f} GB/s",
                    f"{gbps * 1e9 / peak:.0%} of HBM")
            out.data(f"{shape}/{batch}x{context}", {"ms": ms, "GB/s": gbps})


def section_tune(out: Sink, ctx: Context) -> None:
    """Compile every candidate over the cores, then check and time each in this process."""
    from kernels import tuning

    device = ctx.torch_device
    cases = [tuning.TuneCase(kind, _heads(shape), ctx.dtype, ctx.device, ctx.quick)
             for shape in ("smollm2-135m", "llama-0.6b") for kind in ("decode", "prefill")]
    candidates = {kind: _defaults_first(tuning.CANDIDATES[kind], tuning.DEFAULTS[kind])
                  for kind in ("decode", "prefill")}
    if ctx.quick:
        candidates = {kind: configs[:2] for kind, configs in candidates.items()}
    t0 = time.monotonic()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    built = tuning.compile_candidates(cases, candidates, ctx.workers,
                                      t0 + TUNE_COMPILE_SHARE * (ctx.left() - 5), log)
    out.add("compiled", f"{sum(e is None for b in built.values() for e in b.values())} of "
            f"{sum(len(candidates[c.kind]) for c in cases)} candidates", f"{time.monotonic() - t0:.1f} s on "
            f"{ctx.workers} processes")
    timer = lambda fn: time_ms(fn, device, reps=2 if ctx.quick else 10, warmup=1)  # noqa: E731
    configs, notes = {}, {}
    for i, case in enumerate(cases):
        ok = [cfg for j, cfg in enumerate(candidates[case.kind]) if built[case.key].get(j, "") is None]
        deadline = time.monotonic() + (ctx.left() - 5) / (len(cases) - i)
        result = tuning.tune(case, ok, timer, deadline, log)
        note = _tune_note(result, built[case.key], len(candidates[case.kind]))
        item = f"{case.kind} heads {case.heads}"
        notes[case.key] = {"timed": len(result.timings), "rejected": result.rejected, "failed": result.failed,
                           "not_built": len(candidates[case.kind]) - len(built[case.key]),
                           "best_ms": min((ms for _, ms in result.timings), default=None),
                           "default_ms": result.ms_of(tuning.DEFAULTS[case.kind])}
        if result.rejected:
            config, why = result.rejected[0]
            out.fail(f"{item}: candidates disagreeing with the torch reference",
                     f"{len(result.rejected)}, e.g. {json.dumps(config)}: {why}")
        if result.best is None:
            first = next((f"{json.dumps(c)}: {why}" for c, why in result.failed), "")
            out.fail(item, f"no candidate ran ({note})" + (f"; first failure {first}" if first else ""))
            continue
        configs[case.key] = result.best
        default = notes[case.key]["default_ms"]
        out.add(item, json.dumps(result.best), f"{notes[case.key]['best_ms']:.3f} ms vs default "
                f"{'-' if default is None else f'{default:.3f}'} ms; {note}")
    if configs:
        name = tuning.gpu_name(device)
        path = tuning.write_table(name, configs, Path(ctx.out_dir) / f"{name}.json", notes=notes)
        out.add("written", str(path), "named by BATCHGEN_KERNEL_CONFIGS for the engine sections; the "
                "checkout is unchanged")
        out.data("table", str(path))
    out.data("configs", configs)
    out.data("notes", notes)


def _defaults_first(candidates: list[dict], default: dict) -> list[dict]:
    return [default] + [c for c in candidates if c != default]


def _tune_note(result, built: dict[int, str | None], total: int) -> str:
    failed_to_build = sum(e is not None for e in built.values())
    parts = [f"{len(result.timings)} of {total} checked and timed"]
    if result.rejected:
        parts.append(f"{len(result.rejected)} disagree with torch")
    if failed_to_build or result.failed:
        parts.append(f"{failed_to_build + len(result.failed)} did not compile or launch")
    if total - len(built) or result.not_reached:
        parts.append(f"{total - len(built) + result.not_reached} not reached before the deadline")
    return ", ".join(parts)


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


def section_engine(out: Sink, ctx: Context) -> None:
    from benchmarks.throughput import make_workload

    shape, device, quick = ctx.args["shape"], ctx.torch_device, ctx.quick
    t0 = time.perf_counter()
    llm = build_llm(shape, device, ctx.dtype, quick)
    runner = llm.engine.runner
    out.add("start-up", f"{time.perf_counter() - t0:.1f} s",
            f"KV {llm.engine.block_manager.num_blocks} blocks of {llm.config.block_size}; "
            f"{len(runner.graphs)} CUDA graphs captured in {runner.graph_capture_s:.1f} s")
    out.data("start-up", {"kv_blocks": llm.engine.block_manager.num_blocks, "graphs": len(runner.graphs),
                          "graph_capture_s": runner.graph_capture_s, "graph_memory": runner.graph_memory,
                          "graph_memory_estimate": runner.graph_memory_estimate})
    check_graph_memory(out, runner, device)
    replay_times(out, runner, device)
    vocab = llm.engine.model_args.vocab_size
    warm = make_workload(4 if quick else 48, (4, 10) if quick else (16, 1900), (2, 4) if quick else (2, 64),
                         vocab, seed=1)  # prompt + output within max_model_len (2048)
    bench(out, llm, warm, "warm-up (compiles prefill shapes; not timed)", timed=False)
    decode_step(out, llm, device, quick)
    n, lens = (3, (4, 10)) if quick else (256, (100, 1024))
    workload = make_workload(n, lens, lens, vocab, seed=0)
    for temperature in (0.0, 0.6):
        if ctx.left() < (5 if quick else 25):
            out.skip(f"nano-vllm bench, temperature {temperature}", f"{ctx.left():.0f} s left in the section")
            continue
        bench(out, llm, workload, f"nano-vllm bench, temperature {temperature}", temperature=temperature)


def check_graph_memory(out: Sink, runner, device: torch.device) -> None:
    """The graphs must fit in what the KV sizing left for them, or the KV cache took their memory."""
    if device.type != "cuda":
        out.add("CUDA graphs", "-", "not on CUDA")
        return
    if not runner.graphs:
        out.fail("CUDA graphs", "none captured", "every decode step runs eagerly")
        return
    gib = 1 << 30
    took, reserved = runner.graph_memory / gib, runner.graph_memory_estimate / gib
    if runner.graph_memory > runner.graph_memory_estimate:
        out.fail("CUDA graph memory", f"{took:.2f} GiB captured, only {reserved:.2f} GiB reserved when "
                 "the KV cache was sized")
    else:
        out.add("CUDA graph memory", f"{took:.2f} GiB", f"{reserved:.2f} GiB reserved for them when the KV "
                "cache was sized")


def replay_times(out: Sink, runner, device: torch.device) -> None:
    """Replay time of each decode bucket's graph over padding inputs (one key each: the launch- and
    GEMM-bound floor of a decode step of that size)."""
    if not runner.graphs:
        out.add("graph replay", "-", "no CUDA graphs (eager or not on CUDA)")
        return
    times = {}
    for size in [b for b in runner.buckets if b in (1, 8, 32, 64, 128, 256) or b == runner.buckets[-1]]:
        runner._stage_padding(size)
        times[size] = time_ms(runner.graphs[size][0].replay, device, reps=20)
    out.add("graph replay ms by batch size", ", ".join(f"{b}: {ms:.3f}" for b, ms in times.items()),
            "padding inputs: one key per sequence")
    out.data("replay_ms", times)


def graph_replay_mismatches(runner, seqs: list) -> tuple[int, int, float]:
    """Replay the decode graphs over the running sequences' real inputs and run the same padded step
    eagerly: (rows compared, rows whose argmax differs, max |logit difference|). Recomputing a step
    rewrites the same KV slots with the same values, so the engine can go on afterwards."""
    from engine.scheduler import ScheduledSequence

    compared = differ = 0
    worst = 0.0
    for size in sorted({b for b in runner.buckets if b in (1, 8) or b == runner.buckets[-1]}):
        if size > len(seqs) or size not in runner.graphs:
            continue
        pieces = [ScheduledSequence(seq, 1, True) for seq in seqs[:size]]
        runner._update_block_tables(seqs[:size])
        with torch.inference_mode():
            replayed = runner._execute_decode(pieces)[0].float().clone()
            graphs, runner.graphs = runner.graphs, {}
            try:
                eager = runner._execute_decode(pieces)[0].float()
            finally:
                runner.graphs = graphs
        compared += size
        differ += int((replayed.argmax(-1) != eager.argmax(-1)).sum())
        worst = max(worst, float((replayed - eager).abs().max()))
    return compared, differ, worst


def decode_step(out: Sink, llm, device: torch.device, quick: bool) -> None:
    """A pure decode step at the full batch: prefill max_num_seqs prompts, check the graph replays
    against the eager step, then time decode steps (engine.step: schedule + replay + sample +
    bookkeeping), count host syncs, Triton compiles and the GPU's busy share of the step."""
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
    engine.drain()  # the in-flight step's tokens on the host: no placeholder left in the inputs below
    bs = engine.config.block_size  # sequences whose next KV slot is allocated already
    running = [s for s in engine.scheduler.running if (s.num_tokens - 1) // bs < len(s.block_table)]
    if engine.runner.graphs:
        compared, differ, worst = graph_replay_mismatches(engine.runner, running)
        item = "graph replay vs eager step"
        if differ:
            out.fail(item, f"{differ} of {compared} rows pick another token", f"max |logit diff| {worst:.3g}")
        else:
            out.add(item, f"{compared} rows, same tokens", f"max |logit diff| {worst:.3g}")
    staging = engine.runner.staging
    fetches, waits, compiles = staging.num_fetches, staging.num_waits, triton_compiles()
    sync(device)
    with SyncCounter(device) as counter:  # each step ends waiting for its tokens: no closing sync needed
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    explicit = (staging.num_fetches - fetches + staging.num_waits - waits) / steps
    syncs = explicit + counter.count / steps
    if _sees_stream_syncs(device):  # then the debug mode counted the staging's own syncs too
        syncs = counter.count / steps
    compiled = None if compiles is None else triton_compiles() - compiles
    busy = gpu_busy_share(engine, device, steps)
    ctx_len = statistics.fmean([s.num_tokens for s in engine.scheduler.running] or [0])
    item = f"pure decode step, {batch} sequences"
    note = f"context ~{ctx_len:.0f}; GPU busy {busy}"
    if syncs > MAX_SYNCS_PER_STEP:
        out.fail(f"{item}: host syncs per step", f"{syncs:.1f} ({explicit:.1f} of them the staging's fetches "
                 "and waits); one is the most a step may make")
    if compiled:
        out.fail(f"{item}: Triton compiles", f"{compiled} during the timed steps")
    if syncs <= MAX_SYNCS_PER_STEP and not compiled:
        out.add(item, f"{wall_ms:.2f} ms", f"{note}; host syncs/step {syncs:.1f}; Triton compiles {compiled}")
    out.data("decode_step", {"ms": wall_ms, "syncs_per_step": syncs, "syncs_explicit": explicit,
                             "syncs_flagged": counter.count / steps, "gpu_busy": busy, "context": ctx_len,
                             "triton_compiles": compiled})
    engine.abort_request([f"decode-{i}" for i in range(batch)])
    while engine.has_unfinished_requests():
        engine.step()


def _sees_stream_syncs(device: torch.device) -> bool:
    """Whether torch's sync debug mode flags a stream synchronize (what the staging's fetch and wait
    do): asked of this torch, so that no sync is counted twice or missed."""
    if device.type != "cuda":
        return False
    with SyncCounter(device) as counter:
        torch.cuda.current_stream(device).synchronize()
    return counter.count > 0


def gpu_busy_share(engine, device: torch.device, steps: int) -> str:
    """Share of decode-step wall time covered by GPU kernels (the rest is the host's gaps), from the
    torch profiler over a few steps; a profiler that fails says so here and fails nothing else."""
    if device.type != "cuda":
        return "n/a (not CUDA)"
    try:
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
    except Exception as exc:  # noqa: BLE001 - the profiler is a nicety; the step's numbers stand without it
        first = str(exc).splitlines()[0][:80] if str(exc) else ""
        return f"n/a (profiler failed: {type(exc).__name__}: {first})"


def bench(out: Sink, llm, workload, item: str, temperature: float = 0.0, timed: bool = True) -> None:
    """One run of `workload`; a FAILED row (never a throughput) when requests ended in errors or, in
    a timed run, Triton compiled something."""
    from benchmarks.throughput import run_engine

    compiles = triton_compiles()
    result = run_engine(llm, workload, peak=0.0, name=item, temperature=temperature)
    compiled = None if compiles is None else triton_compiles() - compiles
    stats = llm.iteration_stats
    step_ms = statistics.fmean(s.duration_s for s in stats) * 1e3 if stats else 0.0
    out.data(item, {**asdict(result), "steps": len(stats), "mean_step_ms": step_ms,
                    "triton_compiles": compiled})
    if result.num_errors:
        out.fail(item, f"{result.num_errors} of {result.num_requests} requests ended in errors; first: "
                 f"{result.first_error}")
        return
    if timed and compiled:
        out.fail(item, f"{compiled} Triton compile(s) during the timed run",
                 f"{result.output_tokens_per_s:.0f} output tok/s, not a number to keep")
        return
    out.add(item, f"{result.output_tokens_per_s:.0f} output tok/s",
            f"{result.num_requests} requests, {result.output_tokens} output tokens in "
            f"{result.elapsed_s:.1f} s; "
            f"{len(stats)} steps, mean {step_ms:.2f} ms; TTFT p50 {result.ttft_p50_s:.2f} s; "
            f"ITL p50 {result.itl_p50_s * 1e3:.1f} ms; Triton compiles {compiled}")


# ---------------------------------------------------------------- running the sections


@dataclass
class Section:
    """One section of the run: what its process runs, and its hard time limit."""

    name: str  # its rows' section column
    target: str  # "module:function" (module "self": this file), called as function(Sink, Context)
    limit_s: float  # killed after this (or when the budget is spent, if sooner)
    args: dict = field(default_factory=dict)


def run_sections(sections: list[Section], ctx: Context, out_dir: Path, budget_s: float,
                 env: dict[str, str] | None = None, results: Results | None = None,
                 min_section_s: float = MIN_SECTION_S) -> Results:
    """Run each section in a process of its own under min(its limit, what is left of the budget),
    killing it (and every process it started) when it runs over; rewrite the table and JSON after
    each (into `results`, when given). A section whose limit would be under `min_section_s` is
    SKIPPED. A tuned table that the tuning section wrote is named for the sections after it."""
    results = Results() if results is None else results
    results.meta.update(device=ctx.device, dtype=ctx.dtype, quick=ctx.quick, budget_s=budget_s)
    env = dict(os.environ if env is None else env)
    end = time.monotonic() + budget_s
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    for section in sections:
        left = end - time.monotonic()
        limit = min(section.limit_s, left)
        if limit < min_section_s:
            results.rows.append(Row(section.name, "section", f"{left:.0f} s left of the {budget_s:.0f} s "
                                    "budget", status="SKIPPED"))
        else:
            _run_one(section, ctx, out_dir, limit, env, results)
            table = results.data.get(section.name, {}).get("table")
            if table and Path(table).exists():
                env["BATCHGEN_KERNEL_CONFIGS"] = table
        results.meta["elapsed_s"] = budget_s - (end - time.monotonic())
        results.write(out_dir, complete=False)
    results.meta["complete"] = True
    results.write(out_dir, complete=True)
    return results


@contextlib.contextmanager
def _watchdog(seconds: float):
    """The run's last resort (the sections have their own limits): interrupt it after `seconds`."""
    def fire(signum, frame):
        raise _WatchdogFired

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _WatchdogFired:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _WatchdogFired(Exception):
    pass


def _run_one(section: Section, ctx: Context, out_dir: Path, limit: float, env: dict[str, str],
             results: Results) -> None:
    slug = "".join(c if c.isalnum() else "-" for c in section.name)
    rows, log = out_dir / "logs" / f"{slug}.jsonl", out_dir / "logs" / f"{slug}.log"
    rows.unlink(missing_ok=True)
    spec = {"section": section.name, "target": section.target, "rows": str(rows),
            "ctx": {**asdict(ctx), "deadline": time.time() + limit, "args": section.args}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    print(f"gpu_check: {section.name} (at most {limit:.0f} s)", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with log.open("w") as log_file:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", f.name], cwd=ROOT,
                                env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # its own process group: killed whole
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # also when the run's own watchdog interrupts the wait
            _kill_group(proc)
    os.unlink(f.name)
    before = len(results.rows)
    results.read(rows)
    took = time.monotonic() - t0
    if code is None:
        results.rows.append(Row(section.name, "section", f"timed out: killed after {limit:.0f} s",
                                _last_line(log), "FAILED"))
    elif code != 0 and not any(r.status == "FAILED" for r in results.rows[before:]):
        results.rows.append(Row(section.name, "section", f"its process exited with code {code}",
                                _last_line(log), "FAILED"))
    results.rows.append(Row(section.name, "section time", f"{took:.1f} s", f"limit {limit:.0f} s; log {log}"))


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the section's process group (its pool workers too), and reap the section."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _last_line(log: Path) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:200].replace("|", "/") if lines else ""


def child_main(spec_path: str) -> int:
    """A section's process: run it, every row to the JSON-lines file; an exception is a FAILED row."""
    spec = json.loads(Path(spec_path).read_text())
    out = Sink(Path(spec["rows"]), spec["section"])
    ctx = Context(**spec["ctx"])
    try:
        use_device(ctx.torch_device)
        if ctx.torch_device.type == "cpu":  # the Triton kernels, through the interpreter (section_env_vars)
            from kernels import ops

            ops.set_backend("triton")
        module, _, name = spec["target"].partition(":")
        fn = globals()[name] if module == "self" else getattr(importlib.import_module(module), name)
        fn(out, ctx)
    except Exception as exc:  # noqa: BLE001 - the section's failure is a row; the run goes on
        traceback.print_exc()
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        out.fail("raised", f"{type(exc).__name__}: {first[:200]}".replace("|", "/"))
        return 1
    return 0


def plan(args: argparse.Namespace) -> list[Section]:
    shares = SHARES_S["quick" if args.quick else "full"]
    sections = [Section("env", "self:section_env", shares["env"])]
    if "kernels" not in args.skip:
        sections.append(Section("kernels", "self:section_kernels", shares["kernels"]))
    if "bandwidth" not in args.skip:
        sections.append(Section("decode attention", "self:section_decode_bandwidth",
                                shares["decode attention"]))
    if "tune" not in args.skip:
        sections.append(Section("tuning", "self:section_tune", shares["tuning"]))
    if "engine" not in args.skip:
        for shape in args.shapes or (["toy"] if args.quick else ["smollm2-135m", "llama-0.6b"]):
            sections.append(Section(f"engine {shape}", "self:section_engine", shares["engine"],
                                    {"shape": shape}))
    return sections


def section_env_vars(device: torch.device) -> dict[str, str]:
    """The environment the sections run in: on the CPU, the Triton interpreter (set before kernels are
    imported, hence here; child_main picks the Triton kernels)."""
    env = dict(os.environ)
    if device.type == "cpu":
        env.update(TRITON_INTERPRET="1")
    env.pop("BATCHGEN_KERNEL_CONFIGS", None)  # only a table this run tuned is named
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchgen bench gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda",
                        help="cuda, cuda:N, or cpu (with --quick: the interpreter)")
    parser.add_argument("--quick", action="store_true", help="toy sizes: checks the script, measures nothing")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the whole run's time (default 450 s; 1500 s with --quick)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out",
                        help="folder for gpu_check.md/.json, logs and the tuned table (default $OUT)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["kernels", "bandwidth", "tune", "engine"])
    parser.add_argument("--shapes", nargs="*", default=None, choices=list(SHAPES),
                        help="model shapes for the engine sections")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child)
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    budget = args.budget_s or BUDGET_S["quick" if args.quick else "full"]
    ctx = Context(str(device), dtype, args.quick, str(out_dir.resolve()), 0.0,
                  workers=min(16, os.cpu_count() or 1))
    results = Results()
    with _watchdog(budget + WATCHDOG_SLACK_S):
        results = run_sections(plan(args), ctx, out_dir, budget, section_env_vars(device), results)
    if not results.meta.get("complete"):  # the watchdog fired: say so, keep what was measured
        results.rows.append(Row("run", "watchdog", f"stopped after {budget + WATCHDOG_SLACK_S:.0f} s",
                                status="FAILED"))
        results.write(out_dir, complete=False)
    print(results.table())
    print(f"\n{results.failures} failure(s); table, JSON and logs in {out_dir}", file=sys.stderr)
    return 1 if results.failures else 0


if __name__ == "__main__":
    sys.exit(main())
