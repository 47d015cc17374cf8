"""The console, structured events and stage progress.

:func:`event` records one JSON object (``{"event": "stage_end", "run_id": …, "stage":
"curate", "seconds": 12.3, …}``): into every open :class:`EventsFile` (the runner keeps
one per run, ``<root>/reports/<run_id>/events.jsonl``) and on the ``lakeshard.events``
logger, for log shippers and tests. :class:`StageProgress` is a thread that, while a
stage runs, reads Spark's status store every ``interval_s`` seconds and prints each
running step of the stage (its jobs' description: ``curate · list sources``) with the
records its Spark stages have moved so far, their rate and an ETA, and records the same as a
``progress`` event.

The console is the CLI's choice (:func:`console`): by default people see the stage
lines (:func:`say`, progress) and, on stdout, the command's summary; warnings and errors
once; not the events. ``--log-format json`` puts every event and log record on stderr
as one JSON object per line instead (for log shippers) and no human lines;
``-v`` shows everything, events included, with timestamps. Used as a library (tests,
notebooks), lakeshard leaves logging alone and prints its stage lines to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = [
    "event",
    "say",
    "console",
    "console_mode",
    "ConsoleMode",
    "EventsFile",
    "StageProgress",
    "step_label",
    "format_eta",
]

events_log = logging.getLogger("lakeshard.events")
# Where Delta Lake's own words start in a job description it wrapped.
_DELTA_SUFFIX = re.compile(r": (?=[A-Z])| - (?=[A-Z])")


@dataclass(frozen=True)
class ConsoleMode:
    format: str = "text"  # text | json
    verbose: bool = False
    configured: bool = False  # set up by the CLI (else: a library caller's logging)

    @property
    def human(self) -> bool:
        """Whether stage and progress lines are printed."""
        return self.format == "text"

    @property
    def spark_log_level(self) -> str | None:
        """Spark's (log4j) level for this console; None: leave it as the session set it."""
        if not self.configured:
            return None
        return "WARN" if self.verbose else "ERROR"


_MODE = ConsoleMode()
_SINKS: list[EventsFile] = []
_SINKS_LOCK = threading.Lock()


def console_mode() -> ConsoleMode:
    return _MODE


class EventsFile:
    """``with EventsFile(path):`` -- every event recorded meanwhile, one JSON line each,
    appended to the local file `path` (flushed per line: a crash keeps what came
    before it)."""

    def __init__(self, path: str):
        self.path = path
        self._file: TextIO | None = None
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()

    def __enter__(self) -> EventsFile:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 -- closed in __exit__
        with _SINKS_LOCK:
            _SINKS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _SINKS_LOCK:
            if self in _SINKS:
                _SINKS.remove(self)
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def event(name: str, **fields: Any) -> dict:
    """Record a structured event; returns it."""
    record = {"event": name, "ts": round(time.time(), 3), **fields}
    line = json.dumps(record, default=str, sort_keys=False)
    with _SINKS_LOCK:
        sinks = list(_SINKS)
    for sink in sinks:
        sink.write(line)
    events_log.info(line)
    return record


def say(text: str) -> None:
    """A line for people on the console (stderr): stage started, done, failed."""
    if _MODE.human:
        print(f"[lakeshard] {text}", file=sys.stderr, flush=True)


