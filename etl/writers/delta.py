"""Delta sinks of the bronze layer and beside it, all written idempotently:

* ``rejects`` -- one row per record that did not make it, and why;
* ``manifest`` -- one row per source record (accepted, rejected or removed);
* ``accounting`` -- per run and source, records by outcome and reason;
* ``dedup`` -- the duplicate assignments a dedup plan changed;
* ``takedowns`` -- takedown requests, what they matched, when applied and purged.

A table written by an older lakeshard gains the columns a schema has since added
(nullable, by ``ALTER TABLE ... ADD COLUMNS``: a metadata-only change) on its next write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from etl.runtime.local import local_arrow
from etl.schema import (
    ACCOUNTING_SCHEMA,
    MANIFEST_SCHEMA,
    REJECTS_SCHEMA,
    REMOVED,
    TAKEDOWNS_SCHEMA,
    arrow_schema,
)
from etl.writers.remote import subtree

__all__ = [
    "ensure_table",
    "merge_rejects",
    "read_columns",
    "holds_none",
    "is_empty",
    "merge_manifest",
    "merge_accounting",
    "delete_rejects",
    "mark_removed",
    "merge_dedup",
    "merge_dedup_rows",
    "merge_rows",
    "append_rows",
    "set_properties",
    "record_takedowns",
    "update_takedowns",
    "mark_takedowns_applied",
]

# Manifest columns a takedown clears: what the source said about the record. Its ids,
# references and hashes stay, so that it is recognised (and refused) if it comes back.
_SCRUBBED = ("caption_original", "license", "metadata_json", "upstream_quality",
             "upstream_nsfw", "upstream_watermark", "upstream_pii")


def ensure_table(spark: SparkSession, path: str, schema: StructType,
                 properties: Mapping[str, str] | None = None) -> None:
    """The table exists, with every column of `schema` (missing ones added as nullable)
    and `properties` set: looked up and, on a first write, created by delta-rs in this
    process (no Spark job); by Spark for a table delta-rs cannot read or a schema it
    cannot write. A table made before a property was asked for gets it here (one
    metadata commit)."""
    from delta.tables import DeltaTable

    from etl import storage

    props = dict(properties or {})
    have = _rs_columns(path, schema, props)
    if have is None:
        builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema)
        for k, v in props.items():
            builder = builder.property(k, v)
        builder.execute()
        have = set(DeltaTable.forPath(spark, path).toDF().columns)
    missing = [f for f in schema.fields if f.name not in have]
    if missing:
        cols = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in missing)
        spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS ({cols})")
    if props:
        current = storage.delta_properties(spark, path) or {}
        unset = {k: v for k, v in props.items() if current.get(k) != v}
        if unset:
            set_properties(spark, path, unset)


def _rs_columns(path: str, schema: StructType, properties: dict[str, str]) -> set[str] | None:
    """The columns of the Delta table at `path`, read from its log by delta-rs; a table
    not there yet is created empty with `schema` and `properties` first. None when
    delta-rs cannot (a table feature it lacks, a type :func:`etl.schema.arrow_schema`
    does not map)."""
    from deltalake import DeltaTable as RsTable
    from deltalake.exceptions import DeltaError

    from etl import storage

    try:
        table = storage.delta_rs_table(path)
        if table is not None:
            return set(table.schema().to_arrow().names)
        RsTable.create(storage.object_url(path), arrow_schema(schema), mode="ignore",
                       configuration=properties or None,
                       storage_options=storage.delta_rs_storage(path, write=True))
        return set(schema.fieldNames())
    except TypeError:
        return None
    except DeltaError as exc:
        if storage.delta_rs_unsupported(exc):
            return None
        raise


def read_columns(path: str, columns: list[str], *, bound: int):
    """`columns` of the Delta table at `path` as an Arrow table, read by delta-rs in
    this process (no Spark job) when its log's statistics say it has at most `bound`
    rows; an empty table with no table there. None when that cannot be told cheaply
    (more rows, files without statistics, a feature delta-rs does not read)."""
    import pyarrow as pa
    from deltalake.exceptions import DeltaError

    from etl import storage

    try:
        table = storage.delta_rs_table(path)
        if table is None:
            return pa.table({c: pa.array([], pa.string()) for c in columns})
        actions = table.get_add_actions(flatten=True)
        if "num_records" not in actions.schema.names:
            return None
        counts = actions.column("num_records").to_pylist()
        if any(n is None for n in counts) or sum(counts) > bound:
            return None
        return table.to_pyarrow_table(columns=columns,
                                      filesystem=subtree(storage.object_url(path)))
    except DeltaError as exc:
        if storage.delta_rs_unsupported(exc):
            return None
        raise


def holds_none(path: str, ids: list[str], *, bound: int) -> bool:
    """Whether the Delta table at `path` holds none of the ``sample_id`` s `ids`, told by
    delta-rs (:func:`read_columns`, within `bound`). False when it cannot tell that
    cheaply: the caller then MERGEs, which is right either way."""
    held = read_columns(path, ["sample_id"], bound=bound)
    if held is None:
        return False
    return not held.num_rows or not set(held.column("sample_id").to_pylist()) & set(ids)


def is_empty(path: str) -> bool:
    """Whether the Delta table at `path` holds no row, told from its log by delta-rs;
    False when it cannot tell."""
    held = read_columns(path, ["sample_id"], bound=0)
    return held is not None and held.num_rows == 0


def _as_arrow(rows, schema: StructType):
    """`rows` -- a DataFrame, or an Arrow table built on the driver -- as an Arrow table
    of `schema`'s columns: a frame collected once (no job where it is local data)."""
    import pyarrow as pa

    names = schema.fieldNames()
    return rows.select(names) if isinstance(rows, pa.Table) else local_arrow(rows.select(*names))


