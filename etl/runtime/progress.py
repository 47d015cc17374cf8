"""The console, structured events and stage progress.

:func:`event` records one JSON object (``{"event": "stage_end", "run_id": …, "stage":
"curate", "seconds": 12.3, …}``): into every open :class:`EventsFile` (the runner keeps
one per run, ``<root>/reports/<run_id>/events.jsonl``) and on the ``lakeshard.events``
logger, for log shippers and tests. :class:`StageProgress` is a thread that, while a
stage runs, polls Spark's status tracker and prints what is running -- the stage name,
tasks done of total, the rate and an ETA -- every ``interval_s`` seconds, and records the
same as a ``progress`` event.

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
    "format_eta",
]

events_log = logging.getLogger("lakeshard.events")


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


class StageProgress:
    """``with StageProgress(spark, run_id, "caption", interval_s=10):`` around a stage."""

    def __init__(self, spark, run_id: str, stage: str, *, interval_s: float, stream=None):
        self.sc = spark.sparkContext
        self.run_id = run_id
        self.stage = stage
        self.interval_s = interval_s
        self.stream = stream or sys.stderr
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()
        self._last: tuple[float, int] | None = None

    def snapshot(self) -> dict | None:
        """Tasks of the Spark stages running now, or None when nothing runs."""
        tracker = self.sc.statusTracker()
        total = done = active = 0
        for sid in tracker.getActiveStageIds():
            info = tracker.getStageInfo(sid)
            if info is None:
                continue
            total += info.numTasks
            done += info.numCompletedTasks
            active += info.numActiveTasks
        if not total:
            return None
        now = time.monotonic()
        rate = None
        if self._last is not None and now > self._last[0] and done >= self._last[1]:
            rate = (done - self._last[1]) / (now - self._last[0])
        self._last = (now, done)
        eta = (total - done) / rate if rate else None
        return {"tasks_done": done, "tasks_total": total, "tasks_running": active,
                "tasks_per_s": None if rate is None else round(rate, 3),
                "eta_s": None if eta is None else round(eta, 1),
                "elapsed_s": round(now - self._t0, 1)}

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                snap = self.snapshot()
            except Exception:  # the context is stopping: progress is best effort
                return
            if snap is None:
                continue
            rate = "?" if snap["tasks_per_s"] is None else f"{snap['tasks_per_s']:.2f}"
            if _MODE.human:
                print(
                    f"[lakeshard] {self.stage}: {snap['tasks_done']}/{snap['tasks_total']} "
                    f"tasks done ({snap['tasks_running']} running), {rate} tasks/s, "
                    f"ETA {format_eta(snap['eta_s'])}, {format_eta(snap['elapsed_s'])} "
                    "elapsed",
                    file=self.stream, flush=True,
                )
            event("progress", run_id=self.run_id, stage=self.stage, **snap)

    def __enter__(self) -> StageProgress:
        if self.interval_s > 0:
            self._thread = threading.Thread(target=self._loop, name="lakeshard-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
