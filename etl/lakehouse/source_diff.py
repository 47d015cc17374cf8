"""The comparison of what the sources list with the bronze manifest
(:meth:`etl.lakehouse.catalog.Manifest.diff`): which records are new or changed, how
many are unchanged, which left their sources -- one question, three ways to answer it,
chosen here:

* every source lists its records on the driver without opening one (a folder's names,
  sizes and mtimes: :meth:`~etl.sources.base.SourceAdapter.driver_listing`) and the
  manifest's key columns are read by delta-rs within ``driver.ids``: the fingerprints are
  compared in this process, removals found here, and only new and changed records are
  read through Spark;
* every source is read in this process (small local URL lists:
  :meth:`~etl.sources.base.SourceAdapter.lists_in_driver`), on a first run or against a
  manifest within the same bound: the rows are numbered, compared, counted and their
  removals found here, as :func:`~etl.transforms.bronze.mark_unchanged` and
  :func:`~etl.transforms.bronze.removed_records` do in Spark;
* otherwise the containers first: a container whose size and mtime have not changed is
  not opened -- a tar shard whose manifest records all carry its fingerprint, a table
  file of embedded images whose fingerprint curate remembered beside the manifest
  (:meth:`~etl.lakehouse.curate_state.CurateState.table_containers`); its records count
  as unchanged, and are not looked for among the removals. What the opened containers
  list is then compared with the manifest's narrow rows read by delta-rs within
  ``driver.scan_rows`` (:class:`~etl.lakehouse.manifest_rows.ManifestRows`), when it
  holds at most ``driver.ids`` records: read in this process when the files are local
  and small (their few new records prepared on the driver), else by Spark's tasks;
* otherwise Spark: the listing joined with the manifest's snapshot, removals by a join
  (or a source table's history of deletions).

A comparison in the driver hands on at most ``driver.prepare_rows`` new records as a
:attr:`Diff.small` night: fetched, prepared and written from the driver's process. Each
driver path is tested equal to the Spark path on the same tables
(``tests/test_driver_diff.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import reduce
from typing import Protocol

import pyarrow as pa
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from etl.config import Config, SourceConfig
from etl.config.bounds import LOCAL_COLLECT_ROWS
from etl.lakehouse.curate_state import ContainerMemo, CurateState, version_key
from etl.lakehouse.manifest_rows import ManifestRows
from etl.runtime.warm import start_python_workers
from etl.schema import REMOVED, SOURCE_SCHEMA, sample_id_col, sample_id_of
from etl.sources import adapter_for, finish_ingest, finish_ingest_arrow
from etl.transforms.bronze import (
    CONTAINER_FAILURES,
    is_retry,
    live,
    mark_unchanged,
    removed_records,
    unchanged_containers,
)

__all__ = ["Diff", "Removals", "compare", "list_sources"]

log = logging.getLogger(__name__)

_REMOVED_SCHEMA = "sample_id string, source string, status string"


class _ManifestReads(Protocol):
    """What the comparison asks of the manifest (:class:`etl.lakehouse.catalog.Manifest`)."""

    def exists(self) -> bool: ...
    def known(self) -> pa.Table | None: ...
    def snapshot(self) -> DataFrame | None: ...
    def container_groups(self, manifest: DataFrame, source: str) -> list: ...
    def retried_containers(self, manifest: DataFrame, source: str) -> frozenset[str]: ...
    def version(self) -> int | None: ...
    def rows(self) -> ManifestRows | None: ...


@dataclass
class Removals:
    """What the sources no longer list, and how each source was looked at."""
    records: DataFrame | None  # sample_id, source, status, reason (checkpointed)
    scans: dict[str, str]  # per source: "listing", "kept", a history's note, "deferred: …"
    source_versions: dict[str, int] = field(default_factory=dict)  # ledger keys -> the
    # versions fully handled this run

    def deferred(self, name: str) -> bool:
        return self.scans.get(name, "").startswith("deferred")


@dataclass
class Diff:
    """What the sources list, against the manifest."""
    manifest: DataFrame | None  # as read before this run merges into it (checkpointed;
    # None when compared on the driver)
    versions: dict[str, int | None]  # per source with a history: the version read
    listed: DataFrame  # every listed record, `unchanged` marked (persisted); compared
    # on the driver: only the new and changed ones
    stats: dict[str, dict]  # per source: n, unchanged, failures (unreadable containers)
    removals: Removals
    has_manifest: bool = False  # a manifest was there
    skipped: dict[str, int] = field(default_factory=dict)  # per source: the records
    # its unchanged containers (not opened) hold
    small: bool = False  # `listed` is a few records of local data, no Python UDF in its
    # plan: fetched, prepared and written to Lance from the driver
    in_driver: bool = False  # compared with the manifest on the driver: `listed` comes
    # from the driver, in at most one partition per core (per source)
    containers: ContainerMemo | None = None  # table files read in full or skipped
    # whole (see CurateState.table_containers); None: none remembered from this run
    held: frozenset[str] | None = None  # the listed ids the manifest holds, when its
    # rows were read on the driver (ManifestRows); None: not known here

    @property
    def unchanged(self) -> dict[str, int]:
        """Per source: records not processed (listed unchanged, or in skipped containers)."""
        out = dict(self.skipped)
        for name, st in self.stats.items():
            if st["unchanged"]:
                out[name] = out.get(name, 0) + st["unchanged"]
        return out

    @property
    def new_records(self) -> int:
        return sum(st["n"] - st["unchanged"] for st in self.stats.values())

    @property
    def listed_counts(self) -> dict[str, int]:
        """Per source: every record listed or skipped whole (what a quiet rerun finds
        unchanged)."""
        names = {*self.stats, *self.skipped}
        return {n: self.stats.get(n, {}).get("n", 0) + self.skipped.get(n, 0) for n in names}


def compare(spark: SparkSession, cfg: Config, manifest: _ManifestReads,
            state: CurateState, *, prepare_rows: int) -> Diff:
    """The sources' listing against `manifest`, on the driver where it can be (see the
    module docstring), else in Spark; with the removals found and the source versions
    this run fully handles (not those whose removals were deferred)."""
    diff = (_folder_listing(spark, cfg, manifest, prepare_rows)
            or _listed_in_driver(spark, cfg, manifest, prepare_rows)
            or _in_spark(spark, cfg, manifest, state, prepare_rows))
    diff.removals.source_versions.update({
        version_key(s): diff.versions[s.name] for s in cfg.sources
        if diff.versions.get(s.name) is not None and not diff.removals.deferred(s.name)})
    return diff


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


def _source_versions(spark: SparkSession, cfg: Config) -> dict[str, int | None]:
    return {s.name: adapter_for(s.kind).snapshot_version(spark, s) for s in cfg.sources
            if s.on_removed == "delete"}


# -- Spark: the listing joined with the manifest -------------------------------------


def _in_spark(spark: SparkSession, cfg: Config, manifest: _ManifestReads,
              state: CurateState, prepare_rows: int) -> Diff:
    """Sources that do not all list on the driver: unchanged containers skipped, the
    rest compared with the manifest's rows on the driver where they are few
    (:func:`_compared_here`), else by Spark's join with its snapshot."""
    versions = _source_versions(spark, cfg)
    unversioned = all(v is None for v in versions.values())
    memo = state.table_containers(manifest.version())  # {} without a manifest
    ahead = unversioned and _workers_ahead(spark, cfg, memo, _prepare_here(cfg, prepare_rows))
    rows = manifest.rows() if unversioned else None
    before = manifest.snapshot() if rows is None else None  # read before it is merged into
    reads = rows if rows is not None else (
        None if before is None else _Snapshot(manifest, before))
    skip, skipped, current = _skipped_containers(cfg, reads, memo)
    if rows is not None and all(adapter_for(s.kind).lists_in_driver(
            s, skip.get(s.name, frozenset())) for s in cfg.sources):
        here = _compared_here(spark, cfg, rows, _read_here(cfg, skip), skip, skipped,
                              current, memo, _prepare_here(cfg, prepare_rows),
                              workers_started=ahead)
        if here is not None:
            return replace(here, versions=versions)
    listing = list_sources(spark, cfg, skip, versions)
    if rows is not None:
        here = _compared_here(spark, cfg, rows, listing, skip, skipped, current, memo,
                              prepare_rows)
        if here is not None:
            return replace(here, versions=versions)
        before = manifest.snapshot()  # too many listed for the driver: Spark's join
    listed = mark_unchanged(listing, before).persist(StorageLevel.MEMORY_AND_DISK)
    stats = {
        r["source"]: r.asDict() for r in listed.groupBy("source").agg(
            F.count(F.lit(1)).alias("n"),
            F.sum(F.col("unchanged").cast("int")).alias("unchanged"),
            F.sum(F.coalesce(F.col("read_reason").isin(*CONTAINER_FAILURES), F.lit(False))
                  .cast("int")).alias("failures"),  # 0, as the driver's count, when none
        ).collect()
    }
    removals = Removals(None, {})
    if before is not None:
        records, scans = _find_removals(spark, cfg, state, before, listed, skip, versions,
                                        stats, skipped)
        removals = Removals(records.withColumn("reason", F.lit("source_removed"))
                            .localCheckpoint(eager=True), scans)
    return Diff(before, versions, listed, stats, removals, has_manifest=before is not None,
                skipped=skipped,
                containers=_read_containers(listed, current, memo, skip) if current else None)


