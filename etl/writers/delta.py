"""Delta sinks: the `rejects` table, written idempotently with MERGE."""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession

from etl.schema import REJECTS_SCHEMA

__all__ = ["merge_rejects"]


def merge_rejects(spark: SparkSession, rejects: DataFrame, path: str) -> None:
    """Insert rejects not yet recorded; a rerun of the same input adds nothing.

    Keyed by (sample_id, stage): a record rejected again keeps its first row, with the
    run that first rejected it.
    """
    from delta.tables import DeltaTable

    (
        DeltaTable.createIfNotExists(spark)
        .location(path)
        .addColumns(REJECTS_SCHEMA)
        .execute()
    )
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(rejects.alias("s"), "t.sample_id = s.sample_id AND t.stage = s.stage")
        .whenNotMatchedInsertAll()
        .execute()
    )
