"""Shard attempts as files: who runs a shard now, is it alive, and which attempt number is next.

A broker redelivers a message when it believes the consumer is gone (RabbitMQ at once, Redis after
its visibility timeout, the embedded broker after its own); a queue never tells us when a worker
died holding a shard. So the jobs layer tracks attempts itself, in DATA_DIR/jobs/<job>/leases/:

    shard-000003.a002.claim      created with O_EXCL: whoever creates it owns attempt 2
    shard-000003.a002.json       its state (running/committed/failed/...), heartbeat, progress
    shard-000003.a002.requeued   created with O_EXCL by the one checker that re-queued a dead attempt
    shard-000003.republished-<ms> created with O_EXCL by the one checker that re-published a shard
                                 waiting since <ms> whose message the broker no longer holds
    changes/<host>-<pid>.log     "<shard> <attempt> <state>" appended by the writing process before it
                                 creates a claim or writes an end state, and "<shard> <attempt> done"
                                 once that is done (heartbeats write none): which shards a progress
                                 poll must read, and which of them a writer may still be changing
    changes/summary.json         what progress polls learned: the shards found committed or failed,
                                 their sums, the shards still to watch, how far each log was read
                                 (jobs.shards.supervise.job_progress)

Rules:
- The next attempt of a shard is 1 + the highest claimed number; only the process whose O_EXCL
  create succeeds runs it, so two deliveries of one shard never run at once.
- A running attempt is alive while its heartbeat is fresh (`ttl_s`) and, on the claimant's own
  host, its process exists. A second delivery that finds a live attempt is dropped: that attempt
  finishes the shard, or dies and is re-queued by `requeue_dead_shards` (jobs.shards.supervise).
- A claimant checks before committing that no newer claim exists (it was presumed dead): if one
  does, it steps aside. The store's "first commit wins" covers the remaining race.
- Every claim and every end state is noted in the process's change log before the file that makes it
  exists, and noted done after: a reader that read the logs and then the lease files missed no change
  it did not see noted, and knows which shards' files a writer may be changing still (one that died
  between the two lines leaves its shard read on every poll, never counted from memory).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from jobs.shards.state import ShardState
from jobs.store import new_uid

LEASE_TTL_ENV = "BATCHGEN_LEASE_TTL_S"
DEFAULT_LEASE_TTL_S = 30.0  # a heartbeat older than this means the attempt's worker is gone
HEARTBEAT_FRACTION = 0.2  # heartbeats are written every ttl * this
# the states an attempt ends in (jobs.shards.state): handed_back, the worker was interrupted and gave
# the shard back (not a failure; no retry used); requeued, the attempt had failed for good (or its
# rows were lost), and the shard was queued again
ENDED = tuple(s for s in ShardState if s.ended)

_CLAIM_RE = re.compile(r"^shard-(\d{6})\.a(\d{3,})\.claim$")
_REPUBLISHED_RE = re.compile(r"^shard-(\d{6})\.republished-")
CHANGES_DIR = "changes"  # the change logs and the progress summary, inside a job's lease directory
DONE = "done"  # a change log's word for "the change noted before is written"
_LOG_NAME = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())  # + "-<pid>.log"


def lease_ttl_s() -> float:
    """The lease time-to-live in force ($BATCHGEN_LEASE_TTL_S, else 30 s)."""
    return env_seconds(LEASE_TTL_ENV, DEFAULT_LEASE_TTL_S)


def env_seconds(name: str, default: float) -> float:
    """A duration from the environment (> 0), else `default`; a bad value names the variable."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {raw!r}")
    return value


def _create_once(path: Path) -> bool:
    """Create `path` with O_EXCL: True for exactly one caller."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.close(fd)
    return True


@dataclass
class LeaseState:
    """The state file of one attempt, rewritten on every heartbeat."""

    worker_id: str  # the Celery worker name of the claimant
    host: str  # hostname of the claimant (pid liveness is checked only there)
    pid: int  # process id of the claimant
    attempt: int  # 1, 2, ...
    state: ShardState  # running, or one of ENDED
    started_ts: float  # epoch seconds of the claim
    heartbeat_ts: float  # epoch seconds of the latest heartbeat
    rows_done: int = 0  # rows of the shard finished so far (progress)
    output_tokens: int = 0  # tokens generated so far by finished rows (progress)
    note: str = ""  # why it ended (error text, "job cancelled", ...)
    retry_at: float = 0.0  # state "retrying": when the retry message becomes due (epoch seconds)

    def __post_init__(self) -> None:
        self.state = ShardState(self.state)  # a lease file holds the string
        if not self.state.in_lease:
            raise ValueError(f"{self.state!r} is not a lease state")

    def alive(self, now: float, ttl_s: float) -> bool:
        """Running, with a fresh heartbeat and (on this host) a live process."""
        if self.state is not ShardState.RUNNING:
            return False
        if now - self.heartbeat_ts > ttl_s:
            return False
        return not (self.host == socket.gethostname() and not pid_running(self.pid))


def pid_running(pid: int) -> bool:
    """Process `pid` exists and has not exited. An exited worker whose parent is gone stays a zombie
    until init reaps it (seconds, or never under an init that does not reap), and kill(pid, 0)
    succeeds on a zombie, so on Linux /proc says whether it is one."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return not Path("/proc/self/stat").exists()  # no /proc here: trust kill(); else it just went
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]  # the state follows "(comm)"


