"""The Delta ``dedup`` table: its path and schema, its properties, its named queries,
the one writer of its rows, and the entry point that brings it up to date with the
curated table (:meth:`DedupTable.update`, used by ``lakeshard dedup`` and ``forget``).

The table holds one row per curated sample (``etl.schema.DEDUP_SCHEMA``); its Delta
properties say what it covers:

* ``lakeshard.dedup.params`` -- the settings its clusters were computed with
  (threshold, bands): other settings make the next run a full one;
* ``lakeshard.dedup.curatedVersion`` -- the curated version it covers;
* ``lakeshard.dedup.stats`` -- rows per source and kind, clusters of 2+ and clusters per
  size, with the table version they describe. Derived state, kept in the table rather
  than under ``_lakeshard/`` (docs/development.md says why) but under the same rules:
  written after the commit it describes, keyed by that table version, ignored when stale
  (another commit since), foreign (another format) or unreadable; the table is then
  counted again.

How a change is planned -- from metadata alone, in the driver, or by Spark over the
table -- is chosen here, with its bounds (``driver.scan_rows``, ``driver.plan_rows``,
``driver.ids``: :mod:`etl.config.bounds`); the rules all three follow are
:mod:`etl.transforms.dedup_rules`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl import storage, tables
from etl.config import Config, DedupConfig
from etl.lakehouse import dedup_increment
from etl.schema import DEDUP_SCHEMA, arrow_schema
from etl.transforms.dedup import ASSIGNMENT_COLUMNS, ROW_COLUMNS, plan_dedup
from etl.transforms.dedup_local import plan_local, size_histogram, update_stats
from etl.writers.delta import (
    append_rows,
    ensure_table,
    is_empty,
    merge_dedup,
    merge_dedup_rows,
    read_columns,
    set_properties,
)
from etl.writers.lance import lance_reader

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "DEDUP_PARAMS",
    "DEDUP_CURATED_VERSION",
    "DEDUP_STATS",
    "CHANGE_FEED",
    "SourceDedup",
    "DedupResult",
    "DedupCoverage",
    "DedupTable",
    "dedup_params",
    "source_counts",
]

log = logging.getLogger(__name__)

# Delta table properties of the dedup table: the settings it was computed with, and
# the curated table version it covers.
DEDUP_PARAMS = "lakeshard.dedup.params"
DEDUP_CURATED_VERSION = "lakeshard.dedup.curatedVersion"
# The per-source, per-kind row counts, the cluster count and the clusters per size of
# the dedup table as the last run left it (so that a run with nothing to do, and the
# report, read no table), with the table version they describe (the run's last data
# commit; the properties are the commit after it): another writer since makes them
# unusable.
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
    mode: str  # "full", "incremental", "incremental (driver)" or "full (driver)"
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
    # An increment planned in the driver: the stored rows its filtered reads took out of
    # the dedup table (follows the new rows' LSH keys and ids, not the table's size).
    stored_read: int | None = None


@dataclass(frozen=True)
class DedupCoverage:
    """How the dedup table covers the curated table at one version."""

    dedup_version: int  # the curated version dedup last ran over
    curated_version: int
    uncovered: int  # curated rows added, or whose image changed, since: not deduplicated
    removed: int  # rows dedup has that the curated table no longer has

    @property
    def stale(self) -> bool:
        return bool(self.uncovered or self.removed)


# Delta's change data feed, on from the table's first write: a night's MERGE then also
# writes the rows it changed (before and after) beside the files it rewrote, which is
# what the export's increment reads (:meth:`DedupTable.canonical_changes`).
CHANGE_FEED = {"delta.enableChangeDataFeed": "true"}

_BEFORE = ("update_preimage", "delete")


def _first_and_last(feed: pa.Table) -> tuple[pa.Table, pa.Table]:
    """From a change data feed (``sample_id, is_canonical, _change_type,
    _commit_version``): each id's row before its first change, when that change found
    it there (a pre-image or a delete), and after its last, when the row is still there
    (an insert or a post-image); both as ``sample_id, is_canonical``, plain strings.
    Within a version, what was there comes before what replaced it."""
    import pyarrow as pa
    import pyarrow.compute as pc

    plain = pa.schema([("sample_id", pa.string()), ("is_canonical", pa.bool_())])
    if not feed.num_rows:
        return plain.empty_table(), plain.empty_table()
    was = pc.is_in(feed.column("_change_type").cast(pa.string()),
                   pa.array(_BEFORE, pa.string()))
    order = pc.add(pc.multiply(feed.column("_commit_version").cast(pa.int64()), 2),
                   pc.if_else(was, 0, 1))
    events = pa.table({"sample_id": feed.column("sample_id").cast(pa.string()),
                       "is_canonical": feed.column("is_canonical"),
                       "_was": was, "_order": order}).sort_by(
        [("sample_id", "ascending"), ("_order", "ascending")])
    ends = events.group_by("sample_id", use_threads=False).aggregate(
        [("is_canonical", "first"), ("_was", "first"),
         ("is_canonical", "last"), ("_was", "last")])
    before = ends.filter(ends.column("_was_first")).select(
        ["sample_id", "is_canonical_first"])
    after = ends.filter(pc.invert(ends.column("_was_last"))).select(
        ["sample_id", "is_canonical_last"])
    return before.rename_columns(plain.names).cast(plain), \
        after.rename_columns(plain.names).cast(plain)


def dedup_params(cfg: DedupConfig) -> str:
    """The settings a dedup result depends on, as recorded in its table."""
    return json.dumps({"threshold": cfg.threshold, "bands": cfg.bands}, sort_keys=True)


def source_counts(by: dict[str, dict[str, int]], sources: Sequence[str]
                  ) -> tuple[SourceDedup, ...]:
    """Per source (configured ones first, in order; others after, by name), from the
    stats' rows per source and kind."""
    names = list(sources) + sorted(set(by) - set(sources))
    return tuple(
        SourceDedup(name, sum(by.get(name, {}).values()), by.get(name, {}).get("canonical", 0),
                    by.get(name, {}).get("exact", 0), by.get(name, {}).get("near", 0))
        for name in names
    )


