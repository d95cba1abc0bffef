"""Host work per decode step: `python -m benchmarks.host_step --num-seqs 256`.

The model's forward is replaced by a no-op (it returns a zero hidden state) and the vocabulary is
small (--vocab), so what a step costs here is what the host does around the device's work:
scheduling, preparing and uploading the inputs, the sampler's bookkeeping and its op launches, the
token appends and stop checks, the per-step stats. Each mode admits --num-seqs sequences, runs
their prefill and --warmup decode steps, then times --steps decode steps, greedy and at
temperature 0.6, with asynchronous scheduling on and off, as wall time and as the process's CPU
time (what the host spent, less sensitive to other processes on a shared machine). Numbers, not
pass/fail; on a shared machine compare the rows of one run.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from types import SimpleNamespace

import click
import torch

from engine.config import EngineConfig
from engine.families import layout, read_model_args
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def small_llama(vocab: int, seed: int = 0) -> SimpleNamespace:
    """A randomly initialised two-layer Llama checkpoint (no tokenizer) with `vocab` tokens."""
    config = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, vocab_size=vocab, rms_norm_eps=1e-5,
                  rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
                  model_type="llama")
    gen = torch.Generator().manual_seed(seed)
    args = read_model_args(config, "host_step")
    weights = {p.source: torch.randn(p.shape, generator=gen) * 0.02 for p in layout(args)}
    return SimpleNamespace(config=config, weights=weights, tokenizer=None, args=args)


def no_op_forward(engine: LLMEngine, seed: int = 0) -> None:
    """The model's forward returns a zero hidden state of the right shape, and its head fixed
    random logits (the GPU path: logits, then the sampler's ops; no fused CPU argmax): no device
    work but the sampler's ops over a small vocabulary."""
    model, runner = engine.runner.model, engine.runner
    zeros = torch.zeros((engine.config.max_num_batched_tokens, model.args.dim), dtype=runner.dtype,
                        device=runner.device)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((engine.config.max_num_seqs, model.args.vocab_size), generator=gen).to(runner.device)
    model.forward = lambda input_ids, positions, kv_caches, meta: zeros[: input_ids.shape[0]]
    model.compute_logits = lambda hidden: logits[: hidden.shape[0]]
    model.greedy_tokens = lambda hidden: None


def decode_steps(num_seqs: int, temperature: float, steps: int, warmup: int, vocab: int,
                 async_scheduling: bool, profile: str | None = None) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds per decode step (each step() call once every sequence decodes)."""
    config = EngineConfig(model="host-step", max_num_seqs=num_seqs,
                          max_num_batched_tokens=max(num_seqs, 2048),
                          num_kv_blocks=num_seqs * (-(-(16 + warmup + steps + 8) // 16) + 1),
                          dtype="float32", async_scheduling=async_scheduling)
    engine = LLMEngine(config, checkpoint=small_llama(vocab), stat_loggers=[lambda stats: None])
    no_op_forward(engine)
    params = SamplingParams(max_tokens=warmup + steps + 4, temperature=temperature, ignore_eos=True, seed=1)
    for i in range(num_seqs):
        engine.add_request(str(i), [(7 * i + j) % vocab for j in range(16)], params)
    for _ in range(warmup + 1):  # the prefill, then warm-up decodes
        engine.step()
    times, cpu, profiler = [], [], cProfile.Profile() if profile else None
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        if profiler:
            profiler.enable()
        engine.step()
        if profiler:
            profiler.disable()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    assert engine.num_unfinished_requests == num_seqs, "every sequence must still be decoding"
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return times, cpu


@click.command()
@click.option("--num-seqs", type=int, default=256, show_default=True)
@click.option("--steps", type=int, default=200, show_default=True, help="timed decode steps per mode")
@click.option("--warmup", type=int, default=20, show_default=True)
@click.option("--vocab", type=int, default=512, show_default=True, help="vocabulary of the no-op model")
@click.option("--profile", type=click.Choice(["greedy", "sampled"]), default=None,
              help="print cProfile's top functions for this mode (async scheduling on)")
def main(num_seqs: int, steps: int, warmup: int, vocab: int, profile: str | None) -> None:
    torch.set_num_threads(1)
    print(f"host work per decode step, {num_seqs} sequences, forward a no-op, vocab {vocab}, {steps} steps")
    print(f"{'mode':<24}{'median ms':>10}{'mean ms':>10}{'p90 ms':>10}{'CPU median':>12}{'CPU mean':>10}")
    for name, temperature in (("greedy", 0.0), ("temperature 0.6", 0.6)):
        for async_scheduling in (True, False):
            prof = profile if profile and async_scheduling and (profile == "greedy") == (temperature == 0) \
                else None
            wall, cpu = decode_steps(num_seqs, temperature, steps, warmup, vocab, async_scheduling, prof)
            ms, cpu_ms = sorted(x * 1e3 for x in wall), [x * 1e3 for x in cpu]
            label = f"{name}, {'async' if async_scheduling else 'sync'}"
            print(f"{label:<24}{statistics.median(ms):>10.2f}{statistics.fmean(ms):>10.2f}"
                  f"{ms[int(0.9 * len(ms))]:>10.2f}{statistics.median(cpu_ms):>12.2f}"
                  f"{statistics.fmean(cpu_ms):>10.2f}")


if __name__ == "__main__":
    main()