@dataclass(frozen=True)
class _Snapshot:
    """The container questions of :func:`_skipped_containers`, asked of the manifest's
    snapshot by Spark (the driver's twin: :class:`ManifestRows`)."""
    manifest: _ManifestReads
    before: DataFrame

    def retried_containers(self, source: str) -> frozenset[str]:
        return self.manifest.retried_containers(self.before, source)

    def container_groups(self, source: str) -> list:
        return self.manifest.container_groups(self.before, source)


class _ContainerReads(Protocol):
    def retried_containers(self, source: str) -> frozenset[str]: ...
    def container_groups(self, source: str) -> list: ...


def _skipped_containers(cfg: Config, reads: _ContainerReads | None, memo: ContainerMemo
                        ) -> tuple[dict[str, frozenset[str]], dict[str, int],
                                   dict[str, dict[str, str]]]:
    """Per source: unchanged containers (tar shards, table files) and the records they
    hold; and the table files' fingerprints as listed now (to remember after the run)."""
    skip: dict[str, frozenset[str]] = {}
    counts: dict[str, int] = {}
    current: dict[str, dict[str, str]] = {}
    for s in cfg.sources:
        adapter = adapter_for(s.kind)
        listed = adapter.containers(s)
        if listed is None:
            continue
        if adapter.remembered_containers:
            current[s.name] = listed
            known = memo.get(s.name)
            if reads is None or not known:
                continue
            skip[s.name] = _same_files(listed, known) - reads.retried_containers(s.name)
            counts[s.name] = sum(known[uri][1] for uri in skip[s.name])
        elif reads is not None and listed:
            known_groups = reads.container_groups(s.name)
            skip[s.name], counts[s.name] = unchanged_containers(listed, known_groups)
    return skip, counts, current


