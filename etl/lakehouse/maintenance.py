"""Versions, compaction and retention of a Lance table.

Every write to a Lance table (a curate overwrite or append, a feature column, an
index) is a new version; older versions stay readable (time travel) until
:func:`compact` cleans them up by the retention setting. Compaction rewrites small
fragments -- many appends, per-column data files left by feature writes -- into
fragments of ``target_rows_per_fragment`` rows, and remaps the indexes to them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from etl.config import LakehouseConfig

__all__ = [
    "VersionInfo",
    "CompactResult",
    "current_version",
    "table_versions",
    "compact",
    "data_bytes",
]

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
    ds = lance.dataset(path)
    result = CompactResult(
        version_before=before_version,
        version_after=ds.version,
        fragments_before=before_frags,
        fragments_after=len(ds.get_fragments()),
        fragments_rewritten=metrics.fragments_removed,
        versions_removed=stats.old_versions,
        bytes_removed=stats.bytes_removed,
        oldest_version=min(int(v["version"]) for v in ds.versions()),
    )
    log.info("compacted %s: %s", path, result)
    return result
