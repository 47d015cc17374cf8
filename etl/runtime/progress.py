"""Console progress and structured log lines.

:func:`event` logs one JSON object per line on the ``lakeshard.events`` logger
(``{"event": "stage_end", "run_id": …, "stage": "curate", "seconds": 12.3, …}``), for
log shippers and tests. :class:`StageProgress` is a thread that, while a stage runs,
polls Spark's status tracker and prints what is running -- the stage name, tasks done
of total, the rate and an ETA -- every ``interval_s`` seconds, and logs the same as a
``progress`` event.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any

__all__ = ["event", "StageProgress", "format_eta"]

events_log = logging.getLogger("lakeshard.events")


def event(name: str, **fields: Any) -> dict:
    """Log a structured line; returns the record."""
    record = {"event": name, "ts": round(time.time(), 3), **fields}
    events_log.info(json.dumps(record, default=str, sort_keys=False))
    return record


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
            print(
                f"[lakeshard] {self.stage}: {snap['tasks_done']}/{snap['tasks_total']} tasks "
                f"done ({snap['tasks_running']} running), {rate} tasks/s, "
                f"ETA {format_eta(snap['eta_s'])}, {format_eta(snap['elapsed_s'])} elapsed",
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
