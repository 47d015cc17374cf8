"""The files a run's report is made of, under ``<root>/reports/<run_id>/``, and the one
place that changes written reports: :func:`scrub_reports` takes given samples out of
them (their thumbnails, and the contact sheets drawn from them), as `forget` does for a
takedown.

``index.html`` (the page), ``report.json`` (its figures' data: which samples each contact
sheet shows, counts, dedup, captions, timings), the figures as PNG, ``thumbs/<id>.jpg``
(the contact sheets' thumbnails) and, written by the runner beside them,
``summary.json`` and ``events.jsonl``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from etl import tables
from etl.config import Config

log = logging.getLogger(__name__)

__all__ = ["INDEX", "META", "THUMBS", "SHEETS", "thumb_file", "write_meta", "scrub_reports"]

INDEX = "index.html"
META = "report.json"
THUMBS = "thumbs"
# report.json's keys of the contact sheets of sample ids (a list each), and their PNGs.
SHEETS = {"contact_kept": "contact_kept.png", "contact_flagged": "contact_flagged.png"}
# The duplicates' sheet: report.json's dedup.contact_clusters (lists of ids).
CLUSTERS_PNG = "contact_duplicates.png"


def thumb_file(sample_id: str) -> str:
    """A thumbnail's path, relative to the report's folder."""
    return f"{THUMBS}/{sample_id}.jpg"


def write_meta(out_dir: str, meta: dict) -> str:
    """``report.json`` into `out_dir`, atomically (a reader never sees half of it)."""
    path = os.path.join(out_dir, META)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, default=str)
    os.replace(tmp, path)
    return path


def _unlink(path: Path) -> bool:
    if path.exists():
        path.unlink()
        return True
    return False


def _scrub(run_dir: Path, meta: dict, gone: set[str]) -> int | None:
    """Take `gone` out of one report (its `meta`, changed in place); the thumbnails
    removed, or None when the report showed none of them."""
    removed, changed = 0, False
    for sheet, png in SHEETS.items():
        ids = meta.get(sheet) or []
        hit = [s for s in ids if s in gone]
        if hit:
            removed += sum(_unlink(run_dir / thumb_file(sid)) for sid in hit)
            _unlink(run_dir / png)
            meta[sheet] = [s for s in ids if s not in gone]
            changed = True
    dedup = meta.get("dedup") or {}
    clusters = dedup.get("contact_clusters") or []
    hit = [s for c in clusters for s in c if s in gone]
    if hit:  # the duplicates' sheet: clusters, canonical member first
        removed += sum(_unlink(run_dir / thumb_file(sid)) for sid in hit)
        _unlink(run_dir / CLUSTERS_PNG)
        dedup["contact_clusters"] = [kept for c in clusters
                                     if (kept := [s for s in c if s not in gone])]
        changed = True
    return removed if changed else None


def scrub_reports(cfg: Config, sample_ids: Iterable[str]) -> int:
    """Remove `sample_ids`' thumbnails (and the contact sheets drawn from them: kept,
    flagged, duplicates) from every run report under a local root, and their ids from
    each ``report.json``; returns the thumbnails removed. Reports on an object store are
    left as they are (a warning says so)."""
    gone = set(sample_ids)
    reports = tables.layout(cfg).reports_dir
    if "://" in reports:
        log.warning("forget: reports under %s (an object store) are not scrubbed of "
                    "thumbnails", reports)
        return 0
    removed = 0
    for meta_path in sorted(Path(reports).glob(f"*/{META}")):
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        n = _scrub(meta_path.parent, meta, gone) if gone else None
        if n is not None:
            removed += n
            write_meta(str(meta_path.parent), meta)
    return removed
