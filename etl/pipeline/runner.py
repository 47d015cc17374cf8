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

import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from etl import ledger, tables
from etl.config import Config
from etl.errors import BudgetExceededError, ConfigError
from etl.lakehouse import curated_meta, registration
from etl.migrations import migrate
from etl.pipeline.budgets import BudgetBreach, check_budget
from etl.pipeline.preflight import check_run_id
from etl.pipeline.stages import COMMANDS, STAGES, Stage
from etl.pipeline.summary import write_summary
from etl.runtime.faults import arm, fault_point
from etl.runtime.lock import RunLock
from etl.runtime.outcome import RunOutcome
from etl.runtime.progress import EventsFile, StageProgress, console_mode, event, say
from etl.runtime.stage import RunContext, StageResult
from etl.runtime.warm import import_in_background, warm_local_frames
from etl.writers.remote import is_remote
from udfs.faults import RAISE_ENV

__all__ = ["RunOutcome", "new_run_id", "run_pipeline", "run_command", "run_stages"]

log = logging.getLogger(__name__)


def new_run_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


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


def run_command(cfg: Config, name: str, options: Any = None, *,
                run_id: str | None = None) -> RunOutcome:
    """One table-changing command (`caption`, `dedup`, `latents`, `features`, `embed`,
    `compact`, `forget`) as a run of one stage: the same lock, ledger and progress.
    `options`: the stage's typed options, or a mapping of their fields (an unknown key
    is a TypeError), or None for the defaults."""
    stage = STAGES.get(name) if name in STAGES.names() else COMMANDS.get(name)
    opts = stage.make_options(options)
    return run_stages(cfg, [stage], run_id=run_id, command=True,
                      options=() if opts is None else (opts,))


def run_stages(
    cfg: Config,
    stages: list[Stage],
    *,
    run_id: str | None = None,
    export_names: tuple[str, ...] | None = None,
    options: tuple[Any, ...] = (),
    command: bool = False,
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
                     options=options, continued=run_id is not None, command=command)
    for stage in stages:
        if stage.check is not None:
            stage.check(cfg, ctx)
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


@dataclass(frozen=True)
class _Failure:
    """How a stage failed: what the console, the events and the ledger say of it."""

    message: str  # the exception, or the budget breach (the run's `failure`)
    run_note: str  # the run's ledger note
    console: str  # after "<stage>: FAILED "
    row: dict  # the stage's failed ledger row
    event: dict  # the stage_failed event's fields
    end: dict = field(default_factory=dict)  # more of the run_end event's fields
    report: bool = False  # a pipeline run still writes its report and summary.json