def _same_files(listed: dict[str, str], known: dict[str, tuple[str, int]]) -> frozenset[str]:
    """The table files listed now with the fingerprint (size, mtime) the last run's
    memo of them has."""
    return frozenset(uri for uri, (fp, _) in known.items() if listed.get(uri) == fp)


def _read_containers(listed: DataFrame, current: dict[str, dict[str, str]],
                     memo: ContainerMemo, skip: dict[str, frozenset[str]]) -> ContainerMemo:
    """What to remember of the table files after this run (:func:`_containers_memo`),
    the files read counted by Spark."""
    rows = (listed.where(F.col("source").isin(*current))
            .groupBy("source", "source_uri").agg(
                F.count(F.lit(1)).alias("n"),
                F.max(F.coalesce(F.col("read_reason").isin(*CONTAINER_FAILURES),
                                 F.lit(False))).alias("failed"))
            .collect())
    return _containers_memo({(r["source"], r["source_uri"]): (int(r["n"]), bool(r["failed"]))
                             for r in rows}, current, memo, skip)


def _containers_memo(found: dict[tuple[str, str], tuple[int, bool]],
                     current: dict[str, dict[str, str]], memo: ContainerMemo,
                     skip: dict[str, frozenset[str]]) -> ContainerMemo:
    """What to remember of the table files after this run: each file read in full (no
    unreadable part) with its fingerprint as listed and the records it listed, and each
    file skipped whole as it was remembered. `found`: per (source, file) read, the records
    listed and whether a part of it was unreadable."""
    out: ContainerMemo = {}
    for name, files in current.items():
        kept = skip.get(name, frozenset())
        mine = out.setdefault(name, {})
        for uri, fp in files.items():
            if uri in kept:
                mine[uri] = memo[name][uri]
                continue
            n, failed = found.get((name, uri), (0, False))
            if not failed:
                mine[uri] = (fp, n)
    return out


