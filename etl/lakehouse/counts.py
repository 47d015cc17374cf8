"""Corpus-wide counts kept per immutable file, so that a report costs what changed.

A Lance fragment's rows change only through a new data file or a new deletion file, and a
Delta data file never changes (a MERGE or DELETE writes a new file and removes the old
one from the log). Counts grouped by a few columns and kept per fragment (Lance) or per
data file (Delta), under a key naming those files, therefore stay true for as long as
the key is in the table. :func:`lance_counts` and :func:`delta_counts` read only the
fragments or files whose key they have not counted before -- a night's appends, the
fragments a delete or a compaction touched -- and add the rest from a small cache
(JSON, one entry per fragment or file: ``<root>/_lakeshard/counts/<table>.json``),
which they rewrite with exactly the keys the table holds now. No Spark job: the reads are
pylance and delta-rs in this process, over the grouped columns only.

The cache is only ever a shortcut: a missing, unreadable or foreign cache (other
columns) is counted again from the table, and a key that is still in the table names the
same rows, so a report written from it equals a scan of the table (tested).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pandas as pd
import pyarrow as pa

from etl.lakehouse.derived import DerivedState
from etl.writers.remote import subtree

log = logging.getLogger(__name__)

__all__ = ["lance_counts", "delta_counts", "manifest_counts", "MANIFEST_COLUMNS"]

# The bronze manifest's rows by these (curate's closing check, an export's removals).
MANIFEST_COLUMNS = ("status", "stage", "reason")

def _load(cache: str, columns: Sequence[str]) -> dict[str, list]:
    """The cached counts per key, or {} when there is no usable cache."""
    kept = DerivedState(cache, "counts").load({"columns": list(columns)})
    return dict(kept["parts"]) if kept and isinstance(kept.get("parts"), dict) else {}


def _save(cache: str, columns: Sequence[str], parts: dict[str, list]) -> None:
    DerivedState(cache, "counts").save({"columns": list(columns)}, {"parts": parts})


def _grouped(table: pa.Table, columns: Sequence[str]) -> list[list]:
    """``[[value, ..., count], ...]`` of `table` grouped by `columns` (nulls a group)."""
    if table.num_rows == 0:
        return []
    out = table.group_by(list(columns)).aggregate([([], "count_all")])
    cols = [out.column(c).to_pylist() for c in columns] + [
        out.column("count_all").to_pylist()]
    return [list(row) for row in zip(*cols, strict=True)]


def _frame(parts: dict[str, list], columns: Sequence[str]) -> pd.DataFrame:
    rows = [row for groups in parts.values() for row in groups]
    frame = pd.DataFrame(rows, columns=[*columns, "count"])
    if frame.empty:
        return frame.astype({"count": "int64"})
    return (frame.groupby(list(columns), dropna=False, sort=True)["count"].sum()
            .reset_index())


def _fragment_key(fragment, field_ids: set[int]) -> str:
    """Which rows of `fragment` hold which values of the grouped columns: its id, the
    data files holding those columns and its deletion file (a column added later, in a
    data file of its own, leaves the key as it was)."""
    meta = fragment.metadata
    files = sorted(f.path for f in meta.files if field_ids.intersection(f.fields))
    d = meta.deletion_file
    deletion = "" if d is None else f"{d.read_version}.{d.id}.{d.num_deleted_rows}"
    return f"{meta.id}|{'+'.join(files)}|{deletion}"


def lance_counts(ds, columns: Sequence[str], cache: str) -> pd.DataFrame:
    """Rows of the Lance dataset `ds` (one version of it) grouped by `columns`, with a
    ``count`` column; fragments counted before are taken from `cache`."""
    ids = {f.name(): f.id() for f in ds.lance_schema.fields()}
    field_ids = {ids[c] for c in columns}
    known = _load(cache, columns)
    parts: dict[str, list] = {}
    fresh = 0
    for fragment in ds.get_fragments():
        key = _fragment_key(fragment, field_ids)
        if key not in known:
            known[key] = _grouped(fragment.to_table(columns=list(columns)), columns)
            fresh += 1
        parts[key] = known[key]
    log.info("counts: %s: %d of %d fragments read", ds.uri, fresh, len(parts))
    if fresh or len(parts) != len(known):
        _save(cache, columns, parts)
    return _frame(parts, columns)


def delta_counts(path: str, columns: Sequence[str], cache: str) -> pd.DataFrame | None:
    """Rows of the Delta table at `path` (its latest version) grouped by `columns`, with
    a ``count`` column; data files counted before are taken from `cache`. None when
    there is no table, or when delta-rs cannot read it (a feature it does not
    implement, deletion vectors: a file's rows could then change under its name) --
    the caller counts with Spark."""
    import pyarrow.dataset as pds
    from deltalake.exceptions import DeltaError

    from etl import storage

    try:
        table = storage.delta_rs_table(path)
        if table is None:
            return None
        protocol = table.protocol()
        if "deletionVectors" in (protocol.reader_features or []):
            return None
        dataset = table.to_pyarrow_dataset(filesystem=subtree(storage.object_url(path)))
    except DeltaError as exc:
        if storage.delta_rs_unsupported(exc):
            return None
        raise
    known = _load(cache, columns)
    parts: dict[str, list] = {}
    todo = []
    for fragment in dataset.get_fragments():
        key = fragment.path.rsplit("/", 1)[-1]  # Delta data files have unique names
        if key in known:
            parts[key] = known[key]
        else:
            todo.append((key, fragment))
    for key, fragment in todo:
        parts[key] = _grouped(
            pds.FileSystemDataset([fragment], dataset.schema, dataset.format,
                                  dataset.filesystem).to_table(columns=list(columns)),
            columns)
    log.info("counts: %s: %d of %d files read", path, len(todo), len(parts))
    if todo or len(parts) != len(known):
        _save(cache, columns, parts)
    return _frame(parts, columns)


def manifest_counts(paths) -> pd.DataFrame | None:
    """The bronze manifest's rows by ``status, stage, reason`` (`paths`: the root's
    :class:`etl.tables.Layout`), or None as :func:`delta_counts`."""
    return delta_counts(paths.manifest, MANIFEST_COLUMNS, paths.counts_cache("manifest"))
