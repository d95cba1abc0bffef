"""The tuner of the attention kernels' tile sizes (kernels.tile_configs holds the tables a launch
reads). It never writes into the checkout: it writes a table wherever it is told, to be named when wanted.

Tuning one kernel at one serving shape (a `TuneCase`) is two phases under one deadline:
`compile_candidates` builds every candidate config in a pool of processes (each compiles its
candidates by launching them once; Triton's on-disk cache keeps the binaries), then `tune` runs
each candidate that compiled in this process, compares its output with the torch reference (a
candidate that disagrees may not win), and times it. "No candidate ran" is a result of its own
(TuneResult.best is None), never the defaults passed off as tuned.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.tile_configs import (  # noqa: F401  (the tables, re-exported for the tuner's callers)
    CANDIDATES,
    CONFIG_DIR,
    DEFAULTS,
    ENV_FILE,
    clear_cache,
    config_key,
    decode_config,
    gpu_name,
    lookup,
    num_sms,
    prefill_config,
)


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
        from kernels.testing import TOLERANCES

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
