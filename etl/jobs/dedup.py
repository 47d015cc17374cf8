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
from pyspark.sql import functions as F

from etl import tables
from etl.config import Config
from etl.runtime.options import flag
from etl.runtime.stage import Metrics, RunContext, StageResult
from etl.schema import DEDUP_SCHEMA
from etl.transforms.dedup import ASSIGNMENT_COLUMNS, ROW_COLUMNS, lsh_masks, plan_dedup
from etl.transforms.dedup_local import plan_local, size_histogram, update_stats
from etl.writers.delta import append_rows, merge_dedup, set_properties

__all__ = [
    "SourceDedup", "DedupResult", "dedup", "format_dedup", "DedupOptions", "stage", "check",
    "render",
]

log = logging.getLogger(__name__)


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
    mode: str  # "full", "incremental" or "incremental (driver)"
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
    if not full and (done := _driver_increment(spark, cfg, state, params, version, run_id)):
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
    sizes = {r["cluster_size"]: r["count"] for r in table.where("cluster_size > 1")
             .select("dup_cluster_id", "cluster_size").distinct()
             .groupBy("cluster_size").count().collect()}
    clusters = sum(sizes.values())
    sc.setJobDescription(None)
    delta_version = _record(spark, path, state, params, version,
                            {"by": by, "clusters": clusters, "sizes": size_histogram(sizes)})
    return DedupResult(
        path, delta_version, mode, version, plan.new_rows, plan.pairs, plan.rounds,
        changed, removed, clusters, counts,
    )


def _record(spark, path: str, state: dict | None, params: str, version: int,
            stats: dict) -> int:
    """Set the properties that make the next run's shortcuts possible (settings, the
    curated version covered, the stats and the table version they describe); last, so
    that a run killed before this is not taken for up to date. The Delta version after."""
    data_version = tables.delta_version(spark, path)
    props = {tables.DEDUP_PARAMS: params, tables.DEDUP_CURATED_VERSION: str(version),
             tables.DEDUP_STATS: json.dumps({**stats, "table_version": data_version},
                                     sort_keys=True)}
    if state is None or any(state.get(k) != v for k, v in props.items()):
        set_properties(spark, path, props)
    return tables.delta_version(spark, path)


def _same_rows(path: str, covered: int, version: int) -> bool:
    """Whether two curated versions hold the same rows (only columns were added or
    rewritten in between: captions, features), from the fragments' metadata."""
    import lance

    try:
        return tables.row_layout(lance.dataset(path, version=covered)) == tables.row_layout(
            lance.dataset(path, version=version))
    except (ValueError, OSError):  # the version covered was cleaned up
        return False


def _up_to_date(spark, cfg: Config, state: dict | None, params: str,
                version: int) -> DedupResult | None:
    """The result of a run with nothing to do, from the dedup table's properties alone
    (settings, curated version covered, stats) and the curated table's fragment
    metadata (a version that only added columns holds the same rows) -- no table is
    read; None when there is something to do (or the stats cannot be trusted)."""
    path = tables.layout(cfg).dedup
    stats = tables.dedup_stats(spark, path, state, params)
    if stats is None:
        return None
    covered = int(state.get(tables.DEDUP_CURATED_VERSION, -1))
    if covered != version and not _same_rows(tables.layout(cfg).curated, covered, version):
        return None
    return DedupResult(
        path, tables.delta_version(spark, path), "incremental", version, 0, 0, 0, 0, 0,
        stats["clusters"], _counts(stats["by"], [s.name for s in cfg.sources]),
        from_metadata=True,
    )


# Up to this many curated rows, the ordering columns of the stored rows a driver plan
# needs are read by pylance in the driver (its sample_id column: ~70 MB); above, by a
# Spark job over the table.
_DRIVER_SCAN_ROWS = 2_000_000


