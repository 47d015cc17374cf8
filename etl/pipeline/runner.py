"""Running stages: `lakeshard run`, and every other command that changes a table.

For every run: the checks that can fail before Spark (the stages' own, the run id);
the root's run lock (a crashed run's stale lock is taken over and its ledger rows marked
``crashed``); the run's events file (``<root>/reports/<run_id>/events.jsonl``); Spark,
and the migration of tables an older version wrote; then for each stage -- a Spark job
group naming it, a ``running`` ledger row, console progress, the stage, its failure
budgets (:mod:`etl.pipeline.budgets`), its ``ok``/``failed`` ledger row with counts,
versions, manifests and timing. A `lakeshard run` (or `curate`/`export`) then writes the
report (``<root>/reports/<run_id>/index.html``) and ``summary.json``; last, the run's
own ledger row.

A stage that raises, or whose rows exceed a budget, is recorded ``failed`` (the stages
after it ``skipped``, "not run"), the run too, and nothing after it runs. Budgets are
checked after the stage returned -- after its own commits, which are complete and
consistent (one Lance version, atomic Delta MERGEs) -- so the rows it wrote stay and
the next run retries the rows that failed in a retryable way (internal errors, caption
``failed``). A budget failure still writes the report and summary.json, marked failed,
and raises :class:`~etl.errors.BudgetExceededError` with the run's outcome.
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
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from etl import ledger, tables
from etl.config import Config
from etl.errors import BudgetExceededError, ConfigError
from etl.migrations import migrate
from etl.pipeline.budgets import check_budget
from etl.pipeline.outcome import RunOutcome
from etl.pipeline.preflight import check_run_id
from etl.pipeline.stages import COMMANDS, STAGES, Stage
from etl.pipeline.summary import write_summary
from etl.runtime.faults import arm, fault_point
from etl.runtime.lock import RunLock
from etl.runtime.progress import EventsFile, StageProgress, console_mode, event, say
from etl.runtime.stage import RunContext
from etl.writers.remote import is_remote
from udfs.faults import RAISE_ENV

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
    report) under ``<root>/reports/<run_id>/``. Every run leaves its events there
    (``events.jsonl``). A stage that raises, or whose rows exceed a failure budget
    (:class:`~etl.errors.BudgetExceededError`), ends the run ``failed``."""
    check_run_id(run_id)
    names = [s.name for s in stages]
    ctx = RunContext(run_id=run_id or new_run_id(), export_names=export_names,
                     options=dict(options or {}), continued=run_id is not None)
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
    out.events = f"{tables.layout(cfg).report_dir(run_id)}/events.jsonl"
    remote = is_remote(out.events)
    local_events = (os.path.join(tempfile.mkdtemp(prefix="lakeshard-events-"), "events.jsonl")
                    if remote else out.events)
    try:
        with EventsFile(local_events):
            _execute(cfg, stages, ctx, out, summary=summary)
        return out
    finally:
        if remote:
            _upload_events(local_events, out.events)
        if lock is not None:
            lock.release()


def _forward_to_workers(sc) -> None:
    """Test faults armed in the driver's environment reach Python workers of a session
    that is already running (a worker pool is keyed by this environment)."""
    if os.environ.get(RAISE_ENV):
        sc.environment[RAISE_ENV] = os.environ[RAISE_ENV]
    else:
        sc.environment.pop(RAISE_ENV, None)


