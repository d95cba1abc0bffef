"""`batchgen sweep`: the domain text's practical guidance made a command.

Sweeps max_num_seqs and max_num_batched_tokens one at a time (the other held at its base value) on
one workload, `--repeats` times each, and records every configuration's throughput and latency as a
row of the `sweeps` view. Then it names the knee: the smallest setting past which more of the knob
buys less than `--knee-gain` more output tokens/s, and the first setting whose ITL p99 crosses
`--itl-slo-ms`, if one is given.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from dataclasses import dataclass

import click

from benchmarks.machine import describe, machine_info
from benchmarks.throughput import (
    BenchResult,
    Workload,
    build_llm,
    make_workload,
    measure_gemm_peak,
    parse_range,
    run_engine,
    workload_options,
)
from engine.cli_options import engine_config, engine_options


@dataclass
class SweepPoint:
    swept: str  # "max_num_seqs" or "max_num_batched_tokens"
    max_num_seqs: int
    max_num_batched_tokens: int
    repeat: int
    result: BenchResult


def parse_values(value: str, flag: str) -> list[int]:
    try:
        values = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers", param_hint=flag) from None
    if not values or values[0] < 1:
        raise click.BadParameter(f"{value!r}: need one or more positive integers", param_hint=flag)
    return values


def run_sweep(make_llm, workload: Workload, base, seqs_values: list[int], budget_values: list[int],
              repeats: int, peak: float, echo=click.echo) -> list[SweepPoint]:
    """Measure each configuration `repeats` times; make_llm(max_num_seqs, max_num_batched_tokens) -> LLM."""
    plan = [("max_num_seqs", s, base.max_num_batched_tokens) for s in seqs_values]
    plan += [("max_num_batched_tokens", base.max_num_seqs, b) for b in budget_values]
    points = []
    for swept, seqs, budget in plan:
        llm = make_llm(seqs, budget)
        for r in range(repeats):
            result = run_engine(llm, workload, peak, name=f"seqs={seqs},budget={budget}")
            points.append(SweepPoint(swept, seqs, budget, r, result))
            echo(f"  {swept:<24} max_num_seqs={seqs:<5} max_num_batched_tokens={budget:<6} "
                 f"repeat {r}: {result.output_tokens_per_s:8.1f} out tok/s, "
                 f"ITL p99 {result.itl_p99_s * 1e3:7.1f} ms")
    return points


def summarise(points: list[SweepPoint], swept: str) -> list[tuple[int, float, float]]:
    """(knob value, mean output tok/s, mean ITL p99) per configuration of one swept knob."""
    by_value: dict[int, list[BenchResult]] = {}
    for p in points:
        if p.swept == swept:
            by_value.setdefault(getattr(p, swept), []).append(p.result)
    return [(v, statistics.fmean(r.output_tokens_per_s for r in rs),
             statistics.fmean(r.itl_p99_s for r in rs)) for v, rs in sorted(by_value.items())]


def find_knee(curve: list[tuple[int, float, float]], min_gain: float) -> int | None:
    """Smallest knob value after which the next step up gains less than min_gain (relative)."""
    for (v, tps, _), (_, next_tps, _) in zip(curve, curve[1:], strict=False):
        if tps > 0 and (next_tps - tps) / tps < min_gain:
            return v
    return curve[-1][0] if curve else None


def first_slo_breach(curve: list[tuple[int, float, float]], itl_slo_s: float) -> int | None:
    return next((v for v, _, itl in curve if itl > itl_slo_s), None)


def sweep_rows(points: list[SweepPoint], sweep_id: str, model: str, workload_desc: dict) -> list[dict]:
    """One `sweeps` row (SweepRecord fields) per measured configuration and repeat."""
    ts = time.time()
    rows = []
    for p in points:
        r = p.result
        rows.append({
            "sweep_id": sweep_id, "ts": ts, "model": model, "swept": p.swept,
            "max_num_seqs": p.max_num_seqs, "max_num_batched_tokens": p.max_num_batched_tokens,
            "repeat": p.repeat, "num_requests": r.num_requests,
            "output_tokens_per_s": r.output_tokens_per_s, "processed_tokens_per_s": r.processed_tokens_per_s,
            "ttft_p50_s": r.ttft_p50_s, "ttft_p99_s": r.ttft_p99_s, "itl_p50_s": r.itl_p50_s,
            "itl_p99_s": r.itl_p99_s, "e2e_p50_s": r.e2e_p50_s, "e2e_p99_s": r.e2e_p99_s,
            "mean_running": r.mean_running, "mean_budget_utilisation": r.mean_budget_utilisation,
            "num_preemptions": r.num_preemptions, "workload": json.dumps(workload_desc),
        })
    return rows


def _prompts_workload(path: str, sample: int, output_lens: tuple[int, int], tokenizer, seed: int) -> Workload:
    """A sample of a real prompt file's rows (the `prompt` column), tokenized."""
    import random

    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=["prompt"])
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for unreadable files
        raise click.BadParameter(f"{path}: cannot read a `prompt` column: {exc}",
                                 param_hint="--prompts") from None
    texts = [t for t in table.column("prompt").to_pylist() if t]
    rng = random.Random(seed)
    texts = rng.sample(texts, min(sample, len(texts)))
    return Workload(seed, [tokenizer.encode(t) for t in texts], [rng.randint(*output_lens) for _ in texts])