def _find_removals(spark: SparkSession, cfg: Config, state: CurateState, manifest: DataFrame,
                   listed: DataFrame, skip: dict[str, frozenset[str]],
                   versions: dict[str, int | None], stats: dict[str, dict],
                   skipped: dict[str, int]) -> tuple[DataFrame, dict[str, str]]:
    """Records the sources no longer list: ``sample_id, source, status``; and per
    source how they were looked for."""
    previous = None
    full, parts, scans = [], [], {}
    for s in cfg.sources:
        version = versions.get(s.name)
        why = _deferral(s, stats.get(s.name, {}), skipped, lambda name=s.name, v=version: (
            v is None and not live(manifest).where(F.col("source") == name).isEmpty()))
        if why is not None:
            scans[s.name] = why
            continue
        if version is None:
            full.append(s.name)
            scans[s.name] = "listing"
            continue
        if previous is None:
            previous = state.source_versions()
        since = previous.get(version_key(s))
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


# -- The driver: the containers opened compared with the manifest's narrow rows -----

# The listing's columns the comparison on the driver reads.
_NARROW = ["sample_id", "source", "source_uri", "fingerprint", "read_reason"]


def _prepare_here(cfg: Config, prepare_rows: int) -> int:
    """The new records a night prepares on the driver when its listing was read here:
    ``driver.prepare_rows``, or up to :data:`LOCAL_COLLECT_ROWS` when every source's
    records embed their images in the local table files just read -- their bytes are
    then within :data:`~etl.config.bounds.DRIVER_REF_BYTES`, whatever the count (a
    night's new file of small images), read again a row group at a time.
    ``driver.prepare_rows: 0`` keeps every night in Spark's tasks."""
    if prepare_rows and all(adapter_for(s.kind).names_rows(s) for s in cfg.sources):
        return max(prepare_rows, LOCAL_COLLECT_ROWS)
    return prepare_rows


def _read_here(cfg: Config, skip: dict[str, frozenset[str]]) -> pa.Table:
    """Every source's listing read in this process, the containers in `skip` left
    unopened (:meth:`~etl.sources.base.SourceAdapter.read_arrow`), finished."""
    return pa.concat_tables([finish_ingest_arrow(adapter_for(s.kind).read_arrow(
        s, skip.get(s.name, frozenset())), s) for s in cfg.sources])


def _compared_here(spark: SparkSession, cfg: Config, rows: ManifestRows,
                   listing: DataFrame | pa.Table,
                   skip: dict[str, frozenset[str]], skipped: dict[str, int],
                   current: dict[str, dict[str, str]], memo: ContainerMemo,
                   prepare_rows: int, *, workers_started: bool = False) -> Diff | None:
    """What Spark's join would answer, from the manifest's narrow rows read by delta-rs
    (`rows`) and the listing of the containers opened tonight, when it holds at most
    ``driver.ids`` records (a night that opened the few files that changed); None when
    it holds more. A listing read in this process (an Arrow table) is compared here and
    its new records handed on as local data (:func:`_marked_here`: prepared on the
    driver when few); a listing read by Spark's tasks is marked ``unchanged`` by Spark's
    rule (:func:`mark_unchanged`), joined with the manifest rows of the keys it lists."""
    local = isinstance(listing, pa.Table)
    table = (listing if local else
             listing.select(*_NARROW).limit(cfg.driver.ids + 1).toArrow())
    if table.num_rows > cfg.driver.ids:
        return None
    known = rows.known_of(table.column("sample_id").to_pylist())
    marked = (_marked_here(spark, table, _known_ids(known)[0], prepare_rows,
                           workers_started=workers_started) if local
              else _marked_in_spark(spark, listing, table, known))
    listed_ids = frozenset(table.column("sample_id").to_pylist())
    gone, scans = [], {}
    for s in cfg.sources:
        why = _deferral(s, marked.stats.get(s.name, {}), skipped,
                        lambda name=s.name: rows.holds_live(name))
        scans[s.name] = why or "listing"
        if why is None:
            gone += [(sid, s.name, status) for sid, status in
                     rows.removed(s.name, skip.get(s.name, frozenset()), listed_ids)]
    return Diff(None, {}, marked.listed, marked.stats,
                Removals(_removed_frame(spark, gone), scans), has_manifest=True,
                skipped=skipped, small=marked.small, in_driver=local,
                containers=_containers_memo(_files_read(table), current, memo, skip)
                if current else None,
                held=frozenset(known.column("sample_id").to_pylist()))


