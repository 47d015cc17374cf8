"""Add or update columns of a Lance table from Spark without rewriting the other columns.

Caption versions, features, embeddings and text latents are all "compute a few columns
for some rows of the curated table". Rewriting rows would rewrite their image bytes, so
this module only ever writes *new data files holding the written columns*:

1. :func:`ensure_columns` adds the columns that don't exist yet as all-null columns
   (a schema-only change: no data file is written; every row reads null).
2. :func:`write_columns` routes each value to the fragment its row lives in (the
   ``_fragment_id`` read option, or a join on the key), and each Spark task calls
   Lance's ``LanceFragment.update_columns`` for its fragments: a data file with just those
   columns is written next to the fragment's existing files; rows without a value keep
   theirs. The driver commits all fragments in one ``Update`` (``rewrite_columns``)
   transaction -- one new table version, nothing visible until then, and the image data
   files are the same files, byte for byte, before and after.

Rows whose key is not in the table are not written and are counted
(``ColumnWrite.unmatched``). Each key should appear once in the DataFrame; if it
appears several times, one of its values wins.

Dropping columns (:func:`drop_columns`) is metadata-only as well.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl.writers.lance import FRAGMENT_ID, _rebuild_empty_lists, lance_reader

__all__ = ["ColumnWrite", "ensure_columns", "write_columns", "drop_columns"]


@dataclass(frozen=True)
class ColumnWrite:
    version: int  # the table version holding the values
    columns: tuple[str, ...]
    rows: int  # values written
    unmatched: int  # rows of the DataFrame whose key is not in the table
    fragments: int  # fragments that got a new data file
    bytes_written: int  # size of those new data files


def ensure_columns(path: str, fields: list[pa.Field]) -> int:
    """Add `fields` the table lacks, as nullable all-null columns; returns the version.

    A field that exists with another type is refused with its name."""
    import lance

    ds = lance.dataset(path)
    missing = []
    for f in fields:
        if f.name in ds.schema.names:
            have = ds.schema.field(f.name).type
            if have != f.type:
                raise ValueError(
                    f"lance table {path!r}: column {f.name!r} is {have}, cannot write {f.type}"
                )
        else:
            missing.append(f.with_nullable(True))
    if missing:
        ds.add_columns(missing)
    return lance.dataset(path).version


def drop_columns(path: str, names: list[str]) -> int:
    """Drop columns (metadata only; data files are cleaned up by compaction)."""
    import lance

    ds = lance.dataset(path)
    present = [n for n in names if n in ds.schema.names]
    if present:
        ds.drop_columns(present)
    return lance.dataset(path).version


def _pieces(batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Split batches sorted by fragment id into (fragment id, slice) runs."""
    import numpy as np

    for b in batches:
        if b.num_rows == 0:
            continue
        fids = b.column(b.schema.get_field_index(FRAGMENT_ID)).to_numpy()
        cuts = (np.flatnonzero(np.diff(fids)) + 1).tolist()
        for start, end in zip([0, *cuts], [*cuts, len(fids)], strict=True):
            yield int(fids[start]), b.slice(start, end - start)


def _fragment_writer(path: str, version: int, key: str, target: pa.Schema):
    """The per-task function: one ``update_columns`` per fragment in the partition."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import lance

        ds = lance.dataset(path, version=version)
        groups: dict[int, list[pa.RecordBatch]] = {}
        order: list[int] = []
        for fid, piece in _pieces(batches):
            if fid not in groups:
                groups[fid] = []
                order.append(fid)
            groups[fid].append(_rebuild_empty_lists(piece.select(target.names).cast(target)))
        out = {"fragment_json": [], "fields_json": [], "rows": [], "bytes": []}
        for fid in order:
            frag = ds.get_fragment(fid)
            before = {f.path for f in frag.metadata.files}
            data = pa.Table.from_batches(groups.pop(fid), schema=target)
            meta, fields = frag.update_columns(data, left_on=key)
            new_bytes = sum(f.file_size_bytes or 0 for f in meta.files if f.path not in before)
            out["fragment_json"].append(json.dumps(meta.to_json()))
            out["fields_json"].append(json.dumps(list(fields)))
            out["rows"].append(data.num_rows)
            out["bytes"].append(new_bytes)
        yield pa.RecordBatch.from_pydict(out, schema=_RESULT)

    return write


_RESULT = pa.schema(
    [
        ("fragment_json", pa.string()),
        ("fields_json", pa.string()),
        ("rows", pa.int64()),
        ("bytes", pa.int64()),
    ]
)


def write_columns(
    spark: SparkSession, path: str, df: DataFrame, key: str = "sample_id"
) -> ColumnWrite:
    """Write every column of `df` except `key` (and ``_fragment_id``) into the table.

    New columns are added first; existing ones keep their values on rows `df` does not
    mention. Returns what was written; the table gains one version for the values (and
    one for a schema change when columns are new)."""
    import lance
    from lance.fragment import FragmentMetadata
    from pyspark.sql.pandas.types import to_arrow_schema

    values = [c for c in df.columns if c not in (key, FRAGMENT_ID)]
    if not values:
        raise ValueError("write_columns: the DataFrame has no value columns besides the key")
    given = to_arrow_schema(df.select(key, *values).schema)
    version = ensure_columns(path, [given.field(c) for c in values])
    table = lance.dataset(path, version=version).schema
    target = pa.schema([table.field(key)] + [table.field(c) for c in values])

    total = df.count() if FRAGMENT_ID not in df.columns else None
    if FRAGMENT_ID not in df.columns:
        ids = (
            lance_reader(spark)
            .option("columns", key)
            .option("fragment_id", "true")
            .option("version", str(version))
            .load(path)
        )
        df = df.join(ids, key, "inner")
    routed = df.select(key, *values, F.col(FRAGMENT_ID).cast("int").alias(FRAGMENT_ID))
    n_frags = len(lance.dataset(path, version=version).get_fragments())
    parts = max(1, min(n_frags, spark.sparkContext.defaultParallelism * 2))
    results = (
        routed.repartition(parts, FRAGMENT_ID)
        .sortWithinPartitions(FRAGMENT_ID)
        .mapInArrow(_fragment_writer(path, version, key, target), _RESULT_DDL)
        .collect()
    )
    results = [r for r in results if r["fragment_json"]]
    rows = sum(r["rows"] for r in results)
    if results:
        fields = sorted({f for r in results for f in json.loads(r["fields_json"])})
        op = lance.LanceOperation.Update(
            updated_fragments=[FragmentMetadata.from_json(r["fragment_json"]) for r in results],
            fields_modified=fields,
            update_mode="rewrite_columns",
        )
        version = lance.LanceDataset.commit(path, op, read_version=version).version
    return ColumnWrite(
        version=version,
        columns=tuple(values),
        rows=rows,
        unmatched=(total - rows) if total is not None else 0,
        fragments=len(results),
        bytes_written=sum(r["bytes"] for r in results),
    )


_RESULT_DDL = "fragment_json string, fields_json string, rows long, bytes long"
