"""Curate job: sources -> common schema -> prepared images -> Lance `curated` + Delta
`rejects`, with per-source accounting (seen = accepted + rejected)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import reduce

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl.config import Config
from etl.faults import fault_point
from etl.jobs.dedup import DedupResult
from etl.lakehouse.indexes import ensure_scalar_indexes
from etl.samples import ensure_samples
from etl.sources import adapter_for, finish_ingest
from etl.transforms.prepare import (
    accepted_rows,
    outcome_counts,
    prepare_images,
    rejected_rows,
)
from etl.writers.delta import merge_rejects
from etl.writers.lance import table_version

__all__ = ["SourceCounts", "CurateResult", "preflight", "ingest", "curate", "CURATED_TABLE"]

log = logging.getLogger(__name__)

CURATED_TABLE = "curated"
REJECTS_TABLE = "rejects"


@dataclass(frozen=True)
class SourceCounts:
    source: str
    seen: int
    accepted: int
    rejected: int
    reasons: dict[str, int] = field(default_factory=dict)
    # Accepted but flagged by a light filter (keep = false), by filter reason.
    filtered: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CurateResult:
    curated_path: str
    curated_version: int
    curated_rows: int
    rejects_path: str
    counts: tuple[SourceCounts, ...]
    # Set by `lakeshard run` when the dedup stage ran after curate (etl.jobs.dedup).
    dedup: DedupResult | None = None


def preflight(cfg: Config) -> None:
    """Everything that can fail before Spark starts: sample sources, inputs, columns."""
    ensure_samples(cfg)
    for src in cfg.sources:
        adapter_for(src.kind).check_inputs(src)


def ingest(spark: SparkSession, cfg: Config) -> DataFrame:
    """All configured sources, in the common ingest schema, as one DataFrame."""
    frames = [finish_ingest(adapter_for(s.kind).read(spark, s), s) for s in cfg.sources]
    return reduce(DataFrame.unionByName, frames)


def _first_ingested(spark: SparkSession, curated_path: str) -> DataFrame | None:
    """(sample_id, run_id, ingested_at) of rows already curated, so a rerun keeps them."""
    try:
        table_version(curated_path)
    except (ValueError, OSError):
        return None
    return (
        spark.read.format("lance")
        .option("columns", "sample_id,run_id,ingested_at")
        .load(curated_path)
        .withColumnsRenamed({"run_id": "_first_run_id", "ingested_at": "_first_at"})
    )


def _counts_by_source(rows: list, sources: list[str]) -> tuple[SourceCounts, ...]:
    out = []
    for name in sources:
        mine = [r for r in rows if r["source"] == name]
        accepted = sum(r["count"] for r in mine if r["status"] == "ok")
        rejected = sum(r["count"] for r in mine if r["status"] != "ok")
        reasons: dict[str, int] = {}
        filtered: dict[str, int] = {}
        for r in mine:
            if r["status"] != "ok":
                key = r["reason"] or "unknown"
                reasons[key] = reasons.get(key, 0) + r["count"]
            elif r["filter_reason"]:
                filtered[r["filter_reason"]] = filtered.get(r["filter_reason"], 0) + r["count"]
        out.append(
            SourceCounts(
                name, accepted + rejected, accepted, rejected,
                dict(sorted(reasons.items())), dict(sorted(filtered.items())),
            )
        )
    return tuple(out)


def curate(spark: SparkSession, cfg: Config, run_id: str) -> CurateResult:
    sc = spark.sparkContext
    curated_path = cfg.storage.lance_table(CURATED_TABLE)
    rejects_path = cfg.storage.delta_table(REJECTS_TABLE)
    sc.setJobDescription("lakeshard curate: ingest + prepare images")
    prepared = (
        prepare_images(ingest(spark, cfg), cfg.prepare.options())
        .drop("image_bytes")
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    counts = _counts_by_source(
        outcome_counts(prepared).collect(), [s.name for s in cfg.sources]
    )

    fault_point("curate:prepared")
    now = datetime.now(UTC).replace(tzinfo=None)
    accepted = accepted_rows(prepared, run_id=run_id, ingested_at=F.lit(now))
    previous = _first_ingested(spark, curated_path)
    if previous is not None:
        # Read the old ids fully before overwriting the table they come from.
        previous = previous.localCheckpoint(eager=True)
        accepted = (
            accepted.join(previous, "sample_id", "left")
            .withColumn("run_id", F.coalesce("_first_run_id", "run_id"))
            .withColumn("ingested_at", F.coalesce("_first_at", "ingested_at"))
            .select(*accepted.columns)
        )

    sc.setJobDescription("lakeshard curate: write Lance curated")
    accepted.write.format("lance").mode("overwrite").save(curated_path)
    # Scalar indexes on the columns analysts filter by (an index commit is a version).
    ensure_scalar_indexes(curated_path, cfg.lakehouse.scalar_indexes)
    fault_point("curate:lance_written")
    sc.setJobDescription("lakeshard curate: merge Delta rejects")
    merge_rejects(spark, rejected_rows(prepared, run_id=run_id), rejects_path)
    sc.setJobDescription(None)
    prepared.unpersist()

    import lance

    ds = lance.dataset(curated_path)
    expected = sum(c.accepted for c in counts)
    if ds.count_rows() != expected:
        raise RuntimeError(
            f"curated table has {ds.count_rows()} rows, accounting says {expected} accepted"
        )
    return CurateResult(curated_path, ds.version, expected, rejects_path, counts)
