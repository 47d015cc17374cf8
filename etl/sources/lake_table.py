"""`delta` and `lance`: an existing table, read by Spark, mapped row by row with the
same rules as `table` (`columns:` with `key` and one of `image` / `url`).

Both keep a history, which removals use: a run reads the table at one version and
records it; the next run asks which keys were deleted since. Delta answers from its
change data feed when the table has one (``delta.enableChangeDataFeed``), else by
comparing the key column of the two versions; Lance from its transaction log (appends,
compactions, index and config changes delete nothing) and, when a version did delete
or overwrite rows, by comparing the key column of the two versions. When the older
version is no longer kept (VACUUM, version cleanup), the history cannot say and the
caller compares the whole listing with the manifest instead.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator

import pyarrow as pa
from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl.config import ConfigError, SourceConfig
from etl.sources.base import SourceAdapter, is_local_path, local_path, require_exists
from etl.sources.file_table import (
    TABLE_MAPPABLE,
    RowLimits,
    check_mapped_columns,
    map_table_rows,
    validate_table_mapping,
)
from etl.sources.records import MISSING, RAW_ARROW_SCHEMA, RAW_SCHEMA, lookup
from etl.writers.lance import lance_reader

__all__ = ["DeltaSource", "LanceSource", "delta_columns", "source_keys"]

log = logging.getLogger(__name__)

# Lance operations that never take a row away (a key stays where it was).
_LANCE_KEEPS_ROWS = frozenset({
    "Append", "Rewrite", "CreateIndex", "UpdateConfig", "ReserveFragments", "Merge",
    "Project",
})


def source_keys(df: DataFrame, key: str, keep: tuple[str, ...] = ()) -> DataFrame:
    """``source_key`` of each row of `df` as :func:`map_table_rows` spells it (the
    mapped `key` field, dotted into structs, as text), plus the `keep` columns; rows
    without a key (ingested as ``missing_key`` rejects) are left out."""
    root = key.split(".", 1)[0]
    schema = "source_key string" + "".join(
        f", {c} {df.schema[c].dataType.simpleString()}" for c in keep)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            rows = []
            for rec in batch.to_pylist():
                k = lookup(rec, key)
                if k is MISSING or k is None or (isinstance(k, str) and not k.strip()):
                    continue
                rows.append({"source_key": str(k), **{c: rec[c] for c in keep}})
            if rows:
                yield pa.RecordBatch.from_pylist(rows)

    return df.select(root, *keep).mapInArrow(run, schema)


def _version_diff(older: DataFrame, newer: DataFrame, key: str) -> DataFrame:
    """Keys the older version has and the newer one does not."""
    return source_keys(older, key).distinct().join(
        source_keys(newer, key).distinct(), "source_key", "left_anti")


class _ExistingTable(SourceAdapter):
    mappable = TABLE_MAPPABLE
    format: str

    def validate_config(self, source: SourceConfig, where: str) -> None:
        super().validate_config(source, where)
        validate_table_mapping(self.kind, source, where)

    def _columns(self, source: SourceConfig) -> list[str]:
        raise NotImplementedError

    def _load(self, spark: SparkSession, source: SourceConfig, version: int | None
              ) -> DataFrame:
        raise NotImplementedError

    def check_inputs(self, source: SourceConfig) -> None:
        require_exists(source)
        if is_local_path(source.path):
            check_mapped_columns(source, self._columns(source), f"{self.kind} table")

    def read(
        self, spark: SparkSession, source: SourceConfig, skip: frozenset[str] = frozenset(),
        version: int | None = None,
    ) -> DataFrame:
        uri = source.path if "://" in source.path else "file:" + str(
            local_path(source.path).resolve())
        base = uri.rstrip("/")
        mapping = dict(source.columns)
        df = self._load(spark, source, version)
        limits = RowLimits.of(source)

        def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            for batch in batches:
                rows = map_table_rows(batch.to_pylist(), mapping, uri, base, 0, limits)
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

    def _load(self, spark: SparkSession, source: SourceConfig, version: int | None
              ) -> DataFrame:
        reader = spark.read.format("delta")
        if version is not None:
            reader = reader.option("versionAsOf", str(version))
        return reader.load(source.path)

    def listing_digest(self, source: SourceConfig) -> str | None:
        """The table's version, read from its log by delta-rs (None if delta-rs cannot)."""
        from deltalake import DeltaTable
        from deltalake.exceptions import DeltaError

        try:
            return f"version {DeltaTable(source.path).version()}"
        except (DeltaError, OSError, ValueError):
            return None

    def snapshot_version(self, spark: SparkSession, source: SourceConfig) -> int | None:
        from delta.tables import DeltaTable

        return int(DeltaTable.forPath(spark, source.path).history(1).first()["version"])

    def deleted_keys(self, spark: SparkSession, source: SourceConfig, since: int,
                     until: int) -> tuple[DataFrame, str] | None:
        if since >= until:
            return spark.createDataFrame([], "source_key string"), "change data feed"
        key = source.columns["key"]
        try:
            changes = (
                spark.read.format("delta").option("readChangeFeed", "true")
                .option("startingVersion", str(since + 1)).option("endingVersion", str(until))
                .load(source.path)
            )
            events = source_keys(changes, key, ("_change_type", "_commit_version"))
            # A key is gone when the last commit that touched it removed it and did not
            # write it again (an overwrite removes and re-adds in one commit).
            last = events.groupBy("source_key").agg(F.max("_commit_version").alias("_v"))
            gone = F.col("_change_type").isin("delete", "update_preimage").cast("int")
            back = F.col("_change_type").isin("insert", "update_postimage").cast("int")
            deleted = (
                events.join(last, "source_key").where(F.col("_commit_version") == F.col("_v"))
                .groupBy("source_key")
                .agg(F.max(gone).alias("_gone"), F.max(back).alias("_back"))
                .where("_gone = 1 AND _back = 0").select("source_key")
                .localCheckpoint(eager=True)
            )
            return deleted, "change data feed"
        except (PySparkException, Py4JJavaError) as exc:
            log.info("source %s: no change data feed for versions %d..%d (%s); comparing "
                     "the two versions' keys", source.name, since + 1, until,
                     str(exc).splitlines()[0][:200])
        try:
            deleted = _version_diff(self._load(spark, source, since),
                                    self._load(spark, source, until), key)
            return deleted.localCheckpoint(eager=True), "version diff"
        except (PySparkException, Py4JJavaError) as exc:
            log.warning("source %s: Delta version %d is no longer readable (%s); comparing "
                        "the listing with the manifest", source.name, since,
                        str(exc).splitlines()[0][:200])
            return None

    def _columns(self, source: SourceConfig) -> list[str]:
        try:
            return delta_columns(str(local_path(source.path)))
        except ConfigError as exc:
            raise ConfigError(f"source {source.name!r}: path: {exc}") from None