def _driver_increment(spark: SparkSession, cfg: Config, state: dict | None, params: str,
                      version: int, run_id: str) -> DedupResult | None:
    """An increment planned in the driver (:func:`etl.transforms.dedup_local.plan_local`)
    from the rows it touches, or None to plan over the whole table in Spark.

    What changed since the curated version dedup covered comes from Lance's fragment
    metadata: fragments appended (read alone), deletion files that grew, fragments a
    purge or compaction rewrote (their rows before, against the fragments that replaced
    them: moved rows are not new). The dedup table is then read for the rows
    the plan needs -- stored hashes sharing an LSH key with a new hash, the rows of the
    changed ids, the clusters all of those are in -- and the curated table for those
    rows' ordering columns: a filtered read of narrow columns, no shuffle of the table.
    Falls back (None) when the fragments touched hold more than ``dedup.driver_max_rows``
    rows (a compaction of the whole table, a large increment), or when the recorded
    stats no longer describe the table."""
    import lance
    import pyarrow as pa

    limit = cfg.dedup.driver_max_rows
    paths = tables.layout(cfg)
    stats = tables.dedup_stats(spark, paths.dedup, state, params) if limit else None
    if stats is None:
        return None
    covered = int(state.get(tables.DEDUP_CURATED_VERSION, -1))
    try:
        old = {f.fragment_id: f for f in lance.dataset(paths.curated, version=covered)
               .get_fragments()}
    except (ValueError, OSError):  # the version covered was cleaned up
        return None
    now = lance.dataset(paths.curated, version=version)
    new = {f.fragment_id: f for f in now.get_fragments()}
    if any(i in new and old[i].metadata.physical_rows != new[i].metadata.physical_rows
           for i in old):
        return None  # a fragment changed its rows in place: not something Lance does
    gone = [i for i in old if i not in new]  # rewritten (purged, compacted) or dropped
    appended = [i for i in new if i not in old]  # appended, or the rewrites' output
    n_deleted = tables.deleted_rows
    shrunk = [i for i in old if i in new and n_deleted(new[i]) != n_deleted(old[i])]
    if (sum(old[i].count_rows() for i in gone) + sum(new[i].count_rows() for i in appended)
            + sum(n_deleted(new[i]) - n_deleted(old[i]) for i in shrunk)) > limit:
        return None
    sc = spark.sparkContext
    sc.setJobDescription("lakeshard dedup: rows the increment touches")
    columns = list(ROW_COLUMNS)
    schema = pa.schema([now.schema.field(c) for c in columns])
    ident = ["sample_id", "image_sha256", "dhash"]
    # Rows that left their fragment (deleted, or moved by a rewrite), as they were...
    left: dict[str, tuple] = {}
    for i in gone:
        for r in old[i].to_table(columns=ident).to_pylist():
            left[r["sample_id"]] = (r["image_sha256"], r["dhash"])
    for i in shrunk:
        still = set(new[i].to_table(columns=["sample_id"]).column(0).to_pylist())
        for r in old[i].to_table(columns=ident).to_pylist():
            if r["sample_id"] not in still:
                left[r["sample_id"]] = (r["image_sha256"], r["dhash"])
    # ...and rows in new fragments: new, changed, or moved unchanged (not new to dedup).
    arrived = [r for i in appended for r in new[i].to_table(columns=columns).to_pylist()]
    added = [r for r in arrived
             if left.get(r["sample_id"]) != (r["image_sha256"], r["dhash"])]
    deleted = set(left) - {r["sample_id"] for r in arrived}
    added_ids = {r["sample_id"] for r in added}

    # Stored rows the plan needs: near neighbours of the new hashes (an LSH key in
    # common), the previous rows of changed or deleted ids, rows whose cluster is
    # named after a new id; then every member of their clusters.
    table = spark.read.format("delta").load(paths.dedup).select(*ASSIGNMENT_COLUMNS)
    masks = lsh_masks(cfg.dedup.threshold, cfg.dedup.bands)
    keys = sorted({(k, r["dhash"] & m) for r in added if r["dhash"] is not None
                   for k, m in enumerate(masks)})
    found = table.limit(0)
    if keys:
        keyed = table.select(
            "*", F.posexplode(F.array(*[F.col("dhash").bitwiseAND(F.lit(m).cast("long"))
                                        for m in masks])).alias("_key_id", "_key"))
        wanted = spark.createDataFrame(keys, "_key_id int, _key long")
        found = keyed.join(F.broadcast(wanted), ["_key_id", "_key"], "left_semi").select(
            *ASSIGNMENT_COLUMNS)
    ids = sorted(added_ids | deleted)
    if ids:
        by_id = spark.createDataFrame([(i,) for i in ids], "sample_id string")
        found = found.unionByName(table.join(F.broadcast(by_id), "sample_id", "left_semi"))
        found = found.unionByName(table.join(
            F.broadcast(by_id.withColumnRenamed("sample_id", "dup_cluster_id")),
            "dup_cluster_id", "left_semi"))
    first = found.dropDuplicates(["sample_id"]).collect()
    clusters = sorted({r["dup_cluster_id"] for r in first})
    prior = {r["sample_id"]: r.asDict() for r in first}
    if clusters:
        wanted = spark.createDataFrame([(c,) for c in clusters], "dup_cluster_id string")
        for r in table.join(F.broadcast(wanted), "dup_cluster_id", "left_semi").collect():
            prior.setdefault(r["sample_id"], r.asDict())
    if len(prior) > 4 * limit:
        sc.setJobDescription(None)
        return None
    stored = sorted(set(prior) - deleted - added_ids)
    current = list(added)
    if stored and now.count_rows() <= _DRIVER_SCAN_ROWS:
        # A table this size is read in this process (pylance: the narrow columns,
        # filtered by id) -- no Spark job, no Python worker to start.
        import pyarrow.compute as pc

        current += now.to_table(columns=columns, filter=pc.field("sample_id").isin(
            stored)).cast(schema).to_pylist()
    elif stored:
        want = spark.createDataFrame([(i,) for i in stored], "sample_id string")
        rows = (spark.read.format("lance").option("version", str(version))
                .option("columns", ",".join(columns)).load(paths.curated)
                .join(F.broadcast(want), "sample_id", "left_semi").select(*columns))
        current += rows.toArrow().cast(schema).to_pylist()
    sc.setJobDescription(None)
    if len(current) != len(added) + len(stored):
        # The dedup table names rows the curated table lacks but no delete removed:
        # it does not describe the version it says it covers. Plan over the table.
        log.info("dedup: the stored rows do not match curated version %d: planning in Spark",
                 covered)
        return None

    plan = plan_local(current, prior.values(), cfg.dedup, run_id)
    sc.setJobDescription("lakeshard dedup: merge Delta dedup")
    fields = DEDUP_SCHEMA.fields
    # Only new rows, none of them joining a stored row's cluster (a night of new,
    # distinct pictures): one append from the driver, what the MERGE would do.
    inserts_only = not plan.removed and not any(r["sample_id"] in prior for r in plan.changes)
    appended = bool(plan.changes) and inserts_only and append_rows(
        pa.Table.from_pylist([{f.name: r[f.name] for f in fields} for r in plan.changes]),
        paths.dedup, DEDUP_SCHEMA)
    if (plan.changes or plan.removed) and not appended:
        changes = spark.createDataFrame(
            [tuple(r[f.name] for f in fields) for r in plan.changes], DEDUP_SCHEMA)
        removed = spark.createDataFrame([(i,) for i in plan.removed], "sample_id string")
        merge_dedup(spark, paths.dedup, changes, removed, ASSIGNMENT_COLUMNS)
    sc.setJobDescription(None)
    stats = update_stats(stats, plan.changes, plan.removed, prior)
    delta_version = _record(spark, paths.dedup, state, params, version, stats)
    return DedupResult(
        paths.dedup, delta_version, "incremental (driver)", version, plan.new_rows,
        plan.pairs, 0, len(plan.changes), len(plan.removed), stats["clusters"],
        _counts(stats["by"], [s.name for s in cfg.sources]),
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


@dataclass(frozen=True)
class DedupOptions:
    """`lakeshard dedup`'s flags."""

    full: bool = flag(False, "recompare every row (default: new rows against everything)")


def stage(spark: SparkSession, cfg: Config, ctx: RunContext) -> StageResult:
    """exact + near duplicates of the curated table -> Delta `dedup` (new rows only)."""
    if not cfg.dedup.enabled and not ctx.command:
        return StageResult(note="disabled (dedup.enabled: false)")
    res = dedup(spark, cfg, ctx.run_id, full=ctx.options_for(DedupOptions).full)
    by: dict[str, dict[str, int]] = {}
    for c in res.counts:
        for key, value in vars(c).items():
            if isinstance(value, int) and key != "source":
                by.setdefault(key, {})[c.source] = value
    outputs = Metrics({"changed": res.changed, "removed": res.removed,
                       "clusters": res.clusters, "near_pairs": res.pairs}, by=by)
    return StageResult(
        inputs={"new_rows": res.new_rows}, outputs=outputs,
        table_versions={"delta:dedup": res.version},
        note="up to date" if res.new_rows == 0 and res.changed == 0 else None, detail=res,
    )


def check(cfg: Config, ctx: RunContext) -> None:
    """Before Spark, for `lakeshard dedup`: there is a curated table to dedup."""
    if ctx.command:
        tables.open_curated(cfg)


def render(cfg: Config, opts: DedupOptions, result: StageResult) -> str:
    """What `lakeshard dedup` prints."""
    return format_dedup(result.detail)
