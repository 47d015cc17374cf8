"""What a run prints and leaves: the per-source table, one line per stage, the ledger
listing (`lakeshard runs`), and ``summary.json``."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from etl.jobs.caption import format_caption
from etl.jobs.curate import CurateResult
from etl.jobs.dedup import format_dedup
from etl.pipeline.outcome import RunOutcome
from etl.pipeline.stages import STAGES
from etl.runtime.metrics import Metrics
from etl.transforms.accounting import ALL_SOURCES, SourceCounts

__all__ = ["format_summary", "format_outcome", "format_runs", "write_summary"]


def _count_line(c: SourceCounts, *, reasons: bool = True) -> str:
    """One row of the accounting table (the total row without reasons)."""
    r = c.row()
    line = (f"{r['source']:<20} {r['seen']:>7} {r['accepted']:>9} {r['rejected']:>9} "
            f"{r['errors']:>7} {r['flagged']:>8} {r['unchanged']:>10} {r['removed']:>8}")
    return line + (f"  {r['reasons'] or '-'}" if reasons else "")


def format_summary(run_id: str, cur: CurateResult | None, exports: list) -> str:
    """The run's header, the per-source accounting table and where outputs landed."""
    lines = [f"lakeshard run {run_id}"]
    if cur is not None:
        header = (
            f"{'source':<20} {'seen':>7} {'accepted':>9} {'rejected':>9} {'errors':>7} "
            f"{'flagged':>8} {'unchanged':>10} {'removed':>8}  "
            "reasons (rejected; flagged; removed)"
        )
        lines += ["", header, "-" * len(header)]
        total = sum(cur.counts, SourceCounts(ALL_SOURCES, 0, 0, 0))
        lines += [_count_line(c) for c in cur.counts]
        lines.append(_count_line(total, reasons=False))
        for c in cur.counts:
            if c.removal_scan and c.removal_scan.startswith("deferred"):
                lines.append(f"removals of {c.source} {c.removal_scan}")
        if cur.purge is not None:
            p = cur.purge
            lines.append(
                "removed rows' bytes: gone from storage" if p.done else
                f"removed rows' bytes: held by curated versions before {p.version} until "
                f"{p.due:%Y-%m-%d %H:%M} UTC (lakehouse.removal_retention_hours)"
            )
        if total.internal_errors:
            lines += ["", f"errors          : {total.internal_errors} record(s) failed on "
                      "an exception in lakeshard's own code, not on bad data (rejects "
                      "table, reason internal_error, detail = the exception); the next run "
                      "retries them"]
            lines += [f"  {e}" for e in cur.examples if " internal_error" in e]
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
        resumed = ""
        if e.unchanged:
            resumed = ", up to date"
        elif e.kept_partitions:
            resumed = f", {e.kept_partitions} partition(s) kept as they were"
        elif e.resumed_partitions:
            resumed = f", {e.resumed_partitions} partition(s) reused"
        lines.append(
            f"export (MDS)    : {e.path}  {e.samples} samples in {e.shards} shard(s), "
            f"{e.bytes / 1e6:.2f} MB{resumed}"
        )
    return "\n".join(lines)


def format_outcome(out: RunOutcome) -> str:
    """The summary table, dedup and caption summaries, one line per stage (time,
    note), and the report's path."""
    lines = [format_summary(out.run_id, out.detail("curate"), out.detail("export") or []), ""]
    if out.detail("dedup") is not None:
        lines += [format_dedup(out.detail("dedup")), ""]
    cap = out.detail("caption")
    if cap is not None and cap.todo:
        lines += [format_caption(cap), ""]
    for name in STAGES.names():
        if name == out.failed_stage:
            secs = f"{out.seconds[name]:8.1f} s" if name in out.seconds else f"{'':>10}"
            why = (out.failure or "").splitlines()[0] if out.failure else ""
            lines.append(f"stage {name:<10} {secs}  FAILED: {why}")
        elif name in out.results:
            note = out.results[name].note
            lines.append(f"stage {name:<10} {out.seconds[name]:8.1f} s"
                         + (f"  ({note})" if note else ""))
        elif out.failed_stage and name in out.stages:
            lines.append(f"stage {name:<10} {'not run':>10}")
        else:
            lines.append(f"stage {name:<10} {'skipped':>10}")
    if out.migrated:
        lines.append("migrated        : " + "; ".join(out.migrated))
    if out.recovered_run:
        lines.append(f"recovered the stale lock of crashed run {out.recovered_run}")
    if out.report:
        lines.append(f"report          : {out.report}")
    if out.events:
        lines.append(f"events          : {out.events}")
    return "\n".join(lines)


def write_summary(out: RunOutcome, out_dir: str) -> str:
    """``<out_dir>/summary.json``: the run's accounting, outputs and timings."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "summary.json")
    cur = out.detail("curate")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(
            {
                "run_id": out.run_id,
                "status": out.status,
                "failed_stage": out.failed_stage,
                "failure": out.failure,
                "events": out.events,
                "curate": asdict(cur) if cur else None,
                "exports": [asdict(e) for e in out.detail("export") or []],
                "stages": out.stages,
                "seconds": out.seconds,
                "report": out.report,
                "report_error": out.report_error,
                "recovered_run": out.recovered_run,
                "migrated": out.migrated,
            },
            f,
            indent=2,
            default=str,  # datetimes (when removed rows' bytes are purged)
        )
    return path


def _counts(m: dict | None) -> str:
    """A ledger row's counts: its totals (the breakdowns are in the ledger)."""
    totals = Metrics.from_map(m)
    return ", ".join(f"{k}={v}" for k, v in sorted(totals.items())) or "-"


def format_runs(rows: list, path: str, *, stages: bool = False) -> str:
    """`lakeshard runs`: `rows` as :func:`etl.ledger.recent_runs` returns them (run row
    first per run), one line per run (and per stage)."""
    if not rows:
        return f"no runs recorded yet in {path}"
    header = (f"{'run id':<24} {'status':<8} {'started (UTC)':<19} {'secs':>7}  "
              f"{'config':<16} {'code':<24} stages")
    lines = [header, "-" * len(header)]
    by_run: dict[str, list] = {}
    for r in rows:
        by_run.setdefault(r["run_id"], []).append(r)
    for run_id, rs in by_run.items():
        run = next((r for r in rs if r["stage"] == "run"), rs[0])
        parts = [f"{r['stage']}:{r['status']}" for r in rs if r["stage"] != "run"]
        secs = "-" if run["seconds"] is None else f"{run['seconds']:.1f}"
        lines.append(
            f"{run_id:<24} {run['status']:<8} {run['started_at']:%Y-%m-%d %H:%M:%S} "
            f"{secs:>7}  {run['config_hash']:<16} {run['code_version']:<24} "
            + " ".join(parts)
        )
        if stages:
            for r in rs:
                if r["stage"] == "run":
                    continue
                secs = "-" if r["seconds"] is None else f"{r['seconds']:.1f}s"
                versions = ", ".join(f"{k}={v}" for k, v in
                                     sorted((r["table_versions"] or {}).items()))
                lines.append(
                    f"    {r['stage']:<10} {r['status']:<8} {secs:>8}  in: "
                    f"{_counts(r['inputs'])}  out: {_counts(r['outputs'])}"
                    + (f"  versions: {versions}" if versions else "")
                    + (f"  ({r['note']})" if r["note"] else "")
                )
    return "\n".join(lines)