class LanceSource(_ExistingTable):
    kind = "lance"
    format = "lance"

    def _load(self, spark: SparkSession, source: SourceConfig, version: int | None
              ) -> DataFrame:
        reader = lance_reader(spark)
        if version is not None:
            reader = reader.option("version", str(version))
        return reader.load(source.path)

    def _dataset(self, source: SourceConfig, version: int | None = None):
        import lance

        path = source.path if "://" in source.path else str(local_path(source.path))
        return lance.dataset(path, version=version)

    def listing_digest(self, source: SourceConfig) -> str | None:
        try:
            return f"version {self._dataset(source).version}"
        except (ValueError, OSError):
            return None

    def snapshot_version(self, spark: SparkSession, source: SourceConfig) -> int | None:
        return int(self._dataset(source).version)

    def deleted_keys(self, spark: SparkSession, source: SourceConfig, since: int,
                     until: int) -> tuple[DataFrame, str] | None:
        empty = spark.createDataFrame([], "source_key string")
        if since >= until:
            return empty, "version diff"
        try:
            ds = self._dataset(source, until)
            ops = {type(t.operation).__name__
                   for t in ds.delta(begin_version=since, end_version=until).list_transactions()}
            self._dataset(source, since)  # still there to compare with
        except (ValueError, OSError) as exc:
            log.warning("source %s: Lance version %d or its transactions are no longer "
                        "kept (%s); comparing the listing with the manifest", source.name,
                        since, str(exc).splitlines()[0][:200])
            return None
        if ops <= _LANCE_KEEPS_ROWS:
            return empty, "version diff"  # appends, compactions, indexes: nothing deleted
        deleted = _version_diff(self._load(spark, source, since),
                                self._load(spark, source, until), source.columns["key"])
        return deleted.localCheckpoint(eager=True), "version diff"

    def _columns(self, source: SourceConfig) -> list[str]:
        import lance

        try:
            return list(lance.dataset(str(local_path(source.path))).schema.names)
        except (ValueError, OSError) as exc:
            raise ConfigError(
                f"source {source.name!r}: path {source.path!r} is not a Lance table: {exc}"
            ) from None
