"""`lakeshard run`: the configured stages in order, under a lock, into the ledger.

For every run: validate everything that can be validated (config, stage names, export
names, source inputs) before Spark starts; take the root's run lock (a crashed run's
stale lock is taken over and its ledger rows marked ``crashed``); then for each stage
of the registry (:mod:`etl.jobs.stages`) that config and flags select -- a Spark job
group naming the stage, a ``running`` ledger row, console progress, the stage, its
``ok``/``failed`` ledger row with counts, versions, manifests and timing. Finally the
report (``<root>/reports/<run_id>/index.html``), ``summary.json`` and the run's row.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

from etl.config import Config, ConfigError
from etl.faults import arm, fault_point
from etl.jobs.curate import CurateResult, preflight
from etl.jobs.stages import STAGES, RunContext, StageResult
from etl.lock import RunLock
from etl.progress import StageProgress, event
from etl.writers.mds import ExportResult

__all__ = [
    "RunOutcome", "new_run_id", "lock_path", "run_stages", "run", "format_summary",
    "format_outcome", "write_summary",
]

log = logging.getLogger(__name__)
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def new_run_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def lock_path(cfg: Config) -> str:
    return cfg.run.lock_path or os.path.join(cfg.storage.root, "_lock", "run.lock")


@dataclass
class RunOutcome:
    run_id: str
    stages: list[str]
    results: dict[str, StageResult] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    report: str | None = None
    recovered_run: str | None = None  # the crashed run whose stale lock this one took

    @property
    def curate(self) -> CurateResult | None:
        res = self.results.get("curate")
        return res.detail if res else None

    @property
    def dedup(self):
        res = self.results.get("dedup")
        return res.detail if res else None

    @property
    def exports(self) -> list[ExportResult]:
        res = self.results.get("export")
        return list(res.detail) if res else []


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
        if cur.dedup is not None:  # attached by run(); `lakeshard run` prints it per stage
            from etl.jobs.dedup import format_dedup

            lines += ["", format_dedup(cur.dedup), ""]
    for e in exports:
        resumed = f", {e.resumed_partitions} partition(s) reused" if e.resumed_partitions else ""
        lines.append(
            f"export (MDS)    : {e.path}  {e.samples} samples in {e.shards} shard(s), "
            f"{e.bytes / 1e6:.2f} MB{resumed}"
        )
    return "\n".join(lines)


def format_outcome(out: RunOutcome) -> str:
    """The summary table, then one line per stage (time, note), the report's path."""
    lines = [format_summary(out.run_id, out.curate, out.exports), ""]
    if out.dedup is not None:
        from etl.jobs.dedup import format_dedup

        lines += [format_dedup(out.dedup), ""]
    cap = out.results.get("caption")
    if cap is not None and cap.detail is not None:
        from etl.jobs.caption import format_caption

        lines += [format_caption(cap.detail), ""]
    for name in STAGES.names():
        if name in out.results:
            note = out.results[name].note
            lines.append(f"stage {name:<10} {out.seconds[name]:8.1f} s"
                         + (f"  ({note})" if note else ""))
        else:
            lines.append(f"stage {name:<10} {'skipped':>10}")
    if out.recovered_run:
        lines.append(f"recovered the stale lock of crashed run {out.recovered_run}")
    if out.report:
        lines.append(f"report          : {out.report}")
    return "\n".join(lines)


def write_summary(
    cfg: Config, run_id: str, cur: CurateResult | None, exports: list[ExportResult],
    extra: dict | None = None, out_dir: str | None = None,
) -> str:
    """<root>/reports/<run_id>/summary.json: the run's accounting and outputs."""
    out_dir = out_dir or os.path.join(cfg.storage.reports_dir, run_id)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "summary.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(
            {
                "run_id": run_id,
                "curate": asdict(cur) if cur else None,
                "exports": [asdict(e) for e in exports],
                **(extra or {}),
            },
            f,
            indent=2,
        )
    return path


def _ledger_row(base: dict, stage: str, status: str, started, **more) -> dict:
    return {**base, "stage": stage, "status": status, "started_at": started, **more}


