"""Does the job path keep up with the bare engine? `python -m benchmarks.job_path --rounds 2`.

The workload: --num-requests prompts held out of data/samples/prompts.jsonl (every fifth row from
the third), greedy, --max-tokens new tokens each past EOS (the same work for both). Each round
runs the bare engine in this process (LLMEngine, requests added at once, stepped until done: output
tokens over the time from the first add to the last output) and then a whole `batchgen run` of the
same rows in a fresh data directory (output tokens over the job's generation time, first shard
started to last shard finished, as its summary prints them). Reported: both rates and their ratio
per round. The bare engine is stepped from a thread of its own, as a worker's engine loop is
(--bare-on-main-thread: from the main thread). Numbers, not pass/fail; rounds alternate, so
compare within one run.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

from engine.cli_options import engine_config, engine_options
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples" / "prompts.jsonl"
SUMMARY_TOKENS = re.compile(r"tokens: (\d+) output \(([\d.]+) tok/s\)")


def held_out(n: int) -> list[str]:
    rows = [json.loads(line) for line in SAMPLES.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in rows[2::5]]
    if len(prompts) < n:
        raise click.UsageError(f"--num-requests {n}: the held-out rows of {SAMPLES} are {len(prompts)}")
    return prompts[:n]


def bare_engine(engine: LLMEngine, prompts: list[str], max_tokens: int, on_thread: bool = True
                ) -> tuple[int, float]:
    """(output tokens, seconds) of the workload on an engine already loaded, stepped on a thread of
    its own as a worker's engine loop is (`on_thread`), else on this main thread. On the 2-core
    EPYC of docs/benchmarks.md the same engine ran 2x slower stepped from the main thread."""
    if on_thread:
        result = []
        thread = threading.Thread(
            target=lambda: result.append(bare_engine(engine, prompts, max_tokens, False)))
        thread.start()
        thread.join()
        return result[0]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bare-{time.monotonic_ns()}-{i}", prompt, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finish_reason != "length":
                raise RuntimeError(f"bare engine: {out.request_id} ended {out.finish_reason}: {out.error}")
            tokens += len(out.token_ids)
    return tokens, time.perf_counter() - t0


def job_run(prompts: list[str], max_tokens: int, flags: list[str]) -> tuple[int, float, str]:
    """(output tokens, output tok/s over the generation time, the summary) of a whole `batchgen run`."""
    with tempfile.TemporaryDirectory(prefix="job-path-") as tmp:
        path = Path(tmp) / "prompts.jsonl"
        path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p}) + "\n"
                                for i, p in enumerate(prompts)))
        cmd = [sys.executable, "-m", "jobs.cli", "run", str(path), "--data-dir", str(Path(tmp) / "data"),
               "--max-tokens", str(max_tokens), "--temperature", "0", "--ignore-eos",
               "--apply-chat-template", "never", "--no-progress", *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    found = SUMMARY_TOKENS.search(done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"batchgen run failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-3000:]}")
    summary = "\n".join(line for line in (done.stdout + done.stderr).splitlines()
                        if line.startswith(("job ", "rows:", "tokens:")))
    return int(found.group(1)), float(found.group(2)), summary


@click.command()
@engine_options
@click.option("--num-requests", type=int, default=64, show_default=True)
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--rounds", type=int, default=2, show_default=True, help="alternated rounds of each path")
@click.option("--bare-on-main-thread", is_flag=True,
              help="step the bare engine from the main thread (default: a thread, as a worker does)")
def main(num_requests: int, max_tokens: int, rounds: int, bare_on_main_thread: bool, **opts) -> None:
    config = engine_config(opts)
    flags = []
    for name, value in opts.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "kv_cache_memory_gb":
            flag = "--kv-cache-memory"
        flags += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    prompts = held_out(num_requests)
    engine = LLMEngine(config)
    print(f"{num_requests} held-out requests, {max_tokens} output tokens each (greedy, ignore_eos); "
          f"engine {config.model} {config.dtype} on {config.device}, flags {' '.join(flags) or '(defaults)'}",
          flush=True)
    bare_engine(engine, prompts[:8], 8)  # first steps (KV pages, first GEMMs): a worker's start-up
    ratios = []
    for r in range(rounds):
        load = os.getloadavg()[0]
        order = ("bare", "job") if r % 2 == 0 else ("job", "bare")  # alternated: the machine's load drifts
        for path in order:
            if path == "bare":
                tokens, seconds = bare_engine(engine, prompts, max_tokens, not bare_on_main_thread)
                bare_rate = tokens / seconds
            else:
                job_tokens, job_rate, summary = job_run(prompts, max_tokens, flags)
        if job_tokens != tokens:
            raise RuntimeError(f"the job wrote {job_tokens} output tokens, the bare engine {tokens}")
        ratios.append(job_rate / bare_rate)
        print(f"round {r + 1} ({' then '.join(order)}, load average {load:.1f}): bare engine {bare_rate:.1f} "
              f"tok/s ({tokens} tokens in {seconds:.1f} s); batchgen run {job_rate:.1f} tok/s over its "
              f"generation time; ratio {ratios[-1]:.3f}x", flush=True)
        print("  " + summary.replace("\n", "\n  "), flush=True)
    print(f"job path / bare engine: median {statistics.median(ratios):.3f}x, rounds "
          f"{', '.join(f'{x:.3f}x' for x in ratios)}")


if __name__ == "__main__":
    main()
