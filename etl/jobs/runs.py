"""`lakeshard runs`: recent runs from the ledger, one line per run (and per stage)."""

from __future__ import annotations

__all__ = ["format_runs"]


def _counts(m: dict | None) -> str:
    if not m:
        return "-"
    return ", ".join(f"{k}={v}" for k, v in sorted(m.items()) if ":" not in k) or "-"


def format_runs(rows: list, path: str, *, stages: bool = False) -> str:
    """`rows` as :func:`etl.ledger.recent_runs` returns them (run row first per run)."""
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
