"""The request digests' sample twins (jobs.store.rollups, jobs.store.digests): `_bg.request_samples(level)`
answers, in the listed catalog (twins, and the samples of untwinned files), what the default catalog
answers from the digests' scan, at every level and every step of compaction and garbage collection,
with twins missing, changed, corrupt or orphaned; a merge whose twin cannot be written changes nothing."""

from __future__ import annotations

import importlib
import os
import random

import duckdb
import pyarrow.parquet as pq
import pytest

from jobs.store import Store, StoreError, check_store, collect_garbage, connect, rollups
from jobs.store import digests as dg
from jobs.store.compact import compact_group
from jobs.store.listing import LISTED_CATALOG, over_listing, pin
from jobs.store.schemas import ATTEMPT_ID_COLUMN
from tests.jobs.store.test_store_digests import _write_job

catalog = importlib.import_module("jobs.store.catalog")
compact_mod = importlib.import_module("jobs.store.compact")  # the package exports a function `compact`
KIND = rollups.SAMPLED_KIND
FIELDS = ", ".join(name for name, _ in dg.SAMPLE_FIELDS)


@pytest.fixture
def no_delays(monkeypatch):
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)  # a compacted file counts at once
    monkeypatch.setattr(compact_mod, "LIVE_GRACE_S", 0.0)


LOW = 4  # a lower TWIN_MIN_LEVEL than the product's, so that these small jobs' twins hold rows of each level


@pytest.fixture
def low_twins(monkeypatch):
    monkeypatch.setattr(dg, "TWIN_MIN_LEVEL", LOW)


def _store(tmp_path, seed: int = 11) -> Store:
    _write_job(tmp_path, random.Random(seed))
    return Store(tmp_path, compact_as_written=False)


def _sampled(con: duckdb.DuckDBPyConnection, level: int, *, listed: bool = True) -> list[tuple]:
    """The job's chosen digests' sampled rows of level >= `level`, sorted: in the listed catalog (where
    the listing allows it), or in the default one, each over a listing of its own."""
    sql = f"SELECT * FROM ({dg.sampled_rows_sql(level, '_bg.request_digests_live')}) ORDER BY ALL"
    if not listed:
        pin(con)
        return con.execute(sql, {"job_id": "j"}).fetchall()
    with over_listing(con):
        assert con.execute("SELECT current_database()").fetchone()[0] == LISTED_CATALOG
        return con.execute(sql, {"job_id": "j"}).fetchall()


def _reference(con: duckdb.DuckDBPyConnection, level: int) -> list[tuple]:
    """The same rows from the digests' sample columns, as the request figures read them before twins."""
    columns = ", ".join(dg.sample_column(lv) for lv in range(level, dg.MAX_LEVEL + 1))
    pin(con)
    return con.execute(f"SELECT {FIELDS} FROM (SELECT unnest(s, recursive := true) FROM (SELECT "
                       f"unnest(flatten([{columns}])) AS s FROM _bg.request_digests_live "
                       "WHERE job_id = 'j')) ORDER BY ALL").fetchall()


def _agree(con: duckdb.DuckDBPyConnection) -> int:
    """Every level's rows, listed and default, equal the reference; how many rows at the lowest level."""
    for level in dg.LEVELS:
        want = _reference(con, level)
        assert _sampled(con, level) == want, level
        assert _sampled(con, level, listed=False) == want, level
    return len(_reference(con, dg.MIN_LEVEL))


def _twins(store: Store) -> list[str]:
    return sorted(p.name for p in rollups.rollup_dir(store.layout, KIND).glob("*/*.parquet"))


def _compacted(store: Store) -> list[str]:
    return sorted(p.name for p in store.layout.kind_dir(KIND).glob("compacted/*/*.parquet"))


@pytest.mark.parametrize("twin_min_level", [LOW, dg.TWIN_MIN_LEVEL])
def test_the_samples_agree_through_compaction_and_collection(tmp_path, no_delays, monkeypatch,
                                                             twin_min_level):
    """At every level: from the twins at theirs, from the compacted files' sample columns below."""
    monkeypatch.setattr(dg, "TWIN_MIN_LEVEL", twin_min_level)
    store = _store(tmp_path)
    con = connect(tmp_path)
    assert _agree(con) > 20 and _twins(store) == []  # raw parts only: their sample columns
    compact_group(store.layout, KIND, "j", grace_s=0.0)
    assert _twins(store) == _compacted(store) and len(_twins(store)) == 1
    assert _agree(con) > 20  # the twin, and the merged inputs left out
    collect_garbage(tmp_path, grace_s=0.0)
    assert _agree(con) > 20
    _write_job(tmp_path, random.Random(12))  # more attempts, raw again beside the compacted file
    assert _agree(con) > 20
    compact_group(store.layout, KIND, "j", grace_s=0.0)
    collect_garbage(tmp_path, grace_s=0.0)
    assert _twins(store) == _compacted(store) and len(_twins(store)) == 1  # the merged file's twin went
    assert _agree(con) > 20


def test_the_sample_key_is_the_attempt_id():
    assert dg.SAMPLE_KEY == ATTEMPT_ID_COLUMN


