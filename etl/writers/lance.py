"""Lance tables from Spark: a Python data source named ``lance``.

The Lance Spark connector (``org.lance:lance-spark-bundle-4.1_2.13``) is not served by
the package registry this project builds from (docs/development.md, "Pins and why"), so
lakeshard talks to Lance through pylance inside Spark's Python data source API
(Spark >= 4.0):

* **write** -- every Spark task writes its rows as Lance fragments (data files only,
  nothing visible yet) and returns their metadata; the driver commits all fragments in
  one transaction (``Overwrite`` or ``Append``), so a failed or retried task never leaves
  rows in the table, and each write is exactly one new table version.
* **read** -- one Spark partition per fragment of a pinned table version, Arrow batches
  straight from pylance. Pushdown is explicit: a ``filter`` option (Lance SQL,
  evaluated by Lance's scanner, using its indexes) and a ``columns`` option (so scans
  that don't need image bytes never read them).

Spark's own filter pushdown for Python data sources (``pushFilters``, Spark 4.1) is not
used: Spark 4.1.4 caches the pushed-down reader on the relation and reuses it for a
later query on the same DataFrame that pushes nothing, returning rows filtered by the
earlier query's predicate (docs/development.md, "Known issues"). Without it Spark
evaluates every ``where`` itself, so results are always right.

The format is registered in a session by :func:`register_lance` (``get_spark`` does it
for sessions others use; a pipeline run's session registers it when lakeshard first
reads a Lance table through Spark, :func:`lance_reader`). Usage::

    df.write.format("lance").mode("overwrite").save(path)
    spark.read.format("lance").option("columns", "sample_id,width").load(path)
    spark.read.format("lance").option("filter", "width >= 512").load(path)
    spark.read.format("lance").option("version", "3").load(path)   # time travel
    spark.read.format("lance").option("fragment_id", "true").load(path)  # + _fragment_id
    spark.read.format("lance").option("row_address", "true").load(path)  # + _rowaddr

Appends may carry a subset of the table's columns: columns the table has and the
DataFrame lacks (caption versions, features added later with
:mod:`etl.writers.lance_columns`) read as null for the new rows, and the given columns
are cast to the table's types. A column the table lacks is refused with its name.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

__all__ = [
    "LanceDataSource", "register_lance", "lance_reader", "append_frame", "pending_append",
    "PendingAppend", "table_version",
    "delete_rows", "deleted_per_fragment", "FRAGMENT_ID", "ROW_ADDRESS", "stored_uncompressed",
]

# Read option ``fragment_id``: adds this int column (the Lance fragment each row lives in),
# which :func:`etl.writers.lance_columns.write_columns` uses to route values home.
FRAGMENT_ID = "_fragment_id"
# Read option ``row_address``: adds this bigint column (Lance's row address, fragment id
# << 32 | offset), valid for the version read; ``LanceDataset._take_rows`` takes it back.
ROW_ADDRESS = "_rowaddr"


def _dataset(path: str, version: int | None = None):
    import lance

    return lance.dataset(path, version=version)


def table_version(path: str) -> int:
    """The latest version of the Lance table at `path`."""
    return _dataset(path).version


# ----------------------------------------------------------------------------- read


class _LanceReader(DataSourceReader):
    def __init__(self, path: str, version: int, columns: list[str], predicate: str | None):
        self.path = path
        self.version = version
        self.with_fragment_id = FRAGMENT_ID in columns
        self.with_row_address = ROW_ADDRESS in columns
        self.columns = [c for c in columns if c not in (FRAGMENT_ID, ROW_ADDRESS)]
        self.predicate = predicate

    def partitions(self) -> list[InputPartition]:
        # One partition per fragment; the partition's value is its fragment ids.
        frags = [f.fragment_id for f in _dataset(self.path, self.version).get_fragments()]
        return [InputPartition([fid]) for fid in frags] or [InputPartition([])]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not partition.value:
            return
        ds = _dataset(self.path, self.version)
        from udfs.worker import settle_imports

        settle_imports()  # pylance/pyarrow: keep the daemon's per-task GC cheap
        for fid in partition.value:
            yield from self.fragment_batches(ds, fid)

    def fragment_batches(self, ds, fid: int) -> Iterator[pa.RecordBatch]:
        """One fragment's batches, as the data source's schema has them."""
        for batch in ds.get_fragment(fid).to_batches(
            columns=self.columns,
            filter=self.predicate,
            batch_size=1024,
            with_row_address=self.with_row_address,
        ):
            if self.with_row_address:
                i = batch.schema.get_field_index(ROW_ADDRESS)
                addr = batch.column(i).cast(pa.int64())
                batch = batch.set_column(i, ROW_ADDRESS, addr)
            if self.with_fragment_id:
                ids = pa.array([fid] * batch.num_rows, pa.int32())
                batch = batch.append_column(FRAGMENT_ID, ids)
            yield batch


def read_local(spark, path: str, version: int, columns: list[str], where: str | None,
               row_address: bool = False):
    """What ``format("lance")`` with these options reads, read here on the driver by the
    data source's own schema and reader and handed to Spark as local data (for a few
    rows: no Python worker starts to read them, nor to give Spark their schema)."""
    table, schema = read_local_table(path, version, columns, where, row_address)
    return spark.createDataFrame(table, schema)


def read_local_table(path: str, version: int, columns: list[str], where: str | None,
                     row_address: bool = False) -> tuple[pa.Table, StructType]:
    """:func:`read_local`'s rows as an Arrow table, and the Spark schema that
    ``format("lance")`` gives them."""
    from pyspark.sql.datasource import CaseInsensitiveDict
    from pyspark.sql.pandas.types import to_arrow_schema

    # The schema `load` would give, asked here: through the JVM, Spark starts a Python
    # process to ask the data source (1.5-1.9 s in a cold night's export).
    schema = LanceDataSource(CaseInsensitiveDict({
        "path": path, "version": str(version), "columns": ",".join(columns),
        "row_address": str(row_address).lower()})).schema()
    lance_reader = _LanceReader(path, version, list(schema.fieldNames()), where)
    ds = _dataset(path, version)
    arrow = to_arrow_schema(schema)
    batches = [b for f in ds.get_fragments() for b in lance_reader.fragment_batches(
        ds, f.fragment_id)]
    table = (pa.Table.from_batches(batches).cast(arrow) if batches
             else arrow.empty_table())
    return table, schema


# ---------------------------------------------------------------------------- write


@dataclass
class _LanceCommit(WriterCommitMessage):
    fragments_json: list[str] = field(default_factory=list)
    rows: int = 0


class _LanceWriter(DataSourceArrowWriter):
    def __init__(self, path: str, schema: pa.Schema, overwrite: bool, max_rows_per_file: int):
        self.path = path
        self.schema = schema
        self.overwrite = overwrite
        self.max_rows_per_file = max_rows_per_file

    def write(self, iterator: Iterator[pa.RecordBatch]) -> _LanceCommit:
        from lance.fragment import write_fragments

        from udfs.worker import settle_imports

        settle_imports()
        rows = 0
        files = stored_uncompressed(self.schema)

        def batches():
            nonlocal rows
            for batch in iterator:
                rows += batch.num_rows
                batch = batch.cast(self.schema) if batch.schema != self.schema else batch
                yield pa.RecordBatch.from_arrays(_rebuild_empty_lists(batch).columns,
                                                 schema=files)

        reader = pa.RecordBatchReader.from_batches(files, batches())
        try:
            fragments = write_fragments(
                reader, self.path, schema=files, max_rows_per_file=self.max_rows_per_file
            )
        except OSError as exc:  # pylance names only the failed request: name the table
            raise OSError(f"could not write to the Lance table at {self.path}: {exc}") from None
        if rows == 0:
            return _LanceCommit([], 0)
        return _LanceCommit([json.dumps(f.to_json()) for f in fragments], rows)

    def commit(self, messages: list[_LanceCommit | None]) -> None:
        import lance
        from lance.fragment import FragmentMetadata

        fragments = [
            FragmentMetadata.from_json(js) for m in messages if m for js in m.fragments_json
        ]
        exists = _exists(self.path)
        if self.overwrite or not exists:
            op = lance.LanceOperation.Overwrite(stored_uncompressed(self.schema), fragments)
        else:
            op = lance.LanceOperation.Append(fragments)
        read_version = table_version(self.path) if exists else None
        try:
            lance.LanceDataset.commit(self.path, op, read_version=read_version)
        except OSError as exc:
            raise OSError(f"could not commit to the Lance table at {self.path}: {exc}") from None

    def abort(self, messages: list[_LanceCommit | None]) -> None:
        """Remove the data files of tasks that finished; nothing was committed."""
        from lance.fragment import FragmentMetadata

        for m in messages:
            for js in m.fragments_json if m else []:
                for data_file in FragmentMetadata.from_json(js).files:
                    local = os.path.join(self.path, "data", data_file.path)
                    if os.path.exists(local):
                        os.remove(local)


def append_local(path: str, table: pa.Table, max_rows_per_file: int = 1024 * 1024) -> None:
    """Append `table` (a frame's ``toArrow()``) from this process: the same write and
    commit as a ``format("lance")`` append's tasks and driver (a first write creates the
    table with the table's schema)."""
    writer = _writer(path, table.schema, False, max_rows_per_file)
    writer.commit([writer.write(iter(table.to_batches()))])


# What each task of append_frame returns: its fragments' metadata (JSON) and row count.
_TASK_RESULT = pa.schema([pa.field("fragments_json", pa.list_(pa.string())),
                          pa.field("rows", pa.int64())])


def append_frame(df, path: str, max_rows_per_file: int = 1024 * 1024) -> int:
    """Append `df`'s rows to the Lance table at `path` (created by a first write); the
    number of rows appended.

    The write and commit of a ``format("lance")`` append -- each Spark task writes its
    rows as fragments (``mapInArrow``), and this process commits them all in one
    transaction -- without what Spark adds around a Python data source's write: a
    Python process it starts on the driver to plan the write and another to commit it
    (together ~4 s of a cold night's curate, measured). As with the data source, a
    failed task or job commits nothing; its data files stay unreferenced."""
    from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

    writer = _writer(path, to_arrow_schema(df.schema), False, max_rows_per_file)

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        done = writer.write(batches)
        yield pa.RecordBatch.from_pylist(
            [{"fragments_json": done.fragments_json, "rows": done.rows}], schema=_TASK_RESULT)

    results = df.mapInArrow(write, from_arrow_schema(_TASK_RESULT)).collect()
    messages = [_LanceCommit(list(r["fragments_json"]), r["rows"]) for r in results]
    writer.commit(messages)
    return sum(m.rows for m in messages)


@dataclass(frozen=True)
class PendingAppend:
    """An append whose fragments Spark tasks write (:meth:`write_task`, in any task
    function) and this process commits (:meth:`commit`): the table is unchanged until
    then, and a run that stops first leaves their data files unreferenced, as a failed
    append does."""

    writer: _LanceWriter

    @property
    def schema(self) -> pa.Schema:
        """The columns and types the rows are written with: the table's, for an
        existing table."""
        return self.writer.schema

    def write_task(self, batches: Iterator[pa.RecordBatch]) -> list[str]:
        """Write one task's rows as fragments (data files only); their metadata (JSON),
        for :meth:`commit`."""
        return self.writer.write(batches).fragments_json

    def commit(self, fragment_lists: Iterable[Sequence[str]]) -> None:
        """Commit the fragments the tasks wrote (what :meth:`write_task` returned) in
        one transaction: an Append, or the table's creation by a first write (with no
        row too)."""
        self.writer.commit([_LanceCommit(list(f), 0) for f in fragment_lists])


def pending_append(path: str, given: pa.Schema, max_rows_per_file: int = 1024 * 1024
                   ) -> PendingAppend:
    """An append of rows of the `given` columns to the Lance table at `path` (created
    by the commit of a first write), written by Spark tasks."""
    return PendingAppend(_writer(path, given, False, max_rows_per_file))


# Lance's per-column encoding setting (field metadata), read when a data file is written.
_COMPRESSION = b"lance-encoding:compression"


def stored_uncompressed(schema: pa.Schema) -> pa.Schema:
    """`schema` with its binary columns -- image files: JPEG, PNG, WebP, already
    compressed -- marked to be written without compression: what Lance's file format
    2.2 does to binary values by default takes twice the CPU of the write and stores
    JPEGs in the same bytes (docs/performance.md). A column that already says how to
    compress keeps it; other columns are left to Lance's defaults."""
    fields = []
    for f in schema:
        if (pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)) and (
                _COMPRESSION not in (f.metadata or {})):
            f = f.with_metadata({**(f.metadata or {}), _COMPRESSION: b"none"})
        fields.append(f)
    return pa.schema(fields, metadata=schema.metadata)


