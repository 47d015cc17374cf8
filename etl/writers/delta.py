"""Delta sinks of the bronze layer, all written idempotently with MERGE:

* ``rejects`` -- one row per record that did not make it, and why;
* ``samples`` -- the manifest: one row per source record (accepted or rejected);
* ``accounting`` -- per run and source, records by outcome and reason.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from etl.schema import ACCOUNTING_SCHEMA, MANIFEST_SCHEMA, REJECTS_SCHEMA

__all__ = ["merge_rejects", "merge_manifest", "merge_accounting", "read_delta"]


def _ensure(spark: SparkSession, path: str, schema: StructType) -> None:
    from delta.tables import DeltaTable

    DeltaTable.createIfNotExists(spark).location(path).addColumns(schema).execute()


def read_delta(spark: SparkSession, path: str) -> DataFrame | None:
    """The Delta table at `path`, or None if there is none yet."""
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, path):
        return None
    return spark.read.format("delta").load(path)


def merge_rejects(spark: SparkSession, rejects: DataFrame, path: str) -> None:
    """Insert rejects not yet recorded; a rerun of the same input adds nothing.

    Keyed by (sample_id, stage, reason, detail): a record rejected again for the same
    reason keeps its first row, with the run that first rejected it; each extra copy
    of a duplicated key has its own row (its detail says which copy).
    """
    from delta.tables import DeltaTable

    _ensure(spark, path, REJECTS_SCHEMA)
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(
            rejects.alias("s"),
            "t.sample_id = s.sample_id AND t.stage = s.stage AND t.reason = s.reason "
            "AND t.detail <=> s.detail",
        )
        .whenNotMatchedInsertAll()
        .execute()
    )


def merge_manifest(spark: SparkSession, records: DataFrame, path: str) -> None:
    """Upsert manifest rows on sample_id: new records inserted, records that were
    reprocessed (changed fingerprint, transient failure retried) updated. Records
    not in `records` -- everything unchanged -- are not touched."""
    from delta.tables import DeltaTable

    _ensure(spark, path, MANIFEST_SCHEMA)
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(records.select(*MANIFEST_SCHEMA.fieldNames()).alias("s"),
               "t.sample_id = s.sample_id")
        .whenMatchedUpdateAll()
        .whenNotMatchedInsertAll()
        .execute()
    )


def merge_accounting(spark: SparkSession, rows: DataFrame, path: str) -> None:
    """Record a run's counts; writing the same run again changes nothing."""
    from delta.tables import DeltaTable

    _ensure(spark, path, ACCOUNTING_SCHEMA)
    cond = " AND ".join(
        f"t.{c} <=> s.{c}" for c in ("run_id", "source", "status", "stage", "reason",
                                     "filter_reason")
    )
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(rows.select(*ACCOUNTING_SCHEMA.fieldNames()).alias("s"), cond)
        .whenNotMatchedInsertAll()
        .execute()
    )