def test_a_twin_holds_every_sampled_row_of_its_levels_highest_first(tmp_path, no_delays, low_twins):
    store = _store(tmp_path)
    compact_group(store.layout, KIND, "j", grace_s=0.0)
    (twin,) = rollups.rollup_dir(store.layout, KIND).glob("j/*.parquet")
    (compacted,) = store.layout.kind_dir(KIND).glob("compacted/j/*.parquet")
    table = pq.read_table(twin)
    schema = pq.read_schema(rollups.schema_file(store.layout, KIND))
    assert [(f.name, f.type) for f in table.schema] == [(f.name, f.type) for f in schema]
    levels = table.column(dg.SAMPLE_TWIN_LEVEL).to_pylist()
    assert levels == sorted(levels, reverse=True) and set(levels) <= set(range(LOW, dg.MAX_LEVEL + 1))
    digests = pq.read_table(compacted)
    per_level = {lv: sum(len(x) for x in digests.column(dg.sample_column(lv)).to_pylist())
                 for lv in dg.LEVELS if lv >= LOW}
    assert {lv: levels.count(lv) for lv in per_level} == per_level and sum(per_level.values()) > 10


def test_the_twin_is_what_the_listed_catalog_reads_for_its_file_at_its_levels(tmp_path, no_delays, low_twins):
    store = _store(tmp_path)
    compact_group(store.layout, KIND, "j", grace_s=0.0)
    collect_garbage(tmp_path, grace_s=0.0)
    (twin,) = rollups.rollup_dir(store.layout, KIND).glob("j/*.parquet")
    con = connect(tmp_path)
    assert _agree(con) > 20
    duckdb.execute(f"COPY (SELECT * REPLACE (e2e_s + 1 AS e2e_s) FROM read_parquet('{twin}')) "
                   f"TO '{tmp_path / 'x.parquet'}' (FORMAT parquet)")
    os.replace(tmp_path / "x.parquet", twin)
    assert _sampled(con, LOW) != _reference(con, LOW)
    assert _sampled(con, LOW, listed=False) == _reference(con, LOW)
    assert _sampled(con, LOW - 1) == _reference(con, LOW - 1)  # below the twin's levels: the file's columns


def test_a_compacted_file_without_its_twin_reads_its_sample_columns(tmp_path, no_delays, low_twins):
    """Compacted by a batchgen before the twins, or renamed in after the listing looked for twins."""
    store = _store(tmp_path)
    compact_group(store.layout, KIND, "j", grace_s=0.0)
    collect_garbage(tmp_path, grace_s=0.0)
    (rollups.rollup_dir(store.layout, KIND) / "j").rename(tmp_path / "j-twins")
    con = connect(tmp_path)
    assert _agree(con) > 20
    with over_listing(con) as listing:
        assert any("/compacted/j/" in p for p in listing.digests_untwinned)
        assert listing.digest_twins == [str(rollups.schema_file(store.layout, KIND))]
        assert listing.digests_twinned == [str(store.layout.kind_dir(KIND) / "_schema.parquet")]


def test_orphaned_sample_twins_are_collected(tmp_path, no_delays, monkeypatch):
    store = _store(tmp_path)
    compact_group(store.layout, KIND, "j", grace_s=0.0)
    (compacted,) = store.layout.compacted_dir(KIND, "j").glob("*.parquet")
    compacted.unlink()
    collect_garbage(tmp_path, grace_s=0.0)
    assert len(_twins(store)) == 1  # younger than ORPHAN_MAX_AGE_S: a compactor may be between renames
    monkeypatch.setattr(rollups, "ORPHAN_MAX_AGE_S", -1.0)
    collect_garbage(tmp_path, grace_s=0.0)
    assert _twins(store) == []


def test_a_corrupt_sample_twin_is_named_and_moved_aside_by_the_check(tmp_path, no_delays, low_twins):
    store = _store(tmp_path)
    compact_group(store.layout, KIND, "j", grace_s=0.0)
    collect_garbage(tmp_path, grace_s=0.0)
    (twin,) = rollups.rollup_dir(store.layout, KIND).glob("j/*.parquet")
    twin.write_bytes(twin.read_bytes()[:40])
    con = connect(tmp_path)
    with pytest.raises(duckdb.Error, match=twin.name):
        _sampled(con, LOW)
    (bad,) = check_store(tmp_path).bad
    assert bad.path == twin and bad.fate == "re-derivable" and "sampled request rows" in bad.detail


def test_a_merge_whose_sample_twin_cannot_be_written_changes_nothing(tmp_path, no_delays, monkeypatch):
    store = _store(tmp_path)
    raw = sorted(store.layout.raw_dir(KIND, "j").glob("*.parquet"))
    monkeypatch.setattr(rollups, "sample_twin_select", lambda source: "SELECT nothing FROM range(1)")
    with pytest.raises((duckdb.Error, StoreError)):
        compact_group(store.layout, KIND, "j")
    assert sorted(store.layout.raw_dir(KIND, "j").glob("*.parquet")) == raw
    assert _compacted(store) == [] and _twins(store) == [] and list(store.layout.tmp.iterdir()) == []
    assert list(store.layout.gc.iterdir()) == []
