"""Dedup job: the curated table's cheap columns -> Delta `dedup` (MERGE), per-source
stats. (The analyst views over the result are in :mod:`etl.lakehouse.views`.)

The curated Lance table holds image bytes and is never rewritten here: assignments live
in a Delta table keyed by ``sample_id`` (docs/dedup.md). A run reads
``sample_id, source, image_sha256, dhash, width, height, original_*, ingested_at`` at
the table's current version and the previous assignments, plans with
:func:`etl.transforms.dedup.plan_dedup`, and MERGEs only the rows whose assignment
changed (and deletes the rows the curated table no longer has).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from pyspark.sql import DataFrame, SparkSession

from etl import tables
from etl.config import Config
from etl.runtime.stage import RunContext, StageResult
from etl.schema import DEDUP_SCHEMA
from etl.transforms.dedup import ASSIGNMENT_COLUMNS, ROW_COLUMNS, plan_dedup
from etl.writers.delta import merge_dedup, set_properties

__all__ = ["SourceDedup", "DedupResult", "dedup", "format_dedup", "stage", "check"]

log = logging.getLogger(__name__)

# Delta table property: the per-source, per-kind row counts and the cluster count of
# the table as the last run left it, so that a run with nothing to do reads no table.
DEDUP_STATS = "lakeshard.dedup.stats"



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
    # Up to date, decided from the table's properties alone (no table read).
    from_metadata: bool = False


def dedup(spark: SparkSession, cfg: Config, run_id: str, *, full: bool = False) -> DedupResult:
    """Annotate duplicates of the curated table; incremental unless `full` or the
    threshold/bands changed since the last run."""
    from delta.tables import DeltaTable

    sc = spark.sparkContext
    paths = tables.layout(cfg)
    curated_path, path = paths.curated, paths.dedup
    version = tables.open_curated(cfg).version
    state = tables.dedup_state(spark, cfg)
    params = tables.dedup_params(cfg)
    if not full and (done := _up_to_date(spark, cfg, state, params, version)) is not None:
        return done
    current = (
        spark.read.format("lance")
        .option("version", str(version))
        .option("columns", ",".join(ROW_COLUMNS))
        .load(curated_path)
    )
    prior = None
    if state is not None:
        prior = spark.read.format("delta").load(path).select(*ASSIGNMENT_COLUMNS)
        if state.get(tables.DEDUP_PARAMS) != params:
            log.info("dedup: threshold/bands changed (%s -> %s): full run",
                     state.get(tables.DEDUP_PARAMS), params)
            full = True
    else:
        DeltaTable.createIfNotExists(spark).location(path).addColumns(DEDUP_SCHEMA).execute()
    mode = "full" if full or prior is None else "incremental"

    sc.setJobDescription(f"lakeshard dedup: plan ({mode})")
    plan = plan_dedup(current, prior, cfg.dedup, run_id, full=full)
    changed, removed = plan.changes.count(), plan.removed.count()

    sc.setJobDescription("lakeshard dedup: merge Delta dedup")
    if changed or removed:
        merge_dedup(spark, path, plan.changes, plan.removed, ASSIGNMENT_COLUMNS)
    sc.setJobDescription("lakeshard dedup: stats")
    table = spark.read.format("delta").load(path)
    by = _by_source(table)
    counts = _counts(by, [s.name for s in cfg.sources])
    clusters = table.where("cluster_size > 1").select("dup_cluster_id").distinct().count()
    sc.setJobDescription(None)
    # Last, so that a run killed before this line is not taken for up to date.
    props = {tables.DEDUP_PARAMS: params, tables.DEDUP_CURATED_VERSION: str(version),
             DEDUP_STATS: json.dumps({"by": by, "clusters": clusters}, sort_keys=True)}
    if state is None or any(state.get(k) != v for k, v in props.items()):
        set_properties(spark, path, props)
    delta_version = tables.delta_version(spark, path)
    return DedupResult(
        path, delta_version, mode, version, plan.new_rows, plan.pairs, plan.rounds,
        changed, removed, clusters, counts,
    )


def _up_to_date(spark, cfg: Config, state: dict | None, params: str,
                version: int) -> DedupResult | None:
    """The result of a run with nothing to do, from the dedup table's properties alone
    (settings, curated version covered, stats) -- no table is read; None when there is
    something to do (or the table predates the recorded stats)."""
    if (state is None or state.get(tables.DEDUP_PARAMS) != params
            or state.get(tables.DEDUP_CURATED_VERSION) != str(version)
            or DEDUP_STATS not in state):
        return None
    stats = json.loads(state[DEDUP_STATS])
    path = tables.layout(cfg).dedup
    return DedupResult(
        path, tables.delta_version(spark, path), "incremental", version, 0, 0, 0, 0, 0,
        stats["clusters"], _counts(stats["by"], [s.name for s in cfg.sources]),
        from_metadata=True,
    )


def _by_source(table: DataFrame) -> dict[str, dict[str, int]]:
    by: dict[str, dict[str, int]] = {}
    for r in table.groupBy("source", "dup_kind").count().collect():
        by.setdefault(r["source"], {})[r["dup_kind"]] = r["count"]
    return by


def _counts(by: dict[str, dict[str, int]], sources: list[str]) -> tuple[SourceDedup, ...]:
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


def stage(spark: SparkSession, cfg: Config, ctx: RunContext) -> StageResult:
    """exact + near duplicates of the curated table -> Delta `dedup` (new rows only)."""
    if not cfg.dedup.enabled and not ctx.option("dedup", "command"):
        return StageResult(note="disabled (dedup.enabled: false)")
    res = dedup(spark, cfg, ctx.run_id, full=ctx.option("dedup", "full", False))
    outputs = {"changed": res.changed, "removed": res.removed, "clusters": res.clusters,
               "near_pairs": res.pairs}
    for c in res.counts:
        for key, value in vars(c).items():
            if isinstance(value, int) and key != "source":
                outputs[f"{key}:{c.source}"] = value
    return StageResult(
        inputs={"new_rows": res.new_rows}, outputs=outputs,
        table_versions={"delta:dedup": res.version},
        note="up to date" if res.new_rows == 0 and res.changed == 0 else None, detail=res,
    )


def check(cfg: Config, ctx: RunContext) -> None:
    """Before Spark, for `lakeshard dedup`: there is a curated table to dedup."""
    if ctx.option("dedup", "command", False):
        tables.open_curated(cfg)