def _as_frame(spark: SparkSession, rows, schema: StructType) -> DataFrame:
    """`rows` (as :func:`_as_arrow` takes them) as the DataFrame a Spark MERGE reads: an
    Arrow table as local data."""
    import pyarrow as pa

    if isinstance(rows, pa.Table):
        return spark.createDataFrame(rows.select(schema.fieldNames()), schema)
    return rows.select(*schema.fieldNames())


def merge_rejects(spark: SparkSession, rejects, path: str, *, driver_bound: int = 0) -> None:
    """Insert rejects not yet recorded (a DataFrame, or an Arrow table built on the
    driver); a rerun of the same input adds nothing.

    Keyed by (sample_id, stage, reason, detail): a record rejected again for the same
    reason keeps its first row, with the run that first rejected it; each extra copy
    of a duplicated key has its own row (its detail says which copy).

    `driver_bound` > 0: rows of records the table does not hold at all (every record of
    a first run; see :func:`holds_none`, within that bound) are one append by delta-rs,
    the table the MERGE would leave, without its Spark jobs."""
    from delta.tables import DeltaTable

    ensure_table(spark, path, REJECTS_SCHEMA)
    key = "t.sample_id = s.sample_id AND t.stage = s.stage AND t.reason = s.reason AND "
    if driver_bound:
        data = _as_arrow(rejects, REJECTS_SCHEMA)  # collected once
        if _appended_new(data, path, REJECTS_SCHEMA, driver_bound) or merge_rows(
                data, path, REJECTS_SCHEMA, key + "t.detail IS NOT DISTINCT FROM s.detail",
                lambda m: m.when_not_matched_insert_all()):
            return  # none of the records held: an append; some: the same MERGE, by delta-rs
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(_as_frame(spark, rejects, REJECTS_SCHEMA).alias("s"),
               key + "t.detail <=> s.detail")
        .whenNotMatchedInsertAll()
        .execute()
    )


def _appended_new(data, path: str, schema: StructType, bound: int) -> bool:
    """Append the Arrow table `data` by delta-rs when the table holds none of its
    records; False (and nothing written) otherwise. No rows: nothing to commit."""
    if not data.num_rows:
        return True
    return holds_none(path, data.column("sample_id").to_pylist(), bound=bound) and \
        append_rows(data, path, schema)