def _marked_in_spark(spark: SparkSession, listing: DataFrame, narrow: pa.Table,
                     known: pa.Table) -> _Marked:
    """A listing read by Spark's tasks (`narrow`: its :data:`_NARROW` columns, collected)
    counted here against the manifest rows of its keys (`known`), and marked in Spark by
    the same rule (:func:`mark_unchanged`)."""
    col = {c: narrow.column(c).to_pylist() for c in (
        "sample_id", "source", "fingerprint", "read_reason")}
    stats = _counted(col, _unchanged(col, _known_ids(known)[0]))
    before = spark.createDataFrame(known) if known.num_rows else None
    return _Marked(mark_unchanged(listing, before).persist(StorageLevel.MEMORY_AND_DISK),
                   stats, {}, False)


def _unchanged(col: dict[str, list], by_id: dict[str, tuple[str | None, bool]]
               ) -> list[bool]:
    """:func:`mark_unchanged`'s ``unchanged`` for listed rows (columns as lists) against
    the manifest's rows `by_id` (:func:`_known_ids`): known, the same fingerprint, and
    not to be retried."""
    out = []
    for sid, fp in zip(col["sample_id"], col["fingerprint"], strict=True):
        fp_known, retry = by_id.get(sid, (None, True))
        out.append(not retry and fp_known == fp)
    return out


def _counted(col: dict[str, list], unchanged: list[bool]) -> dict[str, dict]:
    """Per source of listed rows: ``n``, ``unchanged`` and ``failures`` (records of
    unreadable files), as the Spark path counts them."""
    stats: dict[str, dict] = {}
    for name, same, reason in zip(col["source"], unchanged, col["read_reason"], strict=True):
        st = stats.setdefault(name, {"source": name, "n": 0, "unchanged": 0, "failures": 0})
        st["n"] += 1
        st["unchanged"] += same
        st["failures"] += reason in CONTAINER_FAILURES
    return stats


def _files_read(table: pa.Table) -> dict[tuple[str, str], tuple[int, bool]]:
    """Per (source, file) of a listing: the records listed, and whether part of the
    file was unreadable."""
    found: dict[tuple[str, str], tuple[int, bool]] = {}
    for name, uri, reason in zip(*(table.column(c).to_pylist() for c in (
            "source", "source_uri", "read_reason")), strict=True):
        n, bad = found.get((name, uri), (0, False))
        found[(name, uri)] = (n + 1, bad or reason in CONTAINER_FAILURES)
    return found


def _deferral(source: SourceConfig, st: dict, skipped: dict[str, int], holds_live
              ) -> str | None:
    """Why a source's removals are not looked for tonight, or None: kept by its
    configuration, deferred while part of it was unreadable, or deferred when it lists
    nothing at all (far likelier an unmounted volume than a wipe) and the manifest still
    holds records of it (`holds_live()`, asked last)."""
    if source.on_removed == "keep":
        return "kept"
    if st.get("failures"):
        why = f"deferred: {st['failures']} record(s) of unreadable files/shards"
        log.warning("curate: source %s: removals deferred, %s", source.name, why)
        return why
    if not st.get("n") and not skipped.get(source.name) and holds_live():
        log.warning("curate: source %s lists nothing: removals deferred", source.name)
        return "deferred: the source lists no record at all"
    return None


# -- The driver: a folder's listing against the manifest's key columns ---------------


