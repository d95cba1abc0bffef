"""User SQL in a process of its own, under limits that hold whatever the query builds.

`run_sandboxed(data_dir, sql, limits)` is how `batchgen sql` and the dashboard's `/api/sql` run SQL
a user typed. DuckDB's `memory_limit` covers only its buffer manager: `repeat('x', 2000000000)`,
`list_resize(...)` or a huge result converted to Python objects grow outside it, and
`con.interrupt()` is not checked inside one long function call. So each query runs in a child
Python process (`python -m jobs.store.sqlsandbox`) that:

- caps its own address space (RLIMIT_AS, `SqlLimits.address_space_bytes`) before it opens DuckDB,
  so a query that builds too much fails there (or the child dies) and the caller's memory never grows;
- checks and runs the query with `usersql.run_user_query` (one SELECT, no file access, DuckDB's
  memory limit) and interrupts it at the deadline;
- sends back at most `max_rows` rows and refuses a result over `max_result_bytes` (pickled size).

The parent kills the child `KILL_GRACE_S` after the deadline if it has not answered (a time limit
met within about a second, whatever the query does), reads at most `max_result_bytes` (plus a little)
of its answer, and holds one of `max_concurrent` slots per data dir while it waits (flock'ed files
under `store/locks/`, so `batchgen sql` processes and every dashboard thread share the cap). A query
beyond the cap is refused at once with `QueryBusy` (the dashboard answers 429).
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from jobs.store.layout import StoreError, init_data_dir
from jobs.store.usersql import DEFAULT_MAX_ROWS, DEFAULT_TIMEOUT_S, QueryResult, QueryTimeout, UserSqlError

DEFAULT_MAX_RESULT_BYTES = 64 << 20  # a result bigger than this is refused (64 MiB)
DEFAULT_ADDRESS_SPACE_BYTES = 3 << 30  # the query process's whole address space (3 GiB; DuckDB's
# threads and Python take ~1.6 GiB of it before the query starts)
DEFAULT_MEMORY_LIMIT = "1GB"  # DuckDB's own limit inside that process (spills or fails cleanly first)
DEFAULT_MAX_CONCURRENT = 4  # user queries running at once over one data dir
KILL_GRACE_S = 1.0  # the child is killed this long after the deadline when it has not answered
CHILD_THREADS = 4  # DuckDB threads of the query process (each costs address space)
_FETCH_ROWS = 64  # rows fetched (and sized) at a time, so a result is refused before it is all held
_REPLY_OVERHEAD = 1 << 20  # bytes of an answer beyond its rows


class QueryBusy(UserSqlError):
    """Refused because `max_concurrent` user queries are already running over the data dir."""


class ResultTooLarge(UserSqlError):
    """The result is over `max_result_bytes`."""


class QueryOutOfMemory(UserSqlError):
    """The query needed more memory than its process may have."""


@dataclass
class SqlLimits:
    """What one user query may use."""

    timeout_s: float = DEFAULT_TIMEOUT_S  # wall clock from the call, process start included
    max_rows: int = DEFAULT_MAX_ROWS  # rows returned at most (the rest are cut: `truncated`)
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES  # a bigger result is an error, not cut
    memory_limit: str = DEFAULT_MEMORY_LIMIT  # DuckDB's memory_limit
    address_space_bytes: int = DEFAULT_ADDRESS_SPACE_BYTES  # RLIMIT_AS of the query's process
    max_concurrent: int = DEFAULT_MAX_CONCURRENT  # slots per data dir

    def __post_init__(self) -> None:
        for name in ("timeout_s", "max_rows", "max_result_bytes", "address_space_bytes", "max_concurrent"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SqlLimits.{name} must be > 0, got {getattr(self, name)!r}")


def run_sandboxed(data_dir: str | os.PathLike, sql: str, limits: SqlLimits | None = None) -> QueryResult:
    """Run SQL a user typed over `data_dir`'s views in a limited child process (see the module doc).

    Raises UserSqlError (QueryBusy, QueryTimeout, ResultTooLarge, QueryOutOfMemory, or a refusal /
    DuckDB error) with a message for the user, or StoreError when the data dir cannot be read."""
    limits = limits or SqlLimits()
    layout = init_data_dir(data_dir, create=False)
    with _slot(layout.locks, limits.max_concurrent, layout.root):
        return _run_child(layout.root, sql, limits)


# ---------------------------------------------------------------- the parent side


@contextmanager
def _slot(locks: Path, max_concurrent: int, root: Path) -> Iterator[None]:
    """Hold one of `max_concurrent` flock'ed slot files; QueryBusy when all are held. A data dir we
    may not write to (a read-only mount) has no slots: its queries run without the cap."""
    for i in range(max_concurrent):
        try:
            fd = os.open(locks / f"sql-slot-{i}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield
        finally:
            os.close(fd)  # releases the lock
        return
    raise QueryBusy(f"{max_concurrent} queries are already running over {root} (the cap on concurrent "
                    "queries); try again when one has finished")


# Arrow's pool in the child: under the child's address-space cap an oversize query fails in under a
# second with mimalloc, in ~10 s with the system allocator (its failing mmaps are retried), which
# `batchgen`'s command line makes the default for its own process (jobs.cli.set_arrow_allocator)
CHILD_ARROW_POOL = "mimalloc"


def child_env() -> dict[str, str]:
    """The environment of a query's child process: the parent's, with glibc's arenas and Arrow's pool
    chosen for a process under a memory cap, and this package importable."""
    return dict(os.environ, MALLOC_ARENA_MAX="2", ARROW_DEFAULT_MEMORY_POOL=CHILD_ARROW_POOL,
                PYTHONPATH=_import_root() + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run_child(root: Path, sql: str, limits: SqlLimits) -> QueryResult:
    deadline = time.time() + limits.timeout_s
    request = {"data_dir": str(root), "sql": sql, "deadline": deadline, **asdict(limits)}
    env = child_env()
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "jobs.store.sqlsandbox"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=stderr, env=env, start_new_session=True)
        try:
            reply, ended = _exchange(proc, json.dumps(request).encode(), deadline + KILL_GRACE_S,
                                     limits.max_result_bytes + _REPLY_OVERHEAD)
        finally:
            _reap(proc)
        stderr.seek(0)
        return _answer(reply, ended, proc.returncode, stderr.read()[-2000:], limits)


def _import_root() -> str:
    """The directory holding this `jobs` package, so the child imports the same code."""
    return str(Path(__file__).resolve().parents[2])


def _exchange(proc: subprocess.Popen, request: bytes, kill_at: float, cap: int) -> tuple[bytes, str]:
    """Send the request, read at most `cap` bytes of the reply; kill the child at `kill_at`. The reply,
    and how it ended: 'exited', 'overflow' (killed past `cap`) or 'timeout' (killed at `kill_at`)."""
    chunks: list[bytes] = []
    state = {"size": 0, "ended": "exited"}

    def read() -> None:
        while chunk := proc.stdout.read1(1 << 16):
            state["size"] += len(chunk)
            if state["size"] > cap:
                state["ended"] = "overflow"
                proc.kill()
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.stdin.write(request)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    try:
        proc.wait(timeout=max(kill_at - time.time(), 0.0))
    except subprocess.TimeoutExpired:
        state["ended"] = "timeout"
        proc.kill()
    reader.join(5.0)
    return b"".join(chunks), state["ended"]


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    proc.stdout.close()


def _answer(reply: bytes, ended: str, returncode: int, stderr: bytes, limits: SqlLimits) -> QueryResult:
    if ended == "overflow":
        raise ResultTooLarge(_too_large(limits.max_result_bytes))
    if ended == "timeout":
        raise QueryTimeout(f"query ran past its {limits.timeout_s:g} s limit and was stopped")
    if not reply:
        raise QueryOutOfMemory(
            f"the query's process died ({_exit_text(returncode)}) without an answer, most likely out of "
            f"its memory ({_gib(limits.address_space_bytes)}): ask for less (LIMIT, fewer or smaller "
            f"values){_last_line(stderr)}")
    answer = pickle.loads(reply)
    if "error" in answer:
        raise {"timeout": QueryTimeout, "memory": QueryOutOfMemory, "too_large": ResultTooLarge,
               }.get(answer["kind"], UserSqlError)(answer["error"])
    return QueryResult(**answer["result"])


def _too_large(max_bytes: int) -> str:
    return (f"the result is over the {max_bytes / (1 << 20):g} MiB cap on results: select fewer rows "
            "(LIMIT) or smaller values")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):g} GiB"


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def _last_line(stderr: bytes) -> str:
    lines = stderr.decode(errors="replace").strip().splitlines()
    return f"; it said: {lines[-1][:300]}" if lines else ""


# ---------------------------------------------------------------- the child side


def _child_main() -> None:
    reply_to = os.fdopen(os.dup(1), "wb")  # the answer's own channel: fd 1 is stderr from here on
    os.dup2(2, 1)  # (DuckDB's progress bar and any stray print must not mix into the answer)
    request = json.loads(sys.stdin.buffer.read())
    limit = int(request["address_space_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        reply = {"result": asdict(_child_query(request))}
    except MemoryError:
        reply = {"kind": "memory", "error": _out_of_memory(request, "")}
    except (UserSqlError, StoreError) as exc:
        kind = _kind(exc)
        reply = {"kind": kind, "error": _out_of_memory(request, str(exc)) if kind == "memory" else str(exc)}
    with reply_to:
        reply_to.write(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


def _kind(exc: Exception) -> str:
    if isinstance(exc, QueryTimeout):
        return "timeout"
    if isinstance(exc, ResultTooLarge):
        return "too_large"
    if "out of memory" in str(exc).lower():
        return "memory"
    return "error"


def _out_of_memory(request: dict, detail: str) -> str:
    """One line: the query ran out of its memory, the caps, and DuckDB's first line if any."""
    first = detail.strip().splitlines()[0] if detail.strip() else "MemoryError"
    return (f"the query ran out of memory (its process may use {_gib(request['address_space_bytes'])}, "
            f"DuckDB {request['memory_limit']}): ask for less (LIMIT, fewer or smaller values) [{first}]")


