"""Versions, compaction and retention of a Lance table, and purging removed rows.

Every write to a Lance table (a curate overwrite or append, a feature column, an
index) is a new version; older versions stay readable (time travel) until
:func:`compact` cleans them up by the retention setting. Compaction rewrites small
fragments -- many appends, per-column data files left by feature writes -- into
fragments of ``target_rows_per_fragment`` rows, and remaps the indexes to them.

Removing rows (a record gone from its source, a takedown) writes deletion files: the
rows' bytes are still in the data files, and in every older version.
:func:`purge_removed` rewrites the fragments that held the rows (their other rows are
copied into new files), so that from that version on no file the table references
holds them, and deletes every version before it once the retention has passed -- at
once when it is 0, else by the first :func:`run_due_purges` after that time (curate,
forget and compact all call it), whatever ``retention_days`` and ``retain_versions``
say. Which versions wait, and until when, is written in the table itself (its config,
``lakeshard.purge.<version>`` -> due time). Tags on those versions are removed: a tag
does not keep removed bytes. A purged version cannot be read again (time travel to it
fails: its manifest is gone).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl.config import Config, LakehouseConfig
from etl.lakehouse.catalog import Catalog
from etl.schema import REMOVED
from etl.transforms.accounting import removal_counts
from etl.transforms.bronze import taken_down_records
from etl.writers.delta import mark_takedowns_applied
from etl.writers.lance import delete_rows, deleted_per_fragment

__all__ = [
    "VersionInfo",
    "CompactResult",
    "current_version",
    "table_versions",
    "compact",
    "data_bytes",
    "PURGE_KEY",
    "PurgeResult",
    "materialize_deletions",
    "purge_removed",
    "run_due_purges",
    "remove_taken_down",
    "mark_applied",
    "pending_purges",
    "RemovalResult",
    "remove_records",
]

# Config key prefix of a scheduled purge: lakeshard.purge.<version> = ISO due time (UTC).
PURGE_KEY = "lakeshard.purge."

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionInfo:
    version: int
    timestamp: datetime
    rows: int
    fragments: int
    data_bytes: int


@dataclass(frozen=True)
class CompactResult:
    version_before: int
    version_after: int
    fragments_before: int
    fragments_after: int
    fragments_rewritten: int
    versions_removed: int
    bytes_removed: int
    oldest_version: int  # the oldest version still readable


def current_version(path: str) -> int:
    """The version a stage produced: the table's latest version once it has written.

    This is what the run ledger records per stage."""
    import lance

    return lance.dataset(path).version


def table_versions(path: str) -> list[VersionInfo]:
    """Every readable version, oldest first (what ``curated_versions`` shows)."""
    import lance

    ds = lance.dataset(path)
    out = []
    for v in ds.versions():
        meta = v.get("metadata") or {}
        out.append(
            VersionInfo(
                version=int(v["version"]),
                timestamp=v["timestamp"],
                rows=int(meta.get("total_rows", 0)),
                fragments=int(meta.get("total_fragments", 0)),
                data_bytes=int(meta.get("total_files_size", 0)),
            )
        )
    return out


def data_bytes(path: str, version: int | None = None) -> int:
    """Bytes of the data files a version references (what a full scan would read)."""
    import lance

    ds = lance.dataset(path, version=version)
    return sum(
        f.file_size_bytes or 0 for frag in ds.get_fragments() for f in frag.metadata.files
    )


def compact(path: str, cfg: LakehouseConfig) -> CompactResult:
    """Compact small fragments, then delete versions outside the retention window.

    A version is removed only when it is older than ``retention_days`` *and* not among
    the newest ``retain_versions``; the latest version is never removed."""
    import lance

    ds = lance.dataset(path)
    before_version, before_frags = ds.version, len(ds.get_fragments())
    metrics = ds.optimize.compact_files(target_rows_per_fragment=cfg.target_rows_per_fragment)
    ds = lance.dataset(path)
    if ds.list_indices():
        # Compaction remaps index row addresses; indexing any rows left out keeps every
        # filter on the index path.
        ds.optimize.optimize_indices()
        ds = lance.dataset(path)
    stats = ds.cleanup_old_versions(
        older_than=timedelta(days=cfg.retention_days),
        retain_versions=cfg.retain_versions,
        error_if_tagged_old_versions=False,
    )
    purged = run_due_purges(path)  # removed rows' versions whose retention has passed
    ds = lance.dataset(path)
    result = CompactResult(
        version_before=before_version,
        version_after=ds.version,
        fragments_before=before_frags,
        fragments_after=len(ds.get_fragments()),
        fragments_rewritten=metrics.fragments_removed,
        versions_removed=stats.old_versions + purged[0],
        bytes_removed=stats.bytes_removed + purged[1],
        oldest_version=min(int(v["version"]) for v in ds.versions()),
    )
    log.info("compacted %s: %s", path, result)
    return result


@dataclass(frozen=True)
class PurgeResult:
    # The first version no file of which holds the removed rows (after the rewrite).
    version: int
    fragments_rewritten: int
    # From when the versions before `version` are deleted (now, with retention 0).
    due: datetime
    versions_removed: int  # by this call
    bytes_removed: int  # by this call
    oldest_version: int  # the oldest version still readable
    tags_removed: tuple[str, ...] = ()

    @property
    def done(self) -> bool:
        """No readable version holds the removed rows' bytes any more."""
        return self.oldest_version >= self.version