def _folder_listing(spark: SparkSession, cfg: Config, manifest: _ManifestReads,
                    prepare_rows: int) -> Diff | None:
    """Every source listed on the driver without opening a record, the manifest's key
    columns read by delta-rs within the driver bound: compared here, and only new and
    changed records read through Spark. None: another way."""
    listings = {}
    for s in cfg.sources:
        listing = adapter_for(s.kind).driver_listing(s)
        if listing is None:
            return None
        listings[s.name] = listing
    known = manifest.known() if manifest.exists() else None
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
        scans[s.name], left = _listing_removals(s, stats.get(s.name, {}),
                                                live_ids.get(s.name, {}), ids)
        gone += [(sid, s.name, status) for sid, status in left]
    # A few new or changed records: read, fetched and prepared on the driver.
    small = _small_night(spark, sum(map(len, changed.values())), prepare_rows)
    frames = [finish_ingest(adapter_for(s.kind).read_keys(spark, s, changed[s.name], small), s)
              for s in cfg.sources if changed[s.name]]
    # Keys of a driver listing are unique (one copy each), and it has no containers to
    # fail: no window over the keys, no Spark job to count failures. Read once, by the
    # fetch and prepare step.
    listed = (reduce(DataFrame.unionByName, frames) if frames else
              spark.createDataFrame([], SOURCE_SCHEMA)).withColumns(
        {"occurrence": F.lit(1), "unchanged": F.lit(False)})
    return Diff(None, _source_versions(spark, cfg), listed, stats,
                Removals(_removed_frame(spark, gone), scans), has_manifest=True,
                small=small, in_driver=True)


def _listed_in_driver(spark: SparkSession, cfg: Config, manifest: _ManifestReads,
                      prepare_rows: int) -> Diff | None:
    """Every source read in this process (small local URL lists), the manifest absent (a
    first run) or read by delta-rs within the driver bound: the rows are finished as
    :func:`finish_ingest` does, their repeated keys numbered and their records compared
    with the manifest as :func:`mark_unchanged` does in Spark, counted and their removals
    found here; only the new and changed records go on, as local data. None: Spark."""
    if not all(adapter_for(s.kind).lists_in_driver(s) for s in cfg.sources):
        return None
    has_manifest = manifest.exists()
    known = manifest.known() if has_manifest else None
    if has_manifest and known is None:
        return None  # too many rows for the driver
    table = pa.concat_tables([finish_ingest_arrow(adapter_for(s.kind).read_arrow(s), s)
                              for s in cfg.sources])
    by_id, live_ids = _known_ids(known) if known is not None else ({}, {})
    here = _marked_here(spark, table, by_id, prepare_rows)
    removals = (_table_removals(spark, cfg, here.stats, live_ids, here.ids) if has_manifest
                else Removals(None, {}))
    return Diff(None, _source_versions(spark, cfg), here.listed, here.stats, removals,
                has_manifest=has_manifest, small=here.small, in_driver=True)


@dataclass(frozen=True)
class _Marked:
    """A listing this process holds, compared with the manifest here."""
    listed: DataFrame  # its new and changed records, `occurrence` and `unchanged` added
    stats: dict[str, dict]  # per source: n, unchanged, failures
    ids: dict[str, dict[str, str]]  # per source: source_key -> sample_id
    small: bool  # few enough new records to prepare on the driver


def _marked_here(spark: SparkSession, table: pa.Table,
                 by_id: dict[str, tuple[str | None, bool]], prepare_rows: int, *,
                 workers_started: bool = False) -> _Marked:
    """The listing `table` (finished, as :func:`finish_ingest_arrow` leaves it) compared
    with the manifest's rows `by_id` (:func:`_known_ids`) as :func:`mark_unchanged` does
    in Spark: its repeated keys numbered, its records counted, and only the new and
    changed ones handed on, as local data."""
    col = {name: table.column(name).to_pylist() for name in (
        "sample_id", "source", "source_key", "read_status", "read_reason", "source_uri",
        "image_ref", "image_offset", "fingerprint")}
    unchanged = _unchanged(col, by_id)
    stats, ids = _counted(col, unchanged), {}
    for name, key, sid in zip(col["source"], col["source_key"], col["sample_id"], strict=True):
        ids.setdefault(name, {})[key] = sid
    todo = pa.array([not u for u in unchanged], pa.bool_())
    new = table.append_column("occurrence", pa.array(_occurrences(col), pa.int32())
                              ).append_column("unchanged", pa.array(unchanged, pa.bool_())
                                              ).filter(todo)
    small = _small_night(spark, len(new), prepare_rows, workers_started)
    listed = spark.createDataFrame(new, T.StructType(SOURCE_SCHEMA.fields + [
        T.StructField("occurrence", T.IntegerType(), False),
        T.StructField("unchanged", T.BooleanType(), False)]))
    return _Marked(listed, stats, ids, small)


