"""`delta` and `lance`: an existing table, read by Spark, mapped row by row with the
same rules as `table` (`columns:` with `key` and one of `image` / `url`)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from etl.config import ConfigError, SourceConfig
from etl.sources.base import SourceAdapter, is_local_path, local_path, require_exists
from etl.sources.file_table import (
    TABLE_MAPPABLE,
    check_mapped_columns,
    map_table_rows,
    validate_table_mapping,
)
from etl.sources.records import RAW_ARROW_SCHEMA, RAW_SCHEMA

__all__ = ["DeltaSource", "LanceSource", "delta_columns"]


class _ExistingTable(SourceAdapter):
    mappable = TABLE_MAPPABLE
    format: str

    def validate_config(self, source: SourceConfig, where: str) -> None:
        super().validate_config(source, where)
        validate_table_mapping(self.kind, source, where)

    def _columns(self, source: SourceConfig) -> list[str]:
        raise NotImplementedError

    def check_inputs(self, source: SourceConfig) -> None:
        require_exists(source)
        if is_local_path(source.path):
            check_mapped_columns(source, self._columns(source), f"{self.kind} table")

    def read(
        self, spark: SparkSession, source: SourceConfig, skip: frozenset[str] = frozenset()
    ) -> DataFrame:
        uri = source.path if "://" in source.path else "file:" + str(
            local_path(source.path).resolve())
        base = uri.rstrip("/")
        mapping = dict(source.columns)
        df = spark.read.format(self.format).load(source.path)

        def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            for batch in batches:
                rows = map_table_rows(batch.to_pylist(), mapping, uri, base, 0)
                if rows:
                    yield pa.RecordBatch.from_pylist(rows, schema=RAW_ARROW_SCHEMA)

        return df.mapInArrow(run, RAW_SCHEMA)


def delta_columns(path: str) -> list[str]:
    """The table's top-level columns from its transaction log (no Spark job)."""
    log = os.path.join(path, "_delta_log")
    if not os.path.isdir(log):
        raise ConfigError(f"{path!r} is not a Delta table (no _delta_log)")
    for commit in sorted(glob.glob(os.path.join(log, "*.json")), reverse=True):
        with open(commit, encoding="utf-8") as f:
            for line in f:
                action = json.loads(line) if line.strip() else {}
                if "metaData" in action:
                    schema = json.loads(action["metaData"]["schemaString"])
                    return [fld["name"] for fld in schema["fields"]]
    for cp in sorted(glob.glob(os.path.join(log, "*.checkpoint*.parquet")), reverse=True):
        import pyarrow.parquet as pq

        for row in pq.read_table(cp, columns=["metaData"]).column(0).to_pylist():
            if row and row.get("schemaString"):
                return [fld["name"] for fld in json.loads(row["schemaString"])["fields"]]
    raise ConfigError(f"{path!r}: no schema found in the Delta log")


class DeltaSource(_ExistingTable):
    kind = "delta"
    format = "delta"

    def _columns(self, source: SourceConfig) -> list[str]:
        try:
            return delta_columns(str(local_path(source.path)))
        except ConfigError as exc:
            raise ConfigError(f"source {source.name!r}: path: {exc}") from None


class LanceSource(_ExistingTable):
    kind = "lance"
    format = "lance"

    def _columns(self, source: SourceConfig) -> list[str]:
        import lance

        try:
            return list(lance.dataset(str(local_path(source.path))).schema.names)
        except (ValueError, OSError) as exc:
            raise ConfigError(
                f"source {source.name!r}: path {source.path!r} is not a Lance table: {exc}"
            ) from None
