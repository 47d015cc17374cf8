"""Curate: sources -> bronze manifest (Delta) -> prepared images -> Lance `curated`
(append-only) + Delta `rejects` and `accounting`; records that left their sources, and
takedowns a `lakeshard forget` could not finish, out of every table.

Reads as the steps it wires (each a function below, with its inputs and outputs as
small dataclasses): **check for change** (curate's derived state,
:class:`~etl.lakehouse.curate_state.CurateState`); **finish pending takedowns** a
`lakeshard forget` left unapplied; **diff sources** -- list every source into the common
schema and mark what the bronze manifest already holds (unchanged records are counted,
not processed; unchanged tar shards are not opened), and **find removals**, the records
the sources no longer list: one question to the manifest,
:meth:`~etl.lakehouse.catalog.Manifest.diff`, which picks the driver or Spark;
**fetch and prepare** -- refuse what a takedown names, fetch referenced images, decode,
re-encode, flag; **write curated** (replacing rows of changed records); **record
bronze** -- MERGE the manifest and rejects; **apply removals** out of every table;
**record accounting**; **purge** removed rows' bytes past their retention; the
**closing check** (curated rows = accepted in the manifest). The decisions are
transforms (:mod:`etl.transforms.bronze`, :mod:`~etl.transforms.prepare`,
:mod:`~etl.transforms.accounting`); this module only reads, calls and writes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.pandas.types import to_arrow_schema

from etl import storage, tables
from etl.config import Config
from etl.lakehouse.catalog import Catalog
from etl.lakehouse.curate_state import CurateState, Quiet
from etl.lakehouse.maintenance import (
    PurgeResult,
    RemovalResult,
    mark_applied,
    remove_records,
    remove_taken_down,
    run_due_purges,
)
from etl.lakehouse.source_diff import Diff, Removals
from etl.report.console import accounting_lines
from etl.runtime.faults import fault_point
from etl.runtime.progress import event
from etl.runtime.stage import RowTally, RunContext, StageDetail, StageResult
from etl.schema import UPSTREAM_COLUMNS
from etl.sources import adapter_for
from etl.sources.listing import one_listing
from etl.transforms.accounting import (
    SourceCounts,
    accounting_rows,
    quiet_accounting,
    source_counts,
    stage_metrics,
)
from etl.transforms.bronze import (
    manifest_rows,
    mark_duplicate_keys,
    refuse_prepared,
    refuse_taken_down,
)
from etl.transforms.prepare import (
    Outcomes,
    accepted_rows,
    counted,
    curated_schema,
    failure_examples,
    fetch_and_prepare,
    prepared_outcomes,
    rejected_rows,
)
from etl.transforms.prepare_task import RowSink
from etl.writers.lance import PendingAppend

__all__ = ["CurateResult", "curate", "stage"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurateResult(StageDetail):
    """What a night of curate did: the tables it left and the accounting per source."""

    curated_path: str
    curated_version: int
    curated_rows: int
    rejects_path: str
    manifest_path: str
    accounting_path: str
    counts: tuple[SourceCounts, ...]
    # The bytes of removed rows: rewritten away now, the older versions deleted when.
    purge: PurgeResult | None = None
    # Source versions read (ledger keys -> version), for the next run's history.
    source_versions: dict[str, int] | None = None
    # A few failed records (internal errors first), for the failure budgets' messages.
    examples: tuple[str, ...] = ()

    def summary_head(self) -> list[str]:
        """The accounting table, then where curate's tables are."""
        return [
            *accounting_lines(self.counts, self.purge, self.examples),
            "",
            f"curated (Lance) : {self.curated_path}  version {self.curated_version}, "
            f"{self.curated_rows} rows",
            f"rejects (Delta) : {self.rejects_path}",
            f"manifest (Delta): {self.manifest_path}",
            f"accounting      : {self.accounting_path}  (Delta; one row per run, source, "
            "outcome, reason)",
        ]

    def summary_json(self) -> dict[str, Any]:
        return {"curate": asdict(self)}

    def source_rows(self) -> list[dict[str, Any]]:
        return [dict(c.row()) for c in self.counts]