class DedupTable:
    """The dedup table of one root, asked through one Spark session."""

    schema = DEDUP_SCHEMA

    def __init__(self, spark: SparkSession, cfg: Config):
        self.spark, self.cfg = spark, cfg
        paths = tables.layout(cfg)
        self.path, self.curated_path = paths.dedup, paths.curated
        self.params = dedup_params(cfg.dedup)

    # ------------------------------------------------------------------ reads

    def read(self) -> DataFrame:
        """Every assignment (ASSIGNMENT_COLUMNS)."""
        return self.spark.read.format("delta").load(self.path).select(*ASSIGNMENT_COLUMNS)

    def scan_local(self):
        """The table's files as a pyarrow dataset opened by delta-rs in this process (no
        Spark job), for filtered reads that materialise only matching rows, while the
        table's log says it holds at most ``driver.scan_rows`` rows; None otherwise (or
        when delta-rs cannot read it)."""
        from deltalake.exceptions import DeltaError

        from etl.writers.remote import subtree

        try:
            table = storage.delta_rs_table(self.path)
            if table is None:
                return None
            actions = table.get_add_actions(flatten=True)
            if "num_records" not in actions.schema.names:
                return None
            counts = actions.column("num_records").to_pylist()
            if any(n is None for n in counts) or sum(counts) > self.cfg.driver.scan_rows:
                return None
            return table.to_pyarrow_dataset(filesystem=subtree(storage.object_url(self.path)))
        except DeltaError as exc:
            if storage.delta_rs_unsupported(exc):
                return None
            raise

    def version(self) -> int | None:
        """The table's latest Delta version; None when dedup never ran."""
        return storage.delta_version(self.spark, self.path)

    def state(self) -> dict[str, str] | None:
        """The table's lakeshard properties, or None when dedup never ran (read from the
        table's log: no Spark job)."""
        props = storage.delta_properties(self.spark, self.path)
        if props is None:
            return None
        return {k: v for k, v in props.items() if k.startswith("lakeshard.")}

    def stats(self, state: dict | None) -> dict | None:
        """The recorded stats (``by``, ``clusters``, ``sizes``) if they still describe
        the table: recorded with the present settings, in the present format, readable,
        and no commit since the run that recorded them (its properties commit aside).
        None otherwise: the table must be counted (:meth:`count_stats`)."""
        if state is None or state.get(DEDUP_PARAMS) != self.params or DEDUP_STATS not in state:
            return None
        try:
            stats = json.loads(state[DEDUP_STATS])
        except ValueError:
            log.info("dedup: unreadable %s: counting the table", DEDUP_STATS)
            return None
        recorded = stats.get("table_version") if isinstance(stats, dict) else None
        if not isinstance(recorded, int) or not all(k in stats for k in ("by", "sizes",
                                                                          "clusters")):
            return None
        if self.version() not in (recorded, recorded + 1):
            return None
        return stats

    def count_stats(self) -> dict:
        """The stats counted from the table (two Spark jobs)."""
        table = self.spark.read.format("delta").load(self.path)
        by: dict[str, dict[str, int]] = {}
        for r in table.groupBy("source", "dup_kind").count().collect():
            by.setdefault(r["source"], {})[r["dup_kind"]] = r["count"]
        sizes = {r["cluster_size"]: r["count"] for r in table.where("cluster_size > 1")
                 .select("dup_cluster_id", "cluster_size").distinct()
                 .groupBy("cluster_size").count().collect()}
        return {"by": by, "clusters": sum(sizes.values()), "sizes": size_histogram(sizes)}

    def current_stats(self, state: dict | None) -> dict:
        """The recorded stats when they describe the table, else counted."""
        stats = self.stats(state)
        return stats if stats is not None else self.count_stats()

    def covers_rows(self, covered: int, version: int) -> bool:
        """Whether curated `version` holds the rows of the covered version (only columns
        added or rewritten in between), from the fragments' metadata."""
        return covered == version or dedup_increment.same_rows(self.curated_path, covered,
                                                               version)

    def coverage(self, curated_version: int) -> DedupCoverage | None:
        """Whether the table still covers the curated table's rows at
        `curated_version`; None when dedup never ran.

        Compared as rows, not version numbers: a version that only added or rewrote
        columns holds the same rows, which the fragments' row counts show without a
        Spark job. Otherwise one Spark job compares ``(sample_id, image_sha256)`` of
        both tables."""
        state = self.state()
        if state is None:
            return None
        covered = int(state.get(DEDUP_CURATED_VERSION, -1))
        if self.covers_rows(covered, curated_version):
            return DedupCoverage(covered, curated_version, 0, 0)
        curated = (lance_reader(self.spark).option("version", str(curated_version))
                   .option("columns", "sample_id,image_sha256").load(self.curated_path)
                   .select("sample_id", F.col("image_sha256").alias("_now")))
        known = self.read().select("sample_id", F.col("image_sha256").alias("_then"))
        counts = curated.join(known, "sample_id", "full_outer").agg(
            F.sum((F.col("_now").isNotNull() & ~F.col("_now").eqNullSafe(F.col("_then")))
                  .cast("long")).alias("uncovered"),
            F.sum(F.col("_now").isNull().cast("long")).alias("removed"),
        ).first()
        return DedupCoverage(covered, curated_version, int(counts["uncovered"] or 0),
                             int(counts["removed"] or 0))

    def non_canonical_ids(self, curated_version: int) -> DataFrame | None:
        """``sample_id`` of the rows exports leave out (non-canonical duplicates), or
        None when dedup never ran. Warns when rows were added, changed or removed since
        dedup last ran (not when a later version only added columns)."""
        found = self.non_canonical(curated_version)
        return None if found is None else found[0]

    def non_canonical(self, curated_version: int) -> tuple[DataFrame, list[str] | None] | None:
        """:meth:`non_canonical_ids`, and the same ids as a list when the driver read
        them (at most ``driver.ids``, from a table within ``driver.scan_rows``; else
        None)."""
        coverage = self.coverage(curated_version)
        if coverage is None:
            log.warning("no dedup table at %s: exporting without dedup", self.path)
            return None
        if coverage.stale:
            log.warning(
                "dedup covers curated version %s; at version %s, %d row(s) were added or "
                "changed since (exported without dedup) and %d removed (their clusters "
                "may lose their canonical member): run `lakeshard dedup`",
                coverage.dedup_version, curated_version, coverage.uncovered,
                coverage.removed,
            )
        local = read_columns(self.path, ["sample_id", "is_canonical"],
                             bound=self.cfg.driver.scan_rows)
        if local is not None:
            import pyarrow.compute as pc

            ids = local.filter(pc.invert(local["is_canonical"]))["sample_id"].to_pylist()
            if len(ids) <= self.cfg.driver.ids:  # a few ids: no Delta read in Spark
                return self.spark.createDataFrame([(i,) for i in ids],
                                                  "sample_id string"), ids
        return self.read().where("NOT is_canonical").select("sample_id"), None

    def canonical_changes(self, since: int
                          ) -> tuple[dict[str, bool], dict[str, bool], pa.Table] | None:
        """``is_canonical`` by id of the rows that changed since Delta version `since`:
        as they are now (rows inserted or updated since, still there) and as they were
        then (rows updated or deleted since, before their first change), read from the
        table's change data feed (:data:`CHANGE_FEED`), less the rows in both with the
        same status, which come third, as Arrow (``sample_id, is_canonical``). The feed
        holds the rows a MERGE changed, not the file it rewrote around them; for
        versions written before the table had a feed, delta-rs answers from the files
        added and removed (every row of a rewritten file then comes back, the unchanged
        ones as the third part) -- unless the first version read is a metadata commit
        without the feed, which delta-rs refuses. None when that cannot be told (`since`
        no longer readable, its change or data files vacuumed, deletion vectors, a
        table delta-rs cannot read)."""
        import pyarrow as pa
        import pyarrow.compute as pc
        from deltalake import DeltaTable
        from deltalake.exceptions import DeltaError

        plain = pa.schema([("sample_id", pa.string()), ("is_canonical", pa.bool_())])
        try:
            now = storage.delta_rs_table(self.path)
            if now is None:
                return None
            url, opts = storage.object_url(self.path), storage.delta_rs_storage(self.path)
            then = DeltaTable(url, version=since, storage_options=opts)
            for table in (now, then):
                actions = table.get_add_actions(flatten=True)
                if any(actions.column(n).null_count < actions.num_rows
                       for n in actions.schema.names if n.startswith("deletionVector")):
                    return None  # rows deleted in place: not told by the files
            if now.version() <= since:
                return {}, {}, plain.empty_table()
            reader = now.load_cdf(
                starting_version=since + 1, ending_version=now.version(),
                columns=["sample_id", "is_canonical", "_change_type", "_commit_version"])
        except (DeltaError, OSError) as exc:
            log.info("dedup: changes since version %d unreadable (%s)", since, exc)
            return None
        try:
            # The files are opened here, as the stream is read; what fails then (a
            # change file or a removed data file vacuumed, a storage error) comes
            # through Arrow's stream interface as a plain Exception.
            feed = pa.table(reader.read_all())
        except Exception as exc:  # noqa: BLE001 -- the export then diffs in full
            log.info("dedup: changes since version %d unreadable (%s)", since, exc)
            return None
        before, after = _first_and_last(feed)
        both = after.join(before.rename_columns(["sample_id", "then"]), "sample_id",
                          join_type="inner")
        same = both.filter(pc.equal(both.column("is_canonical"), both.column("then")))
        kept = pc.invert(pc.is_in(after.column("sample_id"), same.column("sample_id")))
        left = pc.invert(pc.is_in(before.column("sample_id"), same.column("sample_id")))

        def by_id(t: pa.Table) -> dict[str, bool]:
            return dict(zip(t.column(0).to_pylist(), t.column(1).to_pylist(), strict=True))

        return (by_id(after.filter(kept)), by_id(before.filter(left)),
                same.select(["sample_id", "is_canonical"]))

    def canonical_of(self, ids: list[str]) -> dict[str, bool] | None:
        """``is_canonical`` of `ids` (absent: not in the table), by a delta-rs scan
        filtered on them; None beyond ``driver.scan_rows`` rows."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if not ids:
            return {}
        table = self.scan_local()
        if table is None:
            return None
        wanted = pa.array(sorted(ids), pa.string())
        rows = dedup_increment.scan_rows(table, ["sample_id", "is_canonical"],
                                         lambda b: pc.is_in(b["sample_id"], wanted))
        return {r["sample_id"]: r["is_canonical"] for r in rows}

    # ------------------------------------------------------------------ the writer

    def write(self, changes: DataFrame | list[dict], removed: DataFrame | list[str], *,
              state: dict | None, covers: int | None, stats: dict | None = None,
              inserts_only: bool = False) -> tuple[int, dict | None]:
        """The one writer of the table: upsert `changes` (rows whose assignment changed),
        delete `removed` (ids gone from the curated table), then record what the table
        now covers (`covers`, a curated version; None records nothing) and its `stats`
        (None: counted after the write). Rows the driver planned (Python lists) that
        only insert (`inserts_only`: no id the table holds) are appended by delta-rs
        (no Spark job), a plan of few rows is MERGEd by delta-rs, a first plan into an
        empty table is appended; anything else is one MERGE. The properties are set
        last, so that a run killed before is not taken for up to date. Returns the Delta
        version after, and the stats recorded."""
        if state is None:  # created by delta-rs where it can (no Spark job)
            ensure_table(self.spark, self.path, DEDUP_SCHEMA, CHANGE_FEED)
        if isinstance(changes, list):
            self._write_rows(changes, removed, inserts_only=inserts_only)
        elif state is None and is_empty(self.path):
            # A first plan into an empty table: an append is what the MERGE would do (a
            # table a killed first run left rows in is MERGEd into, as before).
            changes.select(*DEDUP_SCHEMA.fieldNames()).write.format("delta").mode(
                "append").save(self.path)
        else:
            merge_dedup(self.spark, self.path, changes, removed, ASSIGNMENT_COLUMNS)
        if covers is None:
            return self.version(), None
        if stats is None:
            self.spark.sparkContext.setJobDescription("lakeshard dedup: stats")
            stats = self.count_stats()
        props = {DEDUP_PARAMS: self.params, DEDUP_CURATED_VERSION: str(covers),
                 DEDUP_STATS: json.dumps({**stats, "table_version": self.version()},
                                         sort_keys=True)}
        # A table made before it had a change data feed gets one with these properties.
        have = storage.delta_properties(self.spark, self.path) or {}
        props.update({k: v for k, v in CHANGE_FEED.items() if have.get(k) != v})
        if state is None or any(state.get(k, have.get(k)) != v for k, v in props.items()):
            set_properties(self.spark, self.path, props)
        return self.version(), stats

    def _write_rows(self, changes: list[dict], removed: list[str], *,
                    inserts_only: bool) -> None:
        import pyarrow as pa

        fields = DEDUP_SCHEMA.fieldNames()
        if not changes and not removed:
            return
        data = pa.Table.from_pylist([{f: r[f] for f in fields} for r in changes],
                                    schema=arrow_schema(DEDUP_SCHEMA))
        if inserts_only and not removed and append_rows(data, self.path, DEDUP_SCHEMA):
            return
        if merge_dedup_rows(self.path, data, removed, ASSIGNMENT_COLUMNS):
            return  # the MERGE below, by delta-rs on the driver (no Spark job)
        rows = self.spark.createDataFrame([tuple(r[f] for f in fields) for r in changes],
                                          DEDUP_SCHEMA)
        gone = self.spark.createDataFrame([(i,) for i in removed], "sample_id string")
        merge_dedup(self.spark, self.path, rows, gone, ASSIGNMENT_COLUMNS)

    # ------------------------------------------------------------------ the entry point

    def update(self, run_id: str, *, full: bool = False,
               new_settings: Literal["full", "defer"] = "full") -> DedupResult:
        """Bring the table up to date with the curated table's current version, by the
        cheapest path that gives the same table: from the properties alone (nothing
        changed), planned in the driver (an increment within ``driver.plan_rows``,
        or a first run over a table of at most that many rows), or planned by Spark over
        the table (a full run, or a large first or incremental one).

        Settings other than the recorded ones make the run a full one; with
        ``new_settings="defer"`` (a takedown, which must not wait for a full search)
        the rows gone from the curated table leave and the full run is left to the
        next dedup."""
        version = tables.open_curated(self.cfg).version
        state = self.state()
        changed_settings = state is not None and state.get(DEDUP_PARAMS) != self.params
        if changed_settings and new_settings == "defer":
            return self._remove_gone(state, version, run_id)
        if not full and (done := self._up_to_date(state, version)) is not None:
            return done
        if not full and (done := self._driver_increment(state, version, run_id)):
            return done
        if state is None and (done := self._driver_first(version, run_id)):
            return done
        if changed_settings:
            log.info("dedup: threshold/bands changed (%s -> %s): full run",
                     state.get(DEDUP_PARAMS), self.params)
        return self._spark_plan(state, version, run_id, full=full or changed_settings)

    def _sources(self) -> list[str]:
        return [s.name for s in self.cfg.sources]

    def _curated_rows(self, version: int) -> DataFrame:
        return (lance_reader(self.spark).option("version", str(version))
                .option("columns", ",".join(ROW_COLUMNS)).load(self.curated_path))

    def _up_to_date(self, state: dict | None, version: int) -> DedupResult | None:
        """The result of a run with nothing to do, from the properties alone and the
        curated table's fragment metadata -- no table is read; None when there is
        something to do (or the stats cannot be trusted)."""
        stats = self.stats(state)
        if stats is None:
            return None
        if not self.covers_rows(int(state.get(DEDUP_CURATED_VERSION, -1)), version):
            return None
        return DedupResult(self.path, self.version(), "incremental", version, 0, 0, 0, 0, 0,
                           stats["clusters"], source_counts(stats["by"], self._sources()),
                           from_metadata=True)

    def _driver_increment(self, state: dict | None, version: int,
                          run_id: str) -> DedupResult | None:
        """An increment planned in the driver from the rows it touches
        (:mod:`etl.lakehouse.dedup_increment`), or None to plan over the table in Spark:
        more rows touched than ``driver.plan_rows``, or stats that no longer
        describe the table."""
        limit = self.cfg.driver.plan_rows
        stats = self.stats(state) if limit else None
        if stats is None:
            return None
        sc = self.spark.sparkContext
        sc.setJobDescription("lakeshard dedup: rows the increment touches")
        local = self.scan_local()  # scanned by the driver, else read in Spark
        try:
            rows = dedup_increment.touched_rows(
                self.spark, self.curated_path, self.read() if local is None else local,
                self.cfg.dedup,
                covered=int(state.get(DEDUP_CURATED_VERSION, -1)), version=version,
                limit=limit, scan_rows=self.cfg.driver.scan_rows)
        finally:
            sc.setJobDescription(None)
        if rows is None:
            return None
        plan = plan_local(rows.current, rows.prior.values(), self.cfg.dedup, run_id)
        sc.setJobDescription("lakeshard dedup: merge Delta dedup")
        stats = update_stats(stats, plan.changes, plan.removed, rows.prior)
        # Only new rows, none of them joining a stored row's cluster (a night of new,
        # distinct pictures): an append does what the MERGE would.
        inserts_only = not any(r["sample_id"] in rows.prior for r in plan.changes)
        delta_version, _ = self.write(plan.changes, plan.removed, state=state,
                                      covers=version, stats=stats, inserts_only=inserts_only)
        sc.setJobDescription(None)
        return DedupResult(
            self.path, delta_version, "incremental (driver)", version, plan.new_rows,
            plan.pairs, 0, len(plan.changes), len(plan.removed), stats["clusters"],
            source_counts(stats["by"], self._sources()), stored_read=rows.stored_read,
        )

    def _driver_first(self, version: int, run_id: str) -> DedupResult | None:
        """A first run over a curated table of at most ``driver.plan_rows`` rows,
        planned in the driver: the rows' narrow columns read by pylance, clustered by
        :func:`plan_local` with no previous assignment (what Spark's first plan gives:
        ``tests/test_dedup_local.py``), written by delta-rs. None for a larger table (or
        ``plan_rows`` 0): Spark plans it."""
        limit = self.cfg.driver.plan_rows
        if not limit:
            return None
        now = tables.open_curated(self.cfg, version)
        if now.count_rows() > limit:
            return None
        rows = now.to_table(columns=list(ROW_COLUMNS)).to_pylist()
        plan = plan_local(rows, [], self.cfg.dedup, run_id)
        stats = update_stats({"by": {}, "clusters": 0, "sizes": {}}, plan.changes, [], {})
        # No properties: no table yet (write() creates it), so an append. A table that
        # holds rows all the same is MERGEd into instead: no row twice.
        fresh = not storage.delta_exists(self.path) or is_empty(self.path)
        sc = self.spark.sparkContext
        sc.setJobDescription("lakeshard dedup: write Delta dedup")
        try:
            delta_version, _ = self.write(plan.changes, [], state=None, covers=version,
                                          stats=stats, inserts_only=fresh)
        finally:
            sc.setJobDescription(None)
        return DedupResult(
            self.path, delta_version, "full (driver)", version, plan.new_rows, plan.pairs, 0,
            len(plan.changes), 0, stats["clusters"], source_counts(stats["by"], self._sources()),
        )

    def _spark_plan(self, state: dict | None, version: int, run_id: str, *,
                    full: bool) -> DedupResult:
        """The plan over the whole table, in Spark."""
        sc = self.spark.sparkContext
        prior = self.read() if state is not None else None
        mode = "full" if full or prior is None else "incremental"
        sc.setJobDescription(f"lakeshard dedup: plan ({mode})")
        plan = plan_dedup(self._curated_rows(version), prior, self.cfg.dedup, run_id,
                          full=full)
        changed, removed = plan.changes.count(), plan.removed.count()
        sc.setJobDescription("lakeshard dedup: merge Delta dedup")
        delta_version, stats = self.write(
            *((plan.changes, plan.removed) if changed or removed else ([], [])),
            state=state, covers=version)
        sc.setJobDescription(None)
        return DedupResult(
            self.path, delta_version, mode, version, plan.new_rows, plan.pairs, plan.rounds,
            changed, removed, stats["clusters"], source_counts(stats["by"], self._sources()),
        )

    def _remove_gone(self, state: dict, version: int, run_id: str) -> DedupResult:
        """Settings changed and the full run deferred: only the rows gone from the
        curated table leave (no properties change: the next dedup runs in full)."""
        current = self._curated_rows(version).select("sample_id")
        gone = self.read().select("sample_id").join(current, "sample_id", "left_anti") \
            .localCheckpoint(eager=True)
        n = gone.count()
        if n:
            self.write(self.read().limit(0), gone, state=state, covers=None)
        return DedupResult(self.path, self.version(), "incremental", version, 0, 0, 0, 0, n,
                           0, ())
