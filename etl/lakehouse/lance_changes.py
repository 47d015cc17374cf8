"""What changed in a Lance table between two of its versions, told from fragment
metadata, and the changed rows read alone (pylance in this process, no Spark job).

Lance appends rows as new fragments and deletes them with deletion files; a fragment's
data files change only when its columns are rewritten or added, and a compaction or
purge replaces fragments. So two versions whose common fragments keep their data files
differ by the fragments appended and the rows their deletion files added -- what a
nightly consumer (an export's increment) reads instead of the table. A fragment written
again (a purge, a compaction, columns added or rewritten) is read again whole, its rows
compared by the caller; an older version cleaned up is answered None: the caller falls
back to reading the whole table.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

__all__ = ["RowChanges", "row_changes", "fragment_rows", "rows_by_id", "read_schema"]


@dataclass(frozen=True)
class RowChanges:
    """The rows of a Lance table that changed from version `since` to `version`."""

    since: int
    version: int
    appended: tuple[int, ...]  # fragment ids whose rows are to be read again (new ones,
    # and those a purge, compaction or column rewrite wrote again)
    arrived: frozenset[str]  # every sample_id those fragments hold now
    deleted: frozenset[str]  # sample_ids gone from the table since
    # those of `arrived` the table did not hold at `since` (in no fragment rewritten
    # since, and deleted from none): nothing made from version `since` holds them
    fresh: frozenset[str] = frozenset()


def _layout(fragment) -> tuple:
    """A fragment's data files and physical rows: equal, the same stored rows."""
    meta = fragment.metadata
    return tuple(sorted(f.path for f in meta.files)), meta.physical_rows


def _deleted(fragment) -> int:
    d = fragment.metadata.deletion_file
    return d.num_deleted_rows if d is not None else 0


def _ids(fragment) -> list[str]:
    return fragment.to_table(columns=["sample_id"]).column(0).to_pylist()


def row_changes(path: str, since: int, version: int) -> RowChanges | None:
    """The changes from `since` to `version` of the Lance table at `path`, at the grain
    of fragments: appended fragments, and fragments written again (gone, or other data
    files: a purge, a compaction, new or rewritten columns), are read again whole;
    deletion files that grew give the ids they deleted. None when `since` can no longer
    be read (cleaned up)."""
    import lance

    try:
        old = {f.fragment_id: f for f in lance.dataset(path, version=since).get_fragments()}
        now = lance.dataset(path, version=version)
    except (ValueError, OSError):
        return None
    new = {f.fragment_id: f for f in now.get_fragments()}
    rewritten = [i for i in old if i not in new or _layout(new[i]) != _layout(old[i])]
    appended = tuple(sorted(i for i in new if i not in old or i in rewritten))
    arrived = {s for i in appended for s in _ids(new[i])}
    held = {s for i in rewritten for s in _ids(old[i])}  # rows of `since` read again
    deleted = held - arrived
    for i in old:
        if i not in rewritten and _deleted(new[i]) != _deleted(old[i]):
            still = set(_ids(new[i]))
            left = {s for s in _ids(old[i]) if s not in still}
            deleted |= left
            held |= left
    return RowChanges(since, version, appended, frozenset(arrived), frozenset(deleted),
                      frozenset(arrived - held))


def _read(ds, columns: list[str], where: str | None, fragments: list) -> pa.Table | None:
    """`columns` and each row's address (``_rowaddr``, int64) of `fragments` of `ds`
    matching `where`."""
    if not fragments:
        return None
    table = ds.scanner(columns=columns, filter=where, fragments=fragments,
                       with_row_address=True).to_table()
    addr = table.schema.get_field_index("_rowaddr")
    return table.set_column(addr, "_rowaddr", table.column(addr).cast(pa.int64()))


def fragment_rows(ds, fragment_ids: tuple[int, ...], columns: list[str],
                  where: str | None, schema: pa.Schema) -> pa.Table:
    """`columns` (and ``_rowaddr``) of the rows of `fragment_ids` of the dataset `ds`
    matching `where`, as `schema` (the types the whole table's read gives them)."""
    table = _read(ds, columns, where, [ds.get_fragment(i) for i in fragment_ids])
    return schema.empty_table() if table is None else table.select(schema.names).cast(schema)


def rows_by_id(ds, ids: list[str], columns: list[str], where: str | None,
               schema: pa.Schema) -> pa.Table:
    """The same for the rows whose ``sample_id`` is one of `ids` (a filtered scan)."""
    if not ids:
        return schema.empty_table()
    quoted = ", ".join("'" + i.replace("'", "''") + "'" for i in sorted(ids))
    match = f"sample_id IN ({quoted})"
    table = _read(ds, columns, f"({where}) AND {match}" if where else match,
                  ds.get_fragments())
    return table.select(schema.names).cast(schema)


def read_schema(path: str, version: int, columns: list[str]):
    """The Spark schema ``format("lance")`` gives `columns` and ``_rowaddr`` at `version`
    (asked of the data source here, as :func:`etl.writers.lance.read_local_table` does),
    and its Arrow form: the changed rows are read with the types a read of the whole
    table gives them, so that their fingerprints are the ones that read would give."""
    from pyspark.sql.datasource import CaseInsensitiveDict
    from pyspark.sql.pandas.types import to_arrow_schema

    from etl.writers.lance import LanceDataSource

    schema = LanceDataSource(CaseInsensitiveDict({
        "path": path, "version": str(version), "columns": ",".join(columns),
        "row_address": "true"})).schema()
    return schema, to_arrow_schema(schema)
