"""`lakeshard run`: curate then export every configured export, then a summary."""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import asdict
from datetime import UTC, datetime

from etl.config import Config
from etl.jobs.curate import CurateResult, curate, preflight
from etl.jobs.export import export
from etl.session import get_spark
from etl.writers.mds import ExportResult

__all__ = ["new_run_id", "run", "format_summary", "write_summary"]

log = logging.getLogger(__name__)


def new_run_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def format_summary(run_id: str, cur: CurateResult | None, exports: list[ExportResult]) -> str:
    lines = [f"lakeshard run {run_id}"]
    if cur is not None:
        header = (
            f"{'source':<20} {'seen':>7} {'accepted':>9} {'rejected':>9} {'flagged':>8} "
            f"{'unchanged':>10}  reasons (rejected; flagged)"
        )
        lines += ["", header, "-" * len(header)]
        for c in cur.counts:
            why = ", ".join(f"{k}={v}" for k, v in {**c.reasons, **c.filtered}.items()) or "-"
            lines.append(
                f"{c.source:<20} {c.seen:>7} {c.accepted:>9} {c.rejected:>9} "
                f"{sum(c.filtered.values()):>8} {c.unchanged:>10}  {why}"
            )
        tot = [sum(getattr(c, f) for c in cur.counts) for f in ("seen", "accepted", "rejected")]
        flagged = sum(sum(c.filtered.values()) for c in cur.counts)
        same = sum(c.unchanged for c in cur.counts)
        lines.append(
            f"{'total':<20} {tot[0]:>7} {tot[1]:>9} {tot[2]:>9} {flagged:>8} {same:>10}"
        )
        lines += [
            "",
            f"curated (Lance) : {cur.curated_path}  version {cur.curated_version}, "
            f"{cur.curated_rows} rows",
            f"rejects (Delta) : {cur.rejects_path}",
            f"manifest (Delta): {cur.manifest_path}",
            f"accounting      : {cur.accounting_path}  (Delta; one row per run, source, "
            "outcome, reason)",
        ]
    for e in exports:
        resumed = f", {e.resumed_partitions} partition(s) reused" if e.resumed_partitions else ""
        lines.append(
            f"export (MDS)    : {e.path}  {e.samples} samples in {e.shards} shard(s), "
            f"{e.bytes / 1e6:.2f} MB{resumed}"
        )
    return "\n".join(lines)


def write_summary(
    cfg: Config, run_id: str, cur: CurateResult | None, exports: list[ExportResult]
) -> str:
    """<root>/reports/<run_id>/summary.json: the run's accounting and outputs."""
    out_dir = os.path.join(cfg.storage.reports_dir, run_id)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "summary.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(
            {
                "run_id": run_id,
                "curate": asdict(cur) if cur else None,
                "exports": [asdict(e) for e in exports],
            },
            f,
            indent=2,
        )
    return path


def run(cfg: Config, *, stages: tuple[str, ...] = ("curate", "export"),
        export_names: tuple[str, ...] | None = None) -> tuple[str, CurateResult | None,
                                                               list[ExportResult]]:
    """Run the given stages; validate everything that can be validated first."""
    names = export_names if export_names is not None else tuple(e.name for e in cfg.exports)
    for name in names:
        cfg.export(name)  # unknown names fail here, before Spark
    if "curate" in stages:
        preflight(cfg)
    run_id = new_run_id()
    spark = get_spark(cfg)
    cur = curate(spark, cfg, run_id) if "curate" in stages else None
    exports = [export(spark, cfg, n) for n in names] if "export" in stages else []
    write_summary(cfg, run_id, cur, exports)
    return run_id, cur, exports
