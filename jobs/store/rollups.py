"""Per-second rollups of the engine iterations: what a long job's iteration chart reads.

A 10M-request job's fleet writes millions of iteration rows, and its chart (time buckets of at
least a second, `dashboard.queries.JOB_ITERATIONS_ROLLED`) needs only, per worker, job and second,
how many iterations there were and the sums of what they measured. So every compacted iterations
file gets a *rollup twin* written beside it by the compactor (`compact._merge`), before the file is
renamed into place:

    store/rollups/iterations/<group>/<the compacted file's name>

one row per (`_bg_part`, worker_id, job_ids, second) of the file's rows (`rollup_select`): the
iterations count, the first start and the last end, each averaged column's sum and count of non-null
values (`sum_<column>`, `n_<column>`), the preemptions, and the time and the values of the limits and
the load at its last iteration (`last_ts`, `last_<column>`). Keyed by the iterations' list of jobs, as
the rows are: a job's rollups are those whose `job_ids` contain it, and a worker's all of its own.

Reading them (`catalog._rollup_scan_sql`, the view `_bg.iteration_seconds`): over a pinned listing,
the twins of the listed compacted files are read, and the rollups of every other listed iterations
file (raw parts, a compacted file whose twin is not there: written by an older batchgen, or renamed
in after this listing read the twins' directory) are computed from its rows. Rows keep the part they
summarise, so the choice of files per part is the iterations scan's own: the answer is that of
`rollup_select` over the `iterations` view, exactly. Without a pinned listing, that is what the view
computes. A twin is derived data: deleted with its compacted file (`compact`'s garbage collection),
and a twin whose compacted file is gone is deleted after `ORPHAN_MAX_AGE_S`.

The compacted request digests get twins the same way, under store/rollups/request_digests/: their
*sample twins* (`jobs.store.digests.sample_twin_select`): the digests' sampled request rows of the levels
a large job's figures read, flat, highest levels first, which those figures read (`catalog`'s
`_bg.request_samples`) instead of every digest's sample columns. `TWINNED_KINDS` lists the kinds with
twins; what follows takes the kind (the iterations' by default).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from jobs.store.digests import sample_twin_select
from jobs.store.layout import TWIN_CODEC, Layout
from jobs.store.schemas import ROLLED_UP_KIND as KIND
from jobs.store.schemas import ROLLUP_AVERAGED as AVERAGED
from jobs.store.schemas import ROLLUP_LATEST as LATEST
from jobs.store.schemas import ROLLUP_SUMMED as SUMMED
from jobs.store.schemas import SAMPLED_KIND

ORPHAN_MAX_AGE_S = 3600.0  # a twin without its compacted file this long: a compactor died between renames


TWINNED_KINDS = (KIND, SAMPLED_KIND)  # the kinds whose compacted files get a twin


def rollup_dir(layout: Layout, kind: str = KIND) -> Path:
    return layout.rollup_dir(kind)


def schema_file(layout: Layout, kind: str = KIND) -> Path:
    """Zero twin rows (`init_data_dir` writes it): the twins' list of a listing is never empty."""
    return layout.twin_schema_file(kind)


def twin_of(layout: Layout, compacted: str | os.PathLike) -> Path:
    """The twin of a compacted file (<kind>/compacted/<group>/<name>) of a kind of TWINNED_KINDS."""
    path = Path(compacted)
    kind = path.parent.parent.parent.name
    if kind not in TWINNED_KINDS:
        raise ValueError(f"{path}: the compacted files of {kind!r} have no twins")
    return rollup_dir(layout, kind) / path.parent.name / path.name


def twin_prefixes(layout: Layout, kind: str = KIND) -> tuple[str, str]:
    """(twin path prefix, compacted file prefix): a twin's path with the first replaced by the second is
    its compacted file's."""
    return str(rollup_dir(layout, kind)) + os.sep, str(layout.kind_dir(kind) / "compacted") + os.sep