def _replace_changed(spark: SparkSession, cfg: Config, ids: DataFrame, count: int) -> int:
    """Delete curated rows of records being (re)written now (`count` of them): changed
    records, and rows a run that died before recording its manifest left behind."""
    return Catalog.of(spark, cfg).curated.replace(spark, ids, count)


def _finish_takedowns(spark: SparkSession, cfg: Config, run_id: str, now: datetime
                      ) -> RemovalResult | None:
    """Takedown requests recorded but not applied (a `lakeshard forget` that died
    midway): their records leave every table now."""
    cat = Catalog.of(spark, cfg)
    pending = cat.takedowns.pending()  # told from the log when every one is applied
    manifest = cat.manifest.read() if pending is not None else None
    if manifest is None:
        return None
    result = remove_taken_down(spark, cfg, manifest, pending, run_id=run_id, now=now)
    mark_applied(spark, cat.takedowns.path, result, now=now)
    log.warning("curate: finished %d takedown record(s) a forget had left unapplied",
                result.total)
    return result


@contextmanager
def _job(spark: SparkSession, step: str, run_id: str) -> Iterator[None]:
    """Step `step` of curate: Spark jobs started inside are labelled ``lakeshard curate:
    <step>`` (UI, event log), and the step's wall time, when it ends without an error,
    is a ``step_end`` event (the run's events.jsonl)."""
    sc = spark.sparkContext
    sc.setJobDescription(f"lakeshard curate: {step}")
    start = time.perf_counter()
    try:
        yield
    finally:
        sc.setJobDescription(None)
    event("step_end", run_id=run_id, stage="curate", step=step,
          seconds=round(time.perf_counter() - start, 2))


@dataclass
class _Prepared:
    """Step "fetch and prepare": every record processed this run, with its outcome."""
    rows: DataFrame | None  # prepared rows (persisted, their JPEGs already written as
    # Lance fragments; or local data, with them); None: none
    outcomes: Outcomes  # outcome_counts(rows): the groups, what the tasks wrote
    examples: tuple[str, ...]  # a few failed records, for the failure budgets' messages
    on_driver: bool = False  # prepared on the driver: `rows` are local data, or their
    # takedown checks (joins) are not
    written: PendingAppend | None = None  # the accepted rows, written by the tasks that
    # prepared them, to commit (not on the driver)
    cached: DataFrame | None = None  # the persisted frame `rows` reads (to unpersist)
    held: pa.Table | None = None  # `rows` as Arrow, where this process holds them: the
    # bookkeeping's rows are built from it, with no Spark query planned over local data

    @classmethod
    def nothing(cls) -> _Prepared:
        """No record to process: no fetch, no prepare, no Python worker started."""
        return cls(None, Outcomes([]), ())

    @property
    def outcome_rows(self) -> list:
        return self.outcomes.rows

    @property
    def processed(self) -> int:
        return sum(r["count"] for r in self.outcome_rows)

    @property
    def accepted(self) -> int:
        return sum(r["count"] for r in self.outcome_rows if r["status"] == "ok")


