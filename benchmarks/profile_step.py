"""Where a step's time goes: `batchgen bench profile --num-seqs 64 --dtype bfloat16`.

Admits N sequences, runs their prefill and a few decode steps unprofiled, then profiles decode
steps with torch.profiler and prints the top ops by self CPU time, plus the share of each step
spent outside the model's forward (schedule, prepare, sample, stops: per-step Python work). Each
`kernels.ops` call is a labelled range (`ops.rms_norm`, ...), so the native C kernels, which the
profiler cannot see inside, show as those ranges' self time (the kernel plus its Python launcher).
Where a decode step's layers run as one native call (kernels/decode_layers.py), the step is timed
that way and again op by op, and the table is made op by op.
Numbers, not pass/fail; on a shared machine compare shares within one run, not absolute times.
"""

from __future__ import annotations

import contextlib
import time

import click

from engine.cli_options import engine_config, engine_options


def _decode_steps(engine, steps: int) -> tuple[float, float]:
    """Run `steps` engine steps; returns (total seconds, seconds inside the model's forward)."""
    model = engine.runner.model
    inside = [0.0]
    forward = model.forward

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - t0

    model.forward = timed
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            engine.step()
    finally:
        del model.forward  # back to the class's method
    return time.perf_counter() - t0, inside[0]


# the kernels.ops entry points the model calls, labelled in the profile
LABELLED_OPS = ("linear", "linear_logits", "linear_silu_and_mul", "rms_norm", "fused_add_rms_norm",
                "rotary_embedding", "store_kv_cache", "paged_attention", "silu_and_mul")


@contextlib.contextmanager
def labelled_ops():
    """Wrap each kernels.ops entry point in a torch.profiler.record_function range while inside."""
    import torch

    from kernels import ops

    def labelled(name, fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function(f"ops.{name}"):
                return fn(*args, **kwargs)
        return call

    saved = {name: getattr(ops, name) for name in LABELLED_OPS}
    try:
        for name, fn in saved.items():
            setattr(ops, name, labelled(name, fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(ops, name, fn)


@click.command("profile")
@engine_options
@click.option("--num-seqs", type=int, default=64, show_default=True, help="sequences decoding together")
@click.option("--prompt-len", type=int, default=128, show_default=True)
@click.option("--steps", type=int, default=8, show_default=True, help="profiled decode steps")
@click.option("--top", type=int, default=20, show_default=True, help="rows of the op table")
def main(num_seqs, prompt_len, steps, top, **engine_kw):
    """Profile decode steps of NUM_SEQS sequences on a random-token workload."""
    import torch

    from benchmarks.throughput import build_llm, make_workload
    from engine.sampling_params import SamplingParams
    from kernels import decode_layers, options

    llm = build_llm(engine_config(engine_kw))
    engine = llm.engine
    workload = make_workload(num_seqs, (prompt_len, prompt_len), (1, 1), engine.model_args.vocab_size)
    params = SamplingParams(max_tokens=10 * steps + 16, temperature=0.0, ignore_eos=True)
    for prompt in workload.prompts:
        engine.add_request(prompt=prompt, params=params)
    while engine.scheduler.waiting or any(  # prefill, unprofiled
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    _decode_steps(engine, 3)  # warm
    total, inside = _decode_steps(engine, steps)
    fused = engine.runner.model.decode_layers.ok and decode_layers.enabled()
    click.echo(f"dtype {llm.config.dtype} ({llm.config.dtype_reason}), {num_seqs} sequences, "
               f"{torch.get_num_threads()} threads: {total / steps * 1e3:.1f} ms a decode step, "
               f"{(total - inside) / total:.0%} of it outside the model's forward"
               + (" (the layers in one native call)" if fused else ""))
    # the table op by op: the fused call (kernels/decode_layers.py) would show as one opaque range
    with options.override(fused_decode=False):
        if fused:
            total, _ = _decode_steps(engine, steps)
            click.echo(f"op by op (fused_decode=off): {total / steps * 1e3:.1f} ms a decode step")
        with labelled_ops(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _decode_steps(engine, steps)
    click.echo(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


if __name__ == "__main__":
    main()