def _table_removals(spark: SparkSession, cfg: Config, stats: dict[str, dict],
                    live_ids: dict[str, dict[str, str]], ids: dict[str, dict[str, str]]
                    ) -> Removals:
    """Removals of sources read in this process; deferred for a source with unreadable
    files."""
    gone, scans = [], {}
    for s in cfg.sources:
        scans[s.name], left = _listing_removals(s, stats.get(s.name, {}),
                                                live_ids.get(s.name, {}), ids.get(s.name, {}))
        gone += [(sid, s.name, status) for sid, status in left]
    return Removals(_removed_frame(spark, gone), scans)


def _small_night(spark: SparkSession, new: int, prepare_rows: int,
                 workers_started: bool = False) -> bool:
    """Whether `new` records are few enough to fetch and prepare on the driver; if not,
    this process's first Python tasks are coming, and their daemon starts now, on a thread
    (:func:`~etl.runtime.warm.start_python_workers`), while the driver hands the records
    to Spark and plans the fetch + prepare job -- unless :func:`_workers_ahead` started
    it already. A night with nothing new, or a few records prepared on the driver,
    starts no Python worker."""
    if new <= prepare_rows:
        return True
    if not workers_started:
        start_python_workers(spark, "lakeshard curate: start the Python workers")
    return False


def _workers_ahead(spark: SparkSession, cfg: Config, memo: ContainerMemo,
                   prepare_rows: int) -> bool:
    """Start the executors' Python daemon before the manifest and the listing are read,
    when the table files that changed since the last run's `memo` of them (new, or
    another size or mtime) hold, by their sources'
    :meth:`~etl.sources.base.SourceAdapter.records_hint`, more records than the driver
    prepares: the daemon's start (~1.7 s on a 2-core machine) then overlaps the
    driver's reads and comparison instead of following them. A hint only: files with a
    record to retry are opened too, and a changed file's records may all be known. No
    memo (a first run: listed in Spark's tasks, which start the daemon), no hint.
    Whether it started."""
    if not memo or not all(adapter_for(s.kind).hints_records(s) for s in cfg.sources):
        return False  # nothing listed for a hint that cannot be had (remote, not parquet)
    hints = []
    for s in cfg.sources:
        adapter = adapter_for(s.kind)
        known = memo.get(s.name, {})
        same = _same_files(adapter.containers(s) or {}, known) if known else frozenset()
        hints.append(adapter.records_hint(s, same))
    if any(h is None for h in hints) or sum(hints) <= prepare_rows:
        return False
    return start_python_workers(spark, "lakeshard curate: start the Python workers") \
        is not None


def _removed_frame(spark: SparkSession, gone: list[tuple[str, str, str]]) -> DataFrame | None:
    if not gone:
        return None
    return spark.createDataFrame(gone, _REMOVED_SCHEMA).withColumn(
        "reason", F.lit("source_removed"))


def _known_ids(known: pa.Table
               ) -> tuple[dict[str, tuple[str | None, bool]], dict[str, dict[str, str]]]:
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


def _listing_removals(source: SourceConfig, st: dict, live: dict[str, str],
                      ids: dict[str, str]) -> tuple[str, list[tuple[str, str]]]:
    """How a source listed in this process had its removals looked for (`st`: its
    counts), and the records of it the manifest holds (accepted or rejected) that the
    listing no longer has."""
    why = _deferral(source, st, {}, lambda: bool(live))
    if why is not None:
        return why, []
    listed = set(ids.values())
    return "listing", sorted((sid, status) for sid, status in live.items()
                          if sid not in listed)