def _fetch_and_prepare(spark: SparkSession, cfg: Config, paths: tables.Layout,
                       diff: Diff, refused: DataFrame | None, run_id: str,
                       now: datetime) -> _Prepared:
    """Refuse what a takedown names, fetch referenced images and prepare them (one
    batch function), refuse what a takedown names by the source bytes' or the JPEG's
    hash. In Spark's tasks, the accepted rows are written as fragments of Lance
    `curated` by the task that prepared them (committed by :func:`_write_curated`)."""
    if diff.has_manifest and storage.lance_exists(paths.curated) and all(
            st["n"] == st["unchanged"] for st in diff.stats.values()):
        return _Prepared.nothing()  # a night with nothing new
    cores = spark.sparkContext.defaultParallelism
    by_row = any(adapter_for(s.kind).names_rows(s) for s in cfg.sources)
    todo = _task_layout(mark_duplicate_keys(diff.listed.where(~F.col("unchanged"))), diff,
                        cores, by_row)
    prepare = _prepare_options(cfg, diff, todo, cores)
    if refused is not None:
        todo = refuse_taken_down(todo, refused)  # by key and URL: nothing fetched
    # One Python worker per task fetches, hashes the source bytes, prepares and writes
    # the accepted rows (the bytes and JPEGs never return); a few records: the same
    # batch function, on the driver.
    written = None if diff.small else _pending_append(spark, cfg, todo)
    sink = None if written is None else _row_sink(spark, written, refused, run_id, now)
    todo = fetch_and_prepare(todo, cfg.fetch, cfg.sources, prepare,
                             on_driver=diff.small, sink=sink)
    if refused is not None:
        # Same bytes, new name: rejected at ingest; prepared_outcomes drops its prepared.
        todo = refuse_taken_down(todo, refused, by_hash=True)
    else:
        todo = todo.withColumn("takedown_detail", F.lit(None).cast("string"))
    dup = F.col("occurrence") > 1
    prepared = (
        prepared_outcomes(todo)
        .withColumns({
            "stage": F.when(F.col("fetch_failed"), F.lit("fetch")).otherwise(F.col("stage")),
            "detail": F.when(dup, F.format_string("copy %d of key %s", "occurrence",
                                                  "source_key"))
            .when(F.col("takedown_detail").isNotNull(), F.col("takedown_detail"))
            .when(F.col("fetch_failed"), F.col("fetch_detail"))
            .otherwise(F.col("detail")),
        })
    )
    if refused is not None:
        prepared = refuse_prepared(prepared, refused)  # the same picture, re-encoded
    got = counted(prepared, new_records=diff.new_records, bound=cfg.driver.ids)
    outcomes = _checked(got.outcomes)
    return _Prepared(got.rows, outcomes,
                     failure_examples(outcomes.rows, cfg.run.budgets.examples),
                     on_driver=diff.small, written=written, cached=got.cached, held=got.held)


def _pending_append(spark: SparkSession, cfg: Config, todo: DataFrame) -> PendingAppend:
    """The append to Lance `curated` of the rows `todo` gives once accepted (their
    schema derived here: no query planned)."""
    return Catalog.of(spark, cfg).curated.pending(to_arrow_schema(curated_schema(
        todo.schema, extra=UPSTREAM_COLUMNS)))


def _row_sink(spark: SparkSession, written: PendingAppend, refused: DataFrame | None,
              run_id: str, now: datetime) -> RowSink:
    """Where the tasks write their accepted rows, with the takedowns' hashes they check
    them against (a broadcast; none: no Spark job)."""
    hashes = None
    if refused is not None:
        values = frozenset(r[0] for r in refused.where(F.col("kind") == "image_sha256")
                           .select("value").collect())
        hashes = spark.sparkContext.broadcast(values) if values else None
    # As Spark stores F.lit(now): the run's timestamp everywhere else.
    return RowSink(written.write_task, written.schema, run_id,
                   T.TimestampType().toInternal(now), hashes)


def _checked(outcomes: Outcomes) -> Outcomes:
    """`outcomes`, once every row the tasks wrote to Lance is accepted and every accepted
    row written (a bug otherwise: the tasks decide what is accepted as the outcome
    columns do); the stage fails and nothing is committed where they disagree."""
    if outcomes.disagree:
        raise RuntimeError(
            f"curate: {outcomes.disagree} row(s) were written to Lance by the fetch + "
            "prepare tasks but are not accepted, or accepted but not written: the tasks' "
            "acceptance and the outcome columns disagree (nothing is committed)")
    return outcomes


# New records per fetch + prepare task, each writing its own Lance fragment: a night of
# a few hundred new records adds one fragment, however many partitions the listing has
# -- unless cores would sit idle: then tasks of at least _MIN_ROWS_PER_TASK records, one
# per core (a 1,000-record night on 16 cores runs 8 tasks, not 2).
_ROWS_PER_TASK = 512
_MIN_ROWS_PER_TASK = 128


