"""Curate: sources -> bronze manifest (Delta) -> prepared images -> Lance `curated`
(append-only) + Delta `rejects` and `accounting`; records that left their sources, and
takedowns a `lakeshard forget` could not finish, out of every table.

Reads as the steps it wires (each a function below, with its inputs and outputs as
small dataclasses): **finish pending takedowns** a `lakeshard forget` left unapplied;
**diff sources** -- list every source into the common schema and mark what the bronze
manifest already holds (unchanged records are counted, not processed; unchanged tar
shards are not opened); **find removals** -- the records the sources no longer list;
**fetch and prepare** -- refuse what a takedown names, fetch referenced images, decode,
re-encode, flag; **write curated** (replacing rows of changed records); **record
bronze** -- MERGE the manifest and rejects; **apply removals** out of every table;
**record accounting**; **purge** removed rows' bytes past their retention; the
**closing check** (curated rows = accepted in the manifest). The decisions are
transforms (:mod:`etl.transforms.bronze`, :mod:`~etl.transforms.prepare`,
:mod:`~etl.transforms.accounting`); this module only reads, calls and writes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from functools import reduce
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.pandas.types import to_arrow_schema

from etl import storage, tables
from etl.config import Config, SourceConfig
from etl.lakehouse.catalog import DRIVER_IDS, Catalog
from etl.lakehouse.derived import DerivedState
from etl.lakehouse.maintenance import (
    PurgeResult,
    RemovalResult,
    mark_applied,
    remove_records,
    remove_taken_down,
    run_due_purges,
)
from etl.ledger import code_version
from etl.report.console import accounting_lines
from etl.runtime.faults import fault_point
from etl.runtime.local import is_local, local_arrow
from etl.runtime.progress import event
from etl.runtime.stage import RowTally, RunContext, StageDetail, StageResult
from etl.runtime.warm import start_python_workers
from etl.schema import (
    REMOVED,
    SOURCE_SCHEMA,
    UPSTREAM_COLUMNS,
    sample_id_col,
    sample_id_of,
)
from etl.sources import adapter_for, finish_ingest, finish_ingest_here
from etl.sources.listing import one_listing
from etl.transforms.accounting import (
    SourceCounts,
    accounting_rows,
    quiet_accounting,
    source_counts,
    stage_metrics,
)
from etl.transforms.bronze import (
    CONTAINER_FAILURES,
    is_retry,
    live,
    manifest_rows,
    manifest_rows_arrow,
    mark_duplicate_keys,
    mark_unchanged,
    refuse_prepared,
    refuse_taken_down,
    removed_records,
    retried,
    unchanged_containers,
)
from etl.transforms.prepare import (
    accepted_rows,
    curated_schema,
    failure_examples,
    fetch_and_prepare,
    outcome_counts,
    outcome_counts_arrow,
    prepared_outcomes,
    rejected_rows,
    rejected_rows_arrow,
)
from etl.transforms.prepare_task import FLAG, WRITTEN, RowSink
from etl.writers.lance import PendingAppend

__all__ = ["CurateResult", "list_sources", "curate", "stage"]

log = logging.getLogger(__name__)

# Key of the version a run read of a source with a history (in the state file below and
# in the ledger's table_versions): source:<name>:<hash of its path>, so a source pointed
# elsewhere starts over instead of reading another table's history.
_SOURCE_VERSION = "source:"
# Where the versions the last completed curate read are kept: one small JSON object
# (read without Spark; the run ledger has them too, but querying it is a Spark job).
_VERSIONS_FILE = "_lakeshard/source_versions.json"
# What a quiet night needs (see _Quiet): the last run's per-source counts, keyed by every
# source's listing digest and the manifest and takedowns versions it left.
_QUIET_FILE = "_lakeshard/curate_quiet.json"


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


def list_sources(spark: SparkSession, cfg: Config,
                 skip: dict[str, frozenset[str]] | None = None,
                 versions: dict[str, int | None] | None = None) -> DataFrame:
    """All configured sources in the common source schema, as one DataFrame (images
    referenced, not yet fetched). `skip`: per source, containers not to open;
    `versions`: per source, the table version to read."""
    skip = skip or {}
    versions = versions or {}
    frames = [
        finish_ingest(adapter_for(s.kind).read(spark, s, skip.get(s.name, frozenset()),
                                               versions.get(s.name)), s)
        for s in cfg.sources
    ]
    return reduce(DataFrame.unionByName, frames)


def _skipped_containers(cfg: Config, cat: Catalog, manifest: DataFrame | None
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
        known = cat.manifest.container_groups(manifest, s.name)
        skip[s.name], counts[s.name] = unchanged_containers(listed, known)
    return skip, counts




def _replace_changed(spark: SparkSession, cfg: Config, ids: DataFrame, count: int) -> int:
    """Delete curated rows of records being (re)written now (`count` of them): changed
    records, and rows a run that died before recording its manifest left behind."""
    return Catalog.of(spark, cfg).curated.replace(spark, ids, count)


def _version_key(source: SourceConfig) -> str:
    where = hashlib.sha256(source.path.encode()).hexdigest()[:8]
    return f"{_SOURCE_VERSION}{source.name}:{where}"


def _versions_state(cfg: Config) -> DerivedState:
    return DerivedState(f"{cfg.storage.root.rstrip('/')}/{_VERSIONS_FILE}", "source_versions")


def _previous_versions(cfg: Config) -> dict[str, int]:
    """The source versions the last completed curate read; {} when there is no (readable)
    record: every source is then compared in full."""
    kept = _versions_state(cfg).load() or {}
    try:
        return {k: int(v) for k, v in kept.items() if k.startswith(_SOURCE_VERSION)}
    except (ValueError, TypeError):
        log.warning("curate: source versions unreadable: comparing every source in full")
        return {}


def _record_versions(cfg: Config, versions: dict[str, int]) -> None:
    """Written once the run's removals are done (a run that dies before leaves the last
    record, and the next run looks at the history since then again)."""
    _versions_state(cfg).save(None, versions)


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


def _find_removals(spark: SparkSession, cfg: Config, manifest: DataFrame,
                   listed: DataFrame, skip: dict[str, frozenset[str]],
                   versions: dict[str, int | None], stats: dict[str, dict],
                   skipped: dict[str, int]) -> tuple[DataFrame, dict[str, str]]:
    """Records the sources no longer list: ``sample_id, source, status``; and per
    source how they were looked for."""
    previous = None
    full, parts, scans = [], [], {}
    for s in cfg.sources:
        if s.on_removed == "keep":
            scans[s.name] = "kept"
            continue
        st = stats.get(s.name, {})
        if st.get("failures"):
            scans[s.name] = (f"deferred: {st['failures']} record(s) of unreadable "
                             "files/shards")
            log.warning("curate: source %s: removals deferred, %s", s.name, scans[s.name])
            continue
        version = versions.get(s.name)
        if version is None:
            if not st.get("n") and not skipped.get(s.name) and not live(manifest).where(
                    F.col("source") == s.name).isEmpty():
                # An empty listing is far likelier an unmounted volume than a wipe.
                scans[s.name] = "deferred: the source lists no record at all"
                log.warning("curate: source %s lists nothing: removals deferred", s.name)
                continue
            full.append(s.name)
            scans[s.name] = "listing"
            continue
        if previous is None:
            previous = _previous_versions(cfg)
        since = previous.get(_version_key(s))
        found = (adapter_for(s.kind).deleted_keys(spark, s, since, version)
                 if since is not None else None)
        if found is None:
            full.append(s.name)
            scans[s.name] = "listing"
            continue
        keys, scans[s.name] = found
        candidates = keys.select(sample_id_col(F.lit(s.name), F.col("source_key"))
                                 .alias("sample_id"))
        parts.append(removed_records(manifest, listed, sources=[s.name],
                                     candidates=candidates))
    parts.append(removed_records(manifest, listed, sources=full, skipped=skip))
    return reduce(DataFrame.unionByName, parts), scans


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
class _Diff:
    """Step "diff sources": what the sources list, against the manifest."""
    manifest: DataFrame | None  # as read before this run merges into it (checkpointed)
    refused: DataFrame | None  # every takedown's identifiers (checkpointed)
    versions: dict[str, int | None]  # per source with a history: the version read
    skip: dict[str, frozenset[str]]  # per source: unchanged containers, not opened
    skipped: dict[str, int]  # per source: the records those containers hold
    listed: DataFrame  # every listed record, `unchanged` marked (persisted); compared
    # on the driver: only the new and changed ones
    stats: dict[str, dict]  # per source: n, unchanged, failures (unreadable containers)
    has_manifest: bool = False  # a manifest was there (`manifest` is None when compared
    # on the driver)
    removed: _Removals | None = None  # compared on the driver: what left the sources
    on_driver: bool = False  # `listed` is a few records of local data, no Python UDF in
    # its plan: fetched, prepared and written to Lance from the driver
    compared_here: bool = False  # compared with the manifest on the driver: `listed`
    # comes from the driver, in at most one partition per core (per source)

    @property
    def unchanged(self) -> dict[str, int]:
        """Per source: records not processed (listed unchanged, or in skipped containers)."""
        out = dict(self.skipped)
        for name, st in self.stats.items():
            if st["unchanged"]:
                out[name] = out.get(name, 0) + st["unchanged"]
        return out


def _diff_sources(spark: SparkSession, cfg: Config, cat: Catalog) -> _Diff:
    for compare_here in (_diff_on_driver, _diff_listed_here):
        diff = compare_here(spark, cfg, cat)
        if diff is not None:
            return diff
    manifest = cat.manifest.snapshot()  # read before it is merged into
    refused = cat.takedowns.identifiers()
    versions = {s.name: adapter_for(s.kind).snapshot_version(spark, s) for s in cfg.sources
                if s.on_removed == "delete"}
    skip, skipped = _skipped_containers(cfg, cat, manifest)
    listed = mark_unchanged(list_sources(spark, cfg, skip, versions), manifest).persist(
        StorageLevel.MEMORY_AND_DISK
    )
    stats = {
        r["source"]: r.asDict() for r in listed.groupBy("source").agg(
            F.count(F.lit(1)).alias("n"),
            F.sum(F.col("unchanged").cast("int")).alias("unchanged"),
            F.sum(F.coalesce(F.col("read_reason").isin(*CONTAINER_FAILURES), F.lit(False))
                  .cast("int")).alias("failures"),  # 0, as the driver's count, when none
        ).collect()
    }
    return _Diff(manifest, refused, versions, skip, skipped, listed, stats,
                 has_manifest=manifest is not None)


def _diff_on_driver(spark: SparkSession, cfg: Config, cat: Catalog) -> _Diff | None:
    """Step "diff sources" without a Spark job over the manifest, when every source
    lists its records on the driver (:meth:`~etl.sources.base.SourceAdapter.driver_listing`)
    and the manifest's key columns are read by delta-rs within the driver bound: the
    listing's fingerprints are compared with the manifest's here, removals found here,
    and only new and changed records are read through Spark. None: compare in Spark."""
    listings = {}
    for s in cfg.sources:
        listing = adapter_for(s.kind).driver_listing(s)
        if listing is None:
            return None
        listings[s.name] = listing
    known = cat.manifest.known() if cat.manifest.exists() else None
    if known is None:
        return None  # a first run (nothing to compare), or too many rows for the driver
    by_id, live_ids = _known_ids(known)
    stats, changed, gone, scans = {}, {}, [], {}
    for s in cfg.sources:
        ids = {key: sample_id_of(s.name, key) for key in listings[s.name]}
        changed[s.name] = frozenset(
            k for k, sid in ids.items() if by_id.get(sid, (None, True))[1]
            or by_id[sid][0] != listings[s.name][k])
        if ids:  # as the Spark path's counts by source: a source listing nothing has none
            stats[s.name] = {"source": s.name, "n": len(ids),
                             "unchanged": len(ids) - len(changed[s.name]), "failures": 0}
        scans[s.name], left = _driver_removals(s, live_ids.get(s.name, {}), ids)
        gone += [(sid, s.name, status) for sid, status in left]
    # A few new or changed records: read, fetched and prepared on the driver.
    on_driver = sum(map(len, changed.values())) <= cfg.prepare.driver_rows
    if not on_driver:
        _start_workers(spark)
    frames = [finish_ingest(adapter_for(s.kind).read_keys(spark, s, changed[s.name],
                                                          on_driver), s)
              for s in cfg.sources if changed[s.name]]
    # Keys of a driver listing are unique (one copy each), and it has no containers to
    # fail: no window over the keys, no Spark job to count failures. Read once, by the
    # fetch and prepare step.
    listed = (reduce(DataFrame.unionByName, frames) if frames else
              spark.createDataFrame([], SOURCE_SCHEMA)).withColumns(
        {"occurrence": F.lit(1), "unchanged": F.lit(False)})
    records = None
    if gone:
        records = spark.createDataFrame(gone, "sample_id string, source string, status string"
                                        ).withColumn("reason", F.lit("source_removed"))
    versions = {s.name: adapter_for(s.kind).snapshot_version(spark, s) for s in cfg.sources
                if s.on_removed == "delete"}
    return _Diff(None, cat.takedowns.identifiers(), versions, {}, {}, listed, stats,
                 has_manifest=True, removed=_Removals(records, scans, {}),
                 on_driver=on_driver, compared_here=True)


def _start_workers(spark: SparkSession) -> None:
    """A comparison on the driver found more new records than the driver prepares: this
    process's first Python tasks are coming, and their daemon starts now, on a thread
    (:func:`~etl.runtime.warm.start_python_workers`), while the driver hands the records
    to Spark and plans the fetch + prepare job -- not before: a night with nothing new,
    or a few records prepared on the driver, starts no Python worker."""
    start_python_workers(spark, "lakeshard curate: start the Python workers")


def _known_ids(known) -> tuple[dict[str, tuple[str | None, bool]], dict[str, dict[str, str]]]:
    """The manifest's rows read by delta-rs (:meth:`Manifest.known`) as a driver-side
    comparison needs them: ``sample_id -> (fingerprint, retried)`` of every record a
    listing may find unchanged (not those that left their source: back, they are new),
    and per source ``sample_id -> status`` of the records still there."""
    by_id, live_ids = {}, {}
    for row in known.to_pylist():
        if row["status"] == REMOVED and row["reason"] == "source_removed":
            continue  # a record back after leaving its source is new
        by_id[row["sample_id"]] = (row["fingerprint"], is_retry(row["status"], row["reason"]))
        if row["status"] != REMOVED:
            live_ids.setdefault(row["source"], {})[row["sample_id"]] = row["status"]
    return by_id, live_ids


def _diff_listed_here(spark: SparkSession, cfg: Config, cat: Catalog) -> _Diff | None:
    """Step "diff sources" without a Spark job, when every source is listed on the driver
    (:meth:`~etl.sources.base.SourceAdapter.lists_here`: small local URL lists) and the
    manifest is absent (a first run) or read by delta-rs within the driver bound: the
    rows are read here (:meth:`~etl.sources.base.SourceAdapter.read_here`, finished as
    :func:`finish_ingest` does), their repeated keys numbered and their records compared
    with the manifest as :func:`mark_unchanged` does in Spark, their counts taken and
    removals found here; only the new and changed records go on, as local data. None:
    compare in Spark."""
    if not all(adapter_for(s.kind).lists_here(s) for s in cfg.sources):
        return None
    has_manifest = cat.manifest.exists()
    known = cat.manifest.known() if has_manifest else None
    if has_manifest and known is None:
        return None  # too many rows for the driver
    table = pa.concat_tables([finish_ingest_here(adapter_for(s.kind).read_here(s), s)
                              for s in cfg.sources])
    by_id, live_ids = _known_ids(known) if known is not None else ({}, {})
    col = {name: table.column(name).to_pylist() for name in (
        "sample_id", "source", "source_key", "read_status", "read_reason", "source_uri",
        "image_ref", "image_offset", "fingerprint")}
    occurrence = _occurrences(col)
    unchanged = []
    for sid, fp in zip(col["sample_id"], col["fingerprint"], strict=True):
        fp_known, retry = by_id.get(sid, (None, True))
        unchanged.append(not retry and fp_known == fp)
    stats, ids = {}, {}
    for i, name in enumerate(col["source"]):
        st = stats.setdefault(name, {"source": name, "n": 0, "unchanged": 0, "failures": 0})
        st["n"] += 1
        st["unchanged"] += unchanged[i]
        st["failures"] += col["read_reason"][i] in CONTAINER_FAILURES
        ids.setdefault(name, {})[col["source_key"][i]] = col["sample_id"][i]
    removed = None
    if has_manifest:
        gone, scans = [], {}
        for s in cfg.sources:
            failures = stats.get(s.name, {}).get("failures")
            if failures and s.on_removed != "keep":
                scans[s.name] = f"deferred: {failures} record(s) of unreadable files/shards"
                log.warning("curate: source %s: removals deferred, %s", s.name, scans[s.name])
                continue
            scans[s.name], left = _driver_removals(s, live_ids.get(s.name, {}),
                                                   ids.get(s.name, {}))
            gone += [(sid, s.name, status) for sid, status in left]
        records = None
        if gone:
            records = spark.createDataFrame(
                gone, "sample_id string, source string, status string"
            ).withColumn("reason", F.lit("source_removed"))
        removed = _Removals(records, scans, {})
    todo = pa.array([not u for u in unchanged], pa.bool_())
    new = table.append_column("occurrence", pa.array(occurrence, pa.int32())).append_column(
        "unchanged", pa.array(unchanged, pa.bool_())).filter(todo)
    on_driver = len(new) <= cfg.prepare.driver_rows
    if not on_driver:
        _start_workers(spark)
    listed = spark.createDataFrame(new, T.StructType(SOURCE_SCHEMA.fields + [
        T.StructField("occurrence", T.IntegerType(), False),
        T.StructField("unchanged", T.BooleanType(), False)]))
    versions = {s.name: adapter_for(s.kind).snapshot_version(spark, s) for s in cfg.sources
                if s.on_removed == "delete"}
    return _Diff(None, cat.takedowns.identifiers(), versions, {}, {}, listed, stats,
                 has_manifest=has_manifest, removed=removed, on_driver=on_driver,
                 compared_here=True)


def _occurrences(col: dict[str, list]) -> list[int]:
    """:func:`mark_unchanged`'s ``occurrence`` for listed rows (columns as lists): 1 for
    the copy kept of each ``sample_id``, readable copies first, then by URI, reference,
    offset and fingerprint, nulls first as Spark orders them."""
    def first_nulls(v):
        return (v is not None, v if v is not None else "")

    order = sorted(range(len(col["sample_id"])), key=lambda i: (
        col["sample_id"][i], col["read_status"][i] != "ok",
        *(first_nulls(col[c][i]) for c in ("source_uri", "image_ref", "image_offset",
                                           "fingerprint"))))
    out, previous, n = [0] * len(order), None, 0
    for i in order:
        n = n + 1 if col["sample_id"][i] == previous else 1
        out[i], previous = n, col["sample_id"][i]
    return out


def _driver_removals(source: SourceConfig, live: dict[str, str], ids: dict[str, str]
                     ) -> tuple[str, list[tuple[str, str]]]:
    """How a driver-listed source's removals were looked for, and the records of it the
    manifest holds (accepted or rejected) that the listing no longer has."""
    if source.on_removed == "keep":
        return "kept", []
    if not ids and live:
        # An empty listing is far likelier an unmounted volume than a wipe.
        log.warning("curate: source %s lists nothing: removals deferred", source.name)
        return "deferred: the source lists no record at all", []
    listed = set(ids.values())
    return "listing", sorted((sid, st) for sid, st in live.items() if sid not in listed)



@dataclass
class _Removals:
    """Step "find removals": records the sources no longer list, and how each source
    was looked at."""
    records: DataFrame | None  # sample_id, source, status, reason (checkpointed)
    scans: dict[str, str]  # per source: "listing", "kept", a history's note, "deferred: …"
    source_versions: dict[str, int]  # ledger keys -> the versions fully handled this run

    def deferred(self, name: str) -> bool:
        return self.scans.get(name, "").startswith("deferred")


def _find_removed(spark: SparkSession, cfg: Config, diff: _Diff) -> _Removals:
    records, scans = None, {}
    if diff.removed is not None:  # compared on the driver
        records, scans = diff.removed.records, diff.removed.scans
    elif diff.manifest is not None:
        records, scans = _find_removals(spark, cfg, diff.manifest, diff.listed, diff.skip,
                                        diff.versions, diff.stats, diff.skipped)
        records = records.withColumn("reason", F.lit("source_removed")).localCheckpoint(
            eager=True)
    found = _Removals(records, scans, {})
    # The versions read, for the next run's history (not when removals were deferred:
    # the next run then looks at everything since the last version fully handled).
    found.source_versions.update({
        _version_key(s): diff.versions[s.name] for s in cfg.sources
        if diff.versions.get(s.name) is not None and not found.deferred(s.name)
    })
    return found


@dataclass
class _Prepared:
    """Step "fetch and prepare": every record processed this run, with its outcome."""
    rows: DataFrame | None  # prepared rows (persisted, their JPEGs already written as
    # Lance fragments; or local data, with them); None: none
    outcome_rows: list  # outcome_counts(rows), collected
    examples: tuple[str, ...]  # a few failed records, for the failure budgets' messages
    on_driver: bool = False  # prepared on the driver: `rows` are local data, or their
    # takedown checks (joins) are not
    written: PendingAppend | None = None  # the accepted rows, written by the tasks that
    # prepared them, to commit (not on the driver)
    fragments: tuple = ()  # what `written`'s tasks wrote, one list per task
    cached: DataFrame | None = None  # the persisted frame `rows` reads (to unpersist)
    held: pa.Table | None = None  # `rows` as Arrow, where this process holds them: the
    # bookkeeping's rows are built from it, with no Spark query planned over local data

    @classmethod
    def nothing(cls) -> _Prepared:
        """No record to process: no fetch, no prepare, no Python worker started."""
        return cls(None, [], ())

    @property
    def processed(self) -> int:
        return sum(r["count"] for r in self.outcome_rows)

    @property
    def accepted(self) -> int:
        return sum(r["count"] for r in self.outcome_rows if r["status"] == "ok")


def _fetch_and_prepare(spark: SparkSession, cfg: Config, paths: tables.Layout,
                       diff: _Diff, run_id: str, now: datetime) -> _Prepared:
    """Refuse what a takedown names, fetch referenced images and prepare them (one
    batch function), refuse what a takedown names by the source bytes' or the JPEG's
    hash. In Spark's tasks, the accepted rows are written as fragments of Lance
    `curated` by the task that prepared them (committed by :func:`_write_curated`)."""
    if diff.has_manifest and storage.lance_exists(paths.curated) and all(
            st["n"] == st["unchanged"] for st in diff.stats.values()):
        return _Prepared.nothing()  # a night with nothing new
    refused = diff.refused
    cores = spark.sparkContext.defaultParallelism
    todo = _task_layout(mark_duplicate_keys(diff.listed.where(~F.col("unchanged"))), diff,
                        cores)
    prepare = _prepare_options(cfg, diff, todo, cores)
    if refused is not None:
        todo = refuse_taken_down(todo, refused)  # by key and URL: nothing fetched
    # One Python worker per task fetches, hashes the source bytes, prepares and writes
    # the accepted rows (the bytes and JPEGs never return); a few records: the same
    # batch function, on the driver.
    written = None if diff.on_driver else _pending_append(spark, cfg, todo)
    sink = None if written is None else _row_sink(spark, written, refused, run_id, now)
    todo = fetch_and_prepare(todo, cfg.fetch, cfg.sources, prepare,
                             on_driver=diff.on_driver, sink=sink)
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
    budget = cfg.run.budgets.examples
    if diff.on_driver and is_local(prepared):
        # Local data (a few records, on the driver) is read again without a job, and
        # counted here.
        held = local_arrow(prepared)
        outcome_rows = outcome_counts_arrow(held)
        return _Prepared(prepared, outcome_rows, failure_examples(outcome_rows, budget),
                         on_driver=True, held=held)
    if _new_records(diff) <= DRIVER_IDS:
        return _collected(spark, prepared, written, budget, on_driver=diff.on_driver)
    prepared = cached = prepared.persist(StorageLevel.MEMORY_AND_DISK)
    fragments: tuple = ()
    if written is None:
        outcome_rows = outcome_counts(prepared).collect()
    else:
        outcome_rows, fragments = _outcome_and_fragments(prepared)
        prepared = prepared.drop(FLAG, WRITTEN)
    return _Prepared(prepared, outcome_rows, failure_examples(outcome_rows, budget),
                     on_driver=diff.on_driver, written=written, fragments=fragments,
                     cached=cached)


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


def _new_records(diff: _Diff) -> int:
    return sum(st["n"] - st["unchanged"] for st in diff.stats.values())


def _collected(spark: SparkSession, prepared: DataFrame, written: PendingAppend | None,
               budget: int, *, on_driver: bool) -> _Prepared:
    """Step "fetch and prepare" for up to :data:`DRIVER_IDS` new records: the tasks'
    rows (without their images: those are written, or in ``prepared.image`` on the
    driver's few) come back to the driver in the job that fetches and prepares them, and
    the later steps read them as local data -- no persisted frame, no Spark job for the
    outcome counts, the rejects or the manifest rows."""
    table = prepared.toArrow()
    fragments: tuple = ()
    if written is not None:
        fragments = _written_fragments(table)
        table = table.drop_columns([FLAG, WRITTEN])
        prepared = prepared.drop(FLAG, WRITTEN)
    rows = spark.createDataFrame(table, prepared.schema)
    outcome_rows = outcome_counts_arrow(table)
    return _Prepared(rows, outcome_rows, failure_examples(outcome_rows, budget),
                     on_driver=on_driver, written=written, fragments=fragments, held=table)


def _written_fragments(table: pa.Table) -> tuple:
    """What the tasks wrote (one list per task), from the collected rows' ``_written`` and
    ``_sink_written``; fails the stage where a row's ``_written`` and final status
    disagree (:func:`_outcome_and_fragments`)."""
    ok = pc.equal(table.column("status"), "ok")
    flag = table.column(FLAG)
    agree = pc.if_else(pc.and_(pc.is_null(flag), pc.is_null(ok)), True,
                       pc.fill_null(pc.equal(flag, ok), False))
    _check_written(len(table) - (pc.sum(agree).as_py() or 0))
    return tuple(w for w in table.column(WRITTEN).to_pylist() if w is not None)


def _check_written(disagree: int) -> None:
    if disagree:
        raise RuntimeError(
            f"curate: {disagree} row(s) were written to Lance by the fetch + prepare "
            "tasks but are not accepted, or accepted but not written: the tasks' acceptance "
            "and the outcome columns disagree (nothing is committed)")


def _outcome_and_fragments(staged: DataFrame) -> tuple[list[Row], tuple]:
    """The outcome counts (as :func:`outcome_counts` collects them) and what the tasks
    wrote (one list per task), in one job once the persisted rows are computed; fails
    the stage if a row's ``_written`` and its final status disagree (a bug: the tasks
    decide what is accepted as the outcome columns do)."""
    groups = outcome_counts(
        staged,
        F.collect_list(WRITTEN).alias("_written_lists"),
        F.sum(F.when(~F.col(FLAG).eqNullSafe(F.col("status") == "ok"), 1).otherwise(0))
        .alias("_disagree"),
    ).collect()
    _check_written(sum(g["_disagree"] for g in groups))
    names = [n for n in groups[0].__fields__ if not n.startswith("_")] if groups else []
    return ([Row(**{n: g[n] for n in names}) for g in groups],
            tuple(list(w) for g in groups for w in g["_written_lists"]))


# New records per fetch + prepare task, each writing its own Lance fragment: a night of
# a few hundred new records adds one fragment, however many partitions the listing has
# -- unless cores would sit idle: then tasks of at least _MIN_ROWS_PER_TASK records, one
# per core (a 1,000-record night on 16 cores runs 8 tasks, not 2).
_ROWS_PER_TASK = 512
_MIN_ROWS_PER_TASK = 128


def _tasks_for(new: int, cores: int) -> int:
    """How many fetch + prepare tasks `new` records get on `cores` task slots."""
    return max(1, -(-new // _ROWS_PER_TASK), min(cores, -(-new // _MIN_ROWS_PER_TASK)))


def _task_layout(todo: DataFrame, diff: _Diff, cores: int) -> DataFrame:
    """`todo` in at most :func:`_tasks_for` partitions: the listing's partitions merged,
    not shuffled (a listing with fewer keeps its own; not asked first: counting the
    partitions plans the frame, ~0.2 s in a cold JVM)."""
    if diff.on_driver:
        return todo
    return todo.coalesce(
        _tasks_for(_new_records(diff), cores))


def _fetch_prepare_tasks(diff: _Diff, todo: DataFrame, cores: int) -> int:
    """How many Spark tasks fetch and prepare `todo` (:func:`_task_layout`'s frame).
    Records compared with the manifest on the driver come from the driver in at most
    one partition per core and source, and at least one per core or row: their tasks
    are the fewer of the cores and :func:`_task_layout`'s count as far as
    ``PrepareConfig.task_threads`` can tell. A listing in Spark has its own partitions,
    asked of the plan (no job; ~0.2 s of planning in a cold JVM, which the first case
    saves)."""
    if diff.compared_here:
        return min(cores, _tasks_for(_new_records(diff), cores))
    return todo.rdd.getNumPartitions()


def _prepare_options(cfg: Config, diff: _Diff, todo: DataFrame, cores: int):
    """``prepare`` with the threads each fetch + prepare task runs resolved
    (``PrepareConfig.task_threads``); a night on the driver is one task on the driver's
    cores (the local master's, or the driver machine's)."""
    if cfg.prepare.threads is not None:
        return cfg.prepare
    if not diff.on_driver:
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
            curated.commit(prep.written, prep.fragments)
        else:
            curated.append(accepted_rows(prep.rows, run_id=run_id, ingested_at=F.lit(now),
                                         extra=UPSTREAM_COLUMNS), on_driver=prep.on_driver)
    if replaced:
        log.info("curate: replaced %d curated rows of changed records", replaced)
    return replaced


def _record_bronze(cat: Catalog, diff: _Diff, prep: _Prepared, run_id: str,
                   now: datetime) -> None:
    """MERGE this run's rejects and manifest rows into Delta (built in Arrow where this
    process holds the rows)."""
    if not prep.processed and diff.has_manifest:
        return
    if prep.held is not None:
        rejects = rejected_rows_arrow(prep.held, run_id=run_id)
        manifest = manifest_rows_arrow(prep.held, run_id=run_id, ingested_at=now)
    else:
        rejects = rejected_rows(prep.rows, run_id=run_id)
        manifest = manifest_rows(prep.rows, run_id=run_id, ingested_at=now)
    cat.rejects.merge(rejects, count=prep.processed - prep.accepted)
    cat.manifest.merge(manifest, count=prep.processed, before=diff.manifest)


def _apply_removals(spark: SparkSession, cfg: Config, removals: _Removals, run_id: str,
                    now: datetime) -> RemovalResult | None:
    """What left the sources leaves every table (the manifest last)."""
    if removals.records is None or removals.records.isEmpty():  # checkpointed: cheap
        return None
    spark.sparkContext.setJobDescription(
        "lakeshard curate: remove records the sources no longer list")
    return remove_records(spark, cfg, removals.records, run_id=run_id, now=now,
                          retention_hours=cfg.lakehouse.removal_retention_hours)


def _record_accounting(cfg: Config, cat: Catalog, diff: _Diff, prep: _Prepared,
                       removals: _Removals, removed: list[RemovalResult | None], run_id: str,
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


def _remember_versions(cfg: Config, diff: _Diff, removals: _Removals) -> None:
    """The source versions this run fully handled, for the next run's history; a source
    whose removals were deferred keeps the version last fully handled."""
    if all(v is None for v in diff.versions.values()):
        return
    deferred = {_version_key(s) for s in cfg.sources if removals.deferred(s.name)}
    kept = {k: v for k, v in _previous_versions(cfg).items() if k in deferred}
    _record_versions(cfg, {**kept, **removals.source_versions})


@dataclass(frozen=True)
class _Quiet:
    """Step "check for change": tonight's key -- every source's listing digest and config,
    the manifest's and the takedowns' versions -- and, when the last run left the same
    key and nothing it processed is retried, its figures. A quiet night then records its
    accounting and checks the curated table, and lists, compares and merges nothing."""
    key: dict | None  # None: a source kind that cannot tell cheaply, or no tables yet
    payload: dict | None  # unchanged, scans, versions per source; None: a full run

    @property
    def hit(self) -> bool:
        return self.payload is not None


def _quiet_state(cfg: Config) -> DerivedState:
    return DerivedState(f"{cfg.storage.root.rstrip('/')}/{_QUIET_FILE}", "curate_quiet")


def _sources_key(cfg: Config) -> dict[str, list[str]] | None:
    out = {}
    for s in cfg.sources:
        digest = adapter_for(s.kind).listing_digest(s)
        if digest is None:
            return None
        out[s.name] = [hashlib.sha256(s.model_dump_json().encode()).hexdigest()[:16], digest]
    return out


def _quiet_key(sources: dict, cat: Catalog) -> dict:
    return {"sources": sources, "manifest": cat.manifest.version(),
            "takedowns": cat.takedowns.version(), "code": code_version()}


def _check_quiet(cfg: Config, cat: Catalog) -> _Quiet:
    sources = _sources_key(cfg)  # listed before any table is read
    if sources is None:
        return _Quiet(None, None)
    key = _quiet_key(sources, cat)
    if key["manifest"] is None or not cat.curated.exists():
        return _Quiet(key, None)
    return _Quiet(key, _quiet_state(cfg).load(key))


def _remember_quiet(spark: SparkSession, cfg: Config, cat: Catalog, quiet: _Quiet,
                    diff: _Diff, prep: _Prepared, removals: _Removals) -> None:
    """Written after the run's last commit, when a rerun on the same listing would find
    every record unchanged: nothing processed is retried (or a second copy of a key),
    no source's removals were deferred."""
    state = _quiet_state(cfg)
    if quiet.key is None or any(removals.deferred(s.name) for s in cfg.sources) or any(
            r["status"] != "ok" and (retried(r["reason"]) or r["reason"] == "duplicate_key")
            for r in prep.outcome_rows):
        state.clear()
        return
    if any(quiet.key["sources"][name][1] != f"version {v}"
           for name, v in diff.versions.items() if v is not None):
        state.clear()  # the table moved between the digest and the read
        return
    unchanged = {s.name: diff.stats.get(s.name, {}).get("n", 0) + diff.skipped.get(s.name, 0)
                 for s in cfg.sources}
    scans = {}
    for s in cfg.sources:
        version = diff.versions.get(s.name)
        scans[s.name] = ("kept" if s.on_removed == "keep" else "listing" if version is None
                         else adapter_for(s.kind).deleted_keys(spark, s, version, version)[1])
    state.save(_quiet_key(quiet.key["sources"], cat), {"unchanged": unchanged, "scans": scans,
                     "versions": removals.source_versions})