def merge_manifest(spark: SparkSession, records, path: str, *,
                   before: DataFrame | None = None, driver_bound: int = 0,
                   held: frozenset[str] | None = None) -> None:
    """Upsert manifest rows (a DataFrame, or an Arrow table built on the driver) on
    sample_id: new records inserted, records that were reprocessed (changed fingerprint,
    transient failure retried, back after a removal) updated. Records not in `records`
    -- everything unchanged -- are not touched.

    `driver_bound` > 0: a batch of records the table holds none of -- a night of new
    records only, a first run -- is one append by delta-rs in this process, the table a
    MERGE would leave without the MERGE's Spark jobs; otherwise (or for a table delta-rs
    cannot write) the MERGE. Whether it holds any is asked of `before`, the manifest as
    this run read it (materialised), of `held` (the listed ids the manifest holds, when
    the comparison read its rows on the driver), or else of the table
    (:func:`holds_none`, within the bound)."""
    from delta.tables import DeltaTable

    ensure_table(spark, path, MANIFEST_SCHEMA)
    if driver_bound and held is not None:
        data = _as_arrow(records, MANIFEST_SCHEMA)
        if not data.num_rows or (held.isdisjoint(data.column("sample_id").to_pylist())
                                 and append_rows(data, path, MANIFEST_SCHEMA)):
            return
    elif driver_bound and before is not None:
        data = _as_arrow(records, MANIFEST_SCHEMA)
        ids = spark.createDataFrame([(i,) for i in data.column("sample_id").to_pylist()],
                                    "sample_id string")
        if before.join(F.broadcast(ids), "sample_id", "left_semi").isEmpty() and \
                append_rows(data, path, MANIFEST_SCHEMA):
            return
    elif driver_bound:
        data = _as_arrow(records, MANIFEST_SCHEMA)  # collected once
        if _appended_new(data, path, MANIFEST_SCHEMA, driver_bound):
            return
    if driver_bound and merge_rows(
            data, path, MANIFEST_SCHEMA, "t.sample_id = s.sample_id",
            lambda m: m.when_matched_update_all().when_not_matched_insert_all()):
        return  # records the table holds (changed, retried): the same MERGE, by delta-rs
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(_as_frame(spark, records, MANIFEST_SCHEMA).alias("s"),
               "t.sample_id = s.sample_id")
        .whenMatchedUpdateAll()
        .whenNotMatchedInsertAll()
        .execute()
    )


def merge_accounting(spark: SparkSession, rows, path: str) -> None:
    """Record a run's counts (a DataFrame, or an Arrow table built on the driver); writing
    the same run again changes nothing.

    The rows of a run the table does not hold yet (every run's first write) are one
    append by delta-rs in this process (a few dozen rows: no MERGE, no Spark job to
    write them); otherwise, or for a table delta-rs cannot write, a Spark MERGE."""
    from delta.tables import DeltaTable

    data = _as_arrow(rows, ACCOUNTING_SCHEMA)
    if _append_new_runs(data, path):  # the table exists with every column: no Spark
        return
    ensure_table(spark, path, ACCOUNTING_SCHEMA)
    if _append_new_runs(data, path):
        return
    frame = _as_frame(spark, rows, ACCOUNTING_SCHEMA)
    cond = " AND ".join(
        f"t.{c} <=> s.{c}" for c in ("run_id", "source", "status", "stage", "reason",
                                     "filter_reason")
    )
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(frame.alias("s"), cond)
        .whenNotMatchedInsertAll()
        .execute()
    )


def _append_new_runs(data, path: str) -> bool:
    """Append accounting rows with delta-rs if none of their runs is in the table yet;
    False when that cannot be done (then the caller MERGEs)."""
    from deltalake.exceptions import DeltaError

    from etl import storage

    try:
        table = storage.delta_rs_table(path, write=True)
        if table is None or not set(data.column_names) <= set(table.schema().to_arrow().names):
            return False  # no table yet, or one missing a column: ensure_table first
        runs = sorted(set(data.column("run_id").to_pylist()))
        if runs and table.to_pyarrow_table(
                columns=["run_id"], filters=[("run_id", "in", runs)],
                filesystem=subtree(storage.object_url(path))).num_rows:
            return False  # the same run again: the MERGE keeps it idempotent
    except DeltaError as exc:
        if storage.delta_rs_unsupported(exc):
            return False
        raise
    return append_rows(data, path, ACCOUNTING_SCHEMA)


