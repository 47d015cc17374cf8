"""Dedup job: the curated table's cheap columns -> Delta `dedup` (MERGE), per-source
stats, and the analyst views `dedup`, `dup_clusters` and `curated` (joined).

The curated Lance table holds image bytes and is never rewritten here: assignments live
in a Delta table keyed by ``sample_id`` (see README, "Deduplication"). A run reads
``sample_id, source, image_sha256, phash, width, height, original_*, ingested_at`` at
the table's current version and the previous assignments, plans with
:func:`etl.transforms.dedup.plan_dedup`, and MERGEs only the rows whose assignment
changed (and deletes the rows the curated table no longer has).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl.config import Config
from etl.schema import DEDUP_SCHEMA
from etl.transforms.dedup import ASSIGNMENT_COLUMNS, ROW_COLUMNS, plan_dedup
from etl.writers.lance import table_version

__all__ = [
    "DEDUP_TABLE",
    "SourceDedup",
    "DedupResult",
    "dedup",
    "format_dedup",
    "dedup_state",
    "non_canonical_ids",
    "register_dedup_views",
]

log = logging.getLogger(__name__)

DEDUP_TABLE = "dedup"
_PARAMS = "lakeshard.dedup.params"
_CURATED_VERSION = "lakeshard.dedup.curatedVersion"


@dataclass(frozen=True)
class SourceDedup:
    source: str
    rows: int
    canonical: int  # canonical members of clusters of 2+ (exported)
    exact: int  # same bytes as their cluster's canonical member (not exported)
    near: int  # perceptual duplicates of their canonical member (not exported)

    @property
    def exact_rate(self) -> float:
        return self.exact / self.rows if self.rows else 0.0

    @property
    def near_rate(self) -> float:
        return self.near / self.rows if self.rows else 0.0


@dataclass(frozen=True)
class DedupResult:
    path: str
    version: int  # Delta version after this run
    mode: str  # "full" or "incremental"
    curated_version: int
    new_rows: int  # rows compared against everything this run
    pairs: int  # verified near pairs found this run (distinct dHashes)
    rounds: int  # connected-components rounds
    changed: int  # rows inserted or updated
    removed: int  # rows deleted (gone from the curated table)
    clusters: int  # clusters of 2+ rows in the whole table
    counts: tuple[SourceDedup, ...] = field(default_factory=tuple)


def _params(cfg: Config) -> str:
    d = cfg.dedup
    return json.dumps({"threshold": d.threshold, "bands": d.bands}, sort_keys=True)


def dedup_state(spark: SparkSession, path: str) -> dict[str, str] | None:
    """The dedup table's lakeshard properties, or None when there is no table."""
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, path):
        return None
    props = DeltaTable.forPath(spark, path).detail().select("properties").first()[0] or {}
    return {k: v for k, v in props.items() if k.startswith("lakeshard.")}


def dedup(spark: SparkSession, cfg: Config, run_id: str, *, full: bool = False) -> DedupResult:
    """Annotate duplicates of the curated table; incremental unless `full` or the
    threshold/bands changed since the last run."""
    import lance
    from delta.tables import DeltaTable

    from etl.jobs.curate import CURATED_TABLE

    sc = spark.sparkContext
    curated_path = cfg.storage.lance_table(CURATED_TABLE)
    path = cfg.storage.delta_table(DEDUP_TABLE)
    try:
        version = lance.dataset(curated_path).version
    except (ValueError, OSError) as exc:
        raise FileNotFoundError(
            f"no curated table at {curated_path}: run `lakeshard curate` first"
        ) from exc
    current = (
        spark.read.format("lance")
        .option("version", str(version))
        .option("columns", ",".join(ROW_COLUMNS))
        .load(curated_path)
    )
    state = dedup_state(spark, path)
    prior = None
    if state is not None:
        prior = spark.read.format("delta").load(path).select(*ASSIGNMENT_COLUMNS)
        if state.get(_PARAMS) != _params(cfg):
            log.info("dedup: threshold/bands changed (%s -> %s): full run",
                     state.get(_PARAMS), _params(cfg))
            full = True
    else:
        DeltaTable.createIfNotExists(spark).location(path).addColumns(DEDUP_SCHEMA).execute()
    mode = "full" if full or prior is None else "incremental"

    sc.setJobDescription(f"lakeshard dedup: plan ({mode})")
    plan = plan_dedup(current, prior, cfg.dedup, run_id, full=full)
    changed, removed = plan.changes.count(), plan.removed.count()

    sc.setJobDescription("lakeshard dedup: merge Delta dedup")
    if changed or removed:
        source = plan.changes.withColumn("_op", F.lit("upsert")).unionByName(
            plan.removed.withColumn("_op", F.lit("delete")), allowMissingColumns=True
        )
        cols = {c: f"s.{c}" for c in ASSIGNMENT_COLUMNS}
        (
            DeltaTable.forPath(spark, path)
            .alias("t")
            .merge(source.alias("s"), "t.sample_id = s.sample_id")
            .whenMatchedDelete(condition="s._op = 'delete'")
            .whenMatchedUpdate(condition="s._op = 'upsert'", set=cols)
            .whenNotMatchedInsert(condition="s._op = 'upsert'", values=cols)
            .execute()
        )
    props = {_PARAMS: _params(cfg), _CURATED_VERSION: str(version)}
    if state is None or any(state.get(k) != v for k, v in props.items()):
        settings = ", ".join(f"'{k}' = '{v}'" for k, v in props.items())
        spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({settings})")

    sc.setJobDescription("lakeshard dedup: stats")
    table = spark.read.format("delta").load(path)
    counts = _counts(table, [s.name for s in cfg.sources])
    clusters = table.where("cluster_size > 1").select("dup_cluster_id").distinct().count()
    sc.setJobDescription(None)
    delta_version = DeltaTable.forPath(spark, path).history(1).select("version").first()[0]
    return DedupResult(
        path, delta_version, mode, version, plan.new_rows, plan.pairs, plan.rounds,
        changed, removed, clusters, counts,
    )