def _quiet_night(spark: SparkSession, cfg: Config, cat: Catalog, quiet: _Quiet,
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


def curate(spark: SparkSession, cfg: Config, run_id: str,
           changes_ahead: Callable[[], None] = lambda: None) -> CurateResult:
    """`changes_ahead`: called once the night is known not to be a no-op (the run's
    later stages may start warming: :meth:`RunContext.changes_ahead`). Each source's
    files are listed once (:func:`~etl.sources.listing.one_listing`): the digest that
    tells a quiet night, the comparison with the manifest and the read of the new
    records see the same listing."""
    with one_listing():
        return _night(spark, cfg, run_id, changes_ahead)


def _night(spark: SparkSession, cfg: Config, run_id: str,
           changes_ahead: Callable[[], None]) -> CurateResult:
    paths, cat = tables.layout(cfg), Catalog.of(spark, cfg)
    now = datetime.now(UTC).replace(tzinfo=None)
    quiet = _check_quiet(cfg, cat)
    if quiet.hit:
        return _quiet_night(spark, cfg, cat, quiet, run_id, now)
    changes_ahead()
    # Before anything reads the manifest:
    with _job(spark, "finish pending takedowns", run_id):
        pending = _finish_takedowns(spark, cfg, run_id, now)
    with _job(spark, "list sources, compare with the manifest", run_id):
        diff = _diff_sources(spark, cfg, cat)
        removals = _find_removed(spark, cfg, diff)
    with _job(spark, "fetch + prepare new records, write them to Lance", run_id):
        prep = _fetch_and_prepare(spark, cfg, paths, diff, run_id, now)
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
    _remember_versions(cfg, diff, removals)
    _remember_quiet(spark, cfg, cat, quiet, diff, prep, removals)
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