@dataclass
class AttemptView:
    """What a reader sees of one attempt: its claim, and its state when one was written yet."""

    shard_id: int
    attempt: int
    claimed_ts: float  # mtime of the claim file
    state: LeaseState | None  # None between the claim and the first state write
    requeued: bool  # a checker already re-queued this attempt

    def alive(self, now: float, ttl_s: float) -> bool:
        if self.state is None:
            return now - self.claimed_ts <= ttl_s
        return self.state.alive(now, ttl_s)

    def dead(self, now: float, ttl_s: float) -> bool:
        """Its worker is gone without ending it (or its retry is overdue): the shard needs re-queueing."""
        if self.state is None:
            return now - self.claimed_ts > ttl_s
        if self.state.state is ShardState.RETRYING:
            return now > self.state.retry_at + ttl_s
        return self.state.state is ShardState.RUNNING and not self.state.alive(now, ttl_s)


class ShardLeases:
    """The lease files of one job."""

    def __init__(self, directory: Path, ttl_s: float | None = None) -> None:
        self.directory = directory
        self.ttl_s = lease_ttl_s() if ttl_s is None else ttl_s

    # -- names
    def claim_file(self, shard_id: int, attempt: int) -> Path:
        return self.directory / f"shard-{shard_id:06d}.a{attempt:03d}.claim"

    def _state(self, shard_id: int, attempt: int) -> Path:
        return self.directory / f"shard-{shard_id:06d}.a{attempt:03d}.json"

    def _requeued(self, shard_id: int, attempt: int) -> Path:
        return self.directory / f"shard-{shard_id:06d}.a{attempt:03d}.requeued"

    # -- reading
    def claimed_attempts(self) -> dict[int, list[int]]:
        """shard id -> its claimed attempt numbers, ascending."""
        found: dict[int, list[int]] = {}
        if not self.directory.is_dir():
            return found
        for entry in os.scandir(self.directory):
            m = _CLAIM_RE.match(entry.name)
            if m:
                found.setdefault(int(m.group(1)), []).append(int(m.group(2)))
        return {s: sorted(a) for s, a in found.items()}

    def latest(self, shard_id: int, attempts: list[int] | None = None) -> AttemptView | None:
        """The newest attempt of a shard, or None when it was never claimed."""
        if attempts is None:
            attempts = self.claimed_attempts().get(shard_id, [])
        if not attempts:
            return None
        return self.view(shard_id, attempts[-1])

    def view(self, shard_id: int, attempt: int) -> AttemptView:
        try:
            claimed = self.claim_file(shard_id, attempt).stat().st_mtime
        except FileNotFoundError:
            claimed = 0.0
        return AttemptView(shard_id, attempt, claimed, self._read_state(shard_id, attempt),
                           self._requeued(shard_id, attempt).exists())

    def _read_state(self, shard_id: int, attempt: int) -> LeaseState | None:
        try:
            return LeaseState(**json.loads(self._state(shard_id, attempt).read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            return None  # written atomically, so only a foreign file can be unparsable

    # -- claiming
    def try_claim(self, shard_id: int, worker_id: str) -> Lease | None:
        """Claim the next attempt of a shard, or None when a live attempt holds it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        attempts = self.claimed_attempts().get(shard_id, [])
        latest = self.latest(shard_id, attempts)
        if latest is not None and latest.alive(now, self.ttl_s):
            return None
        attempt = attempts[-1] + 1 if attempts else 1
        with self.noting(shard_id, attempt, ShardState.RUNNING):
            if not _create_once(self.claim_file(shard_id, attempt)):
                return None  # another delivery claimed it a moment ago
            lease = Lease(self, shard_id, LeaseState(worker_id, socket.gethostname(), os.getpid(), attempt,
                                                     ShardState.RUNNING, now, now))
            try:
                lease.write()
            except OSError:  # a full disk: give the attempt number back, or it would look alive for a TTL
                self.claim_file(shard_id, attempt).unlink(missing_ok=True)
                raise
        return lease

    # -- the change log (read by jobs.shards.supervise.job_progress)
    @property
    def changes(self) -> Path:
        return self.directory / CHANGES_DIR

    @contextlib.contextmanager
    def noting(self, shard_id: int, attempt: int, state: ShardState) -> Iterator[None]:
        """Around a claim (`state` running) or an end written to an attempt's files: noted before,
        noted done after (also when it raised: whatever it wrote is written)."""
        self.note(shard_id, attempt, state)
        try:
            yield
        finally:
            self.note(shard_id, attempt, None)

    def note(self, shard_id: int, attempt: int, state: ShardState | None) -> None:
        """Append "<shard> <attempt> <state>" (or "... done" for None) to this process's change log, in
        one write (a process appends only to its own log, so no two writers share a file)."""
        path = self.changes / f"{_LOG_NAME}-{os.getpid()}.log"
        word = ShardState(state).value if state is not None else DONE
        line = f"{shard_id} {attempt} {word}\n".encode()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def mark_requeued(self, shard_id: int, attempt: int) -> bool:
        """True for exactly one caller per dead attempt: that caller re-queues the shard."""
        return _create_once(self._requeued(shard_id, attempt))


    # -- re-publishing a waiting shard whose message was lost (jobs.shards.supervise)
    def _republished(self, shard_id: int, since: float) -> Path:
        return self.directory / f"shard-{shard_id:06d}.republished-{int(since * 1000)}"

    def last_republished(self, shard_id: int) -> float:
        """When the shard's message was last re-published (0.0 never)."""
        if not self.directory.is_dir():
            return 0.0
        marks = self.directory.glob(f"shard-{shard_id:06d}.republished-*")
        return max((p.stat().st_mtime for p in marks), default=0.0)

    def republished(self) -> dict[int, float]:
        """shard id -> when its message was last re-published, for every shard re-published: one listing
        of the directory for the whole job (`last_republished` lists it for one shard)."""
        found: dict[int, float] = {}
        if not self.directory.is_dir():
            return found
        for entry in os.scandir(self.directory):
            m = _REPUBLISHED_RE.match(entry.name)
            if m:
                try:
                    mtime = entry.stat().st_mtime
                except FileNotFoundError:
                    continue
                shard_id = int(m.group(1))
                found[shard_id] = max(found.get(shard_id, 0.0), mtime)
        return found

    def mark_republished(self, shard_id: int, since: float) -> bool:
        """True for exactly one caller per (shard, waiting since): that caller re-publishes it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return _create_once(self._republished(shard_id, since))


class Lease:
    """The claim on one attempt of one shard, held by this process."""

    def __init__(self, leases: ShardLeases, shard_id: int, state: LeaseState) -> None:
        self.leases = leases
        self.shard_id = shard_id
        self.state = state
        self._lock = threading.Lock()  # heartbeats (housekeeping thread) vs end (task thread)

    @property
    def attempt(self) -> int:
        return self.state.attempt

    def write(self) -> None:
        path = self.leases._state(self.shard_id, self.attempt)
        tmp = path.with_name(f".{path.name}.{new_uid()}.tmp")
        tmp.write_text(json.dumps(asdict(self.state)))
        os.replace(tmp, path)

    def heartbeat(self, rows_done: int | None = None, output_tokens: int | None = None) -> None:
        with self._lock:
            if self.state.state is not ShardState.RUNNING:
                return  # ended: a late heartbeat must not overwrite the final state
            self._touch(rows_done, output_tokens)

    def superseded(self) -> bool:
        """A newer attempt was claimed: this one was presumed dead and must not commit."""
        attempts = self.leases.claimed_attempts().get(self.shard_id, [])
        return bool(attempts) and attempts[-1] > self.attempt

    def end(self, state: ShardState, note: str = "", retry_at: float = 0.0, rows_done: int | None = None,
            output_tokens: int | None = None) -> None:
        if state not in ENDED:
            raise ValueError(f"lease end state must be one of {[str(s) for s in ENDED]}, got {state!r}")
        state = ShardState(state)
        with self._lock:
            with self.leases.noting(self.shard_id, self.attempt, state):
                self.state.state, self.state.note, self.state.retry_at = state, note, retry_at
                self._touch(rows_done, output_tokens)

    def _touch(self, rows_done: int | None, output_tokens: int | None) -> None:
        """Stamp the heartbeat, record progress where given, write the state (lock held)."""
        self.state.heartbeat_ts = time.time()
        if rows_done is not None:
            self.state.rows_done = rows_done
        if output_tokens is not None:
            self.state.output_tokens = output_tokens
        self.write()
