"""Tile sizes of the attention kernels, measured per GPU: defaults, a tuned table per GPU name, and
the tuner that writes one.

A launch reads its tile config from the table that `BATCHGEN_KERNEL_CONFIGS` names, else from a
table committed as `kernels/configs/<gpu name>.json`, else DEFAULTS (picked from sm_90 register
counts, `python -m kernels.compile_check`, not timings). The tuner (`scripts/gpu_check.py` runs it)
never writes into the checkout: it writes a table wherever it is told, to be named when wanted.

Tuning one kernel at one serving shape (a `TuneCase`) is two phases under one deadline:
`compile_candidates` builds every candidate config in a pool of processes (each compiles its
candidates by launching them once; Triton's on-disk cache keeps the binaries), then `tune` runs
each candidate that compiled in this process, compares its output with the torch reference (a
candidate that disagrees may not win), and times it. "No candidate ran" is a result of its own
(TuneResult.best is None), never the defaults passed off as tuned.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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


# ---------------------------------------------------------------- the tuner


@dataclass(frozen=True)
class TuneCase:
    """One attention kernel at one serving shape: its inputs, a launch with a given config, and the
    torch reference that launch must agree with. Plain fields, so a pool process can rebuild it."""

    kind: str  # decode | prefill
    heads: tuple[int, int, int]  # (query heads, KV heads, head dim)
    dtype: str  # torch dtype name, e.g. "bfloat16"
    device: str  # e.g. "cuda:0" (or "cpu" under the Triton interpreter)
    quick: bool = False  # toy sizes (the interpreter): checks the tuner, measures nothing

    @property
    def key(self) -> str:
        return config_key(self.kind, self.heads[2], getattr(torch, self.dtype))

    def inputs(self):
        """Seeded paged inputs: decode, 256 sequences of 2048 tokens; prefill, 4 prompts of 2048."""
        from kernels.testing import make_paged_inputs

        if self.kind == "decode":
            batch, ctx = (2, 40) if self.quick else (256, 2048)
            query_lens, context_lens = [1] * batch, [ctx] * batch
        else:
            plen = 24 if self.quick else 2048
            query_lens = context_lens = [plen] * 4
        return make_paged_inputs(query_lens, context_lens, *self.heads, 16, getattr(torch, self.dtype),
                                 self.device, garbage=None)

    def run(self, p, config: dict) -> torch.Tensor:
        """The Triton kernel with tile config `config` on inputs `p`."""
        from kernels.attention_decode import paged_decode_attention_triton
        from kernels.attention_prefill import paged_prefill_attention_triton

        if self.kind == "decode":
            return paged_decode_attention_triton(p.q, p.k_cache, p.v_cache, p.meta.block_tables,
                                                 p.meta.context_lens, p.scale, config=config)
        m = p.meta
        return paged_prefill_attention_triton(p.q, p.k_cache, p.v_cache, m.block_tables, m.query_start_loc,
                                              m.context_lens, m.max_query_len, p.scale, config=config)

    def reference(self, p) -> torch.Tensor:
        from kernels.attention_decode import paged_decode_attention_ref
        from kernels.attention_prefill import paged_prefill_attention_ref

        if self.kind == "decode":
            return paged_decode_attention_ref(p.q, p.k_cache, p.v_cache, p.meta.block_tables,
                                              p.meta.context_lens, p.scale)
        m = p.meta
        return paged_prefill_attention_ref(p.q, p.k_cache, p.v_cache, m.block_tables, m.query_lens_cpu,
                                           m.context_lens_cpu, p.scale)

    def mismatch(self, got: torch.Tensor, want: torch.Tensor) -> str | None:
        """Why `got` is not the reference's output within the dtype's tolerance, or None."""
        from kernels.bench import TOLERANCES

        atol, rtol = TOLERANCES[getattr(torch, self.dtype)]
        if got.shape != want.shape:
            return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        if torch.allclose(got.double(), want.double(), atol=atol, rtol=rtol):
            return None
        err = (got.double() - want.double()).abs().nan_to_num(float("inf")).max().item()
        return f"max error {err:.3g} over atol {atol:g} / rtol {rtol:g}"


@dataclass
class TuneResult:
    """What tuning one case found."""

    best: dict | None  # the fastest candidate that agreed with the reference; None: no candidate ran
    timings: list[tuple[dict, float]] = field(default_factory=list)  # (config, median ms), agreed ones
    rejected: list[tuple[dict, str]] = field(default_factory=list)  # disagreed with the reference: why
    failed: list[tuple[dict, str]] = field(default_factory=list)  # did not compile or launch: why
    not_reached: int = 0  # candidates the deadline left untried

    def ms_of(self, config: dict) -> float | None:
        return next((ms for c, ms in self.timings if c == config), None)


def tune(case: TuneCase, candidates: list[dict], time_ms: Callable[[Callable[[], object]], float],
         deadline: float = float("inf"), log: Callable[[str], None] = print) -> TuneResult:
    """Run, check and time every candidate in this process until `deadline` (time.monotonic());
    the fastest one whose output agrees with the reference wins."""
    result = TuneResult(None)
    inputs = case.inputs()
    want = case.reference(inputs)
    for i, config in enumerate(candidates):
        if time.monotonic() >= deadline:
            result.not_reached = len(candidates) - i
            log(f"  {case.key}: deadline reached, {result.not_reached} candidate(s) left untried")
            break
        try:
            why = case.mismatch(case.run(inputs, config), want)
            if why is None:
                result.timings.append((config, time_ms(lambda config=config: case.run(inputs, config))))
        except Exception as exc:  # noqa: BLE001 - a config the compiler or the GPU refuses cannot win
            result.failed.append((config, _first_line(exc)))
            continue
        if why is not None:
            result.rejected.append((config, why))
            log(f"  {case.key} {config}: rejected, disagrees with the torch reference ({why})")
    if result.timings:
        result.best = min(result.timings, key=lambda t: t[1])[0]
    return result


def compile_candidates(cases: list[TuneCase], candidates: dict[str, list[dict]], workers: int,
                       deadline: float, log: Callable[[str], None] = print
                       ) -> dict[str, dict[int, str | None]]:
    """Build every candidate of every case in `workers` spawned processes until `deadline`
    (time.monotonic()): each process launches its share once, so Triton compiles them there and its
    on-disk cache hands the binaries to the process that times them. Returns case key -> candidate
    index -> None (built) or why not; candidates the deadline left unbuilt are absent."""
    tasks = [(case, i, config) for case in cases for i, config in enumerate(candidates[case.kind])]
    built: dict[str, dict[int, str | None]] = {case.key: {} for case in cases}
    if not tasks:
        return built
    pool = multiprocessing.get_context("spawn").Pool(max(1, min(workers, len(tasks))))
    try:
        pending = pool.imap_unordered(_compile_one, tasks)
        for _ in tasks:
            left = deadline - time.monotonic()
            if left <= 0:
                raise multiprocessing.TimeoutError
            key, i, error = pending.next(timeout=left)
            built[key][i] = error
    except multiprocessing.TimeoutError:
        log(f"  compile deadline reached: {sum(map(len, built.values()))} of {len(tasks)} candidates built")
    finally:
        pool.terminate()
        pool.join()
    return built


_inputs_of: dict[TuneCase, object] = {}  # a pool process's inputs, built once per case


def _compile_one(task: tuple[TuneCase, int, dict]) -> tuple[str, int, str | None]:
    case, index, config = task
    try:
        if case.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(case.device))  # Triton launches on the current device
        if case not in _inputs_of:
            _inputs_of[case] = case.inputs()
        case.run(_inputs_of[case], config)
        if case.device.startswith("cuda"):
            torch.cuda.synchronize(case.device)
        return case.key, index, None
    except Exception as exc:  # noqa: BLE001 - reported per candidate: it cannot win
        return case.key, index, _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def write_table(name: str, configs: dict, path: Path, notes: dict | None = None) -> Path:
    """Write a tuned table for GPU `name` to `path`; a launch uses it once BATCHGEN_KERNEL_CONFIGS
    names it (or once it is committed as kernels/configs/<name>.json)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"gpu": name, "configs": configs, **({"notes": notes} if notes else {})}
    path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    clear_cache()
    return path
