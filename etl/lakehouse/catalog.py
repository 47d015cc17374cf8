"""The tables a run writes, one object each: its path and schema, how it is read, its
writes and its named queries -- and, inside it, the choice between the driver path
(delta-rs, pylance: no Spark job) and the Spark path.

::

    catalog = Catalog.of(spark, cfg)
    catalog.manifest.snapshot()      # the manifest as this run read it, or None
    catalog.manifest.diff(cfg, state)  # what the sources list against it
    catalog.curated.replace(ids, n)  # delete the rows of records being rewritten
    catalog.takedowns.pending()      # requests recorded but not applied

Driver or Spark. A batch of up to ``driver.ids`` record ids (:mod:`etl.config.bounds`)
is handled on the driver
(a Lance merge-delete against the table itself; a manifest append by delta-rs when none
of them is in the manifest yet); a larger one by a Spark join first. The dedup table's
own planners and their thresholds are :class:`etl.lakehouse.dedup_table.DedupTable`;
the corpus-wide counts are :mod:`etl.lakehouse.counts`. Each pair of paths is tested
equal on the same data (``tests/test_catalog.py``).

`etl.tables` names the tables and where they live; the writes themselves (MERGE
conditions, delta-rs appends) are :mod:`etl.writers.delta` and :mod:`etl.writers.lance`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import pandas as pd
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl import storage, tables
from etl.config import Config
from etl.config.bounds import DRIVER_IDS, DRIVER_SCAN_ROWS
from etl.lakehouse.counts import MANIFEST_COLUMNS, delta_counts
from etl.lakehouse.curate_state import CurateState
from etl.lakehouse.indexes import ensure_scalar_indexes
from etl.lakehouse.manifest_rows import ManifestRows
from etl.lakehouse.source_diff import Diff, compare
from etl.runtime.local import local_arrow
from etl.schema import REMOVED
from etl.transforms.bronze import (
    known_fingerprint,
    retry_column,
    takedown_identifiers,
    taken_down_ids,
)
from etl.writers.delta import (
    delete_rejects,
    mark_removed,
    merge_accounting,
    merge_manifest,
    merge_rejects,
    read_columns,
    update_takedowns,
)
from etl.writers.lance import (
    PendingAppend,
    append_frame,
    append_local,
    delete_rows,
    lance_reader,
    pending_append,
)

__all__ = ["Manifest", "Rejects", "Accounting", "Takedowns", "Curated", "Catalog"]


@dataclass(frozen=True)
class _DeltaTable:
    spark: SparkSession
    path: str
    ids: int = DRIVER_IDS  # record ids handled on the driver (``driver.ids``)

    def read(self) -> DataFrame | None:
        """The table as a DataFrame, None if there is none yet."""
        return storage.read_delta(self.spark, self.path)

    def exists(self) -> bool:
        return storage.delta_exists(self.path)

    def version(self) -> int | None:
        """Its latest version, from its log (delta-rs; Spark for a table it cannot read)."""
        return storage.delta_version(self.spark, self.path)


@dataclass(frozen=True)
class Manifest(_DeltaTable):
    """One row per source record: accepted, rejected (stage, reason) or removed."""

    counts_cache: str = ""  # where its per-file counts are kept (etl.lakehouse.counts)
    scan_rows: int = DRIVER_SCAN_ROWS  # rows whose narrow columns the driver may read

    def rows(self) -> ManifestRows | None:
        """Its narrow rows read by delta-rs, for a comparison on the driver of what the
        sources' changed containers list (:class:`ManifestRows`); None when there is no
        manifest, or more than :attr:`scan_rows` rows."""
        if not self.exists():
            return None
        return ManifestRows.read(self.path, self.scan_rows)

    def snapshot(self) -> DataFrame | None:
        """The manifest as this run read it, materialised before the run merges into it."""
        manifest = self.read()
        return None if manifest is None else manifest.localCheckpoint(eager=True)

    def accepted(self) -> int:
        """Rows with status ``accepted``: from the counts kept per data file
        (:mod:`etl.lakehouse.counts`), so a night reads the files its MERGE wrote, not
        the manifest; Spark counts a table delta-rs does not read."""
        counts = delta_counts(self.path, MANIFEST_COLUMNS, self.counts_cache)
        if counts is None:
            return self.read().where("status = 'accepted'").count()
        return int(counts.loc[counts["status"] == "accepted", "count"].sum())

    def removed_from_curated(self) -> tuple[DataFrame | None, dict]:
        """Records removals took out of the curated table: their manifest rows (None
        when there are none, or no manifest) and how many by reason -- from the kept
        per-file counts (no Spark read of the table when removals took out nothing), or
        counted by Spark for a table delta-rs does not read."""
        if not self.exists():
            return None, {}
        counts = delta_counts(self.path, MANIFEST_COLUMNS, self.counts_cache)
        if counts is not None:
            mine = counts[(counts["status"] == REMOVED) & (counts["stage"] == "curated")]
            by_reason = {(None if pd.isna(r) else r): int(n) for r, n in mine.groupby(
                "reason", dropna=False)["count"].sum().items()}
            if not by_reason:
                return None, {}
        manifest = self.read()
        if manifest is None:
            return None, {}
        gone = manifest.where((F.col("status") == REMOVED) & (F.col("stage") == "curated"))
        if counts is None:
            by_reason = {r["reason"]: r["count"]
                         for r in gone.groupBy("reason").count().collect()}
        return gone, by_reason

    def known(self):
        """What a listing is compared with -- ``sample_id, source, status, reason,
        fingerprint`` of every row -- as an Arrow table read by delta-rs in this process,
        when the log says there are at most :attr:`ids` rows; None otherwise (or
        for a table delta-rs does not read): the comparison is then a Spark join."""
        return read_columns(self.path, ["sample_id", "source", "status", "reason",
                                        "fingerprint"], bound=self.ids)

    def diff(self, cfg: Config, state: CurateState) -> Diff:
        """What the configured sources list against this manifest: new and changed
        records, the unchanged counted, what left the sources -- compared on the driver
        where every source lists there and the manifest's keys are within the bound,
        else by Spark (:mod:`etl.lakehouse.source_diff`). `state`: curate's derived
        state (where a source table's history of deletions starts)."""
        return compare(self.spark, cfg, self, state, prepare_rows=cfg.driver.prepare_rows)

    def container_groups(self, manifest: DataFrame, source: str) -> list:
        """A source's records still listed, as ``(source_uri, fingerprint, count)``: what
        tells an unchanged container (tar shard) from one to open again."""
        gone = (F.col("status") == REMOVED) & (F.col("reason") == "source_removed")
        return (manifest.where((F.col("source") == source) & ~gone)
                .groupBy("source_uri", known_fingerprint()).count().collect())

    def retried_containers(self, manifest: DataFrame, source: str) -> frozenset[str]:
        """The ``source_uri`` s of a source's records the next run retries (a transient
        failure, an internal error): a table file holding one is opened again."""
        rows = manifest.where((F.col("source") == source) & retry_column())
        return frozenset(r[0] for r in rows.select("source_uri").distinct().collect())

    def merge(self, rows: DataFrame | pa.Table, *, count: int,
              before: DataFrame | None, held: frozenset[str] | None = None) -> None:
        """Upsert this run's `count` rows (a DataFrame, or an Arrow table built on the
        driver); a small batch none of whose records the table
        holds (asked of `before`, the snapshot, or of `held`, the listed ids the
        comparison found in the manifest, else of the table by delta-rs) is appended on
        the driver instead of MERGEd."""
        merge_manifest(self.spark, rows, self.path, before=before, held=held,
                       driver_bound=self.ids if count <= self.ids else 0)

    def mark_removed(self, removed: DataFrame, *, run_id: str, now: datetime) -> None:
        mark_removed(self.spark, removed, self.path, run_id=run_id, removed_at=now)


class Rejects(_DeltaTable):
    """Records that did not make it, and why (one row per copy of a key)."""

    def merge(self, rows: DataFrame | pa.Table, *, count: int) -> None:
        """Insert this run's `count` rejects (a DataFrame, or an Arrow table built on the
        driver); with none, only create the table on a first
        run. A small batch of records the table holds none of is appended on the driver."""
        if count or not self.exists():
            merge_rejects(self.spark, rows, self.path,
                          driver_bound=self.ids if count <= self.ids else 0)

    def delete(self, ids: DataFrame) -> None:
        delete_rejects(self.spark, ids, self.path)


class Accounting(_DeltaTable):
    """Per run and source: records by outcome (see :mod:`etl.transforms.accounting`)."""

    def record(self, rows) -> None:
        """A run's rows (a DataFrame, or an Arrow table built on the driver)."""
        merge_accounting(self.spark, rows, self.path)


class Takedowns(_DeltaTable):
    """Takedown requests, what they matched, and when their bytes were gone."""

    def pending(self) -> DataFrame | None:
        """Requests recorded but not applied (a `forget` that died midway), or None."""
        if not self.exists():
            return None
        applied = read_columns(self.path, ["applied_at"], bound=self.ids)
        if applied is not None and not applied.column("applied_at").null_count:
            return None  # every request applied, told by delta-rs: no Spark job
        pending = self.read().where(F.col("applied_at").isNull())
        return None if pending.isEmpty() else pending

    def taken_down_ids(self) -> DataFrame | None:
        """``sample_id`` of every record a takedown names (materialised), None without
        takedowns: what no export may hold."""
        takedowns = self.read()
        if takedowns is None:
            return None
        return taken_down_ids(takedowns).localCheckpoint(eager=True)

    def identifiers(self) -> DataFrame | None:
        """Everything the table refuses (:func:`etl.transforms.bronze.takedown_identifiers`),
        materialised; None with no table."""
        takedowns = self.read()
        if takedowns is None:
            return None
        return takedown_identifiers(takedowns).localCheckpoint(eager=True)

    def mark_purged(self, oldest_version: int, now: datetime) -> None:
        """Requests whose purge version is the oldest curated version left, or older."""
        if self.read() is not None:
            update_takedowns(self.spark, self.path,
                             f"purged_at IS NULL AND purge_version <= {int(oldest_version)}",
                             {"purged_at": now})


@dataclass(frozen=True)
class Curated:
    """The curated Lance table: one row per accepted sample."""

    cfg: Config
    path: str

    def exists(self) -> bool:
        return storage.lance_exists(self.path)

    def open(self, version: int | None = None):
        return tables.open_curated(self.cfg, version)

    def oldest_version(self) -> int:
        return min(int(v["version"]) for v in self.open().versions())

    def replace(self, spark: SparkSession, ids: DataFrame, count: int) -> int:
        """Delete the rows of the `count` records in `ids` (``sample_id``) that the table
        holds; the number deleted. Up to ``driver.ids``: one Lance merge-delete from
        the driver (Lance joins them against the table itself); more: a Spark join
        finds those present first."""
        if not self.exists():
            return 0
        if count <= self.cfg.driver.ids:
            return delete_rows(self.path, [r.sample_id for r in ids.collect()])
        return delete_rows(self.path, self.present(spark, ids))

    def present(self, spark: SparkSession, ids: DataFrame) -> list[str]:
        """The ``sample_id`` s of `ids` the table holds (a Spark join)."""
        existing = lance_reader(spark).option("columns", "sample_id").load(self.path)
        return [r.sample_id for r in existing.join(ids.select("sample_id"), "sample_id",
                                                   "left_semi").collect()]

    def pending(self, given: pa.Schema) -> PendingAppend:
        """An append of rows of the `given` columns (typed as the table has them), to be
        written by Spark tasks (:meth:`PendingAppend.write_task`) and committed by
        :meth:`commit`."""
        return pending_append(self.path, given)

    def commit(self, written: PendingAppend, fragments) -> None:
        """Commit the fragments tasks wrote (what their ``write_task`` calls returned)
        in one version; the scalar indexes analysts filter by extend to them."""
        written.commit(fragments)
        ensure_scalar_indexes(self.path, self.cfg.lakehouse.scalar_indexes)

    def append(self, rows: DataFrame | pa.Table, on_driver: bool = False) -> None:
        """Append rows; the scalar indexes analysts filter by extend to the new fragments.
        Rows this process holds (an Arrow table), or `on_driver` (a frame of few rows,
        collected), are written from this process (no Spark task runs Python: the Lance
        data source's writer is Python)."""
        if isinstance(rows, pa.Table):
            append_local(self.path, rows)
        elif on_driver:
            append_local(self.path, local_arrow(rows))
        else:
            append_frame(rows, self.path)
        ensure_scalar_indexes(self.path, self.cfg.lakehouse.scalar_indexes)


@dataclass(frozen=True)
class Catalog:
    manifest: Manifest
    rejects: Rejects
    accounting: Accounting
    takedowns: Takedowns
    curated: Curated

    @classmethod
    def of(cls, spark: SparkSession, cfg: Config) -> Catalog:
        paths, ids = tables.layout(cfg), cfg.driver.ids
        return cls(Manifest(spark, paths.manifest, ids, paths.counts_cache("manifest"),
                            cfg.driver.scan_rows),
                   Rejects(spark, paths.rejects, ids), Accounting(spark, paths.accounting, ids),
                   Takedowns(spark, paths.takedowns, ids),
                   Curated(cfg, paths.curated))