def run_stages(
    cfg: Config,
    *,
    only: tuple[str, ...] = (),
    skip: tuple[str, ...] = (),
    export_names: tuple[str, ...] | None = None,
    run_id: str | None = None,
) -> RunOutcome:
    """Run the selected stages; everything that can be validated is, before Spark."""
    from etl import ledger
    from etl.session import get_spark

    try:
        selected = STAGES.select(cfg.run.stages, only, skip)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    names = [s.name for s in selected]
    if not names:
        raise ConfigError("run.stages: no stage left to run after --only/--skip")
    if "export" in names:
        for name in export_names if export_names is not None else ():
            cfg.export(name)  # unknown names fail here, before Spark
    if "curate" in names:
        preflight(cfg)
    if run_id is not None and not _RUN_ID_RE.match(run_id):
        raise ConfigError(f"--run-id: {run_id!r} is not a valid run id (letters, digits, "
                          "'.', '_', '-'; it names the report folder)")
    run_id = run_id or new_run_id()
    arm()
    out = RunOutcome(run_id=run_id, stages=names)
    lock = None
    if cfg.run.lock:
        lock = RunLock(lock_path(cfg), run_id, stale_after_s=cfg.run.stale_lock_s,
                       heartbeat_s=cfg.run.heartbeat_s).acquire()
        if lock.recovered is not None:
            out.recovered_run = lock.recovered.run_id
    try:
        fault_point("run:locked")
        spark = get_spark(cfg)
        sc = spark.sparkContext
        runs_path = cfg.storage.delta_table(ledger.RUNS_TABLE)
        base = {"run_id": run_id, "config_hash": ledger.config_hash(cfg),
                "code_version": ledger.code_version(), "host": socket.gethostname()}
        event("run_start", stages=names, **base)
        if out.recovered_run:
            n = ledger.mark_crashed(spark, runs_path, out.recovered_run,
                                    f"stale lock taken over by run {run_id}")
            log.warning("run %s had crashed (%d ledger row(s) marked crashed); its lock "
                        "was stale and is now this run's", out.recovered_run, n)
            event("recovered_crashed_run", run_id=run_id, crashed_run=out.recovered_run)
        run_started = ledger.utcnow()
        t_run = time.monotonic()
        # One MERGE per step: a stage's `running` row goes in with the previous row.
        started = ledger.utcnow()
        ledger.record(spark, runs_path, [
            _ledger_row(base, "run", "running", run_started),
            *[_ledger_row(base, s, "skipped", run_started, note="not selected")
              for s in STAGES.names() if s not in names],
            _ledger_row(base, selected[0].name, "running", started),
        ])
        ctx = RunContext(run_id=run_id, export_names=export_names)
        for i, stage in enumerate(selected):
            t0 = time.monotonic()
            sc.setJobGroup(f"lakeshard-{run_id}-{stage.name}",
                           f"lakeshard {stage.name} (run {run_id})")
            event("stage_start", run_id=run_id, stage=stage.name)
            try:
                fault_point(f"{stage.name}:start")
                with StageProgress(spark, run_id, stage.name,
                                   interval_s=cfg.run.progress_interval_s):
                    result = stage.load()(spark, cfg, ctx)
            except BaseException as exc:
                secs = time.monotonic() - t0
                msg = f"{type(exc).__name__}: {exc}"[:2000]
                event("stage_failed", run_id=run_id, stage=stage.name, seconds=secs, error=msg)
                ledger.record(spark, runs_path, [
                    _ledger_row(base, stage.name, "failed", started, ended_at=ledger.utcnow(),
                                seconds=secs, note=msg),
                    _ledger_row(base, "run", "failed", run_started, ended_at=ledger.utcnow(),
                                seconds=time.monotonic() - t_run,
                                note=f"stage {stage.name} failed"),
                ])
                raise
            finally:
                sc.setLocalProperty("spark.jobGroup.id", None)
                sc.setJobDescription(None)
            secs = time.monotonic() - t0
            ctx.results[stage.name] = result
            out.results[stage.name] = result
            out.seconds[stage.name] = secs
            rows = [_ledger_row(
                base, stage.name, "ok", started, ended_at=ledger.utcnow(), seconds=secs,
                inputs=result.inputs, outputs=result.outputs,
                table_versions=result.table_versions,
                export_manifests=json.dumps(result.manifests, sort_keys=True)
                if result.manifests else None,
                note=result.note,
            )]
            if i + 1 < len(selected):
                started = ledger.utcnow()
                rows.append(_ledger_row(base, selected[i + 1].name, "running", started))
            ledger.record(spark, runs_path, rows)
            event("stage_end", run_id=run_id, stage=stage.name, seconds=round(secs, 2),
                  inputs=result.inputs, outputs=result.outputs,
                  table_versions=result.table_versions, note=result.note)
            fault_point(f"{stage.name}:done")

        # Reports are written locally, then copied when the root is an object store.
        final_dir = f"{cfg.storage.reports_dir}/{run_id}"
        remote = "://" in final_dir
        report_dir = tempfile.mkdtemp(prefix="lakeshard-report-") if remote else final_dir
        if cfg.run.report:
            from etl.report import write_report

            t0 = time.monotonic()
            sc.setJobGroup(f"lakeshard-{run_id}-report", f"lakeshard report (run {run_id})")
            index = write_report(spark, cfg, out, report_dir)
            sc.setLocalProperty("spark.jobGroup.id", None)
            sc.setJobDescription(None)
            out.seconds["report"] = time.monotonic() - t0
            out.report = f"{final_dir}/{os.path.basename(index)}"
        write_summary(cfg, run_id, out.curate, out.exports, out_dir=report_dir, extra={
            "stages": names, "seconds": out.seconds, "report": out.report,
            "recovered_run": out.recovered_run,
        })
        if remote:
            import pyarrow.fs as pafs

            pafs.copy_files(report_dir, final_dir)
            shutil.rmtree(report_dir, ignore_errors=True)
        versions, manifests = {}, {}
        for res in out.results.values():
            versions.update(res.table_versions)
            manifests.update(res.manifests)
        ledger.record(spark, runs_path, [_ledger_row(
            base, "run", "ok", run_started, ended_at=ledger.utcnow(),
            seconds=time.monotonic() - t_run, table_versions=versions,
            export_manifests=json.dumps(manifests, sort_keys=True) if manifests else None,
            note=out.report,
        )])
        event("run_end", run_id=run_id, seconds=round(time.monotonic() - t_run, 2),
              report=out.report)
        return out
    finally:
        if lock is not None:
            lock.release()


def run(cfg: Config, *, stages: tuple[str, ...] | None = None,
        export_names: tuple[str, ...] | None = None) -> tuple[str, CurateResult | None,
                                                               list[ExportResult]]:
    """Compatibility wrapper: run `stages` (default: the configured ones)."""
    out = run_stages(cfg, only=tuple(stages or ()), export_names=export_names)
    cur = out.curate
    if cur is not None and out.dedup is not None:
        cur = dataclasses.replace(cur, dedup=out.dedup)
    return out.run_id, cur, out.exports