def _execute(cfg: Config, stages: list[Stage], ctx: RunContext, out: RunOutcome, *,
             summary: bool) -> None:
    from etl.session import get_spark

    run_id, names = ctx.run_id, [s.name for s in stages]
    fault_point("run:locked")
    spark = get_spark(cfg)
    sc = spark.sparkContext
    _forward_to_workers(sc)
    if console_mode().spark_log_level:
        sc.setLogLevel(console_mode().spark_log_level)
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
    if skipped and ctx.continued:
        # One run across processes (a multi-task job passing its run id to each task):
        # "not selected" only for stages no earlier task of this run recorded, so the
        # ledger shows one run with every stage's own outcome.
        recorded = ledger.recorded_stages(spark, runs_path, run_id)
        skipped = [s for s in skipped if s not in recorded]
    ledger.record(spark, runs_path, [
        _ledger_row(base, "run", "running", run_started),
        *[_ledger_row(base, s, "skipped", run_started, note="not selected")
          for s in skipped],
        _ledger_row(base, stages[0].name, "running", started),
    ])

    def failed(stage: Stage, note: str, rows: list[dict]) -> None:
        """The failed stage's row, the stages after it (not run) and the run's row."""
        later = names[names.index(stage.name) + 1:]
        ledger.record(spark, runs_path, [
            *rows,
            *[_ledger_row(base, s, "skipped", run_started,
                          note=f"not run: stage {stage.name} failed") for s in later],
            _ledger_row(base, "run", "failed", run_started, ended_at=ledger.utcnow(),
                        seconds=time.monotonic() - t_run, note=note),
        ])

    for i, stage in enumerate(stages):
        t0 = time.monotonic()
        sc.setJobGroup(f"lakeshard-{run_id}-{stage.name}",
                       f"lakeshard {stage.name} (run {run_id})")
        event("stage_start", run_id=run_id, stage=stage.name)
        say(f"{stage.name}: started")
        try:
            fault_point(f"{stage.name}:start")
            with StageProgress(spark, run_id, stage.name,
                               interval_s=cfg.run.progress_interval_s):
                result = stage.load()(spark, cfg, ctx)
        except BaseException as exc:
            secs = time.monotonic() - t0
            msg = f"{type(exc).__name__}: {exc}"[:2000]
            out.failed_stage, out.failure = stage.name, msg
            event("stage_failed", run_id=run_id, stage=stage.name, seconds=secs, error=msg)
            say(f"{stage.name}: FAILED after {secs:.1f} s: {msg.splitlines()[0][:300]}")
            failed(stage, f"stage {stage.name} failed", [_ledger_row(
                base, stage.name, "failed", started, ended_at=ledger.utcnow(),
                seconds=secs, note=msg)])
            event("run_end", run_id=run_id, status="failed", failed_stage=stage.name,
                  seconds=round(time.monotonic() - t_run, 2))
            exc.add_note(
                f"lakeshard: run {run_id} failed in stage {stage.name}. It is recorded in "
                f"the run ledger (`lakeshard runs --stages`); its events: {out.events}")
            raise
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)
            sc.setJobDescription(None)
        secs = time.monotonic() - t0
        ctx.results[stage.name] = result
        out.results[stage.name] = result
        out.seconds[stage.name] = secs
        breach = check_budget(stage.name, result.tally, cfg.run.budgets)
        row = _ledger_row(
            base, stage.name, "failed" if breach else "ok", started,
            ended_at=ledger.utcnow(), seconds=secs,
            inputs=result.inputs, outputs=result.outputs,
            table_versions=result.table_versions,
            export_manifests=json.dumps(result.manifests, sort_keys=True)
            if result.manifests else None,
            note=breach.message[:2000] if breach else result.note,
        )
        if breach:
            out.failed_stage, out.failure = stage.name, breach.message
            event("stage_failed", run_id=run_id, stage=stage.name, seconds=round(secs, 2),
                  budget=breach.budget, tally=asdict(result.tally), error=breach.message,
                  inputs=result.inputs, outputs=result.outputs,
                  table_versions=result.table_versions)
            say(f"{stage.name}: FAILED in {secs:.1f} s: over its failure budget "
                f"{breach.budget}")
            failed(stage, f"stage {stage.name} is over its failure budget {breach.budget}",
                   [row])
            if summary:
                try:
                    _write_report(spark, cfg, out)
                except Exception as exc:  # noqa: BLE001 -- the budget is the failure to tell
                    log.warning("the report of failed run %s could not be written: %s: %s",
                                run_id, type(exc).__name__, exc)
            event("run_end", run_id=run_id, status="failed", failed_stage=stage.name,
                  budget=breach.budget, seconds=round(time.monotonic() - t_run, 2),
                  report=out.report)
            raise BudgetExceededError(breach.message, stage=stage.name, budget=breach.budget,
                                      outcome=out)
        rows = [row]
        if i + 1 < len(stages):
            started = ledger.utcnow()
            rows.append(_ledger_row(base, stages[i + 1].name, "running", started))
        ledger.record(spark, runs_path, rows)
        event("stage_end", run_id=run_id, stage=stage.name, seconds=round(secs, 2),
              inputs=result.inputs, outputs=result.outputs,
              table_versions=result.table_versions, note=result.note)
        counts = ", ".join(f"{k}={v}" for k, v in result.outputs.items() if ":" not in k)
        say(f"{stage.name}: done in {secs:.1f} s" + (f" ({counts})" if counts else ""))
        fault_point(f"{stage.name}:done")

    if summary:
        try:
            _write_report(spark, cfg, out)
        except Exception as exc:  # noqa: BLE001 -- summary.json or its upload: recorded
            out.report_error = out.report_error or f"{type(exc).__name__}: {exc}"[:2000]
            log.error("the summary of run %s could not be written (the run's stages "
                      "committed; the run is not failed): %s", run_id, out.report_error,
                      exc_info=True)
    versions, manifests = {}, {}
    for res in out.results.values():
        versions.update(res.table_versions)
        manifests.update(res.manifests)
    ledger.record(spark, runs_path, [_ledger_row(
        base, "run", "ok", run_started, ended_at=ledger.utcnow(),
        seconds=time.monotonic() - t_run, table_versions=versions,
        export_manifests=json.dumps(manifests, sort_keys=True) if manifests else None,
        note=out.report if out.report_error is None else
        f"report failed: {out.report_error}"[:1000],
    )])
    event("run_end", run_id=run_id, status="ok",
          seconds=round(time.monotonic() - t_run, 2), report=out.report,
          report_error=out.report_error)


