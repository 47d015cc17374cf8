"""Ingest rows -> prepared rows (decoded, oriented, re-encoded as JPEG) and rejects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from etl.config import FetchConfig, PrepareConfig, SourceConfig
from etl.runtime.local import is_local, local_arrow, per_batch, projected
from etl.schema import CURATED_COLUMNS, REJECTS_SCHEMA
from etl.transforms.fetch import fetch_outcome, needs_fetch
from etl.transforms.prepare_task import (
    ARGS,
    FLAG,
    FP_TYPE,
    WRITTEN,
    RowSink,
    batch_args,
    fp_struct,
    stored_batch,
    task_function,
)
from udfs.arrow_types import nullable_type
from udfs.fetch import rules_for
from udfs.images import PREPARED_TYPE, prepare_udf
from udfs.ingest import fetch_prepare_batches
from udfs.outcomes import INTERNAL_ERROR

__all__ = ["fetch_and_prepare", "prepared_outcomes", "prepare_images", "accepted_rows",
           "curated_columns", "curated_schema", "rejected_rows",
           "Outcomes", "outcome_counts", "Counted", "counted", "failure_examples"]


def fetch_and_prepare(df: DataFrame, fetch: FetchConfig, sources: Iterable[SourceConfig],
                      opts: PrepareConfig, *, on_driver: bool = False,
                      sink: RowSink | None = None) -> DataFrame:
    """Fetch the images readable rows reference and prepare every readable row, in one
    pass of the fetch + prepare batch function (:mod:`udfs.ingest`) in one Python worker
    per task (:mod:`etl.transforms.prepare_task`): the source bytes never come back.

    A fetch is :func:`etl.transforms.fetch.fetch_images`'s, under each row's `source`
    rules (one of `sources`); a failed one makes the row ``rejected`` with the fetch
    status as reason (``fetch_failed``, ``fetch_detail``) and unprepared. Adds
    ``original_sha256`` (the source bytes' sha256: fetched, or carried by the row, read
    or not; null without bytes) and ``prepared`` (:data:`PREPARED_TYPE`; null where the
    row is not readable after the fetch); drops ``image_bytes``. The final outcome is
    :func:`prepared_outcomes`' (after any refusal by the source bytes' hash).

    `sink`: each task writes the rows it accepts to it (``prepared.image`` is then null
    on every row) and adds ``_written`` and ``_sink_written``
    (:mod:`etl.transforms.prepare_task`; the caller commits and checks them).

    `on_driver`: `df` is a few rows whose plan holds no Python UDF; they are collected
    and fetched and prepared here, by the same batch function, in this process (no
    Python worker starts), and the result is a frame of local data."""
    rules = {s.name: rules_for(s) for s in sources}
    read_ok = F.coalesce(F.col("read_status") == "ok", F.lit(False))
    need = F.col("_need")
    # ARGS: rows not processed pass nulls. One projection (each frame built is analysed
    # by the driver JVM as it is made: a few tenths of a second in a cold one).
    staged = df.select("*", needs_fetch().alias("_need"), read_ok.alias(ARGS[0]),
                       F.when(needs_fetch(), F.col("image_ref")).alias(ARGS[1]))
    fields = [f for f in staged.schema.fields if f.name not in ARGS]
    fields.append(T.StructField("_fp", FP_TYPE, True))
    if on_driver:
        if sink is not None:
            raise ValueError("fetch_and_prepare: a sink is for Spark's tasks, not the driver")
        out = _fetch_prepare_in_driver(staged, T.StructType(fields), fetch, rules, opts)
    else:
        if sink is not None:
            fields += [T.StructField(FLAG, T.BooleanType(), True),
                       T.StructField(WRITTEN, T.ArrayType(T.StringType(), True), True)]
        schema = T.StructType(fields)
        out = staged.mapInArrow(task_function(fetch, rules, opts, sink, to_arrow_schema(schema)),
                                schema)
    fp = F.col("_fp")
    fetched = fetch_outcome(need, fp.fetch_status, fp.fetch_detail)
    prepared = F.struct(*[fp[name].alias(name) for name in PREPARED_TYPE.fieldNames()])
    has_bytes = F.col("image_bytes").isNotNull()
    return _with_columns(out, [f.name for f in fields], {
        **fetched,
        "original_sha256": F.when(read_ok, fp.original_sha256)
        .when(has_bytes, F.sha2(F.col("image_bytes"), 256)),
        "prepared": F.when(read_ok & ~fetched["fetch_failed"], prepared),
    }, drop=("_fp", "image_bytes", "_need"))


def _with_columns(df: DataFrame, names: Sequence[str], columns: Mapping[str, Column],
                  drop: Sequence[str]) -> DataFrame:
    """``df.withColumns(columns).drop(*drop)`` as one projection, the columns in the
    same order (`names`: `df`'s columns, known here without asking the JVM)."""
    kept = [columns[c].alias(c) if c in columns else F.col(c) for c in names if c not in drop]
    return df.select(*kept, *[v.alias(c) for c, v in columns.items() if c not in names])


# Rows per batch of a fetch and prepare on the driver: a batch's downloads run while the
# batch before is prepared, as in the tasks.
_DRIVER_BATCH = 64


def _fetch_prepare_in_driver(staged: DataFrame, schema: T.StructType, fetch: FetchConfig,
                        rules: Mapping, opts: PrepareConfig) -> DataFrame:
    """`staged` (with the :data:`ARGS` columns) with ``_fp`` (:data:`FP_TYPE`, null
    where the row is not to be processed) computed in this process, as a frame of local
    data of `schema` (`staged`'s columns but the :data:`ARGS`, then ``_fp``)."""
    table = local_arrow(staged)
    chunks = (batch_args(table.slice(i, _DRIVER_BATCH))
              for i in range(0, table.num_rows, _DRIVER_BATCH))
    results = list(fetch_prepare_batches(chunks, fetch, rules, opts))
    struct = fp_struct(results, table.column(ARGS[0]).combine_chunks())
    local = table.drop_columns(list(ARGS)).append_column("_fp", struct)
    return staged.sparkSession.createDataFrame(local, schema)


def prepared_outcomes(rows: DataFrame) -> DataFrame:
    """The final ``status`` / ``stage`` / ``reason`` / ``detail`` of each row with a
    `prepared` struct: the prepare's where the row was read, else the read's (stage
    ``ingest``); ``prepared`` is null where the row was not read (refused after it was
    prepared: none of its fields reach a table)."""
    read_ok = F.col("read_status") == "ok"
    p = F.col("prepared")
    return rows.withColumn("prepared", F.when(read_ok, p)).select(
        "*",
        F.when(read_ok, p.status).otherwise(F.col("read_status")).alias("status"),
        F.when(read_ok, F.lit("prepare")).otherwise(F.lit("ingest")).alias("stage"),
        F.when(read_ok, p.reason).otherwise(F.col("read_reason")).alias("reason"),
        F.when(read_ok, p.detail).alias("detail"),
    )


def prepare_images(ingested: DataFrame, opts: PrepareConfig) -> DataFrame:
    """Run the image UDF over rows that were read; keep every row.

    The result has the ingest columns, a `prepared` struct (null where the read
    already failed) and a final `status` / `stage` / `reason` / `detail` per row.
    """
    udf = prepare_udf(opts)
    read_ok = F.col("read_status") == "ok"
    return prepared_outcomes(ingested.withColumn(
        "prepared", F.when(read_ok, udf(F.col("image_bytes")))
    ))


def curated_columns(prepared: DataFrame, *, run_id: str, ingested_at: Column,
                    extra: Sequence[str] = ()) -> list[Column]:
    """A curated table row of each `prepared` row, in the table's column order, then
    the columns `extra` of `prepared` as they are (from the same row: no join)."""
    p = F.col("prepared")
    columns = {c: F.col(c) for c in prepared.columns}
    columns.update({f: p[f] for f in PREPARED_TYPE.fieldNames()})
    columns.update(
        image_size_bytes=F.length(p.image).cast("long"),  # the stored JPEG's size
        run_id=F.lit(run_id),
        ingested_at=ingested_at,
    )
    return [*[columns[c].alias(c) for c in CURATED_COLUMNS], *[F.col(c) for c in extra]]


def accepted_rows(prepared: DataFrame | pa.Table, *, run_id: str, ingested_at: datetime,
                  extra: Sequence[str] = ()) -> DataFrame | pa.Table:
    """Rows for the curated table (:func:`curated_columns`) of the accepted rows: a
    Spark projection of a frame, or built here from prepared rows this process holds (an
    Arrow table, as ``toArrow`` gives them; :func:`~etl.transforms.prepare_task.
    stored_batch`, the rule a writing task stores its rows by), with the same columns
    and types (:func:`curated_schema`)."""
    if not isinstance(prepared, pa.Table):
        return prepared.where(F.col("status") == "ok").select(*curated_columns(
            prepared, run_id=run_id, ingested_at=F.lit(ingested_at), extra=extra))
    schema = to_arrow_schema(curated_schema(from_arrow_schema(prepared.schema), extra=extra))
    idx = pc.indices_nonzero(pc.fill_null(pc.equal(prepared.column("status"), "ok"), False))
    struct = prepared.column("prepared").combine_chunks().take(idx)
    fields = {name: struct.field(name) for name in PREPARED_TYPE.fieldNames()}
    # As Spark stores F.lit(ingested_at): a naive datetime is this process's local time.
    at = T.TimestampType().toInternal(ingested_at)
    return pa.Table.from_batches([stored_batch(prepared, idx, fields, schema, run_id, at)])


# The columns curated_columns computes, typed as Spark's analysis types them: the size
# of a nullable binary, the run's id and its timestamp as literals.
_COMPUTED_FIELDS = {
    "image_size_bytes": T.StructField("image_size_bytes", T.LongType(), True),
    "run_id": T.StructField("run_id", T.StringType(), False),
    "ingested_at": T.StructField("ingested_at", T.TimestampType(), False),
}


def curated_schema(rows: T.StructType, *, extra: Sequence[str] = ()) -> T.StructType:
    """The types :func:`accepted_rows` gives rows of schema `rows` (the columns before
    :func:`fetch_and_prepare`) once prepared, with the run's timestamp as a literal
    (``F.lit``). Derived here as Spark's analysis derives them -- the row's own columns
    as they are, the prepared image's fields nullable (fields of a nullable struct), the
    computed ones (:data:`_COMPUTED_FIELDS`) --, with no query of its own planned (0.18 s
    in a cold driver JVM, docs/performance.md)."""
    prepared = {f.name: T.StructField(f.name, f.dataType, True)
                for f in nullable_type(PREPARED_TYPE).fields}
    own = {f.name: f for f in rows.fields}
    return T.StructType([
        *[_COMPUTED_FIELDS.get(c) or prepared.get(c) or own[c] for c in CURATED_COLUMNS],
        *[own[c] for c in extra]])


def rejected_rows(prepared: DataFrame | pa.Table, *, run_id: str) -> DataFrame | pa.Table:
    """Rows for the rejects table: which record, at which stage, and why. One rule
    (:func:`_rejected_batch`), run on prepared rows this process holds (an Arrow table,
    as ``toArrow`` gives them) or in Spark's tasks
    (:func:`~etl.runtime.local.per_batch`)."""
    return per_batch(prepared, partial(_rejected_batch, run_id=run_id), REJECTS_SCHEMA,
                     [*REJECTS_SCHEMA.fieldNames(), "status"])


def _rejected_batch(prepared: pa.Table, *, run_id: str) -> pa.Table:
    """:func:`rejected_rows` of one Arrow batch."""
    rows = prepared.filter(pc.not_equal(prepared.column("status"), "ok"))
    return projected(rows, REJECTS_SCHEMA, {
        "reason": pc.coalesce(rows.column("reason"), "unknown"),
        "run_id": pa.array([run_id] * rows.num_rows, pa.string())})


# The groups of the run's accounting, and one batch's partial counts of them
# (:func:`_outcome_batch`): per group its rows and its smallest failed example, and where
# a sink wrote the rows, how many rows' ``_written`` flag disagrees with their status and
# what the sink returned, in row order (on the batch's first group).
_OUTCOME_KEYS = ("source", "stage", "status", "reason", "filter_reason")
_PARTIAL_OUTCOMES = T.StructType([
    *[T.StructField(k, T.StringType(), True) for k in _OUTCOME_KEYS],
    T.StructField("count", T.LongType(), True),
    T.StructField("example", T.StructType([T.StructField("key", T.StringType(), True),
                                           T.StructField("detail", T.StringType(), True)]),
                  True),
    T.StructField("_disagree", T.LongType(), True),
    T.StructField("_written", T.ArrayType(T.ArrayType(T.StringType(), True), True), True),
])


@dataclass(frozen=True)
class Outcomes:
    """A run's outcome counts, collected."""
    rows: list[Row]  # per group: source, stage, status, reason, filter_reason, count,
    # example (key, detail) of a failed row or None
    fragments: tuple = ()  # what a sink wrote, one list per task (rows with ``_written``)
    disagree: int = 0  # rows whose ``_written`` flag and final status disagree


def outcome_counts(prepared: DataFrame | pa.Table) -> Outcomes:
    """Counts by (source, stage, status, reason, filter_reason): the run's accounting,
    as data. `filter_reason` is set on accepted rows a light filter flagged. Each group
    of failed rows also carries an `example`: the key and detail of one of its rows (the
    smallest key, so the same input gives the same example). Rows a sink wrote
    (``_written``, ``_sink_written``: :mod:`etl.transforms.prepare_task`) also give what
    it wrote and how many rows' flag disagrees with their status.

    One rule per Arrow batch (:func:`_outcome_batch`), run on prepared rows this process
    holds (no Spark job: 1-1.5 s when it is the first of a cold driver JVM) or in Spark's
    tasks (:func:`~etl.runtime.local.per_batch`, one job); the batches' partial counts
    are merged here. `prepared` has ``source, stage, status, reason, source_key, detail``
    and either ``filter_reason`` or the ``prepared`` struct it is read from."""
    if isinstance(prepared, DataFrame) and "filter_reason" not in prepared.columns:
        prepared = prepared.withColumn("filter_reason", F.col("prepared.filter_reason"))
    partials = per_batch(prepared, _outcome_batch, _PARTIAL_OUTCOMES,
                         [*_OUTCOME_KEYS, "source_key", "detail", FLAG, WRITTEN],
                         fold=_folded)
    return _merged(partials if isinstance(partials, pa.Table) else partials.toArrow())


@dataclass(frozen=True)
class Counted:
    """Prepared rows with their outcomes, as the later steps read them."""
    rows: DataFrame  # without a sink's columns; local data where this process holds them
    outcomes: Outcomes
    held: pa.Table | None = None  # `rows` as Arrow, where this process holds them
    cached: DataFrame | None = None  # the persisted frame `rows` reads (to unpersist)


def counted(prepared: DataFrame, *, new_records: int, bound: int) -> Counted:
    """`prepared`'s outcome counts, and its rows where the later steps read them, with
    one job at most: local data (a few records prepared on the driver) is collected
    without a job; up to `bound` new records (``driver.ids``) the rows -- without their
    images, so small -- come back to the driver in the job that makes them; more are
    persisted and counted in Spark's tasks. A sink's columns (``_written``,
    ``_sink_written``) are read into the outcomes and dropped."""
    sink = [c for c in (FLAG, WRITTEN) if c in prepared.columns]
    local = is_local(prepared)
    if local or new_records <= bound:
        table = local_arrow(prepared) if local else prepared.toArrow()
        outcomes = outcome_counts(table)
        if sink:
            table, prepared = table.drop_columns(sink), prepared.drop(*sink)
        rows = prepared if local else prepared.sparkSession.createDataFrame(
            table, prepared.schema)
        return Counted(rows, outcomes, held=table)
    cached = prepared.persist(StorageLevel.MEMORY_AND_DISK)
    return Counted(cached.drop(*sink), outcome_counts(cached), cached=cached)


def _outcome_batch(table: pa.Table) -> pa.Table:
    """One batch's partial outcome counts (:data:`_PARTIAL_OUTCOMES`)."""
    if "filter_reason" not in table.column_names:
        table = table.append_column("filter_reason", pc.struct_field(
            table.column("prepared").combine_chunks(), "filter_reason"))
    keys = list(_OUTCOME_KEYS)
    aggregates = [("source_key", "count", pc.CountOptions(mode="all"))]
    sink = FLAG in table.column_names
    if sink:  # as Spark's NOT _written <=> (status = 'ok')
        ok, flag = pc.equal(table.column("status"), "ok"), table.column(FLAG)
        agree = pc.if_else(pc.and_(pc.is_null(flag), pc.is_null(ok)), True,
                           pc.fill_null(pc.equal(flag, ok), False))
        table = table.append_column("_disagree", pc.cast(pc.invert(agree), pa.int64()))
        aggregates.append(("_disagree", "sum"))
    counts = table.group_by(keys, use_threads=False).aggregate(aggregates)
    examples = _smallest_examples(table, keys)
    written = [w for w in table.column(WRITTEN).to_pylist() if w is not None] if sink else []
    groups = [(tuple(r[k] for k in keys), r["source_key_count"],
               examples.get(tuple(r[k] for k in keys)), r.get("_disagree_sum") or 0)
              for r in counts.to_pylist()]
    return _partial_table(groups, written)


def _partial_table(groups: list[tuple[tuple, int, tuple | None, int]],
                   written: list) -> pa.Table:
    """Partial counts as :data:`_PARTIAL_OUTCOMES` rows: per group (keys, count, smallest
    example, disagreeing rows), what the sink wrote on the first group's row."""
    out = [{**dict(zip(_OUTCOME_KEYS, keys, strict=True)), "count": count,
            "example": None if ex is None else {"key": ex[0], "detail": ex[1]},
            "_disagree": disagree, "_written": written if i == 0 else []}
           for i, (keys, count, ex, disagree) in enumerate(groups)]
    return pa.Table.from_pylist(out, schema=to_arrow_schema(_PARTIAL_OUTCOMES))


def _folded(partials: pa.Table) -> pa.Table:
    """A Spark task's partial counts, one row per group (:func:`_merged`'s rule): the
    driver then merges a few rows per task instead of a few per Arrow batch."""
    merged = _merged(partials)
    groups = [(tuple(r[k] for k in _OUTCOME_KEYS), r["count"],
               None if r["example"] is None else (r["example"]["key"], r["example"]["detail"]),
               merged.disagree if i == 0 else 0)
              for i, r in enumerate(merged.rows)]
    return _partial_table(groups, [list(w) for w in merged.fragments])


def _smallest_examples(table: pa.Table, keys: list[str]) -> dict[tuple, tuple]:
    """Per group, Spark's min of the (key, detail) struct over its failed rows, field by
    field, null first: in Python over the failed rows alone."""
    failed = table.filter(pc.fill_null(pc.not_equal(table.column("status"), "ok"), False))
    examples: dict[tuple, tuple] = {}
    for r in failed.select([*keys, "source_key", "detail"]).to_pylist():
        group, example = tuple(r[k] for k in keys), (r["source_key"], r["detail"])
        if group not in examples or _struct_order(example) < _struct_order(examples[group]):
            examples[group] = example
    return examples


def _merged(partial: pa.Table) -> Outcomes:
    """The batches' partial counts as one :class:`Outcomes`."""
    groups: dict[tuple, list] = {}
    fragments: list = []
    disagree = 0
    for r in partial.to_pylist():
        group = groups.setdefault(tuple(r[k] for k in _OUTCOME_KEYS), [0, None])
        group[0] += r["count"]
        ex = r["example"]
        if ex is not None and (group[1] is None or _struct_order(
                (ex["key"], ex["detail"])) < _struct_order(group[1])):
            group[1] = (ex["key"], ex["detail"])
        disagree += r["_disagree"] or 0
        fragments += [list(w) for w in r["_written"] or ()]
    rows = [Row(**dict(zip(_OUTCOME_KEYS, key, strict=True)), count=count,
                example=None if ex is None else Row(key=ex[0], detail=ex[1]))
            for key, (count, ex) in groups.items()]
    return Outcomes(rows, tuple(fragments), disagree)


def _struct_order(values: tuple) -> tuple:
    return tuple((v is not None, v or "") for v in values)


def failure_examples(outcome: Sequence[Mapping], n: int) -> tuple[str, ...]:
    """Up to `n` example failures from collected :func:`outcome_counts` rows, internal
    errors first, then the commonest reasons: ``source key: stage reason: detail``."""
    failed = [r for r in outcome if r["status"] != "ok" and r["example"] is not None]
    failed.sort(key=lambda r: (r["reason"] != INTERNAL_ERROR, -r["count"], r["source"],
                               r["reason"] or ""))
    out = []
    for r in failed[:n]:
        ex = r["example"]
        detail = f": {ex['detail']}" if ex["detail"] else ""
        out.append(f"{r['source']} {ex['key']}: {r['stage']} {r['reason']}{detail}")
    return tuple(out)