# rows per row group of a kind's twins (DuckDB's default where not named): a sample twin is read from its
# start (highest levels first) to the query's level, a few percent of it at 10M requests (8,192: the
# twins' read 34 -> 16 ms)
_ROW_GROUP_ROWS = {SAMPLED_KIND: 8192}


def twin_copy_options(kind: str) -> str:
    """The options of the COPY that writes a twin of `kind`."""
    rows = _ROW_GROUP_ROWS.get(kind)
    return f"FORMAT parquet, COMPRESSION {TWIN_CODEC}" + (f", ROW_GROUP_SIZE {rows}" if rows else "")


def twin_select(kind: str, source: str) -> str:
    """The rows of the twin of a compacted file of `kind` whose rows are `source`."""
    if kind == KIND:
        return rollup_select(source)
    if kind == SAMPLED_KIND:
        return sample_twin_select(source)
    raise ValueError(f"the compacted files of {kind!r} have no twins")


def rollup_select(source: str, keep: tuple[str, ...] = ()) -> str:
    """The rollup rows of the iterations rows of `source` (a relation with `_bg_part`), grouped also by
    its columns `keep`."""
    sums = ", ".join(f"sum({c})::DOUBLE AS sum_{c}, count({c}) AS n_{c}" for c in AVERAGED)
    summed = ", ".join(f"sum({c})::BIGINT AS {c}" for c in SUMMED)
    latest = ", ".join(f"arg_max({c}, ts) AS last_{c}" for c in LATEST)
    keys = ", ".join((*keep, "_bg_part", "worker_id", "job_ids", "second"))
    return f"""SELECT {keys}, count(*) AS iterations, min(ts) AS first_ts, max(ts + duration_s) AS last_end,
       {sums}, {summed}, max(ts) AS last_ts, {latest}
FROM (SELECT *, floor(ts)::BIGINT AS second FROM {source})
GROUP BY {keys}"""


def twins_listed(layout: Layout, files: list[str], kind: str = KIND) -> tuple[list[str], list[str]]:
    """(twins, untwinned): of a listing's files of `kind`, the twins found of its compacted files, and
    the files without one (raw parts, `_schema.parquet`, twinless compacted files). Listed after the
    kind's files: a twin is renamed in before its file, so a listed file's twin is found. Only the
    groups of the listed compacted files are read (a listing of one job's files reads that job's)."""
    twin_prefix, compacted_prefix = twin_prefixes(layout, kind)
    groups = {path[len(compacted_prefix):].split(os.sep, 1)[0] for path in files
              if path.startswith(compacted_prefix)}
    found = {e for group in groups for e in _walk_group(twin_prefix + group)}
    twins, untwinned = [], []
    for path in files:
        twin = twin_prefix + path[len(compacted_prefix):] if path.startswith(compacted_prefix) else None
        if twin is not None and twin in found:
            twins.append(twin)
        else:
            untwinned.append(path)
    return twins, untwinned


def orphans(layout: Layout, now: float | None = None) -> list[Path]:
    """Twins (of every kind of TWINNED_KINDS) whose compacted file is gone, older than ORPHAN_MAX_AGE_S."""
    now = time.time() if now is None else now
    out = []
    for kind in TWINNED_KINDS:
        twin_prefix, compacted_prefix = twin_prefixes(layout, kind)
        for twin in _walk(rollup_dir(layout, kind)):
            if os.path.exists(compacted_prefix + twin[len(twin_prefix):]):
                continue
            try:
                if now - os.stat(twin).st_mtime > ORPHAN_MAX_AGE_S:
                    out.append(Path(twin))
            except FileNotFoundError:
                pass
    return out


def _walk(directory: Path) -> list[str]:
    """<group>/<name>.parquet files under `directory`."""
    try:
        groups = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    return [path for group in groups for path in _walk_group(group.path)]


def _walk_group(directory: str) -> list[str]:
    """The .parquet files in one group's directory (none when it is not there)."""
    try:
        with os.scandir(directory) as entries:
            return [e.path for e in entries if e.name.endswith(".parquet")]
    except (FileNotFoundError, NotADirectoryError):
        return []