class _JsonLines(logging.Formatter):
    """Events as they are; every other log record as a JSON object too."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name == events_log.name:
            return record.getMessage()
        out = {"event": "log", "ts": round(record.created, 3), "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


@contextmanager
def console(fmt: str = "text", verbose: bool = False) -> Iterator[ConsoleMode]:
    """The CLI's console for one command (restored afterwards, so in-process callers
    such as tests get their logging back):

    * ``text``: warnings and errors of every logger (a Python warning once per place),
      the stage and progress lines; events only in the events file. ``-v``: every log
      record from DEBUG with timestamps, events included (as before this console).
    * ``json``: every event and log record (INFO and up) on stderr, one JSON object per
      line; no human lines.

    Spark's own log goes down to ERROR (``-v``: WARN) once the runner has a session;
    Lance's native log to errors (``LANCE_LOG``, inherited by Spark's Python workers),
    unless set or ``-v``."""
    global _MODE
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, events_log.propagate, events_log.level, _MODE,
             os.environ.get("LANCE_LOG"))
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonLines())
        level, show_events = logging.INFO, True
    elif verbose:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        level, show_events = logging.DEBUG, True
    else:
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        level, show_events = logging.WARNING, False
    root.handlers[:] = [handler]
    root.setLevel(level)
    events_log.propagate = show_events
    events_log.setLevel(logging.INFO if show_events else logging.NOTSET)
    if not verbose:
        os.environ.setdefault("LANCE_LOG", "error")
    _MODE = ConsoleMode(fmt, verbose, configured=True)
    with warnings.catch_warnings():
        # pylance warns whenever a process that imported it forks; the driver forks only
        # to exec (Spark's launcher) and Spark's workers import lance after their fork.
        warnings.filterwarnings("ignore", message="lance is not fork-safe")
        logging.captureWarnings(True)  # warnings as log records: formatted, counted once
        try:
            yield _MODE
        finally:
            logging.captureWarnings(False)
            root.handlers[:], level, events_log.propagate, ev_level, _MODE, lance_log = saved
            root.setLevel(level)
            events_log.setLevel(ev_level)
            if lance_log is None:
                os.environ.pop("LANCE_LOG", None)


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


@dataclass
class _Step:
    """One step of a stage (the Spark jobs that share a job description): the records
    its Spark stages moved so far, when the first of them was submitted (epoch s), and
    its leading Spark stage's tasks."""

    label: str
    began: float
    records: int = 0
    tasks_done: int = 0
    tasks_total: int = 0
    tasks_running: int = 0
    lead: int = -1  # records of the running Spark stage whose tasks are shown
    active: bool = False
    shown: bool = False  # printed while running
    ended_shown: bool = False  # its end printed


def step_label(description: str | None, stage: str) -> str:
    """What a step does, from its job description (``lakeshard curate: list sources`` ->
    ``list sources``). Delta Lake wraps the description of the jobs it starts (``Delta:
    lakeshard curate: <step>: Filtering files for query``, ``<step> - MERGE operation``):
    those count under the step they serve, cut where Delta's capitalised phrase begins.
    Jobs without a description are the stage's ``other`` work."""
    if not description:
        return "other"
    prefix = f"lakeshard {stage}: "
    at = description.find(prefix)
    rest = description[at + len(prefix):] if at >= 0 else description
    return _DELTA_SUFFIX.split(rest, maxsplit=1)[0][:80]


def _records(data) -> int:
    """Records a Spark stage has moved so far: the largest of what it read (files,
    tables, a shuffle) and wrote (a sink, a shuffle). Spark's status store adds a task's
    counts when the task ends (on `local[*]` no heartbeat updates them while it runs:
    measured on Spark 4.1), so the count moves task by task."""
    return max(int(data.inputRecords()), int(data.shuffleReadRecords()),
               int(data.outputRecords()), int(data.shuffleWriteRecords()))


