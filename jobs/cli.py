"""The `batchgen` command line: one entry point, subcommands loaded lazily.

Each package owns its commands; this module only maps names to them, so `batchgen sql` does not
import torch and a broken optional piece cannot take the whole CLI down. Commands of the layers above
jobs (`dashboard`; `bench` and `sweep`, the benchmarks) plug in through the `batchgen.commands`
entry-point group (pyproject.toml), the way Flask's `flask.commands` does: jobs never imports them.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys

import click

# name -> "module:attribute" of a click.Command
COMMANDS: dict[str, str] = {
    "models": "engine.registry:models",
    "sql": "jobs.store.cli:sql",
    "store": "jobs.repair:store",
    "run": "jobs.commands:run",
    "submit": "jobs.commands:submit",
    "worker": "jobs.commands:worker",
    "status": "jobs.commands:status",
    "cancel": "jobs.commands:cancel",
    "retry": "jobs.commands:retry",
    "export": "jobs.commands:export",
}
ENTRY_POINT_GROUP = "batchgen.commands"
# commands that run for a long time and log as they go: each gets --log-format text|json (jobs.logs)
LONG_RUNNING = ("run", "worker", "dashboard", "sweep")


def _targets() -> dict[str, str]:
    """Every command name -> "module:attribute": jobs' own, then the plugged-in ones."""
    from importlib.metadata import entry_points

    plugged = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return {**plugged, **COMMANDS}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_targets())

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = _targets().get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
                return _unavailable(name, f"{module_name} is not built yet")
            raise
        command = getattr(module, attr)
        if name in LONG_RUNNING:
            from jobs.logs import add_log_format_option

            add_log_format_option(command)
        return command


def _unavailable(name: str, why: str) -> click.Command:
    @click.command(name=name, context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def cmd(args: tuple[str, ...]) -> None:
        raise click.UsageError(f"`batchgen {name}` is unavailable: {why}")

    return cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batchgen")
def cli() -> None:
    """batchgen: offline batch generation over Parquet prompts."""


def main() -> None:
    """Run the CLI; an error of the environment (a full disk, a read-only or vanished directory) or
    a damaged file of the data dir that no command turned into its own message ends in one line and
    exit 1, never a traceback. The engine's OpenMP waiting is set first, before any command loads
    torch (libgomp reads it then), and Arrow's allocator before any command loads pyarrow."""
    from engine.openmp import set_openmp_defaults

    set_openmp_defaults()
    set_arrow_allocator()
    try:
        cli()
    except OSError as exc:
        click.echo(f"Error: {describe_os_error(exc)}", err=True)
        sys.exit(1)
    except Exception as exc:
        message = describe_data_error(exc)
        if message is None:
            raise
        click.echo(f"Error: {message}", err=True)
        sys.exit(1)


ARROW_POOL_ENV = "ARROW_DEFAULT_MEMORY_POOL"  # Arrow C++ reads it once, when pyarrow is imported


def set_arrow_allocator() -> None:
    """Arrow's default memory pool: the system allocator, unless $ARROW_DEFAULT_MEMORY_POOL chose one.

    pyarrow's default, mimalloc, keeps the pages it freed in its arenas: `batchgen submit` of 10M rows
    held 209 MB at the end of its shard writing, 148 MB with the system allocator (docs/benchmarks.md,
    issue 38). `jobs.submit` also sets pyarrow's own pool, but the Parquet writer allocates from Arrow
    C++'s default pool, which only this variable chooses, and only before pyarrow is imported
    (jobs.cli imports none)."""
    os.environ.setdefault(ARROW_POOL_ENV, "system")


def describe_data_error(exc: Exception) -> str | None:
    """One line for an error that a damaged file of the data dir causes (it names the file and what to
    do), None for any other error (a bug: its traceback is wanted)."""
    from jobs.manifest import ManifestError, ShardFileError
    from jobs.store import StoreError, unreadable_part_message

    if isinstance(exc, ManifestError | StoreError):
        return str(exc)
    if isinstance(exc, ShardFileError):
        return (f"{exc}: restore it from a copy of the data dir; the job's other shards and rows are "
                "intact")
    if type(exc).__module__.split(".")[0] in ("duckdb", "_duckdb"):
        return unreadable_part_message(str(exc))
    return None


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def describe_os_error(exc: OSError) -> str:
    """One line naming the cause and the path (a full disk says so: the input is not at fault)."""
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in NO_SPACE or "No space left on device" in str(exc):
        return f"no space left on the device{where}: free some space and run the command again"
    text = exc.strerror or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"{text}{where}"


if __name__ == "__main__":
    main()