def _utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def materialize_deletions(path: str, fragment_ids: Iterable[int], target_rows: int
                          ) -> tuple[int, int]:
    """Rewrite the fragments `fragment_ids` without their deleted rows, and no other
    fragment (the rest are excluded from the compaction plan; adjacent fragments of the
    set may be merged up to `target_rows`). Returns (version, fragments rewritten).
    Fragments that no longer exist (every row deleted) need nothing."""
    import lance

    ds = lance.dataset(path)
    wanted = set(fragment_ids)
    present = {f.fragment_id for f in ds.get_fragments()}
    if not wanted & present:
        return ds.version, 0
    metrics = ds.optimize.compact_files(
        target_rows_per_fragment=target_rows,
        materialize_deletions=True,
        materialize_deletions_threshold=0.0,  # any deleted row makes a fragment eligible
        excluded_fragment_ids=sorted(present - wanted),
    )
    return lance.dataset(path).version, metrics.fragments_removed


def pending_purges(path: str) -> dict[int, datetime]:
    """Scheduled purges of the table: version -> when the versions before it go."""
    import lance

    return {
        int(k[len(PURGE_KEY):]): datetime.fromisoformat(v)
        for k, v in (lance.dataset(path).config() or {}).items() if k.startswith(PURGE_KEY)
    }


def run_due_purges(path: str, now: datetime | None = None, *,
                   before: int | None = None) -> tuple[int, int, tuple[str, ...]]:
    """Delete the versions before every scheduled purge that is due at `now` (and before
    version `before`, if given): returns (versions removed, bytes removed, tags removed).
    Writes nothing when nothing is due."""
    import lance

    now = now or _utcnow()
    pending = pending_purges(path)
    due = [v for v, when in pending.items() if when <= now]
    if before is not None:
        due.append(before)
    if not due:
        return 0, 0, ()
    target = max(due)
    ds = lance.dataset(path)
    old = sorted(int(v["version"]) for v in ds.versions() if int(v["version"]) < target)
    tags = tuple(sorted(name for name, t in ds.tags.list().items() if t["version"] < target))
    for name in tags:
        log.warning("%s: tag %r is on version %d, which holds removed rows: tag removed",
                    path, name, ds.tags.list()[name]["version"])
        ds.tags.delete(name)
    removed = bytes_removed = 0
    if old:
        stats = ds.cleanup_old_versions(versions=old, error_if_tagged_old_versions=True)
        removed, bytes_removed = stats.old_versions, stats.bytes_removed
    done = [f"{PURGE_KEY}{v}" for v in pending if v <= target]
    if done:
        lance.dataset(path).delete_config_keys(done)
    log.info("%s: purged %d version(s) before %d (%d bytes)", path, removed, target,
             bytes_removed)
    return removed, bytes_removed, tags


