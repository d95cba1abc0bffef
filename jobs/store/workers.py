"""Worker records: who serves this data dir, alive or gone since when.

Each `batchgen worker` keeps one small JSON file, DATA_DIR/store/workers/<worker>.json, rewritten
atomically on every heartbeat (every lease TTL x 0.2, 6 s by default) and once more with
`stopped_ts` on a clean shutdown. A reader tells the states apart with no help from the worker:

- alive: heartbeat within `ttl_s` (the worker's lease TTL, recorded in the file);
- stopped: `stopped_ts` set (a warm shutdown finished);
- lost: heartbeat older than `ttl_s` and never stopped (killed, out of memory, machine gone): its
  shards are re-queued by the same TTL (jobs.shards.leases), so the two agree on when a worker is gone.

Iteration telemetry cannot say this: an idle worker writes no iterations, and neither does a dead one.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from jobs.store.layout import Layout, new_uid, path_safe

log = logging.getLogger(__name__)


@dataclass
class WorkerRecord:
    """What a worker says about itself on each heartbeat."""

    worker_id: str  # the Celery worker name
    host: str  # hostname it runs on
    pid: int  # its process id there
    started_ts: float  # epoch seconds it started serving
    heartbeat_ts: float  # epoch seconds of its latest heartbeat
    ttl_s: float  # gone once the heartbeat is older than this (its lease TTL)
    stopped_ts: float = 0.0  # set on a clean shutdown
    model: str = ""  # the model its engine serves
    queue: str = ""  # the queue it consumes
    broker: str = ""  # the broker URL without password
    concurrency: int = 0  # shards it holds in its engine at once, at most
    shards_held: int = 0  # shard attempts it held at the heartbeat
    iterations: int = 0  # engine steps it had run at the heartbeat
    metrics_url: str = ""  # its Prometheus /metrics, when served
    engine_config: dict = field(default_factory=dict)  # the EngineConfig it serves, resolved (every field)
    engine_error: str = ""  # why its engine failed (out of memory, a device error); it then stopped
    device: str = ""  # where its engine runs: cpu or cuda:N (jobs.placement)

    def state(self, now: float) -> str:
        """alive | stopped | lost (see the module docstring)."""
        if self.stopped_ts:
            return "stopped"
        return "alive" if now - self.heartbeat_ts <= self.ttl_s else "lost"

    def gone_since(self, now: float) -> float | None:
        """When it stopped, or its last heartbeat when lost; None while alive."""
        state = self.state(now)
        if state == "stopped":
            return self.stopped_ts
        return self.heartbeat_ts if state == "lost" else None


def workers_dir(data_dir: str | os.PathLike) -> Path:
    return Layout.of(data_dir).store / "workers"


def write_worker_record(data_dir: str | os.PathLike, record: WorkerRecord) -> None:
    """Write (replace) a worker's record atomically: readers see the old one or the new one."""
    directory = workers_dir(data_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{path_safe(record.worker_id)}.json"
    tmp = directory / f".{path.name}.{new_uid()}.tmp"
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, path)


def read_worker_records(data_dir: str | os.PathLike) -> list[WorkerRecord]:
    """Every worker record of the data dir; a file that cannot be read is skipped with a warning."""
    directory = workers_dir(data_dir)
    if not directory.is_dir():
        return []
    records = []
    names = {f.name for f in fields(WorkerRecord)}
    for path in sorted(directory.glob("*.json")):
        try:
            raw = json.loads(path.read_text())
            records.append(WorkerRecord(**{k: v for k, v in raw.items() if k in names}))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, TypeError) as exc:
            log.warning("worker record %s is unreadable (%s); skipped", path, exc)
    return records


def live_consumers(records: list[WorkerRecord], queue: str, broker: str, now: float) -> list[WorkerRecord]:
    """The alive workers that consume `queue` on `broker` (its URL without password, or "embedded")."""
    return [r for r in records if r.state(now) == "alive" and r.queue == queue and r.broker == broker]


def no_worker_warning(queued_shards: int, queue: str, broker: str, records: list[WorkerRecord],
                      now: float) -> str | None:
    """The warning `batchgen status` and the dashboard show for a job whose shards wait while no
    live worker consumes its queue; None when there is nothing to warn about."""
    if queued_shards <= 0 or not queue or live_consumers(records, queue, broker, now):
        return None
    return (f"{queued_shards} shard(s) queued but no live worker consumes queue {queue!r} on {broker}: "
            f"start one (batchgen worker --queue {queue}) or resume the run")