@click.command()
@engine_options
@workload_options
@click.option("--max-num-seqs-values", default="1,4,16,64,128,256", show_default=True,
              help="comma-separated max_num_seqs to try (budget held at --max-num-batched-tokens)")
@click.option("--max-num-batched-tokens-values", default="128,512,2048,8192", show_default=True,
              help="comma-separated token budgets to try (max_num_seqs held at --max-num-seqs)")
@click.option("--repeats", type=int, default=1, show_default=True)
@click.option("--prompts", "prompts_path", default=None, help="sample real prompts from this Parquet file")
@click.option("--knee-gain", type=float, default=0.05, show_default=True,
              help="a step that buys less than this relative throughput gain is past the knee")
@click.option("--itl-slo-ms", type=float, default=None, help="report where ITL p99 crosses this")
@click.option("--data-dir", envvar="BATCHGEN_DATA_DIR", default="data", show_default=True)
def sweep(num_requests, prompt_len, output_len, shared_prefix, seed, max_num_seqs_values,
          max_num_batched_tokens_values, repeats, prompts_path, knee_gain, itl_slo_ms, data_dir, **engine_kw):
    """Sweep max_num_seqs and max_num_batched_tokens one at a time; record rows in the `sweeps` view."""
    from dataclasses import replace

    if repeats < 1:
        raise click.BadParameter("must be >= 1", param_hint="--repeats")
    seqs_values = parse_values(max_num_seqs_values, "--max-num-seqs-values")
    budget_values = parse_values(max_num_batched_tokens_values, "--max-num-batched-tokens-values")
    output_lens = parse_range(output_len, "--output-len")
    base = engine_config(engine_kw)
    checkpoint = _load(base.model)  # once: every configuration shares the same weights
    first = build_llm(base, checkpoint)
    if prompts_path:
        workload = _prompts_workload(prompts_path, num_requests, output_lens, first.tokenizer, seed)
    else:
        workload = make_workload(num_requests, parse_range(prompt_len, "--prompt-len"), output_lens,
                                 first.engine.model_args.vocab_size, seed, shared_prefix)
    del first
    peak = measure_gemm_peak(base.dtype, base.device)
    click.echo(describe(machine_info(base.device)))
    click.echo(f"workload: {len(workload.prompts)} requests, {workload.prompt_tokens} prompt tokens, "
               f"{workload.output_tokens} output tokens; GEMM peak {peak / 1e9:.1f} GFLOP/s")

    def make_llm(seqs: int, budget: int):
        try:
            config = replace(base, max_num_seqs=seqs, max_num_batched_tokens=budget)
        except ValueError as exc:
            raise click.UsageError(f"engine flags: {exc}") from None
        return build_llm(config, checkpoint)

    points = run_sweep(make_llm, workload, base, seqs_values, budget_values, repeats, peak)
    sweep_id = uuid.uuid4().hex[:12]
    desc = {"num_requests": len(workload.prompts), "prompt_len": prompt_len, "output_len": output_len,
            "shared_prefix": shared_prefix, "seed": seed, "prompts": prompts_path, "repeats": repeats}
    _record(data_dir, sweep_rows(points, sweep_id, base.model, desc))
    _report(points, knee_gain, itl_slo_ms, sweep_id)


def _load(model: str):
    from engine.loader import load_checkpoint
    from engine.registry import ModelNotFoundError, resolve_model

    try:
        return load_checkpoint(resolve_model(model))
    except (ModelNotFoundError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None


def _record(data_dir: str, rows: list[dict]) -> None:
    from jobs.store import Store, SweepRecord

    Store(data_dir).record_sweep([SweepRecord(**row) for row in rows])


def _report(points: list[SweepPoint], knee_gain: float, itl_slo_ms: float | None, sweep_id: str) -> None:
    click.echo(f"\nsweep {sweep_id} (rows in the `sweeps` view)")
    for swept in ("max_num_seqs", "max_num_batched_tokens"):
        curve = summarise(points, swept)
        click.echo(f"\n{swept:>24}  out tok/s  ITL p99 ms")
        for v, tps, itl in curve:
            click.echo(f"{v:>24}  {tps:9.1f}  {itl * 1e3:10.1f}")
        click.echo(f"knee ({swept}): {find_knee(curve, knee_gain)} "
                   f"(next step gains < {knee_gain:.0%} output tokens/s)")
        if itl_slo_ms is not None:
            breach = first_slo_breach(curve, itl_slo_ms / 1e3)
            click.echo(f"ITL p99 crosses {itl_slo_ms:g} ms at {swept}={breach}" if breach is not None
                       else f"ITL p99 stays under {itl_slo_ms:g} ms for every {swept} tried")