def merge_rows(data, path: str, schema: StructType, predicate: str, clauses) -> bool:
    """MERGE the Arrow table `data` (the columns of `schema`, plus any the clauses name)
    into the Delta table at `path` with delta-rs in this process: one commit, no Spark
    job. `clauses` adds the when-clauses to delta-rs's merger (``s``: the source, ``t``:
    the table). False when delta-rs cannot write this table or these types: the caller
    MERGEs with Spark. Only the run lock's holder writes (as for every write)."""
    import pyarrow as pa
    from deltalake.exceptions import DeltaError

    from etl import storage

    try:
        arrow = arrow_schema(schema)
    except TypeError:
        return False
    cast = pa.table({f.name: data.column(f.name).cast(f.type) for f in arrow} |
                    {c: data.column(c) for c in data.column_names if c not in arrow.names})
    try:
        table = storage.delta_rs_table(path, write=True)
        if table is None:
            return False
        clauses(table.merge(cast, predicate, source_alias="s", target_alias="t")).execute()
        return True
    except DeltaError as exc:
        if storage.delta_rs_unsupported(exc):
            return False
        raise


def append_rows(data, path: str, schema: StructType) -> bool:
    """Append the Arrow table `data` (the columns of `schema`) to the Delta table at
    `path` with delta-rs: one commit from this process, no Spark job. False when
    delta-rs cannot write this table (a protocol feature it lacks) or these types: the
    caller writes with Spark. Only the run lock's holder writes (as for every write)."""
    from deltalake import write_deltalake
    from deltalake.exceptions import DeltaError

    from etl import storage

    try:
        arrow = arrow_schema(schema)
    except TypeError:  # a type lakeshard's tables do not use
        return False
    try:
        table = storage.delta_rs_table(path, write=True)
        if table is None:
            return False
        write_deltalake(table, data.select(schema.fieldNames()).cast(arrow), mode="append")
        return True
    except DeltaError as exc:
        if storage.delta_rs_unsupported(exc):
            return False
        raise


def delete_rejects(spark: SparkSession, ids: DataFrame, path: str) -> None:
    """Delete every rejects row of the ``sample_id`` s in `ids` (all copies)."""
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, path):
        return
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(ids.select("sample_id").distinct().alias("s"), "t.sample_id = s.sample_id")
        .whenMatchedDelete()
        .execute()
    )


def mark_removed(spark: SparkSession, removed: DataFrame, path: str, *, run_id: str,
                 removed_at: datetime) -> None:
    """Manifest rows of `removed` (``sample_id``, ``reason``) become ``removed``.

    ``stage`` says which table the record left (``curated`` if it had been accepted,
    ``rejects`` if rejected). A takedown (reason ``taken_down``) also clears what the
    source said about it (caption, licence, metadata, upstream flags) and applies to a
    record already removed from its source; a source removal touches only live rows."""
    from delta.tables import DeltaTable

    ensure_table(spark, path, MANIFEST_SCHEMA)
    left = (
        "CASE WHEN t.status = 'accepted' THEN 'curated' "
        "WHEN t.status = 'rejected' THEN 'rejects' ELSE t.stage END"
    )
    common = {
        "status": F.lit(REMOVED), "stage": F.expr(left), "reason": F.col("s.reason"),
        "run_id": F.lit(run_id), "removed_at": F.lit(removed_at),
    }
    scrub = {c: F.lit(None) for c in _SCRUBBED}
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(removed.select("sample_id", "reason").distinct().alias("s"),
               "t.sample_id = s.sample_id")
        .whenMatchedUpdate(condition="s.reason = 'taken_down'", set={**common, **scrub})
        .whenMatchedUpdate(condition=f"t.status != '{REMOVED}'", set=common)
        .execute()
    )