def _upload_events(local: str, final: str) -> None:
    """The events file of a run on an object-store root, copied there at the end (a
    crashed driver leaves only what it had uploaded: nothing)."""
    from etl.writers.remote import write_file

    try:
        with open(local, "rb") as f:
            write_file(final, f.read())
    except Exception as exc:  # noqa: BLE001 -- never hide the run's own outcome
        log.warning("could not upload the run's events to %s: %s: %s", final,
                    type(exc).__name__, exc)
    finally:
        shutil.rmtree(os.path.dirname(local), ignore_errors=True)


def _write_report(spark, cfg: Config, out: RunOutcome) -> None:
    """The report and summary.json, written locally, then uploaded when the root is an
    object store (etl.writers.remote, the same S3 settings as every other client).

    The stages have committed by now, so a report that cannot be drawn fails nothing:
    the error is logged with its traceback, kept in ``out.report_error`` (summary.json,
    the run's ledger note, the ``report_failed`` event) and summary.json still written."""
    from etl.writers.remote import upload_dir

    final_dir = tables.layout(cfg).report_dir(out.run_id)
    remote = is_remote(final_dir)
    report_dir = tempfile.mkdtemp(prefix="lakeshard-report-") if remote else final_dir
    try:
        if cfg.run.report:
            try:
                _draw_report(spark, cfg, out, report_dir, final_dir)
            except Exception as exc:  # noqa: BLE001 -- recorded; the stages committed
                out.report_error = f"{type(exc).__name__}: {exc}"[:2000]
                log.error("the report of run %s could not be written (the run's stages "
                          "committed; the run is not failed): %s", out.run_id,
                          out.report_error, exc_info=True)
                event("report_failed", run_id=out.run_id, error=out.report_error)
                say(f"report: FAILED ({out.report_error[:200]}); the run's outputs are "
                    "committed")
        write_summary(out, report_dir)
        if remote:
            upload_dir(report_dir, final_dir)
    finally:
        if remote:
            shutil.rmtree(report_dir, ignore_errors=True)


def _draw_report(spark, cfg: Config, out: RunOutcome, report_dir: str, final_dir: str
                 ) -> None:
    from etl.report import write_report

    sc = spark.sparkContext
    t0 = time.monotonic()
    sc.setJobGroup(f"lakeshard-{out.run_id}-report", f"lakeshard report (run {out.run_id})")
    try:
        index = write_report(spark, cfg, out, report_dir)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setJobDescription(None)
    out.seconds["report"] = time.monotonic() - t0
    out.report = f"{final_dir}/{os.path.basename(index)}"
