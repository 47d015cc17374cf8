"""Curate job: sources -> common schema -> bronze manifest (Delta) -> prepared images
-> Lance `curated` (append-only) + Delta `rejects`, with per-source accounting.

Incremental: a record whose sample_id is in the manifest with the same fingerprint
(file size + mtime for folders and tars; the key alone for tables) is *unchanged*:
it is counted but neither fetched nor decoded again. Tar shards whose fingerprint
matches are not even opened. Records that failed for a transient reason (timeout,
connection, DNS, 429, 5xx) are retried on the next run.

Per source and run: seen = accepted + rejected (records processed this run, by
reason) and `unchanged` (skipped as already ingested); printed by the run summary
and stored in the Delta `accounting` table.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import reduce

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from etl.config import Config
from etl.faults import fault_point
from etl.jobs.dedup import DedupResult
from etl.lakehouse.indexes import ensure_scalar_indexes
from etl.samples import ensure_samples
from etl.schema import ACCOUNTING_SCHEMA, UPSTREAM_COLUMNS
from etl.sources import adapter_for, finish_ingest
from etl.transforms.prepare import (
    accepted_rows,
    outcome_counts,
    prepare_images,
    rejected_rows,
)
from etl.writers.delta import merge_accounting, merge_manifest, merge_rejects, read_delta
from udfs.fetch import TRANSIENT_STATUSES, fetch_udf

__all__ = [
    "SourceCounts", "CurateResult", "preflight", "ingest", "fetch_images", "curate",
    "CURATED_TABLE", "MANIFEST_TABLE", "REJECTS_TABLE", "ACCOUNTING_TABLE",
]

log = logging.getLogger(__name__)

CURATED_TABLE = "curated"
REJECTS_TABLE = "rejects"
MANIFEST_TABLE = "samples"
ACCOUNTING_TABLE = "accounting"


@dataclass(frozen=True)
class SourceCounts:
    source: str
    seen: int
    accepted: int
    rejected: int
    reasons: dict[str, int] = field(default_factory=dict)
    # Accepted but flagged by a light filter (keep = false), by filter reason.
    filtered: dict[str, int] = field(default_factory=dict)
    # Already in the manifest with the same fingerprint: not fetched, not decoded.
    unchanged: int = 0


@dataclass(frozen=True)
class CurateResult:
    curated_path: str
    curated_version: int
    curated_rows: int
    rejects_path: str
    counts: tuple[SourceCounts, ...]
    # Set by `lakeshard run` when the dedup stage ran after curate (etl.jobs.dedup).
    dedup: DedupResult | None = None
    manifest_path: str = ""
    accounting_path: str = ""


def preflight(cfg: Config) -> None:
    """Everything that can fail before Spark starts: sample sources, inputs, columns."""
    ensure_samples(cfg)
    for src in cfg.sources:
        adapter_for(src.kind).check_inputs(src)


def ingest(spark: SparkSession, cfg: Config,
           skip: dict[str, frozenset[str]] | None = None) -> DataFrame:
    """All configured sources in the common source schema, as one DataFrame (images
    referenced, not yet fetched)."""
    skip = skip or {}
    frames = [
        finish_ingest(adapter_for(s.kind).read(spark, s, skip.get(s.name, frozenset())), s)
        for s in cfg.sources
    ]
    return reduce(DataFrame.unionByName, frames)


def fetch_images(df: DataFrame, opts) -> DataFrame:
    """Fill `image_bytes` from `image_ref` for readable rows that reference their image;
    a failed fetch makes the row `rejected` with the fetch status as reason (`http_404`,
    `timeout`, `too_large`, `dns`, `missing_file`, …) and `fetch_detail` set."""
    need = (F.col("read_status") == "ok") & F.col("image_bytes").isNull() & \
        F.col("image_ref").isNotNull()
    fetched = df.withColumn(
        "_fetch",
        F.when(need, fetch_udf(opts)(F.when(need, F.col("image_ref")), "image_offset",
                                     "image_length")),
    )
    failed = need & (F.col("_fetch.status") != "ok")
    return fetched.withColumns({
        "image_bytes": F.when(need, F.col("_fetch.bytes")).otherwise(F.col("image_bytes")),
        "read_status": F.when(failed, F.lit("rejected")).otherwise(F.col("read_status")),
        "read_reason": F.when(failed, F.col("_fetch.status")).otherwise(F.col("read_reason")),
        "fetch_failed": F.coalesce(failed, F.lit(False)),
        "fetch_detail": F.col("_fetch.detail"),
    }).drop("_fetch")


def _counts_by_source(rows: list, sources: list[str],
                      unchanged: dict[str, int]) -> tuple[SourceCounts, ...]:
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
                unchanged.get(name, 0),
            )
        )
    return tuple(out)


def _skipped_containers(cfg: Config, manifest: DataFrame | None
                        ) -> tuple[dict[str, frozenset[str]], dict[str, int]]:
    """Per source: containers (tar shards) whose fingerprint the manifest already has,
    and how many manifest records they hold (counted as unchanged)."""
    skip: dict[str, frozenset[str]] = {}
    counts: dict[str, int] = {}
    if manifest is None:
        return skip, counts
    for s in cfg.sources:
        listed = adapter_for(s.kind).containers(s)
        if not listed:
            continue
        known = (
            manifest.where(F.col("source") == s.name)
            .groupBy("source_uri", "fingerprint").count().collect()
        )
        same = [r for r in known if listed.get(r["source_uri"]) == r["fingerprint"]]
        # A shard is skipped only if every record of it has the current fingerprint.
        stale = {r["source_uri"] for r in known if listed.get(r["source_uri"]) != r["fingerprint"]}
        skip[s.name] = frozenset(r["source_uri"] for r in same) - stale
        counts[s.name] = sum(r["count"] for r in same if r["source_uri"] in skip[s.name])
    return skip, counts


def _mark_unchanged(ingested: DataFrame, manifest: DataFrame | None) -> DataFrame:
    """Add `occurrence` (1 = the copy kept of a key) and `unchanged`."""
    order = Window.partitionBy("sample_id").orderBy(
        (F.col("read_status") != "ok"), "source_uri", "image_ref", "image_offset",
        "fingerprint",
    )
    out = ingested.withColumn("occurrence", F.row_number().over(order))
    if manifest is None:
        return out.withColumn("unchanged", F.lit(False))
    known = manifest.select(
        "sample_id",
        F.col("fingerprint").alias("_known_fp"),
        F.lit(True).alias("_known"),
        ((F.col("status") == "rejected") & F.col("reason").isin(*TRANSIENT_STATUSES)
         | F.col("reason").startswith("http_5")).alias("_retry"),
    )
    joined = out.join(known, "sample_id", "left")
    unchanged = (
        F.coalesce(F.col("_known"), F.lit(False))
        & F.col("fingerprint").eqNullSafe(F.col("_known_fp"))
        & ~F.coalesce(F.col("_retry"), F.lit(False))
    )
    return joined.withColumn("unchanged", unchanged).drop("_known_fp", "_known", "_retry")


def _mark_duplicates(df: DataFrame) -> DataFrame:
    dup = (F.col("occurrence") > 1) & (F.col("read_status") == "ok")
    return df.withColumns({
        "read_status": F.when(dup, F.lit("rejected")).otherwise(F.col("read_status")),
        "read_reason": F.when(dup, F.lit("duplicate_key")).otherwise(F.col("read_reason")),
    })


def _replace_in_curated(spark: SparkSession, curated_path: str, ids: DataFrame) -> int:
    """Delete rows of records being (re)written now: changed records, and rows a run
    that died before recording its manifest left behind. Returns rows deleted."""
    import lance

    try:
        ds = lance.dataset(curated_path)
    except (ValueError, OSError):
        return 0
    existing = spark.read.format("lance").option("columns", "sample_id").load(curated_path)
    stale = [r.sample_id for r in existing.join(ids, "sample_id", "left_semi").collect()]
    for i in range(0, len(stale), 1000):
        quoted = ", ".join("'" + s.replace("'", "''") + "'" for s in stale[i:i + 1000])
        ds.delete(f"sample_id IN ({quoted})")
    return len(stale)


def curate(spark: SparkSession, cfg: Config, run_id: str) -> CurateResult:
    sc = spark.sparkContext
    curated_path = cfg.storage.lance_table(CURATED_TABLE)
    rejects_path = cfg.storage.delta_table(REJECTS_TABLE)
    manifest_path = cfg.storage.delta_table(MANIFEST_TABLE)
    accounting_path = cfg.storage.delta_table(ACCOUNTING_TABLE)
    now = datetime.now(UTC).replace(tzinfo=None)
    names = [s.name for s in cfg.sources]

    sc.setJobDescription("lakeshard curate: list sources, compare with the manifest")
    manifest = read_delta(spark, manifest_path)
    if manifest is not None:
        manifest = manifest.localCheckpoint(eager=True)  # read before it is merged into
    skip, skipped = _skipped_containers(cfg, manifest)
    listed = _mark_unchanged(ingest(spark, cfg, skip), manifest).persist(
        StorageLevel.MEMORY_AND_DISK
    )
    unchanged = dict(skipped)
    for r in listed.where("unchanged").groupBy("source").count().collect():
        unchanged[r["source"]] = unchanged.get(r["source"], 0) + r["count"]

    sc.setJobDescription("lakeshard curate: fetch + prepare new records")
    todo = fetch_images(_mark_duplicates(listed.where(~F.col("unchanged"))), cfg.fetch.options())
    prepared = prepare_images(todo, cfg.prepare.options())
    dup = F.col("occurrence") > 1
    prepared = prepared.withColumns({
        "stage": F.when(F.col("fetch_failed"), F.lit("fetch")).otherwise(F.col("stage")),
        "detail": F.when(dup, F.format_string("copy %d of key %s", "occurrence", "source_key"))
        .when(F.col("fetch_failed"), F.col("fetch_detail"))
        .otherwise(F.col("detail")),
    }).drop("image_bytes").persist(StorageLevel.MEMORY_AND_DISK)
    outcome = outcome_counts(prepared).collect()
    counts = _counts_by_source(outcome, names, unchanged)
    fault_point("curate:prepared")

    sc.setJobDescription("lakeshard curate: append to Lance curated")
    accepted = accepted_rows(prepared, run_id=run_id, ingested_at=F.lit(now))
    upstream = prepared.where(F.col("status") == "ok").select("sample_id", *UPSTREAM_COLUMNS)
    accepted = accepted.join(upstream, "sample_id").select(*accepted.columns, *UPSTREAM_COLUMNS)
    kept = prepared.where(F.col("occurrence") == 1)
    processed = sum(c.seen for c in counts)
    replaced = 0
    if processed:  # a run with nothing new writes nothing but its accounting
        replaced = _replace_in_curated(spark, curated_path, kept.select("sample_id"))
    if sum(c.accepted for c in counts) or not _lance_exists(curated_path):
        accepted.write.format("lance").mode("append").save(curated_path)
        # Scalar indexes on the columns analysts filter by (extended to new fragments).
        ensure_scalar_indexes(curated_path, cfg.lakehouse.scalar_indexes)
    fault_point("curate:lance_written")

    sc.setJobDescription("lakeshard curate: merge Delta rejects, manifest, accounting")
    if processed or manifest is None:
        merge_rejects(spark, rejected_rows(prepared, run_id=run_id), rejects_path)
        ok = F.col("status") == "ok"
        merge_manifest(
            spark,
            kept.withColumns({
                "status": F.when(ok, F.lit("accepted")).otherwise(F.lit("rejected")),
                "stage": F.when(~ok, F.col("stage")),
                "reason": F.when(~ok, F.coalesce("reason", F.lit("unknown"))),
                "run_id": F.lit(run_id),
                "ingested_at": F.lit(now),
            }),
            manifest_path,
        )
    merge_accounting(spark, _accounting_rows(spark, run_id, now, outcome, unchanged),
                     accounting_path)
    sc.setJobDescription(None)
    prepared.unpersist()
    listed.unpersist()

    import lance

    ds = lance.dataset(curated_path)
    in_manifest = spark.read.format("delta").load(manifest_path).where(
        "status = 'accepted'").count()
    if ds.count_rows() != in_manifest:
        raise RuntimeError(
            f"curated table has {ds.count_rows()} rows, the manifest {in_manifest} accepted"
        )
    if replaced:
        log.info("curate: replaced %d curated rows of changed records", replaced)
    return CurateResult(curated_path, ds.version, ds.count_rows(), rejects_path, counts,
                        manifest_path=manifest_path, accounting_path=accounting_path)


def _lance_exists(path: str) -> bool:
    import lance

    try:
        lance.dataset(path)
        return True
    except (ValueError, OSError):
        return False


def _accounting_rows(spark: SparkSession, run_id: str, now: datetime, outcome: list,
                     unchanged: dict[str, int]) -> DataFrame:
    rows = [
        (run_id, now, r["source"], "accepted" if r["status"] == "ok" else "rejected",
         None if r["status"] == "ok" else r["stage"],
         None if r["status"] == "ok" else (r["reason"] or "unknown"),
         r["filter_reason"] if r["status"] == "ok" else None, int(r["count"]))
        for r in outcome
    ]
    rows += [(run_id, now, src, "unchanged", None, None, None, int(n))
             for src, n in unchanged.items() if n]
    return spark.createDataFrame(rows, ACCOUNTING_SCHEMA)