def merge_dedup_rows(path: str, changes, removed: list[str], columns: Iterable[str]) -> bool:
    """:func:`merge_dedup` for a plan made on the driver (`changes`: an Arrow table of
    the dedup schema's columns), by delta-rs in this process; False when delta-rs cannot
    write the table (the caller then MERGEs with Spark)."""
    import pyarrow as pa

    from etl.schema import DEDUP_SCHEMA

    loose = pa.schema([f.with_nullable(True) for f in changes.schema])  # deletes: ids only
    gone = pa.table({f.name: pa.array(removed, pa.string()) if f.name == "sample_id"
                     else pa.nulls(len(removed), f.type) for f in loose}, schema=loose)
    ops = ["upsert"] * changes.num_rows + ["delete"] * len(removed)
    source = pa.concat_tables([changes.cast(loose), gone]).append_column(
        "_op", pa.array(ops, pa.string()))
    cols = {c: f"s.{c}" for c in columns}
    return merge_rows(source, path, DEDUP_SCHEMA, "t.sample_id = s.sample_id", lambda m: (
        m.when_matched_delete(predicate="s._op = 'delete'")
        .when_matched_update(updates=cols, predicate="s._op = 'upsert'")
        .when_not_matched_insert(updates=cols, predicate="s._op = 'upsert'")))


def merge_dedup(spark: SparkSession, path: str, changes: DataFrame, removed: DataFrame,
                columns: Iterable[str]) -> None:
    """Apply a dedup plan: upsert `changes` (rows whose assignment changed), delete the
    ``sample_id`` s in `removed` (rows gone from the curated table)."""
    from delta.tables import DeltaTable

    source = changes.withColumn("_op", F.lit("upsert")).unionByName(
        removed.withColumn("_op", F.lit("delete")), allowMissingColumns=True
    )
    cols = {c: f"s.{c}" for c in columns}
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(source.alias("s"), "t.sample_id = s.sample_id")
        .whenMatchedDelete(condition="s._op = 'delete'")
        .whenMatchedUpdate(condition="s._op = 'upsert'", set=cols)
        .whenNotMatchedInsert(condition="s._op = 'upsert'", values=cols)
        .execute()
    )


def set_properties(spark: SparkSession, path: str, props: Mapping[str, str]) -> None:
    """Set Delta table properties (one metadata commit): by delta-rs in this process,
    or Spark's ``ALTER TABLE`` for a table delta-rs cannot write."""
    from deltalake.exceptions import DeltaError

    from etl import storage

    try:
        table = storage.delta_rs_table(path, write=True)
        if table is not None:
            table.alter.set_table_properties(dict(props), raise_if_not_exists=False)
            return
    except DeltaError as exc:
        if not storage.delta_rs_unsupported(exc):
            raise
    settings = ", ".join(f"'{k}' = '{v}'" for k, v in props.items())
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({settings})")


def record_takedowns(spark: SparkSession, rows: DataFrame, path: str) -> None:
    """Insert takedown rows not yet recorded (keyed by request, kind, value, origin and
    matched record): recording the same request again adds nothing."""
    from delta.tables import DeltaTable

    ensure_table(spark, path, TAKEDOWNS_SCHEMA)
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(
            rows.select(*TAKEDOWNS_SCHEMA.fieldNames()).alias("s"),
            "t.request_id = s.request_id AND t.kind = s.kind AND t.value = s.value "
            "AND t.origin = s.origin AND t.sample_id <=> s.sample_id",
        )
        .whenNotMatchedInsertAll()
        .execute()
    )


def update_takedowns(spark: SparkSession, path: str, condition: str,
                     values: Mapping[str, object]) -> None:
    """Set `values` (column -> Python value) on the takedown rows matching `condition`."""
    from delta.tables import DeltaTable

    DeltaTable.forPath(spark, path).update(
        condition, {k: F.lit(v) if v is not None else F.lit(None) for k, v in values.items()}
    )


def mark_takedowns_applied(spark: SparkSession, path: str, *, now: datetime,
                           purge_version: int | None, purge_after: datetime | None,
                           purged: bool, oldest_version: int | None = None) -> None:
    """Every request not yet applied is applied now, with when its bytes are (or will be)
    gone; and requests whose purge version is now the oldest version left or older are
    purged."""
    update_takedowns(spark, path, "applied_at IS NULL", {
        "applied_at": now, "purge_version": purge_version,
        "purge_after": purge_after or now, "purged_at": now if purged else None,
    })
    if oldest_version is not None:
        update_takedowns(spark, path,
                         f"purged_at IS NULL AND purge_version <= {int(oldest_version)}",
                         {"purged_at": now})
