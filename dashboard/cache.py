"""Results of the dashboard's own queries, kept while the store's files are unchanged.

Fifty browsers on a live job page ask the same few queries every few seconds; each one scans the
job's parts. `QueryCache` keeps each (query, parameters) result with the store fingerprint it was
computed under, and serves it while the fingerprint is the same. The fingerprint is the listing of
`store/tables/` (every file's path, size and mtime): parts are immutable and renamed into place, so
any new part, compacted file or deletion changes it. A request takes the fingerprint once, before
its first query, and is served a result computed under the same fingerprint, or one whose query
started after the request began listing: never one older than the files it saw.

Requests that miss on the same key wait for the one computing it (one query per key at a time, not
fifty), and take its result when that query started after they listed: while a job writes, the
fingerprint changes every few hundred ms, and a burst of requests must not compute one by one.
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

    def __init__(self, max_entries: int = DEFAULT_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._computing: dict[tuple, threading.Lock] = {}  # key -> held while one request computes it
        self._lock = threading.Lock()  # guards both dicts
        self.hits = 0
        self.misses = 0

    def get(self, sql: str, params: Any, listing: Listing, compute: Callable[[], QueryResult]) -> QueryResult:
        key = (sql, _frozen(params))
        with self._lock:
            found = self._lookup(key, listing)
            if found is not None:
                return found
            key_lock = self._computing.setdefault(key, threading.Lock())
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