def _counts(table: DataFrame, sources: list[str]) -> tuple[SourceDedup, ...]:
    rows = table.groupBy("source", "dup_kind").count().collect()
    by = {}
    for r in rows:
        by.setdefault(r["source"], {})[r["dup_kind"]] = r["count"]
    names = sources + sorted(set(by) - set(sources))  # sources no longer configured last
    return tuple(
        SourceDedup(
            name,
            sum(by.get(name, {}).values()),
            by.get(name, {}).get("canonical", 0),
            by.get(name, {}).get("exact", 0),
            by.get(name, {}).get("near", 0),
        )
        for name in names
    )


def format_dedup(res: DedupResult) -> str:
    lines = [
        f"dedup (Delta)   : {res.path}  version {res.version}, {res.mode} over curated "
        f"version {res.curated_version}: {res.new_rows} new row(s), {res.pairs} near "
        f"pair(s), {res.changed} row(s) changed, {res.removed} removed; "
        f"{res.clusters} duplicate cluster(s)",
    ]
    header = (
        f"{'source':<20} {'rows':>7} {'canonical':>9} {'exact':>7} {'near':>7} "
        f"{'exact rate':>10} {'near rate':>9}"
    )
    lines += [header, "-" * len(header)]
    for c in res.counts:
        lines.append(
            f"{c.source:<20} {c.rows:>7} {c.canonical:>9} {c.exact:>7} {c.near:>7} "
            f"{c.exact_rate:>10.1%} {c.near_rate:>9.1%}"
        )
    return "\n".join(lines)


def non_canonical_ids(spark: SparkSession, cfg: Config, curated_version: int) -> DataFrame | None:
    """``sample_id`` of the rows exports leave out, or None when dedup never ran."""
    path = cfg.storage.delta_table(DEDUP_TABLE)
    state = dedup_state(spark, path)
    if state is None:
        log.warning("no dedup table at %s: exporting without dedup", path)
        return None
    if state.get(_CURATED_VERSION) != str(curated_version):
        log.warning(
            "dedup covers curated version %s, the table is at %s: rows added since are "
            "exported unchecked (run `lakeshard dedup`)",
            state.get(_CURATED_VERSION), curated_version,
        )
    return spark.read.format("delta").load(path).where("NOT is_canonical").select("sample_id")


def register_dedup_views(spark: SparkSession, cfg: Config) -> list[str]:
    """Temp views `dedup` (one row per sample), `dup_clusters` (one row per cluster of
    2+: size, canonical member, members, sources, kinds) and `curated` with
    dup_cluster_id, is_canonical, dup_kind, cluster_size joined in. No-op without a
    dedup table."""
    from etl.jobs.curate import CURATED_TABLE

    path = cfg.storage.delta_table(DEDUP_TABLE)
    if dedup_state(spark, path) is None:
        return []
    table = spark.read.format("delta").load(path)
    table.createOrReplaceTempView("dedup")
    clusters = (
        table.where("cluster_size > 1")
        .groupBy("dup_cluster_id")
        .agg(
            F.count(F.lit(1)).alias("cluster_size"),
            F.max(F.when(F.col("is_canonical"), F.col("sample_id"))).alias("canonical_sample_id"),
            F.max(F.when(F.col("is_canonical"), F.col("source"))).alias("canonical_source"),
            F.sort_array(F.collect_list("sample_id")).alias("members"),
            F.sort_array(F.collect_set("source")).alias("sources"),
            F.sum((F.col("dup_kind") == "exact").cast("int")).alias("exact"),
            F.sum((F.col("dup_kind") == "near").cast("int")).alias("near"),
        )
    )
    clusters.createOrReplaceTempView("dup_clusters")
    names = ["dedup", "dup_clusters"]
    curated_path = cfg.storage.lance_table(CURATED_TABLE)
    try:
        table_version(curated_path)
    except (ValueError, OSError):  # no curated table: only the dedup views
        return names
    curated = spark.read.format("lance").load(curated_path)
    dup_cols = table.select("sample_id", "dup_cluster_id", "is_canonical", "dup_kind",
                            "cluster_size")
    curated.join(dup_cols, "sample_id", "left").createOrReplaceTempView("curated")
    return [*names, "curated"]