def _rebuild_empty_lists(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Work around pylance 14 rejecting list columns whose values are all empty.

    Arrow IPC (how Spark hands batches to Python) may give an empty child array a
    zero-length offsets buffer; Lance then reads garbage offsets ("Error converting
    offset[0] (-189153672) to usize"). Rebuilding such columns in Python gives them
    a proper offsets buffer. Only list columns without any child values are touched.
    """
    columns = list(batch.columns)
    changed = False
    for i, col in enumerate(columns):
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            if len(col.values) == 0 and len(col) > 0:
                columns[i] = pa.array(col.to_pylist(), type=col.type)
                changed = True
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema) if changed else batch


def _exists(path: str) -> bool:
    # Not "any error means absent": on object storage an unreachable store would turn
    # this Append into an Overwrite. lance_exists raises, naming the table.
    from etl.storage import lance_exists

    return lance_exists(path)


class LanceDataSource(DataSource):
    """``format("lance")``: options ``path`` (required), ``version``, ``columns``,
    ``filter`` (read), ``max_rows_per_file`` (write)."""

    @classmethod
    def name(cls) -> str:
        return "lance"

    def _path(self) -> str:
        path = self.options.get("path")
        if not path:
            raise ValueError("format('lance') needs a path: .load(path) or .save(path)")
        return path

    def _version(self) -> int | None:
        v = self.options.get("version")
        return int(v) if v not in (None, "") else None

    def schema(self) -> StructType:
        from pyspark.sql.pandas.types import from_arrow_schema

        arrow = _dataset(self._path(), self._version()).schema
        fields = [arrow.field(c) for c in self._columns(arrow)]
        # Same order as read() yields them: Lance appends _rowaddr, then _fragment_id.
        if self.options.get("row_address", "").lower() == "true":
            fields.append(pa.field(ROW_ADDRESS, pa.int64(), nullable=False))
        if self.options.get("fragment_id", "").lower() == "true":
            fields.append(pa.field(FRAGMENT_ID, pa.int32(), nullable=False))
        return from_arrow_schema(pa.schema(fields))

    def _columns(self, arrow: pa.Schema) -> list[str]:
        raw = self.options.get("columns")
        if not raw:
            return list(arrow.names)
        cols = [c.strip() for c in raw.split(",") if c.strip()]
        missing = [c for c in cols if c not in arrow.names]
        if missing:
            raise ValueError(
                f"lance table {self._path()!r} has no column {missing[0]!r} "
                f"(columns: {', '.join(arrow.names)})"
            )
        return cols

    def reader(self, schema: StructType) -> DataSourceReader:
        path = self._path()
        version = self._version() or table_version(path)
        return _LanceReader(
            path, version, list(schema.fieldNames()), self.options.get("filter") or None
        )

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceArrowWriter:
        from pyspark.sql.pandas.types import to_arrow_schema

        path = self._path()
        max_rows = int(self.options.get("max_rows_per_file", 1024 * 1024))
        return _writer(path, to_arrow_schema(schema), overwrite, max_rows)


def _writer(path: str, given: pa.Schema, overwrite: bool, max_rows_per_file: int
            ) -> _LanceWriter:
    """The writer of `given` columns to `path`: an append to an existing table writes
    them as the table types them (:func:`_append_schema`)."""
    arrow = _append_schema(path, given) if not overwrite and _exists(path) else given
    return _LanceWriter(path, arrow, overwrite, max_rows_per_file)


def _append_schema(path: str, given: pa.Schema) -> pa.Schema:
    """The schema an append writes: the given columns, typed as the table has them."""
    table = _dataset(path).schema
    unknown = [n for n in given.names if n not in table.names]
    if unknown:
        raise ValueError(
            f"lance table {path!r} has no column {unknown[0]!r}; add it first "
            "(etl.writers.lance_columns.write_columns) or overwrite the table"
        )
    return pa.schema([table.field(n) for n in given.names])


def delete_rows(path: str, sample_ids: list[str]) -> int:
    """Delete the rows of `sample_ids` from the Lance table at `path` in one version
    (deletion files: no data file is rewritten, see
    :func:`etl.lakehouse.maintenance.materialize_deletions` for that). Returns how many
    rows were deleted; ids the table does not hold are ignored (callers pass ids it
    holds: Lance writes a version even when none matches)."""
    if not sample_ids:
        return 0
    ids = pa.table({"sample_id": pa.array(sorted(set(sample_ids)), pa.string())})
    ds = _dataset(path)
    # merge_insert joins the ids against the table (its sample_id index when there is
    # one), however many there are: one transaction, not one predicate per chunk.
    stats = ds.merge_insert("sample_id").when_matched_delete().execute(ids)
    return int(stats["num_deleted_rows"])


def deleted_per_fragment(path: str) -> dict[int, int]:
    """Fragment id -> rows its deletion file marks deleted (0: none), from the table's
    metadata alone: what a delete touched is the difference of two of these."""
    return {
        f.fragment_id: (f.metadata.deletion_file.num_deleted_rows
                        if f.metadata.deletion_file is not None else 0)
        for f in _dataset(path).get_fragments()
    }


# Sessions ``lance`` is registered in. Registering is not free: a session's first
# registration of a Python data source (or its first lookup of any format) makes Spark
# start a Python process to look for installed data sources (~0.7 s in a cold process,
# measured), which a night that reads no table through Spark need not pay.
_REGISTERED: weakref.WeakSet = weakref.WeakSet()
_REGISTERING = threading.Lock()


def register_lance(spark) -> None:
    """Register :class:`LanceDataSource` as format ``lance`` in `spark`, once."""
    with _REGISTERING:
        if spark not in _REGISTERED:
            spark.dataSource.register(LanceDataSource)
            _REGISTERED.add(spark)


def lance_reader(spark):
    """``spark.read.format("lance")``, the format registered first: how lakeshard's own
    code reads a Lance table through Spark."""
    register_lance(spark)
    return spark.read.format("lance")
