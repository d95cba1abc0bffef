"""A listing that tells which kinds hold each part in one file only (`Listing.disjoint`), so that their
scans read the files as they are: when it says so, when it must not (each way a part can be in two
listed files), that the views then still count each row once, and the markers' garbage collection."""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from jobs.store import catalog, listing
from jobs.store.catalog import connect
from jobs.store.compact import collect_garbage, compact_group, compact_job
from jobs.store.listing import LISTING_VARIABLE, RENAMING_SUFFIX, SUSPECT_SUFFIX, list_files, marker_name, pin
from jobs.store.parts import Store
from jobs.store.schemas import KINDS, JobRecord

compact = importlib.import_module("jobs.store.compact")  # (the package's `compact` is the function)

SHARDS, ROWS = 3, 2  # rows per flush; two flushes per shard


@pytest.fixture(autouse=True)
def compacted_files_count_at_once(monkeypatch):
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)


def _fill(store: Store, job_id: str = "job-d", shards_total: int = SHARDS) -> None:
    """The job's SHARDS shards written and committed (of `shards_total`: more, and the job still runs)."""
    store.record_job(JobRecord(job_id, "tiny", shards_total * 2 * ROWS, shards_total, time.time()))
    for shard in range(SHARDS):
        att = store.begin_attempt(job_id, shard, 1, "w")
        for flush in range(2):
            att.add_outputs([{"request_id": f"{shard}-{flush}-{i}", "output_text": "o",
                              "finish_reason": "stop", "prompt_tokens": 1, "output_tokens": 1, "error": None}
                             for i in range(ROWS)])
            att.flush()
        att.commit()


def _counts(data_dir, variable: dict | None = None) -> tuple:
    """(output rows, commits, shard events, completed shards) over a listing pinned now, or over
    `variable` as the pinned listing."""
    con = connect(data_dir)
    try:
        if variable is None:
            pin(con)
        else:
            con.execute(f"SET VARIABLE {LISTING_VARIABLE} = $1", [variable])
        return (con.execute("SELECT count(*) FROM outputs").fetchone()[0],
                con.execute("SELECT count(*) FROM _bg.scan_commits").fetchone()[0],
                con.execute("SELECT count(*) FROM _bg.scan_shard_events").fetchone()[0],
                con.execute("SELECT shards_completed FROM jobs").fetchone()[0])
    finally:
        con.close()


def _output_uid(layout, tomb: Path) -> tuple[dict, str]:
    info = json.loads(tomb.read_text())
    return info, listing.compacted_uid(info["output"])


def test_raw_and_compacted_stores_are_disjoint_and_answer_alike(tmp_path):
    store = Store(tmp_path)
    _fill(store)
    before = _counts(tmp_path)
    assert before[0] == SHARDS * 2 * ROWS and before[3] == SHARDS
    assert all(list_files(store.layout).disjoint[kind] for kind in KINDS)
    assert compact_job(tmp_path, "job-d").groups > 0
    found = list_files(store.layout)
    assert found.left_out > 0 and all(found.disjoint[kind] for kind in KINDS)
    assert _counts(tmp_path) == before
    assert not list(store.layout.gc.glob(f"*{RENAMING_SUFFIX}"))  # each removed with its tombstone


def test_the_views_read_files_as_they_are_only_where_the_listing_says_so(tmp_path):
    """The flag is what the scans go by: over a listing of a compaction's inputs beside its output
    (its tombstone gone, its marker too: a state no compactor leaves), a kind called disjoint counts
    their rows twice, and one that is not, once."""
    store = Store(tmp_path)
    _fill(store)
    before = _counts(tmp_path)
    compact_job(tmp_path, "job-d")
    for tomb in store.layout.gc.glob("*.json"):
        tomb.unlink()
    found = list_files(store.layout)
    assert found.left_out == 0
    honest, lying = found.variable(), found.variable()
    honest["disjoint"] = {kind: False for kind in KINDS}
    lying["disjoint"] = {kind: True for kind in KINDS}
    assert _counts(tmp_path, honest) == before
    assert _counts(tmp_path, lying)[:3] == tuple(2 * n for n in before[:3])


def compaction_killed_before_its_tombstone(monkeypatch, layout, kind: str, group: str) -> None:
    """Compact `kind`'s `group` with a compactor killed between its output's rename and its tombstone
    (its `.renaming` marker stays)."""
    def die(*args, **kwargs):
        raise OSError("killed before the tombstone")

    with monkeypatch.context() as patched:
        patched.setattr(compact, "_write_tombstone", die)
        with pytest.raises(OSError, match="killed before the tombstone"):
            compact_group(layout, kind, group)


