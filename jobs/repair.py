"""`batchgen store check`: what in a data dir is damaged, and the one way back to a complete job.

Read-only by default, it lists:

- every Parquet part under store/tables/ that cannot be read (`jobs.store.check_store`), and
  whether its rows are re-derivable (held by another file) or lost;
- committed shards whose output rows the views no longer find (a part gone or damaged), and
  committed shards whose commit record is gone (their lease says committed, the store does not);
- jobs whose manifest is unreadable or missing, and jobs the store has no record of.

With `--repair` (`--quarantine` is the same flag) it acts, in this order:

1. unreadable part files move to DATA_DIR/quarantine/<time>/ (nothing is deleted);
2. an unreadable or missing manifest is rebuilt from the store's record of the job and its shard
   files (the bad one goes to the quarantine folder too); a lost job record is written again from
   the manifest;
3. every committed shard whose rows are now missing is marked for re-run (`ShardLedger.lose`): its
   commit no longer counts, and the shard shows failed naming what was lost, so `batchgen status`
   shows the job incomplete meanwhile.

Then `batchgen retry JOB` (workers on a broker) or the same `batchgen run` command re-runs the
marked shards, and `batchgen export` writes the complete job.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from jobs.manifest import (
    JOBS_DIR,
    JobPaths,
    ManifestError,
    load_manifest,
    rebuild_manifest,
)
from jobs.shards.leases import ShardLeases
from jobs.shards.ledger import ShardLedger
from jobs.shards.state import ShardState
from jobs.store import (
    DATA_DIR_ENV,
    DEFAULT_DATA_DIR,
    CheckReport,
    Layout,
    Store,
    StoreError,
    check_store,
    connect_reporting,
    missing_rows,
    quarantine,
)

QUARANTINE_DIR = "quarantine"


@dataclass
class LostShard:
    """A committed shard whose rows are gone: it has to run again."""

    job_id: str
    shard_id: int
    what: str  # what was lost

    def describe(self) -> str:
        return f"job {self.job_id} shard {self.shard_id}: {self.what} (lost: the shard must run again)"

    def reason(self) -> str:
        """The shard's error while it waits to run again (`batchgen status` shows it)."""
        return (f"{self.what}: a part file was lost or damaged; `batchgen retry {self.job_id}` or the same "
                "`batchgen run` command runs the shard again")


@dataclass
class JobProblem:
    """A job whose manifest or store record is damaged or gone."""

    job_id: str
    what: str  # "manifest" | "record"
    detail: str  # what is wrong, one line

    def describe(self) -> str:
        return f"job {self.job_id}: {self.detail}"


@dataclass
class DataDirReport:
    """Everything `store check` found."""

    store: CheckReport
    lost: list[LostShard] = field(default_factory=list)
    jobs: list[JobProblem] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)  # checks that could not run, and why

    @property
    def healthy(self) -> bool:
        return self.store.healthy and not self.lost and not self.jobs


def check_data_dir(data_dir: str | os.PathLike, *, deep: bool = True) -> DataDirReport:
    """What is damaged in a data dir (nothing is changed)."""
    store = check_store(data_dir, deep=deep)
    report = DataDirReport(store)
    root = Layout.of(data_dir).root
    report.jobs = _job_problems(root, report)
    report.lost = [LostShard(m.job_id, m.shard_id, m.what) for m in store.missing]
    report.lost += _commits_gone(root, report)
    return report


def repair(data_dir: str | os.PathLike, report: DataDirReport) -> list[str]:
    """Act on `report` (the module docstring's three steps); one line per thing done."""
    root = Layout.of(data_dir).root
    done = []
    target = root / QUARANTINE_DIR / time.strftime("%Y%m%dT%H%M%S")
    if report.store.bad:
        done.append(f"moved {len(report.store.bad)} files to {quarantine(root, report.store.bad)}")
    for problem in report.jobs:
        done.append(_repair_job(root, problem, target))
    lost = {(s.job_id, s.shard_id): s for s in report.lost}
    for m in missing_rows(root):  # rows the quarantined files held are missing now
        lost.setdefault((m.job_id, m.shard_id), LostShard(m.job_id, m.shard_id, m.what))
    for shard in lost.values():
        ShardLedger(root, shard.job_id).lose(shard.shard_id, shard.reason())
        done.append(f"job {shard.job_id} shard {shard.shard_id}: marked for re-run ({shard.what})")
    for job_id in sorted({job for job, _ in lost}):
        done.append(f"job {job_id}: incomplete until its marked shards run again: `batchgen retry {job_id}` "
                    "(workers on a broker) or the same `batchgen run` command")
    return done


# ---------------------------------------------------------------- jobs: manifests and records


def _job_dirs(root: Path) -> list[Path]:
    jobs = root / JOBS_DIR
    if not jobs.is_dir():
        return []
    return sorted(p for p in jobs.iterdir() if p.is_dir() and not p.name.startswith("."))


