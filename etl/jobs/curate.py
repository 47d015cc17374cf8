"""Curate: sources -> bronze manifest (Delta) -> prepared images -> Lance `curated`
(append-only) + Delta `rejects` and `accounting`.

Reads as the steps it wires: **list** every source into the common schema, **diff**
with the bronze manifest (unchanged records are counted, not processed; unchanged tar
shards are not opened), **fetch** referenced images, **prepare** (decode, re-encode,
flag), **write** the curated rows (replacing rows of changed records), **merge** the
manifest, rejects and accounting. The decisions are transforms
(:mod:`etl.transforms.bronze`, :mod:`~etl.transforms.prepare`,
:mod:`~etl.transforms.accounting`); this module only reads, calls and writes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import reduce

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl import tables
from etl.config import Config
from etl.lakehouse.indexes import ensure_scalar_indexes
from etl.runtime.faults import fault_point
from etl.runtime.stage import RowTally, RunContext, StageResult
from etl.schema import UPSTREAM_COLUMNS
from etl.sources import adapter_for, finish_ingest
from etl.transforms.accounting import SourceCounts, accounting_rows, source_counts
from etl.transforms.bronze import (
    known_fingerprint,
    manifest_rows,
    mark_duplicate_keys,
    mark_unchanged,
    unchanged_containers,
)
from etl.transforms.fetch import fetch_images
from etl.transforms.prepare import (
    accepted_rows,
    failure_examples,
    outcome_counts,
    prepare_images,
    rejected_rows,
)
from etl.writers.delta import merge_accounting, merge_manifest, merge_rejects
from etl.writers.lance import delete_rows

__all__ = ["CurateResult", "list_sources", "curate", "stage"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurateResult:
    curated_path: str
    curated_version: int
    curated_rows: int
    rejects_path: str
    manifest_path: str
    accounting_path: str
    counts: tuple[SourceCounts, ...]
    # A few failed records (internal errors first), for the failure budgets' messages.
    examples: tuple[str, ...] = ()


def list_sources(spark: SparkSession, cfg: Config,
                 skip: dict[str, frozenset[str]] | None = None) -> DataFrame:
    """All configured sources in the common source schema, as one DataFrame (images
    referenced, not yet fetched). `skip`: per source, containers not to open."""
    skip = skip or {}
    frames = [
        finish_ingest(adapter_for(s.kind).read(spark, s, skip.get(s.name, frozenset())), s)
        for s in cfg.sources
    ]
    return reduce(DataFrame.unionByName, frames)


def _skipped_containers(cfg: Config, manifest: DataFrame | None
                        ) -> tuple[dict[str, frozenset[str]], dict[str, int]]:
    """Per source: unchanged containers (tar shards) and the records they hold."""
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
            .groupBy("source_uri", known_fingerprint()).count().collect()
        )
        skip[s.name], counts[s.name] = unchanged_containers(listed, known)
    return skip, counts


def _replace_changed(spark: SparkSession, curated_path: str, ids: DataFrame) -> int:
    """Delete curated rows of records being (re)written now: changed records, and rows
    a run that died before recording its manifest left behind."""
    if not tables.lance_exists(curated_path):
        return 0
    existing = spark.read.format("lance").option("columns", "sample_id").load(curated_path)
    stale = [r.sample_id for r in existing.join(ids, "sample_id", "left_semi").collect()]
    return delete_rows(curated_path, stale)


def curate(spark: SparkSession, cfg: Config, run_id: str) -> CurateResult:
    sc = spark.sparkContext
    paths = tables.layout(cfg)
    now = datetime.now(UTC).replace(tzinfo=None)

    # list -> diff with bronze
    sc.setJobDescription("lakeshard curate: list sources, compare with the manifest")
    manifest = tables.read_delta(spark, paths.manifest)
    if manifest is not None:
        manifest = manifest.localCheckpoint(eager=True)  # read before it is merged into
    skip, skipped = _skipped_containers(cfg, manifest)
    listed = mark_unchanged(list_sources(spark, cfg, skip), manifest).persist(
        StorageLevel.MEMORY_AND_DISK
    )
    unchanged = dict(skipped)
    for r in listed.where("unchanged").groupBy("source").count().collect():
        unchanged[r["source"]] = unchanged.get(r["source"], 0) + r["count"]

    # fetch -> prepare
    sc.setJobDescription("lakeshard curate: fetch + prepare new records")
    todo = fetch_images(mark_duplicate_keys(listed.where(~F.col("unchanged"))), cfg.fetch,
                        cfg.sources)
    dup = F.col("occurrence") > 1
    prepared = (
        prepare_images(todo, cfg.prepare)
        .withColumns({
            "stage": F.when(F.col("fetch_failed"), F.lit("fetch")).otherwise(F.col("stage")),
            "detail": F.when(dup, F.format_string("copy %d of key %s", "occurrence",
                                                  "source_key"))
            .when(F.col("fetch_failed"), F.col("fetch_detail"))
            .otherwise(F.col("detail")),
        })
        .drop("image_bytes")
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    outcome = outcome_counts(prepared).persist()
    outcome_rows = outcome.collect()
    counts = source_counts(outcome_rows, [s.name for s in cfg.sources], unchanged)
    examples = failure_examples(outcome_rows, cfg.run.budgets.examples)
    fault_point("curate:prepared")

    # write curated
    sc.setJobDescription("lakeshard curate: append to Lance curated")
    accepted = accepted_rows(prepared, run_id=run_id, ingested_at=F.lit(now))
    upstream = prepared.where(F.col("status") == "ok").select("sample_id", *UPSTREAM_COLUMNS)
    accepted = accepted.join(upstream, "sample_id").select(*accepted.columns, *UPSTREAM_COLUMNS)
    processed = sum(c.seen for c in counts)
    replaced = 0
    if processed:  # a run with nothing new writes nothing but its accounting
        replaced = _replace_changed(
            spark, paths.curated, prepared.where(F.col("occurrence") == 1).select("sample_id")
        )
    if sum(c.accepted for c in counts) or not tables.lance_exists(paths.curated):
        accepted.write.format("lance").mode("append").save(paths.curated)
        # Scalar indexes on the columns analysts filter by (extended to new fragments).
        ensure_scalar_indexes(paths.curated, cfg.lakehouse.scalar_indexes)
    fault_point("curate:lance_written")

    # merge bronze
    sc.setJobDescription("lakeshard curate: merge Delta rejects, manifest, accounting")
    if processed or manifest is None:
        merge_rejects(spark, rejected_rows(prepared, run_id=run_id), paths.rejects)
        merge_manifest(spark, manifest_rows(prepared, run_id=run_id, ingested_at=now),
                       paths.manifest)
    merge_accounting(spark, accounting_rows(outcome, unchanged, run_id=run_id, run_at=now),
                     paths.accounting)
    sc.setJobDescription(None)
    for df in (outcome, prepared, listed):
        df.unpersist()

    ds = tables.open_curated(cfg)
    in_manifest = spark.read.format("delta").load(paths.manifest).where(
        "status = 'accepted'").count()
    if ds.count_rows() != in_manifest:
        raise RuntimeError(
            f"curated table has {ds.count_rows()} rows, the manifest {in_manifest} accepted"
        )
    if replaced:
        log.info("curate: replaced %d curated rows of changed records", replaced)
    return CurateResult(paths.curated, ds.version, ds.count_rows(), paths.rejects,
                        paths.manifest, paths.accounting, counts, examples=examples)


def stage(spark: SparkSession, cfg: Config, ctx: RunContext) -> StageResult:
    """ingest + prepare + write: sources -> Lance `curated` + Delta `rejects`."""
    cur = curate(spark, cfg, ctx.run_id)
    inputs: dict[str, int] = {"seen": sum(c.seen for c in cur.counts)}
    outputs: dict[str, int] = {"accepted": 0, "rejected": 0, "flagged": 0}
    for c in cur.counts:
        inputs[f"seen:{c.source}"] = c.seen
        outputs["accepted"] += c.accepted
        outputs["rejected"] += c.rejected
        outputs["flagged"] += sum(c.filtered.values())
        for reason, n in c.reasons.items():
            outputs[f"rejected:{reason}"] = outputs.get(f"rejected:{reason}", 0) + n
        for reason, n in c.filtered.items():
            outputs[f"flagged:{reason}"] = outputs.get(f"flagged:{reason}", 0) + n
    errors = sum(c.internal_errors for c in cur.counts)
    if errors:
        outputs["internal_error"] = errors
    tally = RowTally(rows=inputs["seen"], ok=outputs["accepted"], failed=outputs["rejected"],
                     internal_errors=errors, examples=cur.examples, failed_label="rejected")
    versions = {"lance:curated": cur.curated_version}
    rejects_version = tables.delta_version(spark, cur.rejects_path)
    if rejects_version is not None:
        versions["delta:rejects"] = rejects_version
    return StageResult(inputs=inputs, outputs=outputs, table_versions=versions, tally=tally,
                       detail=cur)
