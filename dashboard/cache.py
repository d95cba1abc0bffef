"""Results of the dashboard's own queries, kept while the store's files are unchanged.

Fifty browsers on a live job page ask the same few queries every few seconds; each one scans the
job's parts. `QueryCache` keeps each (query, parameters) result with the store fingerprint it was
computed under, and serves it while the fingerprint is the same. The fingerprint is the listing of
`store/tables/` (every file's path, size and mtime): parts are immutable and renamed into place, so
any new part, compacted file or deletion changes it. A request takes the fingerprint once, before
its first query, and is served a result computed under the same fingerprint, or one whose query
started after the request began listing: never one older than the files it saw.

Requests that miss on the same key while another request computes it are served the previous
result of that key at once, when it is at most `max_stale_s` older than their listing (a live page
polls every few seconds; a query over a busy job's parts can take longer than the job takes to write
its next part, so without this every request would wait for a whole computation). Otherwise they wait
for the one computing it (one query per key at a time, not fifty) and take its result when that query
started after they listed. A lone client always gets a result as new as what it listed.
Queries whose answer depends on the clock (`cache=False`, e.g. a worker's recent tokens/s) are not
kept; clock-derived fields (elapsed, ETA) are computed after the query, per request.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jobs.store import QueryResult

DEFAULT_ENTRIES = 256
DEFAULT_MAX_STALE_S = 30.0


def store_fingerprint(tables_dir: str | os.PathLike) -> str:
    """A digest of every file under `tables_dir`: relative path, size and mtime (ns)."""
    digest = hashlib.blake2b(digest_size=16)
    stack = [os.fspath(tables_dir)]
    while stack:
        path = stack.pop()
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except FileNotFoundError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed while listed: the next listing differs anyway
                continue
            digest.update(f"{entry.path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class Listing:
    """What one request saw of the store."""

    fingerprint: str  # store_fingerprint of store/tables
    started: float  # time.monotonic() before the listing began


def list_store(tables_dir: str | os.PathLike) -> Listing:
    started = time.monotonic()
    return Listing(store_fingerprint(tables_dir), started)


@dataclass(frozen=True)
class _Entry:
    fingerprint: str  # of the listing of the request that computed it
    started: float  # time.monotonic() when its query started (after that listing)
    result: QueryResult


class QueryCache:
    """LRU of (sql, params) -> the latest result; one computation per key at a time."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES, max_stale_s: float = DEFAULT_MAX_STALE_S) -> None:
        self.max_entries = max_entries
        self.max_stale_s = max_stale_s  # how much older than a request's listing a result it is served may
        # be while a newer one is being computed
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._computing: dict[tuple, threading.Lock] = {}  # key -> held while one request computes it
        self._lock = threading.Lock()  # guards both dicts
        self.hits = 0
        self.misses = 0
        self.stale = 0  # served the previous result while a newer one was being computed

    def get(self, sql: str, params: Any, listing: Listing, compute: Callable[[], QueryResult]) -> QueryResult:
        key = (sql, _frozen(params))
        with self._lock:
            found = self._lookup(key, listing)
            if found is not None:
                return found
            key_lock = self._computing.setdefault(key, threading.Lock())
            previous = self._entries.get(key)
            recent = previous is not None and previous.started >= listing.started - self.max_stale_s
            if key_lock.locked() and recent:
                self.stale += 1
                return previous.result
        with key_lock:
            with self._lock:
                found = self._lookup(key, listing)  # computed while we waited
                if found is not None:
                    return found
                self.misses += 1
            started = time.monotonic()
            result = compute()
            with self._lock:
                self._store(key, _Entry(listing.fingerprint, started, result))
        return result

    def _lookup(self, key: tuple, listing: Listing) -> QueryResult | None:
        entry = self._entries.get(key)
        if entry is None or (entry.fingerprint != listing.fingerprint and entry.started < listing.started):
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry.result

    def _store(self, key: tuple, entry: _Entry) -> None:
        old = self._entries.get(key)
        if old is not None and old.started > entry.started:
            return  # a newer result landed while this one was computed
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            old, _ = self._entries.popitem(last=False)
            self._computing.pop(old, None)


def _frozen(params: Any) -> Any:
    """Parameters as a hashable value (dicts and lists become tuples)."""
    if isinstance(params, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in params.items()))
    if isinstance(params, list | tuple):
        return tuple(_frozen(v) for v in params)
    return params