class _Run:
    """One run's transitions: every ledger row is built (:func:`etl.ledger.transition`)
    and recorded here, with its event and console line."""

    def __init__(self, spark, cfg: Config, ctx: RunContext, out: RunOutcome,
                 stages: list[Stage], summary: bool) -> None:
        self.spark, self.cfg, self.ctx, self.out = spark, cfg, ctx, out
        self.names = [s.name for s in stages]
        self.summary = summary
        self.runs_path = tables.layout(cfg).runs
        self.base = {"run_id": ctx.run_id, "config_hash": ledger.config_hash(cfg),
                     "code_version": ledger.code_version(), "host": socket.gethostname()}
        self.started = ledger.utcnow()
        self.t0 = time.monotonic()
        self.draft = None  # the report's table part, once started (draft_report)

    def draft_report(self, remaining: list[Stage]) -> None:
        """Start the report's table part on a thread when every stage left to run
        leaves the tables it reads as they are (:attr:`Stage.keeps_tables`): it is
        made while they run instead of after them."""
        if (self.draft is None and self.summary and self.cfg.run.report
                and all(s.keeps_tables for s in remaining)):
            self.draft = _draft_report(self.spark, self.cfg, self.out)

    def row(self, stage: str, status: str, started=None, **more) -> dict:
        return ledger.transition(self.base, stage, status, started or self.started, **more)

    def record(self, rows: list[dict]) -> None:
        ledger.record(self.spark, self.runs_path, rows)

    def ended(self) -> dict:
        return {"ended_at": ledger.utcnow(), "seconds": time.monotonic() - self.t0}

    def begin(self, first: str) -> datetime:
        """The run's ``running`` row, ``skipped`` rows of the stages not selected, and
        the first stage's ``running`` row, in one write; returns that stage's start."""
        run_id = self.ctx.run_id
        event("run_start", stages=self.names, **self.base)
        if self.out.recovered_run:
            n = ledger.mark_crashed(self.spark, self.runs_path, self.out.recovered_run,
                                    f"stale lock taken over by run {run_id}")
            log.warning("run %s had crashed (%d ledger row(s) marked crashed); its lock "
                        "was stale and is now this run's", self.out.recovered_run, n)
            event("recovered_crashed_run", run_id=run_id, crashed_run=self.out.recovered_run)
        self.started = ledger.utcnow()
        self.t0 = time.monotonic()
        started = ledger.utcnow()
        skipped = [s for s in STAGES.names() if s not in self.names] if self.summary else []
        if skipped and self.ctx.continued:
            # One run across processes (a multi-task job passing its run id to each
            # task): "not selected" only for stages no earlier task of this run
            # recorded, so the ledger shows one run with every stage's own outcome.
            recorded = ledger.recorded_stages(self.spark, self.runs_path, run_id)
            skipped = [s for s in skipped if s not in recorded]
        self.record([self.row("run", "running"),
                     *[self.row(s, "skipped", note="not selected") for s in skipped],
                     self.row(first, "running", started)])
        return started

    def stage_done(self, stage: str, result: StageResult, secs: float, started,
                   following: str | None) -> datetime:
        """The stage's ``ok`` row with the next stage's ``running`` row; returns the
        next stage's start."""
        rows = [self.row(stage, "ok", started, result=result, ended_at=ledger.utcnow(),
                         seconds=secs)]
        nxt = ledger.utcnow()
        if following is not None:
            rows.append(self.row(following, "running", nxt))
        self.record(rows)
        event("stage_end", run_id=self.ctx.run_id, stage=stage, seconds=round(secs, 2),
              inputs=result.inputs.as_map(), outputs=result.outputs.as_map(),
              table_versions=result.table_versions, note=result.note)
        counts = ", ".join(f"{k}={v}" for k, v in result.outputs.items())
        say(f"{stage}: done in {secs:.1f} s" + (f" ({counts})" if counts else ""))
        return nxt

    def fail(self, stage: str, failure: _Failure) -> None:
        """The one failure path: the stage's failed row, the stages after it (not run)
        and the run's failed row; its events and console line; the report of a
        pipeline run that failed on a budget."""
        run_id, out = self.ctx.run_id, self.out
        out.failed_stage, out.failure = stage, failure.message
        event("stage_failed", run_id=run_id, stage=stage, **failure.event)
        say(f"{stage}: FAILED {failure.console}")
        later = self.names[self.names.index(stage) + 1:]
        self.record([
            failure.row,
            *[self.row(s, "skipped", note=f"not run: stage {stage} failed") for s in later],
            self.row("run", "failed", **self.ended(), note=failure.run_note),
        ])
        if failure.report and self.summary:
            try:
                _write_report(self.spark, self.cfg, out, self.draft)
            except Exception as exc:  # noqa: BLE001 -- the budget is the failure to tell
                log.warning("the report of failed run %s could not be written: %s: %s",
                            run_id, type(exc).__name__, exc)
        elif self.draft is not None:
            self.draft.discard()
        event("run_end", run_id=run_id, status="failed", failed_stage=stage, **failure.end,
              seconds=round(time.monotonic() - self.t0, 2),
              **({"report": out.report} if failure.report else {}))

    def finish(self) -> None:
        """The report and summary.json of a pipeline run, then the run's ``ok`` row."""
        out = self.out
        if self.summary:
            try:
                _write_report(self.spark, self.cfg, out, self.draft)
            except Exception as exc:  # noqa: BLE001 -- summary.json or its upload: recorded
                out.report_error = out.report_error or f"{type(exc).__name__}: {exc}"[:2000]
                log.error("the summary of run %s could not be written (the run's stages "
                          "committed; the run is not failed): %s", out.run_id,
                          out.report_error, exc_info=True)
        versions, manifests = {}, {}
        for res in out.results.values():
            versions.update(res.table_versions)
            manifests.update(res.manifests)
        self.record([self.row(
            "run", "ok", **self.ended(), table_versions=versions,
            export_manifests=ledger.manifests_json(manifests),
            note=out.report if out.report_error is None else
            f"report failed: {out.report_error}"[:1000],
        )])
        event("run_end", run_id=out.run_id, status="ok",
              seconds=round(time.monotonic() - self.t0, 2), report=out.report,
              report_error=out.report_error)


def _crashed(run: _Run, stage: str, exc: BaseException, secs: float, started) -> _Failure:
    msg = f"{type(exc).__name__}: {exc}"[:2000]
    return _Failure(
        message=msg, run_note=f"stage {stage} failed",
        console=f"after {secs:.1f} s: {msg.splitlines()[0][:300]}",
        row=run.row(stage, "failed", started, ended_at=ledger.utcnow(), seconds=secs,
                    note=msg),
        event={"seconds": secs, "error": msg})


