"""Running stages: `lakeshard run`, and every other command that changes a table.

For every run: the checks that can fail before Spark (the stages' own, the run id);
the root's run lock (a crashed run's stale lock is taken over and its ledger rows marked
``crashed``); Spark, and the migration of tables an older version wrote; then for each
stage -- a Spark job group naming it, a ``running`` ledger row, console progress, the
stage, its ``ok``/``failed`` ledger row with counts, versions, manifests and timing.
A `lakeshard run` (or `curate`/`export`) then writes the report
(``<root>/reports/<run_id>/index.html``) and ``summary.json``; last, the run's own
ledger row.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from etl import ledger, tables
from etl.config import Config
from etl.errors import ConfigError
from etl.migrations import migrate
from etl.pipeline.outcome import RunOutcome
from etl.pipeline.preflight import check_run_id
from etl.pipeline.stages import COMMANDS, STAGES, Stage
from etl.pipeline.summary import write_summary
from etl.runtime.faults import arm, fault_point
from etl.runtime.lock import RunLock
from etl.runtime.progress import StageProgress, event
from etl.runtime.stage import RunContext

__all__ = ["RunOutcome", "new_run_id", "run_pipeline", "run_command", "run_stages"]

log = logging.getLogger(__name__)


def new_run_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def _ledger_row(base: dict, stage: str, status: str, started, **more) -> dict:
    return {**base, "stage": stage, "status": status, "started_at": started, **more}


def run_pipeline(cfg: Config, *, only: Sequence[str] = (), skip: Sequence[str] = (),
                 export_names: tuple[str, ...] | None = None,
                 run_id: str | None = None) -> RunOutcome:
    """`lakeshard run` (and `curate`, `export`): the configured stages in order."""
    try:
        selected = STAGES.select(cfg.run.stages, tuple(only), tuple(skip))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not selected:
        raise ConfigError("run.stages: no stage left to run after --only/--skip")
    return run_stages(cfg, selected, run_id=run_id, export_names=export_names,
                      summary=True)


def run_command(cfg: Config, name: str, options: dict[str, Any] | None = None, *,
                run_id: str | None = None) -> RunOutcome:
    """One table-changing command (`caption`, `dedup`, `latents`, `features`, `embed`,
    `compact`) as a run of one stage: the same lock, ledger and progress."""
    stage = STAGES.get(name) if name in STAGES.names() else COMMANDS.get(name)
    return run_stages(cfg, [stage], run_id=run_id,
                      options={name: {"command": True, **(options or {})}})


def run_stages(
    cfg: Config,
    stages: list[Stage],
    *,
    run_id: str | None = None,
    export_names: tuple[str, ...] | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    summary: bool = False,
) -> RunOutcome:
    """Run `stages` in order; everything that can be checked is, before Spark.

    `summary`: a pipeline run -- the ledger gets `skipped` rows for the registered
    stages not run, and the run leaves summary.json (and, with `run.report`, the
    report) under ``<root>/reports/<run_id>/``."""
    from etl.session import get_spark

    check_run_id(run_id)
    names = [s.name for s in stages]
    ctx = RunContext(run_id=run_id or new_run_id(), export_names=export_names,
                     options=dict(options or {}))
    for stage in stages:
        check = stage.load_check()
        if check is not None:
            check(cfg, ctx)
    run_id = ctx.run_id
    arm()
    out = RunOutcome(run_id=run_id, stages=names)
    lock = None
    if cfg.run.lock:
        lock = RunLock(tables.lock_path(cfg), run_id, stale_after_s=cfg.run.stale_lock_s,
                       heartbeat_s=cfg.run.heartbeat_s).acquire()
        if lock.recovered is not None:
            out.recovered_run = lock.recovered.run_id
    try:
        fault_point("run:locked")
        spark = get_spark(cfg)
        sc = spark.sparkContext
        out.migrated = migrate(spark, cfg)
        runs_path = tables.layout(cfg).runs
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
        # One write per step: a stage's `running` row goes in with the previous row.
        started = ledger.utcnow()
        skipped = [s for s in STAGES.names() if s not in names] if summary else []
        ledger.record(spark, runs_path, [
            _ledger_row(base, "run", "running", run_started),
            *[_ledger_row(base, s, "skipped", run_started, note="not selected")
              for s in skipped],
            _ledger_row(base, stages[0].name, "running", started),
        ])
        for i, stage in enumerate(stages):
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
            if i + 1 < len(stages):
                started = ledger.utcnow()
                rows.append(_ledger_row(base, stages[i + 1].name, "running", started))
            ledger.record(spark, runs_path, rows)
            event("stage_end", run_id=run_id, stage=stage.name, seconds=round(secs, 2),
                  inputs=result.inputs, outputs=result.outputs,
                  table_versions=result.table_versions, note=result.note)
            fault_point(f"{stage.name}:done")

        if summary:
            _write_report(spark, cfg, out)
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


def _write_report(spark, cfg: Config, out: RunOutcome) -> None:
    """The report and summary.json, written locally, then uploaded when the root is an
    object store (etl.writers.remote, the same S3 settings as every other client)."""
    from etl.report import write_report
    from etl.writers.remote import is_remote, upload_dir

    final_dir = tables.layout(cfg).report_dir(out.run_id)
    remote = is_remote(final_dir)
    report_dir = tempfile.mkdtemp(prefix="lakeshard-report-") if remote else final_dir
    sc = spark.sparkContext
    try:
        if cfg.run.report:
            t0 = time.monotonic()
            sc.setJobGroup(f"lakeshard-{out.run_id}-report",
                           f"lakeshard report (run {out.run_id})")
            index = write_report(spark, cfg, out, report_dir)
            sc.setLocalProperty("spark.jobGroup.id", None)
            sc.setJobDescription(None)
            out.seconds["report"] = time.monotonic() - t0
            out.report = f"{final_dir}/{os.path.basename(index)}"
        write_summary(out, report_dir)
        if remote:
            upload_dir(report_dir, final_dir)
    finally:
        if remote:
            shutil.rmtree(report_dir, ignore_errors=True)