def _job_problems(root: Path, report: DataDirReport) -> list[JobProblem]:
    problems, readable = [], []
    for path in _job_dirs(root):
        try:
            load_manifest(root, path.name)
            readable.append(path.name)
        except ManifestError as exc:
            problems.append(JobProblem(path.name, "manifest", str(exc)))
        except FileNotFoundError:
            if JobPaths.of(root, path.name).shards.is_dir():
                problems.append(JobProblem(path.name, "manifest", f"{path / 'manifest.json'} is missing"))
        except StoreError:
            continue  # not a job's directory (its name is no job id)
    recorded = _recorded_jobs(root, report)
    if recorded is not None:
        problems += [JobProblem(job, "record", "the store has no record of the job (its job_records part "
                                "was lost)") for job in readable if job not in recorded]
    return problems


def _recorded_jobs(root: Path, report: DataDirReport) -> set[str] | None:
    """Jobs the store has a record of; None when job records cannot be read."""
    con, broken = connect_reporting(root)
    try:
        if "job_records" in broken:
            report.unchecked.append(f"job records: {broken['job_records']}")
            return None
        return {r[0] for r in con.execute("SELECT job_id FROM _bg.job_records").fetchall()}
    finally:
        con.close()


def _repair_job(root: Path, problem: JobProblem, quarantine_to: Path) -> str:
    if problem.what == "record":
        from jobs.submit import job_record

        Store(root).record_job(job_record(load_manifest(root, problem.job_id)))
        return f"job {problem.job_id}: its record written again from its manifest"
    paths = JobPaths.of(root, problem.job_id)
    config = _recorded_config(root, problem.job_id)
    if config is None:
        return (f"job {problem.job_id}: {paths.manifest} cannot be rebuilt (the store has no record of the "
                "job either): restore it from a copy of the data dir")
    if paths.manifest.exists():
        dest = quarantine_to / paths.manifest.relative_to(root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(paths.manifest, dest)
    try:
        rebuild_manifest(root, problem.job_id, config)
    except ManifestError as exc:
        return f"job {problem.job_id}: {exc}"
    return f"job {problem.job_id}: {paths.manifest} rebuilt from the store's record of the job"


def _recorded_config(root: Path, job_id: str) -> str | None:
    con, broken = connect_reporting(root)
    try:
        if "job_records" in broken:
            return None
        row = con.execute("SELECT config FROM _bg.job_records WHERE job_id = ?", [job_id]).fetchone()
    finally:
        con.close()
    return row[0] if row and row[0] and row[0] != "{}" else None


# ---------------------------------------------------------------- commits that are gone


def _commits_gone(root: Path, report: DataDirReport) -> list[LostShard]:
    """Shards whose latest lease says committed while the store has no commit for them (a commits
    part lost): their rows no longer count, so they have to run again."""
    leased = _leased_committed(root)
    if not leased:
        return []
    con, broken = connect_reporting(root)
    try:
        if "commits" in broken:
            report.unchecked.append(f"commits: {broken['commits']}")
            return []
        done = con.execute("SELECT job_id, shard_id FROM shards WHERE status = 'completed'").fetchall()
    finally:
        con.close()
    return [LostShard(job, shard, "its commit record is gone") for job, shard in sorted(leased - set(done))]


def _leased_committed(root: Path) -> set[tuple[str, int]]:
    found = set()
    for path in _job_dirs(root):
        leases = ShardLeases(path / "leases")
        for shard_id, attempts in leases.claimed_attempts().items():
            view = leases.view(shard_id, attempts[-1])
            if view.state is not None and view.state.state is ShardState.COMMITTED:
                found.add((path.name, shard_id))
    return found


# ---------------------------------------------------------------- the command


@click.group(name="store")
def store() -> None:
    """Look after the data dir's store."""


@store.command(name="check")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None, envvar=DATA_DIR_ENV,
              help=f"data dir (default: ${DATA_DIR_ENV} or ./data)")
@click.option("--repair", "--quarantine", "act", is_flag=True,
              help="move unreadable files aside (DATA_DIR/quarantine/<time>/), rebuild damaged manifests and "
                   "job records, and mark the shards whose rows were lost for re-run")
@click.option("--quick", is_flag=True, help="read only each file's footer, not every row group")
def check(data_dir: str | None, act: bool, quick: bool) -> None:
    """List what is damaged in the data dir: part files that cannot be read (re-derivable or lost),
    committed shards whose rows are gone, unreadable manifests. Exits 1 when something is wrong and
    --repair was not given; after --repair, `batchgen retry JOB` or the same `batchgen run` re-runs
    the shards marked for re-run."""
    root = Layout.of(data_dir or os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR).root
    try:
        report = check_data_dir(root, deep=not quick)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{report.store.files_checked} part files checked, {len(report.store.bad)} unreadable")
    lines = [item.describe(root) for item in report.store.bad]
    lines += [item.describe() for item in report.lost] + [item.describe() for item in report.jobs]
    lines += [f"not checked: {item}" for item in report.unchecked]
    for line in lines:
        click.echo("  " + line)
    if act and not report.healthy:
        for line in repair(root, report):
            click.echo(line)
    elif not report.healthy:
        click.echo("`batchgen store check --repair` moves the unreadable files aside and marks the shards "
                   "whose rows were lost for re-run")
        raise SystemExit(1)


__all__ = ["DataDirReport", "JobProblem", "LostShard", "check_data_dir", "repair", "store"]