def _over_budget(run: _Run, stage: str, result: StageResult, breach: BudgetBreach,
                 secs: float, started) -> _Failure:
    return _Failure(
        message=breach.message,
        run_note=f"stage {stage} is over its failure budget {breach.budget}",
        console=f"in {secs:.1f} s: over its failure budget {breach.budget}",
        row=run.row(stage, "failed", started, result=result, ended_at=ledger.utcnow(),
                    seconds=secs, note=breach.message[:2000]),
        event={"seconds": round(secs, 2), "budget": breach.budget,
               "tally": asdict(result.tally), "error": breach.message,
               "inputs": result.inputs.as_map(), "outputs": result.outputs.as_map(),
               "table_versions": result.table_versions},
        end={"budget": breach.budget}, report=True)


def _warm(cfg: Config, stages: list[Stage], ctx: RunContext, report: bool) -> None:
    """Imports the run will need, on threads (etl.runtime.warm): the report's, started
    now to overlap the Spark start-up; the stages' own (:attr:`Stage.warm`, e.g. the
    export's writer), once a stage says the run will change tables
    (:meth:`RunContext.changes_ahead`: a no-op night warms nothing) -- or now, when the
    first stage is one of them."""
    if report:
        import_in_background("etl.report.figures", "etl.report.html",
                             name="lakeshard-report-import")
    warms = [s.warm for s in stages if s.warm is not None]

    def start() -> None:
        for warm in warms:
            warm(cfg, ctx)

    if warms and stages[0].warm is not None:
        start()
    elif warms:
        ctx.on_changes = start


def _start_spark(cfg: Config, out: RunOutcome):
    """Spark for the run (test faults forwarded, the console's log level), and the
    migration of tables an older version wrote."""
    from etl.session import get_spark

    fault_point("run:locked")
    # Format lance is registered when a stage first reads a Lance table through Spark
    # (etl.writers.lance.lance_reader): a no-op night never does.
    spark = get_spark(cfg, archive_classes=True, lance_format=False)
    sc = spark.sparkContext
    _forward_to_workers(sc)
    if console_mode().spark_log_level:
        sc.setLogLevel(console_mode().spark_log_level)
    out.migrated = migrate(spark, cfg)
    return spark


def _call_stage(spark, cfg: Config, ctx: RunContext, stage: Stage) -> StageResult:
    """One stage in its Spark job group, with progress."""
    sc = spark.sparkContext
    sc.setJobGroup(f"lakeshard-{ctx.run_id}-{stage.name}",
                   f"lakeshard {stage.name} (run {ctx.run_id})")
    event("stage_start", run_id=ctx.run_id, stage=stage.name)
    say(f"{stage.name}: started")
    try:
        fault_point(f"{stage.name}:start")
        with StageProgress(spark, ctx.run_id, stage.name,
                           interval_s=cfg.run.progress_interval_s):
            try:
                result = stage.run(spark, cfg, ctx)
            except Exception:
                _sync_after_failure(spark, cfg, stage.name)
                raise
            # curated_meta follows the Lance table after every stage that may move it
            # (a no-op when not published, or when the Lance version did not move).
            curated_meta.sync(spark, cfg)
            return result
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setJobDescription(None)


def _sync_after_failure(spark, cfg: Config, stage: str) -> None:
    """curated_meta brought to what a failed stage committed to Lance before it failed
    (its deletions above all); the stage's own error is the one raised."""
    try:
        curated_meta.sync(spark, cfg)
    except Exception as exc:  # noqa: BLE001 -- the stage's failure is the one to tell
        log.warning("curated_meta could not follow the Lance table after stage %s failed "
                    "(the next run's first stage brings it in step): %s: %s", stage,
                    type(exc).__name__, exc)