def test_an_output_renamed_in_before_its_tombstone_keeps_its_kind_chosen_part_by_part(tmp_path, monkeypatch):
    """A compactor that dies between its rename and its tombstone leaves its `.renaming` marker: the
    kinds whose groups it merged are not disjoint until a later compaction merges its output."""
    store = Store(tmp_path)
    _fill(store)
    before = _counts(tmp_path)
    compaction_killed_before_its_tombstone(monkeypatch, store.layout, "outputs", "job-d")
    [marker] = store.layout.gc.glob(f"*{RENAMING_SUFFIX}")
    assert marker.name.startswith("outputs~job-d~")
    found = list_files(store.layout)
    assert not found.disjoint["outputs"] and found.disjoint["commits"]
    assert any("/compacted/" in p for p in found.files["outputs"])
    assert _counts(tmp_path) == before
    compact_group(store.layout, "outputs", "job-d")  # merges the orphaned output with its inputs
    found = list_files(store.layout)
    assert found.disjoint["outputs"] and _counts(tmp_path) == before


def test_two_compactions_of_the_same_inputs_are_not_disjoint(tmp_path):
    """Two outputs of the same inputs (a lock broken while its holder ran): their tombstones share an
    input, so the listing keeps choosing part by part."""
    store = Store(tmp_path)
    _fill(store)
    before = _counts(tmp_path)
    layout = store.layout
    inputs = sorted((layout.kind_dir("outputs") / "raw" / "job-d").glob("*.parquet"))
    for _ in range(2):
        _, output = compact._merge(layout, "outputs", inputs, layout.compacted_dir("outputs", "job-d"))
        compact._write_tombstone(layout, "outputs", "job-d", inputs, output)
    found = list_files(store.layout)
    assert len([p for p in found.files["outputs"] if "/compacted/" in p]) == 2
    assert not found.disjoint["outputs"] and found.disjoint["commits"]
    assert _counts(tmp_path) == before


def test_a_lock_broken_while_its_holder_may_run_marks_the_group(tmp_path):
    store = Store(tmp_path)
    _fill(store)
    lock = store.layout.locks / "outputs~job-d.lock"
    lock.write_text("other-host 1234\n")  # a holder this host cannot see: broken only once stale
    old = time.time() - compact.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert compact_group(store.layout, "outputs", "job-d").groups == 1
    [suspect] = store.layout.gc.glob(f"*{SUSPECT_SUFFIX}")
    assert suspect.name.startswith("outputs~job-d~")
    found = list_files(store.layout)
    assert not found.disjoint["outputs"] and found.disjoint["commits"]
    _fill(store, "job-e")  # another job's groups are not marked
    assert not list_files(store.layout, job_id="job-d").disjoint["outputs"]
    assert list_files(store.layout, job_id="job-e").disjoint["outputs"]


def test_a_dead_holder_on_this_host_leaves_no_suspect_marker(tmp_path):
    store = Store(tmp_path)
    _fill(store)
    lock = store.layout.locks / "outputs~job-d.lock"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    lock.write_text(f"{socket.gethostname()} {gone} {time.time()}\n")
    assert compact_group(store.layout, "outputs", "job-d").groups == 1
    assert not list(store.layout.gc.glob(f"*{SUSPECT_SUFFIX}"))
    assert list_files(store.layout).disjoint["outputs"]


def test_a_tombstone_without_an_output_keeps_its_listed_inputs_chosen(tmp_path):
    """Tombstones written before they named their output leave their inputs listed (listing.py)."""
    store = Store(tmp_path)
    _fill(store)
    before = _counts(tmp_path)
    compact_job(tmp_path, "job-d")
    for tomb in store.layout.gc.glob("outputs~*.json"):
        info = json.loads(tomb.read_text())
        del info["output"]
        tomb.write_text(json.dumps(info))
    listing._TOMBSTONES.clear()
    found = list_files(store.layout)
    assert not found.disjoint["outputs"] and found.disjoint["commits"]
    assert _counts(tmp_path) == before


def test_stale_renaming_markers_go_once_their_output_is_gone(tmp_path, monkeypatch):
    store = Store(tmp_path)
    _fill(store)
    layout = store.layout
    compact_job(tmp_path, "job-d")
    [tomb] = layout.gc.glob("outputs~job-d~*.json")
    _, uid = _output_uid(layout, tomb)
    kept = layout.gc / marker_name("outputs", "job-d", uid, RENAMING_SUFFIX)  # its output is in place
    orphan = layout.gc / marker_name("outputs", "job-d", "0123456789ab", RENAMING_SUFFIX)  # never renamed
    young = layout.gc / marker_name("outputs", "job-d", "ba9876543210", RENAMING_SUFFIX)
    old = time.time() - compact.STALE_LOCK_S - 60
    for marker in (kept, orphan, young):
        marker.touch()
    for marker in (kept, orphan):
        os.utime(marker, (old, old))
    collect_garbage(tmp_path, grace_s=3600)
    assert kept.exists() and young.exists() and not orphan.exists()
    assert not list_files(layout).disjoint["outputs"]  # the marker's output is listed


