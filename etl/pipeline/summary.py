"""What a run prints and leaves: what each stage's result shows of itself
(:class:`~etl.runtime.stage.StageDetail`), one line per stage, the ledger listing
(`lakeshard runs`), and ``summary.json``."""

from __future__ import annotations

import json
import os

from etl.pipeline.stages import STAGES
from etl.runtime.metrics import Metrics
from etl.runtime.outcome import RunOutcome

__all__ = ["format_outcome", "format_runs", "write_summary"]

# summary.json's entries for stage results, there (null, empty) also when the stage did
# not run: the document's shape. Each result fills its own (StageDetail.summary_json).
_STAGE_ENTRIES: dict[str, object] = {"curate": None, "exports": []}


def format_outcome(out: RunOutcome) -> str:
    """The run's first line, what each stage's result shows under it (the accounting
    table, where outputs landed), each result's own section (dedup, caption), one line
    per stage (time, note), and the report's path."""
    details = out.details()
    lines = [f"lakeshard run {out.run_id}"]
    lines += [line for d in details for line in d.summary_head()]
    lines.append("")
    for d in details:
        section = d.summary_section()
        if section is not None:
            lines += [section, ""]
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
    doc = {"run_id": out.run_id, "status": out.status, "failed_stage": out.failed_stage,
           "failure": out.failure, "events": out.events, **_STAGE_ENTRIES}
    for d in out.details():
        doc.update(d.summary_json())
    doc.update({"stages": out.stages, "seconds": out.seconds, "report": out.report,
                "report_error": out.report_error, "recovered_run": out.recovered_run,
                "migrated": out.migrated})
    with open(path, "w", encoding="utf-8") as f:
        # default=str: datetimes (when removed rows' bytes are purged)
        json.dump(doc, f, indent=2, default=str)
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