def _execute(cfg: Config, stages: list[Stage], ctx: RunContext, out: RunOutcome, *,
             summary: bool) -> None:
    _warm(cfg, stages, ctx, report=summary and cfg.run.report)
    spark = _start_spark(cfg, out)
    warm_local_frames(spark)
    warming = registration.warm_catalog(spark, cfg)
    run = _Run(spark, cfg, ctx, out, stages, summary)
    started = run.begin(stages[0].name)
    for i, stage in enumerate(stages):
        run.draft_report(stages[i:])
        t0 = time.monotonic()
        try:
            result = _call_stage(spark, cfg, ctx, stage)
        except BaseException as exc:
            run.fail(stage.name, _crashed(run, stage.name, exc, time.monotonic() - t0,
                                          started))
            exc.add_note(
                f"lakeshard: run {ctx.run_id} failed in stage {stage.name}. It is recorded "
                f"in the run ledger (`lakeshard runs --stages`); its events: {out.events}")
            raise
        secs = time.monotonic() - t0
        ctx.results[stage.name] = out.results[stage.name] = result
        out.seconds[stage.name] = secs
        breach = check_budget(stage.name, result.tally, cfg.run.budgets)
        if breach:
            run.fail(stage.name, _over_budget(run, stage.name, result, breach, secs, started))
            raise BudgetExceededError(breach.message, stage=stage.name, budget=breach.budget,
                                      outcome=out)
        started = run.stage_done(stage.name, result, secs, started,
                                 stages[i + 1].name if i + 1 < len(stages) else None)
        fault_point(f"{stage.name}:done")
    _register(spark, cfg, out, warming)
    run.finish()


def _register(spark, cfg: Config, out: RunOutcome, warming) -> None:
    """Every Delta table registered in the configured catalog, once the stages have
    committed (etl.lakehouse.registration). The stages' outputs stand whatever happens
    here: a catalog that cannot be reached is logged and recorded (event
    ``catalog_failed``), and the next run registers again."""
    if warming is not None:
        warming.join()
    t0 = time.monotonic()
    try:
        done = registration.register_tables(spark, cfg)
    except Exception as exc:  # noqa: BLE001 -- recorded; the stages committed
        msg = f"{type(exc).__name__}: {exc}"[:2000]
        log.error("the tables of run %s could not be registered in catalog %s (the run's "
                  "stages committed; the run is not failed): %s", out.run_id,
                  cfg.catalog.namespace, msg, exc_info=True)
        event("catalog_failed", run_id=out.run_id, error=msg)
        say(f"catalog: FAILED ({msg[:200]})")
        return
    if done is not None:
        out.seconds["catalog"] = time.monotonic() - t0
        event("catalog", run_id=out.run_id, namespace=cfg.catalog.namespace,
              created=list(done.created), moved=list(done.moved),
              unchanged=len(done.unchanged), checked=done.checked,
              seconds=round(done.seconds, 2))


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


def _draft_report(spark, cfg: Config, out: RunOutcome):
    """The report's table part started on a thread (:class:`etl.report.ReportDraft`),
    in a private folder: its files reach the run's report folder only with the report
    (:func:`_write_report`); a run that ends without one discards them."""
    from etl.report import ReportDraft

    return ReportDraft(spark, cfg, out, tempfile.mkdtemp(prefix="lakeshard-report-"),
                       (f"lakeshard-{out.run_id}-report", f"lakeshard report (run {out.run_id})"))


def _move_into(src: str, dest: str) -> None:
    """Every entry of the folder `src` moved into the folder `dest` (made if missing),
    replacing an entry of the same name."""
    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(src):
        target = os.path.join(dest, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        shutil.move(os.path.join(src, name), target)


def _write_report(spark, cfg: Config, out: RunOutcome, draft=None) -> None:
    """The report and summary.json, written locally, then uploaded when the root is an
    object store (etl.writers.remote, the same S3 settings as every other client).
    `draft`: the report's table part, started while the last stages ran (its folder).

    The stages have committed by now, so a report that cannot be drawn fails nothing:
    the error is logged with its traceback, kept in ``out.report_error`` (summary.json,
    the run's ledger note, the ``report_failed`` event) and summary.json still written."""
    from etl.writers.remote import upload_dir

    final_dir = tables.layout(cfg).report_dir(out.run_id)
    remote = is_remote(final_dir)
    if draft is not None:
        report_dir = draft.out_dir
    else:
        report_dir = tempfile.mkdtemp(prefix="lakeshard-report-") if remote else final_dir
    try:
        if cfg.run.report:
            try:
                _draw_report(spark, cfg, out, report_dir, final_dir, draft)
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
        elif report_dir != final_dir:
            _move_into(report_dir, final_dir)
    finally:
        if report_dir != final_dir:
            shutil.rmtree(report_dir, ignore_errors=True)


def _draw_report(spark, cfg: Config, out: RunOutcome, report_dir: str, final_dir: str,
                 draft=None) -> None:
    from etl.report import write_report

    sc = spark.sparkContext
    t0 = time.monotonic()
    sc.setJobGroup(f"lakeshard-{out.run_id}-report", f"lakeshard report (run {out.run_id})")
    try:
        index = write_report(spark, cfg, out, report_dir, draft)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setJobDescription(None)
    out.seconds["report"] = time.monotonic() - t0
    out.report = f"{final_dir}/{os.path.basename(index)}"