def _unmark(path: Path) -> Path:
    """The name an older compactor (before the markers) would have given a compacted file."""
    c, uid = path.name[:-len(".parquet")].split("~", 1)
    assert uid.startswith(listing.MARKED_UID_PREFIX)
    return path.rename(path.with_name(f"{c}~{uid[len(listing.MARKED_UID_PREFIX):]}.parquet"))


def _older_compactor_died_before_its_tombstone(store: Store, monkeypatch) -> Path:
    """Job-d's outputs merged by a compactor from before the markers that died between its rename and its
    tombstone: its output (returned), unmarked, beside its inputs, and no marker."""
    monkeypatch.setattr(compact, "_write_tombstone", lambda *a, **k: None)  # died before it
    compact_group(store.layout, "outputs", "job-d")
    monkeypatch.undo()
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)
    for marker in store.layout.gc.glob(f"*{RENAMING_SUFFIX}"):
        marker.unlink()  # an older compactor wrote none
    [output] = (store.layout.kind_dir("outputs") / "compacted" / "job-d").glob("*.parquet")
    return _unmark(output)


def test_an_older_compactors_output_without_a_tombstone_is_trusted_only_alone_in_its_group(tmp_path,
                                                                                           monkeypatch):
    """A compactor from before the markers that died between its rename and its tombstone left its output
    beside its inputs and no marker: an unmarked compacted file no tombstone names is not trusted while
    other files of its group are listed; alone (a finished job compacted whole), it is."""
    store = Store(tmp_path)
    _fill(store)
    before = _counts(tmp_path)
    old = _older_compactor_died_before_its_tombstone(store, monkeypatch)
    found = list_files(store.layout)
    assert not found.disjoint["outputs"] and found.disjoint["commits"]
    assert _counts(tmp_path) == before
    for raw in (store.layout.kind_dir("outputs") / "raw" / "job-d").glob("*.parquet"):
        raw.unlink()  # its inputs collected (its tombstone with them): the file alone in its group
    assert list_files(store.layout).disjoint["outputs"] and old.exists()
    assert _counts(tmp_path) == before


def test_new_compacted_files_carry_the_marked_uid(tmp_path):
    store = Store(tmp_path)
    _fill(store)
    compact_job(tmp_path, "job-d")
    names = [p.name for p in store.layout.store.joinpath("tables").rglob("compacted/*/*.parquet")]
    assert names and all(n.split("~", 1)[1].startswith(listing.MARKED_UID_PREFIX) for n in names)


def _spy_disjoint(monkeypatch) -> list[bool]:
    """What each merge found about its inputs (listing.files_disjoint, as compact calls it)."""
    seen: list[bool] = []
    real = compact.files_disjoint

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(compact, "files_disjoint", spy)
    return seen


def test_merges_of_inputs_that_share_no_part_skip_the_deduplication(tmp_path, monkeypatch):
    """Raw parts, and compacted files named by tombstones that share no input, hold each part once: their
    merge writes their union as it is, and the views answer as before."""
    seen = _spy_disjoint(monkeypatch)
    store = Store(tmp_path)
    _fill(store)
    before = _counts(tmp_path)
    assert compact_group(store.layout, "outputs", "job-d").groups == 1
    _fill(store)  # the same shards' parts again: a second attempt each, new parts
    assert compact_group(store.layout, "outputs", "job-d").files_in > 1  # the first output and the new parts
    assert seen == [True, True]
    assert _counts(tmp_path)[0] == before[0]  # a shard's second attempt 1 is not its winner: not counted
    [info] = [i for t in store.layout.gc.glob("outputs~*.json")
              if len((i := json.loads(t.read_text()))["files"]) > 2 * SHARDS]  # the second merge's
    output = store.layout.file(info["output"])
    con = duckdb.connect()
    assert con.execute(f"SELECT count(*), count(DISTINCT _bg_part) FROM '{output}'").fetchone() == (
        2 * before[0], 4 * SHARDS)