class StageProgress:
    """``with StageProgress(spark, run_id, "curate", interval_s=10):`` around a stage.

    Every `interval_s` it reads, from Spark's status store (the JVM's ``AppStatusStore``:
    the records each Spark stage has read and written, added as each of its tasks ends),
    the Spark stages of the jobs in the caller's job group, and groups them into
    steps by job description (``lakeshard curate: list sources`` is the step ``list
    sources``). Per running step it prints and records its records so far -- the
    largest count of the step's Spark stages, so that one step's count does not restart
    with each of its jobs -- their rate since the step began, and an ETA from the share
    of the leading Spark stage's tasks done; a step that ended is printed once more with
    its total."""

    def __init__(self, spark, run_id: str, stage: str, *, interval_s: float, stream=None):
        self.sc = spark.sparkContext
        self.run_id = run_id
        self.stage = stage
        self.interval_s = interval_s
        self.stream = stream or sys.stderr
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()
        self._group: str | None = None
        self._steps: dict[str, _Step] = {}
        self._finished: dict[int, tuple[str, int]] = {}  # Spark stage -> (step, records)
        self._never_ran: set[int] = set()  # skipped, or not submitted by a job that ended

    def _stage_data(self) -> list[tuple[int, Any]]:
        """(Spark stage id, its last attempt's StageData) of the jobs in the group, but
        for stages already done (kept) or that never ran in a job that ended."""
        tracker, store = self.sc.statusTracker(), self.sc._jsc.sc().statusStore()
        stages: dict[int, bool] = {}  # stage id -> whether its job still runs
        for job in tracker.getJobIdsForGroup(self._group):
            info = tracker.getJobInfo(job)
            if info is not None:
                running = str(info.status) in ("RUNNING", "UNKNOWN")
                for sid in info.stageIds:
                    stages[sid] = stages.get(sid, False) or running
        out = []
        for sid, running in sorted(stages.items()):
            if sid in self._finished or sid in self._never_ran:
                continue
            try:
                data = store.lastStageAttempt(sid)
            except Exception:  # noqa: BLE001 -- not in the store: not submitted (yet)
                data = None
            if data is None or str(data.status()) == "SKIPPED":
                if not running or data is not None:
                    self._never_ran.add(sid)
                continue
            out.append((sid, data))
        return out

    def _update(self, now: float) -> None:
        for step in self._steps.values():
            step.active, step.records, step.lead = False, 0, -1
            step.tasks_done = step.tasks_total = step.tasks_running = 0
        for label, records in self._finished.values():
            step = self._steps[label]
            step.records = max(step.records, records)
        for sid, data in self._stage_data():
            desc = data.description()
            label = step_label(desc.get() if desc.isDefined() else None, self.stage)
            submitted = data.submissionTime()
            began = submitted.get().getTime() / 1000 if submitted.isDefined() else now
            step = self._steps.setdefault(label, _Step(label, began))
            step.began = min(step.began, began)
            records, status = _records(data), str(data.status())
            step.records = max(step.records, records)
            if status == "COMPLETE":
                self._finished[sid] = (label, records)
            elif status == "ACTIVE" and records > step.lead:
                step.active, step.lead = True, records
                step.tasks_done, step.tasks_total = data.numCompleteTasks(), data.numTasks()
                step.tasks_running = data.numActiveTasks()

    def snapshot(self) -> list[dict]:
        """Per step that is running now or ended since the last snapshot: its records,
        rate, ETA and leading Spark stage's tasks."""
        now = time.time()
        self._update(now)
        out = []
        for step in self._steps.values():
            if not step.active and (not step.shown or step.ended_shown):
                continue  # printed only while it runs, and once when it ends
            elapsed = now - step.began
            rate = step.records / elapsed if step.records and elapsed >= 1 else None
            eta = None
            if step.active and step.tasks_done and rate:
                eta = max(0.0, (step.records * step.tasks_total / step.tasks_done
                                - step.records) / rate)
            out.append({"step": step.label, "records": step.records,
                        "records_per_s": None if rate is None else round(rate, 1),
                        "eta_s": None if eta is None else round(eta, 1),
                        "done": not step.active, "tasks_done": step.tasks_done,
                        "tasks_total": step.tasks_total, "tasks_running": step.tasks_running,
                        "elapsed_s": round(time.monotonic() - self._t0, 1)})
            step.shown, step.ended_shown = True, not step.active
        return out

    def records(self) -> dict[str, int]:
        """Records read so far per step seen, as of the last snapshot."""
        return {label: step.records for label, step in self._steps.items()}

    def _print(self, snap: dict) -> None:
        rate = "?" if snap["records_per_s"] is None else f"{snap['records_per_s']:,.0f}"
        head = f"[lakeshard] {self.stage} · {snap['step']}: {snap['records']:,} records"
        if snap["done"]:
            line = f"{head}, done ({rate} records/s)"
        else:
            line = (f"{head}, {rate} records/s, ETA {format_eta(snap['eta_s'])} "
                    f"({snap['tasks_done']}/{snap['tasks_total']} tasks, "
                    f"{snap['tasks_running']} running), "
                    f"{format_eta(snap['elapsed_s'])} elapsed")
        print(line, file=self.stream, flush=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                snaps = self.snapshot()
            except Exception:  # noqa: BLE001 -- the context is stopping: best effort
                return
            for snap in snaps:
                if _MODE.human:
                    self._print(snap)
                event("progress", run_id=self.run_id, stage=self.stage, **snap)

    def __enter__(self) -> StageProgress:
        # The caller's job group (a thread-local property, so read here, not in the thread).
        self._group = self.sc.getLocalProperty("spark.jobGroup.id")
        if self.interval_s > 0 and self._group:
            self._thread = threading.Thread(target=self._loop, name="lakeshard-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
