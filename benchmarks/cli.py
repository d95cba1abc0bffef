"""`batchgen bench <benchmark>`: the lab's entry, plugged into the CLI through the `batchgen.commands`
entry point (pyproject.toml) the way `batchgen dashboard` is, so that jobs never imports it.

Modelled on vLLM's `vllm bench <sub>`. Each benchmark is loaded only when named (`batchgen bench
--help` imports no torch). The ones written with argparse get their arguments as they are
(`batchgen bench kernels --help` prints the benchmark's own help).
"""

from __future__ import annotations

import importlib
import sys

import click

# name -> ("module:attribute", one line of help). A click command is used as it is; a function
# main(argv) -> exit code (argparse) gets the arguments that follow the name.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "throughput": ("benchmarks.throughput:bench",
                   "Throughput, latency and MFU of the engine on a seeded workload (--baseline hf|vllm)."),
    "profile": ("benchmarks.profile_step:main", "Where a decode step's time goes (torch.profiler)."),
    "kernels": ("benchmarks.kernel_ops:main", "Every kernel against its torch reference, timed."),
    "gemm": ("benchmarks.gemm:main", "GFLOP/s of each CPU GEMM path at the model's shapes."),
    "model-load": ("benchmarks.model_load:main", "Time and memory of loading a 1B checkpoint."),
    "store": ("benchmarks.store_queries:main", "The dashboard's queries over a synthetic job."),
    "dashboard-load": ("benchmarks.dashboard_load:main",
                       "The dashboard under concurrent clients while a job writes."),
    "gpu-check": ("benchmarks.gpu_check:main",
                  "The GPU path end to end on one CUDA device (make gpu-check)."),
    "soak": ("benchmarks.soak:main", "Faults against a real job on Redis, then a count of every row."),
    "host-step": ("benchmarks.host_step:main",
                  "Host work per decode step with the forward a no-op (scheduler, inputs, sampler)."),
    "job-path": ("benchmarks.job_path:main", "A whole `batchgen run` against the bare engine, same rows."),
    "submit-scale": ("benchmarks.submit_scale:main", "Submit's time and peak memory at 1M to 100M rows."),
    "store-live": ("benchmarks.store_live:main",
                   "Every dashboard query and `status`, timed while a large job's parts land."),
    "compact-memory": ("benchmarks.compact_memory:main",
                       "Peak memory of a compaction merge against the rows it merges."),
    "request-digests": ("benchmarks.request_digests:main",
                        "A large job's request figures from its rows against its digests' sample."),
    "run-progress": ("benchmarks.run_progress:main",
                     "One progress poll of `batchgen run` / `status JOB` at 10,000 to 390,625 shards."),
}
# benchmarks that log as they go: --log-format text|json (jobs.logs), as the long-running commands
LOGGING = ("throughput",)


def _argparse_command(name: str, main, help_text: str) -> click.Command:
    """A click command handing every argument after its name to the benchmark's main(argv)."""

    @click.command(name=name, help=help_text, add_help_option=False,
                   context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args: tuple[str, ...]) -> None:
        sys.exit(main(list(args)) or 0)

    return command


class BenchGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(BENCHMARKS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in BENCHMARKS:
            return None
        target, help_text = BENCHMARKS[name]
        module_name, attr = target.split(":")
        found = getattr(importlib.import_module(module_name), attr)
        if not isinstance(found, click.Command):
            return _argparse_command(name, found, help_text)
        if name in LOGGING:
            from jobs.logs import add_log_format_option

            add_log_format_option(found)
        return found

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The list from BENCHMARKS' help lines, without importing a benchmark (and torch)."""
        with formatter.section("Benchmarks"):
            formatter.write_dl([(name, BENCHMARKS[name][1]) for name in self.list_commands(ctx)])


@click.group(cls=BenchGroup, context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """The lab: benchmarks, baselines, profilers and checks (`batchgen bench <name> --help`).

    Numbers, not pass/fail; docs/benchmarks.md holds the figures with date, machine and command."""