def test_two_outputs_of_the_same_inputs_are_deduplicated_when_merged(tmp_path, monkeypatch):
    """A lock broken while its holder ran: two outputs of the same inputs. Their next merge takes each
    part once, whether the tombstones that tell (they share an input) are still there or were collected
    with the inputs, the lock breaker's `.suspect` marker left."""
    seen = _spy_disjoint(monkeypatch)
    for collected in (False, True):
        data_dir = tmp_path / str(collected)
        store = Store(data_dir)
        _fill(store)
        before = _counts(data_dir)
        layout = store.layout
        raw = sorted((layout.kind_dir("outputs") / "raw" / "job-d").glob("*.parquet"))
        tombs = []
        for _ in range(2):
            _, output = compact._merge(layout, "outputs", raw, layout.compacted_dir("outputs", "job-d"))
            compact._write_tombstone(layout, "outputs", "job-d", raw, output)
            tombs.append(max(layout.gc.glob("outputs~*.json"), key=lambda p: p.stat().st_mtime_ns))
        if collected:
            (layout.gc / marker_name("outputs", "job-d", "0123456789ab", SUSPECT_SUFFIX)).touch()
            for path in raw + list(layout.gc.glob("outputs~*.json")):
                path.unlink()
        del seen[:]
        assert compact_group(layout, "outputs", "job-d").files_in == 2
        assert seen == [False]
        assert _counts(data_dir) == before


def test_an_older_compactors_output_beside_its_inputs_is_deduplicated_when_merged(tmp_path, monkeypatch):
    """An output of a compactor from before the markers, which died before its tombstone, beside the
    inputs it holds: the next merge of the group takes each part once."""
    store = Store(tmp_path)
    _fill(store)
    before = _counts(tmp_path)
    _older_compactor_died_before_its_tombstone(store, monkeypatch)
    seen = _spy_disjoint(monkeypatch)
    assert compact_group(store.layout, "outputs", "job-d").files_in == 1 + 2 * SHARDS
    assert seen == [False]
    assert list_files(store.layout).disjoint["outputs"] and _counts(tmp_path) == before


def _two_outputs_of_the_same_inputs(store: Store, holder: str, age_s: float) -> Path:
    """A lock broken while its holder (`holder`: "<host> <pid> <time>") ran, both having merged the same
    raw parts; their tombstones collected with those parts, the breaker's `.suspect` marker, `age_s`
    old, left: the state only the marker tells."""
    layout = store.layout
    lock = layout.locks / "outputs~job-d.lock"
    lock.write_text(holder)
    old = time.time() - compact.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    raw = sorted((layout.kind_dir("outputs") / "raw" / "job-d").glob("*.parquet"))
    monkey = pytest.MonkeyPatch()
    monkey.setattr(compact, "_inputs", lambda *args: raw)  # the holder's inputs, not yet merged
    compact_group(layout, "outputs", "job-d")  # the breaker's merge
    monkey.undo()
    _, output = compact._merge(layout, "outputs", raw, layout.compacted_dir("outputs", "job-d"))
    compact._write_tombstone(layout, "outputs", "job-d", raw, output)  # the holder's, finished late
    for path in raw + list(layout.gc.glob("outputs~*.json")):
        path.unlink()
    [marker] = layout.gc.glob(f"*{SUSPECT_SUFFIX}")
    assert marker.read_text() == holder
    at = time.time() - age_s
    os.utime(marker, (at, at))
    return marker


@pytest.mark.parametrize(("where", "age_s", "settled"), [
    ("this host, gone", 60.0, True), ("this host, running", 60.0, False),
    ("another host", 60.0, False), ("another host", compact.SUSPECT_MAX_AGE_S + 60, True),
    ("unsaid", compact.SUSPECT_MAX_AGE_S + 60, True), ("unsaid", 60.0, False)])
def test_the_janitor_settles_a_suspect_group_once_the_holder_is_gone(tmp_path, where, age_s, settled):
    """The janitor (`compact`) merges a suspect group's files, each part once, and removes the marker, once
    the broken lock's holder is gone (its process on this host ended, or the marker is a day old); until
    then the group's kind stays chosen part by part, and counts each row once all the same. The job still
    runs, with too few parts for the janitor's live compaction: only the settling merges them."""
    store = Store(tmp_path)
    _fill(store, shards_total=SHARDS + 1)
    before = _counts(tmp_path)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        holder = {"another host": "other-host 1234 1.0\n", "unsaid": ""}.get(
            where, f"{socket.gethostname()} {running.pid} 1.0\n")
        marker = _two_outputs_of_the_same_inputs(store, holder, age_s)
        assert not list_files(store.layout).disjoint["outputs"] and _counts(tmp_path) == before
        if where == "this host, gone":
            running.kill()
            running.wait()
        report = compact.compact(tmp_path, grace_s=3600)
    finally:
        running.kill()
        running.wait()
    assert marker.exists() != settled
    found = list_files(store.layout)
    assert found.disjoint["outputs"] == settled
    assert report.rows >= (before[0] if settled else 0)
    assert _counts(tmp_path) == before
    if settled:
        assert len([p for p in found.files["outputs"] if "/compacted/" in p]) == 1