def _tasks_for(new: int, cores: int) -> int:
    """How many fetch + prepare tasks `new` records get on `cores` task slots."""
    return max(1, -(-new // _ROWS_PER_TASK), min(cores, -(-new // _MIN_ROWS_PER_TASK)))


def _task_layout(todo: DataFrame, diff: Diff, cores: int, by_row: bool = False
                 ) -> DataFrame:
    """`todo` in at most :func:`_tasks_for` partitions: the listing's partitions merged,
    not shuffled (a listing with fewer keeps its own; not asked first: counting the
    partitions plans the frame, ~0.2 s in a cold JVM). `by_row`: some records name
    their images by file and row, and a listing joined in Spark comes in the join's
    order: ranges of (file, row) instead, in that order, so that each task reads the
    row groups it needs once (:mod:`udfs.fetch_table`)."""
    if diff.small:
        return todo
    tasks = _tasks_for(diff.new_records, cores)
    if by_row and not diff.in_driver:
        # As many tasks as the merge below would leave (every later job over the
        # prepared rows runs one task per partition): asked of the plan.
        tasks = min(tasks, todo.rdd.getNumPartitions())
        return (todo.repartitionByRange(tasks, "image_ref", "image_offset")
                .sortWithinPartitions("image_ref", "image_offset"))
    return todo.coalesce(tasks)


def _fetch_prepare_tasks(diff: Diff, todo: DataFrame, cores: int) -> int:
    """How many Spark tasks fetch and prepare `todo` (:func:`_task_layout`'s frame).
    Records compared with the manifest on the driver come from the driver in at most
    one partition per core and source, and at least one per core or row: their tasks
    are the fewer of the cores and :func:`_task_layout`'s count as far as
    ``PrepareConfig.task_threads`` can tell. A listing in Spark has its own partitions,
    asked of the plan (no job; ~0.2 s of planning in a cold JVM, which the first case
    saves)."""
    if diff.in_driver:
        return min(cores, _tasks_for(diff.new_records, cores))
    return todo.rdd.getNumPartitions()


def _prepare_options(cfg: Config, diff: Diff, todo: DataFrame, cores: int):
    """``prepare`` with the threads each fetch + prepare task runs resolved
    (``PrepareConfig.task_threads``); a night on the driver is one task on the driver's
    cores (the local master's, or the driver machine's)."""
    if cfg.prepare.threads is not None:
        return cfg.prepare
    if not diff.small:
        tasks = _fetch_prepare_tasks(diff, todo, cores)
    else:
        tasks = 1
        if not cfg.spark.master.startswith("local"):
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
                os.cpu_count() or 1)
    threads = cfg.prepare.task_threads(cores, tasks)
    log.info("curate: fetch + prepare in %d task(s) on %d core(s), %d prepare thread(s) "
             "per task", tasks, cores, threads)
    return cfg.prepare.model_copy(update={"threads": threads})


def _write_curated(spark: SparkSession, cfg: Config, paths: tables.Layout, prep: _Prepared,
                   run_id: str, now: datetime) -> int:
    """Append the accepted rows to Lance `curated`, first deleting the rows of records
    being rewritten; the number of rows replaced."""
    if prep.rows is None:
        return 0
    replaced = 0
    if prep.processed:  # a run with nothing new writes nothing but its accounting
        replaced = _replace_changed(
            spark, cfg,
            prep.rows.where(F.col("occurrence") == 1).select("sample_id"), prep.processed,
        )
    if prep.accepted or not storage.lance_exists(paths.curated):
        # Scalar indexes on the columns analysts filter by extend to the new fragments.
        curated = Catalog.of(spark, cfg).curated
        if prep.written is not None:
            curated.commit(prep.written, prep.outcomes.fragments)
        else:
            # Prepared here: the rows this process holds, images and all.
            rows = prep.held if prep.on_driver and prep.held is not None else prep.rows
            curated.append(accepted_rows(rows, run_id=run_id, ingested_at=now,
                                         extra=UPSTREAM_COLUMNS), on_driver=prep.on_driver)
    if replaced:
        log.info("curate: replaced %d curated rows of changed records", replaced)
    return replaced


def _record_bronze(cat: Catalog, diff: Diff, prep: _Prepared, run_id: str,
                   now: datetime) -> None:
    """MERGE this run's rejects and manifest rows into Delta (built in Arrow where this
    process holds the rows)."""
    if not prep.processed and diff.has_manifest:
        return
    rows = prep.held if prep.held is not None else prep.rows
    rejects = rejected_rows(rows, run_id=run_id)
    manifest = manifest_rows(rows, run_id=run_id, ingested_at=now)
    cat.rejects.merge(rejects, count=prep.processed - prep.accepted)
    cat.manifest.merge(manifest, count=prep.processed, before=diff.manifest, held=diff.held)


def _apply_removals(spark: SparkSession, cfg: Config, removals: Removals, run_id: str,
                    now: datetime) -> RemovalResult | None:
    """What left the sources leaves every table (the manifest last)."""
    if removals.records is None or removals.records.isEmpty():  # checkpointed: cheap
        return None
    spark.sparkContext.setJobDescription(
        "lakeshard curate: remove records the sources no longer list")
    return remove_records(spark, cfg, removals.records, run_id=run_id, now=now,
                          retention_hours=cfg.lakehouse.removal_retention_hours)


def _record_accounting(cfg: Config, cat: Catalog, diff: Diff, prep: _Prepared,
                       removals: Removals, removed: list[RemovalResult | None], run_id: str,
                       now: datetime) -> tuple[SourceCounts, ...]:
    """Per source and outcome: the run's accounting rows, MERGEd into Delta; the counts."""
    counts = [c for r in removed if r is not None for c in r.counts]
    unchanged = diff.unchanged
    cat.accounting.record(accounting_rows(prep.outcome_rows, unchanged, run_id=run_id,
                                          run_at=now, removed=counts))
    return source_counts(prep.outcome_rows, [s.name for s in cfg.sources], unchanged,
                         counts, removals.scans)


def _purge_due(cat: Catalog, now: datetime) -> None:
    """Removed rows' versions past their retention; takedowns whose bytes that frees."""
    if not cat.curated.exists():
        return
    purged, _, _ = run_due_purges(cat.curated.path, now)
    if purged:
        cat.takedowns.mark_purged(cat.curated.oldest_version(), now)


def _closing_check(cat: Catalog):
    """The curated table as left, once its row count is checked against the manifest."""
    ds = cat.curated.open()
    in_manifest = cat.manifest.accepted()
    if ds.count_rows() != in_manifest:
        raise RuntimeError(
            f"curated table has {ds.count_rows()} rows, the manifest {in_manifest} accepted"
        )
    return ds


def _quiet_night(spark: SparkSession, cfg: Config, cat: Catalog, quiet: Quiet,
                 run_id: str, now: datetime) -> CurateResult:
    """Nothing changed since the last run: its unchanged counts are tonight's."""
    unchanged = {k: int(v) for k, v in quiet.payload["unchanged"].items()}
    with _job(spark, "nothing changed: record accounting", run_id):
        cat.accounting.record(quiet_accounting(unchanged, run_id=run_id, run_at=now))
        _purge_due(cat, now)
    ds = _closing_check(cat)
    counts = source_counts([], [s.name for s in cfg.sources], unchanged, (),
                           quiet.payload["scans"])
    return _result(cat, ds, counts, None,
                   {k: int(v) for k, v in quiet.payload["versions"].items()}, ())


def _result(cat: Catalog, ds, counts: tuple[SourceCounts, ...], purge: PurgeResult | None,
            versions: dict[str, int], examples: tuple[str, ...]) -> CurateResult:
    return CurateResult(cat.curated.path, ds.version, ds.count_rows(), cat.rejects.path,
                        cat.manifest.path, cat.accounting.path, counts, purge, versions,
                        examples=examples)


def _table_versions(cat: Catalog) -> tuple[int | None, int | None]:
    return cat.manifest.version(), cat.takedowns.version()


def curate(spark: SparkSession, cfg: Config, run_id: str,
           changes_ahead: Callable[[int], None] = lambda new: None) -> CurateResult:
    """`changes_ahead`: called once the night is known not to be a no-op, with the count
    of new and changed records (the run's later stages may start warming:
    :meth:`RunContext.changes_ahead`). Each source's
    files are listed once (:func:`~etl.sources.listing.one_listing`): the digest that
    tells a quiet night, the comparison with the manifest and the read of the new
    records see the same listing."""
    with one_listing():
        return _night(spark, cfg, run_id, changes_ahead)


def _night(spark: SparkSession, cfg: Config, run_id: str,
           changes_ahead: Callable[[int], None]) -> CurateResult:
    paths, cat = tables.layout(cfg), Catalog.of(spark, cfg)
    state = CurateState.of(paths)
    now = datetime.now(UTC).replace(tzinfo=None)
    quiet = state.check_quiet(cfg, lambda: _table_versions(cat), cat.curated.exists)
    if quiet.hit:
        return _quiet_night(spark, cfg, cat, quiet, run_id, now)
    # Before anything reads the manifest:
    with _job(spark, "finish pending takedowns", run_id):
        pending = _finish_takedowns(spark, cfg, run_id, now)
    with _job(spark, "list sources, compare with the manifest", run_id):
        diff = cat.manifest.diff(cfg, state)
        removals, refused = diff.removals, cat.takedowns.identifiers()
    changes_ahead(diff.new_records)
    with _job(spark, "fetch + prepare new records, write them to Lance", run_id):
        prep = _fetch_and_prepare(spark, cfg, paths, diff, refused, run_id, now)
    fault_point("curate:prepared")
    with _job(spark, "commit Lance curated", run_id):
        _write_curated(spark, cfg, paths, prep, run_id, now)
    fault_point("curate:lance_written")
    with _job(spark, "merge Delta rejects, manifest, accounting", run_id):
        _record_bronze(cat, diff, prep, run_id, now)
        gone = _apply_removals(spark, cfg, removals, run_id, now)
        counts = _record_accounting(cfg, cat, diff, prep, removals, [pending, gone], run_id,
                                    now)
        _purge_due(cat, now)
    for df in (prep.cached, diff.listed):
        if df is not None:
            df.unpersist()
    ds = _closing_check(cat)
    deferred = [s.name for s in cfg.sources if removals.deferred(s.name)]
    state.remember_versions(cfg, diff.versions, removals.source_versions, deferred)
    state.remember_containers(cat.manifest.version(), diff.containers)
    state.remember_quiet(spark, cfg, quiet, versions=diff.versions, listed=diff.listed_counts,
                         outcome_rows=prep.outcome_rows, deferred=deferred,
                         handled=removals.source_versions,
                         table_versions=lambda: _table_versions(cat))
    purge = next((r.purge for r in (gone, pending) if r is not None and r.purge), None)
    return _result(cat, ds, counts, purge, removals.source_versions, prep.examples)


def stage(spark: SparkSession, cfg: Config, ctx: RunContext
          ) -> StageResult[CurateResult]:
    """ingest + prepare + write: sources -> Lance `curated` + Delta `rejects`; records
    the sources no longer list out of every table."""
    cur = curate(spark, cfg, ctx.run_id, ctx.changes_ahead)
    inputs, outputs = stage_metrics(cur.counts)
    tally = RowTally(rows=inputs["seen"], ok=outputs["accepted"], failed=outputs["rejected"],
                     internal_errors=outputs.get("internal_error", 0), examples=cur.examples,
                     failed_label="rejected")
    versions = {"lance:curated": cur.curated_version, **(cur.source_versions or {})}
    rejects_version = storage.delta_version(spark, cur.rejects_path)
    if rejects_version is not None:
        versions["delta:rejects"] = rejects_version
    note = None
    if cur.purge is not None and not cur.purge.done:
        note = (f"removed rows' bytes stay in versions before {cur.purge.version} until "
                f"{cur.purge.due:%Y-%m-%d %H:%M} UTC")
    return StageResult(inputs=inputs, outputs=outputs, table_versions=versions, note=note,
                       tally=tally, detail=cur)