def purge_removed(path: str, fragment_ids: Iterable[int], *, target_rows: int,
                  retention_hours: float, now: datetime | None = None) -> PurgeResult:
    """After rows were deleted from `fragment_ids`: rewrite those fragments, then delete
    the versions before the rewrite -- now when `retention_hours` is 0, else schedule it
    (and run any purge already due)."""
    import lance

    now = now or _utcnow()
    version, rewritten = materialize_deletions(path, fragment_ids, target_rows)
    due = now + timedelta(hours=retention_hours)
    if due > now:
        lance.dataset(path).update_config({f"{PURGE_KEY}{version}": due.isoformat()})
        removed, nbytes, tags = run_due_purges(path, now)
    else:
        removed, nbytes, tags = run_due_purges(path, now, before=version)
    oldest = min(int(v["version"]) for v in lance.dataset(path).versions())
    return PurgeResult(version, rewritten, due, removed, nbytes, oldest, tags)


@dataclass(frozen=True)
class RemovalResult:
    # Removed records by source, table left (curated / rejects) and reason: the
    # accounting rows' `source, stage, reason, count`.
    counts: tuple[dict, ...]
    curated_deleted: int  # rows deleted from the curated table
    fragments: tuple[int, ...]  # the curated fragments that held them
    version: int | None  # the curated table's version after the delete (and purge)
    purge: PurgeResult | None  # None: nothing to purge, or no purge by policy

    @property
    def total(self) -> int:
        return sum(c["count"] for c in self.counts)


def remove_records(spark: SparkSession, cfg: Config, removed: DataFrame, *, run_id: str,
                   now: datetime, retention_hours: float | None) -> RemovalResult:
    """Take the records of `removed` (``sample_id, source, status, reason``; status = the
    manifest status they had) out of every table: the curated table (one Lance delete),
    the rejects, and the manifest (status ``removed``, last: it is what a rerun would
    find them by again). Then, unless `retention_hours` is None, purge their bytes
    (:func:`purge_removed`). Dedup re-elects canonical members on its next run (or the
    caller runs it). The caller writes the accounting rows (``counts``)."""
    cat = Catalog.of(spark, cfg)
    removed = removed.select("sample_id", "source", "status", "reason").localCheckpoint(
        eager=True)
    if removed.isEmpty():
        return RemovalResult((), 0, (), None, None)
    # Rows already removed (from their source) left every table then: a takedown only
    # clears their manifest row, and they are not counted again.
    counts = tuple(r.asDict() for r in removal_counts(
        removed.where(F.col("status") != REMOVED)).collect())
    deleted, fragments, version = 0, (), None
    curated = cat.curated.path
    if cat.curated.exists():
        in_table = cat.curated.present(spark, removed)
        if in_table:
            before = deleted_per_fragment(curated)
            deleted = delete_rows(curated, in_table)
            after = deleted_per_fragment(curated)
            fragments = tuple(sorted(f for f, n in before.items() if after.get(f) != n))
        version = current_version(curated)
    cat.rejects.delete(removed)  # every copy a key had
    cat.manifest.mark_removed(removed, run_id=run_id, now=now)
    purge = None
    if fragments and retention_hours is not None:
        purge = purge_removed(curated, fragments,
                              target_rows=cfg.lakehouse.target_rows_per_fragment,
                              retention_hours=retention_hours, now=now)
        version = current_version(curated)
    log.info("removed %d record(s) (%d curated rows, fragments %s)",
             sum(c["count"] for c in counts), deleted, list(fragments))
    return RemovalResult(counts, deleted, fragments, version, purge)


def remove_taken_down(spark: SparkSession, cfg: Config, manifest: DataFrame,
                      pending: DataFrame, *, run_id: str, now: datetime) -> RemovalResult:
    """The records pending takedown rows name out of every table (curate finishing what
    a dead `forget` left, and `forget` itself): :func:`remove_records` with the
    takedowns' retention."""
    return remove_records(spark, cfg, taken_down_records(manifest, pending), run_id=run_id,
                          now=now, retention_hours=cfg.lakehouse.takedown_retention_hours)


def mark_applied(spark: SparkSession, path: str, removal: RemovalResult | None, *,
                 now: datetime, oldest_version: int | None = None) -> None:
    """Every pending takedown request applied, with when its bytes are (or will be)
    gone: `removal`'s purge, or now when no curated row held them."""
    purge = removal.purge if removal is not None else None
    mark_takedowns_applied(spark, path, now=now,
                           purge_version=purge.version if purge else None,
                           purge_after=purge.due if purge else None,
                           purged=purge is None or purge.done, oldest_version=oldest_version)