def _child_query(request: dict) -> QueryResult:
    """Open the hardened connection, run the query with the deadline left, fetch within the caps."""
    import duckdb

    from jobs.store.catalog import connect
    from jobs.store.usersql import check_user_sql

    con = connect(request["data_dir"], read_only_user_sql=True, memory_limit=request["memory_limit"],
                  threads=CHILD_THREADS)
    start = time.perf_counter()
    timeout_s = max(request["deadline"] - time.time(), 0.01)
    timer = threading.Timer(timeout_s, con.interrupt)
    timer.daemon = True
    try:
        statement = check_user_sql(con, request["sql"])
        timer.start()
        con.execute(statement)
        columns = [d[0] for d in con.description or []]
        rows, truncated = _fetch_capped(con, request["max_rows"], request["max_result_bytes"])
    except duckdb.InterruptException as exc:
        limit = request["timeout_s"]
        raise QueryTimeout(f"query ran past its {limit:g} s limit and was interrupted") from exc
    except duckdb.Error as exc:
        raise UserSqlError(str(exc)) from exc
    finally:
        timer.cancel()
    return QueryResult(columns, rows, truncated, time.perf_counter() - start)


def _fetch_capped(con, max_rows: int, max_bytes: int) -> tuple[list[tuple], bool]:
    rows: list[tuple] = []
    size = 0
    while len(rows) <= max_rows:
        chunk = con.fetchmany(min(_FETCH_ROWS, max_rows + 1 - len(rows)))
        if not chunk:
            break
        size += len(pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL))
        if size > max_bytes:
            raise ResultTooLarge(_too_large(max_bytes))
        rows.extend(chunk)
    return rows[:max_rows], len(rows) > max_rows


if __name__ == "__main__":
    _child_main()
