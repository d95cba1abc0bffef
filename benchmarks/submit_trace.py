"""`batchgen submit` phase by phase: where its memory goes (`bench submit-scale --trace-rss`).

    python benchmarks/submit_trace.py OUT.json [--tracemalloc] [--trim] -- submit PROMPTS ...

Run as a script (by path) in the source tree under test: it wraps the functions that begin each phase
of a submit, then runs the CLI with the arguments after `--`. The phases, in order:

    start           imports, flags, the model check, the staging directory
    shards          reading the input and writing the shard files (and the ids' spill file)
    id check        the duplicate id check (DuckDB over the spill file)
    manifest        moving the shards into place, writing manifest.json
    job record      the store's record of the job
    queued events   the shards' `queued` events
    messages        one broker message per shard
    end             what is left until the CLI returns

A thread samples /proc/self/status every `SAMPLE_S`; each phase reports its wall time, VmRSS at entry
and exit, the highest VmRSS and RssAnon sampled during it, glibc's heap (mallinfo2: bytes in use and
bytes free inside the heap), Arrow's pool and the count of live Python objects at its exit.
--tracemalloc adds the allocation sites that grew most during each phase (slow: use it at 1M rows);
--trim calls glibc's malloc_trim(0) at each phase's exit and reports how much RSS that gave back,
which is how much of the heap was freed but still held. Nothing here changes what submit does.
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
import threading
import time
import tracemalloc

SAMPLE_S = 0.1
SERIES_POINTS = 400  # the sampled RSS series kept in the output (evenly thinned)


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc, or a glibc before 2.33
        return None


LIBC = _libc()


def heap() -> dict[str, int]:
    """glibc's heap over all arenas: bytes in use (small blocks and mmapped ones) and free inside it."""
    if LIBC is None:
        return {}
    info = LIBC.mallinfo2()
    return {"heap_in_use": info.uordblks + info.hblkhd, "heap_free": info.fordblks, "heap_arena": info.arena}


def arrow_bytes() -> int:
    pa = sys.modules.get("pyarrow")
    return pa.total_allocated_bytes() if pa is not None else 0


class Trace:
    """Phases in order, each closed when the next begins; a sampler thread keeps each one's highest RSS."""

    def __init__(self, use_tracemalloc: bool, trim: bool) -> None:
        self.use_tracemalloc, self.trim = use_tracemalloc, trim
        self.t0 = time.perf_counter()
        self.phases: list[dict] = []
        self.series: list[tuple[float, str, int, int]] = []  # (s, phase, VmRSS, RssAnon)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.snapshot = None
        if use_tracemalloc:
            tracemalloc.start(8)
            self.snapshot = tracemalloc.take_snapshot()
        self._open("start")
        threading.Thread(target=self._sample, daemon=True).start()

    def _open(self, name: str) -> None:
        st = proc_status()
        self.phases.append({"phase": name, "t_start_s": time.perf_counter() - self.t0, "rss_in": st["VmRSS"],
                            "rss_max": st["VmRSS"], "anon_max": st["RssAnon"], "calls": 1})

    def _close(self) -> None:
        ph = self.phases[-1]
        st = proc_status()
        ph.update(wall_s=time.perf_counter() - self.t0 - ph["t_start_s"], rss_out=st["VmRSS"],
                  anon_out=st["RssAnon"], file_out=st["RssFile"], hwm_out=st["VmHWM"],
                  rss_max=max(ph["rss_max"], st["VmRSS"]), anon_max=max(ph["anon_max"], st["RssAnon"]),
                  arrow_out=arrow_bytes(), python_objects=len(gc.get_objects()), **heap())
        if self.use_tracemalloc:
            snap = tracemalloc.take_snapshot()
            diff = snap.compare_to(self.snapshot, "lineno")
            ph["tracemalloc_top"] = [f"{d.size_diff / 1e6:+.2f} MB {d.count_diff:+d} blocks "
                                     f"{d.traceback[0].filename}:{d.traceback[0].lineno}" for d in diff[:6]]
            ph["tracemalloc_mb"] = sum(s.size for s in snap.statistics("filename")) / 1e6
            self.snapshot = snap
        if self.trim and LIBC is not None:
            LIBC.malloc_trim(0)
            ph["trim_gave_back"] = ph["rss_out"] - proc_status()["VmRSS"]

    def enter(self, name: str) -> None:
        with self.lock:
            if self.phases[-1]["phase"] == name:
                self.phases[-1]["calls"] += 1
                return
            self._close()
            self._open(name)

    def finish(self) -> dict:
        self.done.set()
        with self.lock:
            self._close()
        step = max(1, len(self.series) // SERIES_POINTS)
        pa = sys.modules.get("pyarrow")
        return {"phases": self.phases, "series": self.series[::step], "glibc": LIBC is not None,
                "arrow_pool": pa.default_memory_pool().backend_name if pa is not None else None}

    def _sample(self) -> None:
        while not self.done.wait(SAMPLE_S):
            st = proc_status()
            with self.lock:
                ph = self.phases[-1]
                ph["rss_max"] = max(ph["rss_max"], st["VmRSS"])
                ph["anon_max"] = max(ph["anon_max"], st["RssAnon"])
                self.series.append((round(time.perf_counter() - self.t0, 2), ph["phase"], st["VmRSS"],
                                    st["RssAnon"]))


def _wrap(trace: Trace, owner, attr: str, phase: str, wrapped: list[str]) -> None:
    """Make `owner.attr` enter `phase` when called; a tree without it is reported, not an error."""
    fn = getattr(owner, attr, None)
    if fn is None:
        return

    def entering(*args, **kwargs):
        trace.enter(phase)
        return fn(*args, **kwargs)

    setattr(owner, attr, entering)
    wrapped.append(f"{getattr(owner, '__name__', owner)}.{attr}")


def install(trace: Trace) -> list[str]:
    import jobs.shards.broker_messages as messages
    import jobs.submit as submit
    from jobs.input_contract import RequestIds
    from jobs.shards.ledger import ShardLedger
    from jobs.store import Store

    wrapped: list[str] = []
    _wrap(trace, submit, "_read_file", "shards", wrapped)
    _wrap(trace, RequestIds, "check_unique", "id check", wrapped)
    _wrap(trace, submit, "_move_into_place", "manifest", wrapped)
    _wrap(trace, Store, "record_job", "job record", wrapped)
    _wrap(trace, ShardLedger, "queue_new", "queued events", wrapped)
    _wrap(trace, messages, "publish_shard", "messages", wrapped)
    return wrapped


def main() -> None:
    if sys.path and sys.path[0].endswith("benchmarks"):
        del sys.path[0]  # run by path: the tree under test comes from PYTHONPATH, not this folder
    argv = sys.argv[1:]
    split = argv.index("--")
    out, opts, cli_args = argv[0], argv[1:split], argv[split + 1:]
    import jobs.cli

    # what jobs.cli.main does before any command imports pyarrow, done before `install` imports it
    getattr(jobs.cli, "set_arrow_allocator", lambda: None)()
    trace = Trace(use_tracemalloc="--tracemalloc" in opts, trim="--trim" in opts)
    wrapped = install(trace)

    sys.argv = ["batchgen", *cli_args]
    code = 0
    try:
        jobs.cli.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        trace.enter("end")
        result = trace.finish()
        result["wrapped"] = wrapped
        with open(out, "w") as f:
            json.dump(result, f)
    sys.exit(code)


if __name__ == "__main__":
    main()
