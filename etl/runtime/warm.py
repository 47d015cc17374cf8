"""Work started on a thread while the driver waits for Spark, or plans a job.

A nightly `lakeshard run` is a fresh process: before its first stage it waits seconds
for the driver JVM to start, with its Python thread idle, and later pays imports of its
own on the critical path (the report's matplotlib; the MDS writer, for an export the
driver writes). :func:`import_in_background` starts such
imports on a daemon thread now, so that they overlap the wait; the code that needs a
module imports it as usual, and the import system makes it wait for a module still
being imported. An import that fails on the thread is left for that code to raise.

:func:`warm_local_frames` does the same for the driver JVM's first frame of local data
(an Arrow table handed to Spark, planned and collected: ~0.7 s of a cold JVM's class
loading and compilation, paid by whatever step first does it).

:func:`start_python_workers` does the same for the executors' Python daemon on a local
master: its start (the interpreter, PySpark and the modules every task needs,
``etl/runtime/worker_daemon.py``; ~0.7 s of one core) would otherwise wait for the
first Python task, while the driver spends ~1 s planning the job that runs it.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading

log = logging.getLogger(__name__)

__all__ = ["import_in_background", "start_python_workers", "warm_local_frames"]


def import_in_background(*modules: str, name: str = "lakeshard-import"
                         ) -> threading.Thread | None:
    """Import `modules` in order on a daemon thread; None when all are imported."""
    todo = [m for m in modules if m not in sys.modules]
    if not todo:
        return None

    def load() -> None:
        for module in todo:
            try:
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 -- raised again where it is needed
                log.debug("background import of %s failed: %s", module, exc)
                return

    thread = threading.Thread(target=load, name=name, daemon=True)
    thread.start()
    return thread


def _drain(batches):
    """The warm-up task's function: reads its row, returns no batch."""
    for _ in batches:
        pass
    return iter(())


def start_python_workers(spark, what: str) -> threading.Thread | None:
    """On a local master, start the executors' Python daemon now, with a one-task Arrow
    job on a thread (labelled ``what``; it inherits the caller's job group), so that the
    job the caller is planning finds its workers forking from a daemon that is already
    up. None elsewhere: a cluster's executors start their own daemons, one per
    executor, which one task cannot reach.

    An Arrow job (``mapInArrow``), as the tasks that follow run: Spark keeps one daemon
    per interpreter, worker module and environment, and an RDD job's workers get another
    environment, so another daemon (measured: two daemons, the second job's tasks no
    earlier). A failure on the thread is logged; the caller's own job meets it again."""
    if not spark.sparkContext.master.startswith("local"):
        return None
    from pyspark import InheritableThread

    def run() -> None:
        spark.sparkContext.setJobDescription(what)
        try:
            spark.range(1, numPartitions=1).mapInArrow(_drain, "id long").collect()
        except Exception as exc:  # noqa: BLE001 -- the caller's job raises it where it counts
            log.warning("starting the Python workers failed: %s", exc)

    thread = InheritableThread(target=run, name="lakeshard-python-workers", daemon=True)
    thread.start()
    return thread


_frames_warmed = False


def warm_local_frames(spark) -> threading.Thread | None:
    """Once per process, on a daemon thread: hand the driver JVM a two-row Arrow table
    as a frame of local data, filter and project it, and collect it as
    :func:`etl.runtime.local.local_arrow` does (no Spark job) -- so that the night's own
    first such frame (the rows a driver-side comparison hands on, measured 0.85 s for
    the first ``createDataFrame`` of 1,200 rows in a cold JVM against 0.09 s once warm)
    finds the JVM's Arrow reader, analyser and planner loaded and compiled. It runs
    while the driver reads the manifest and lists the sources; a failure is logged at
    DEBUG (the night's own frames meet it again)."""
    global _frames_warmed
    if _frames_warmed:
        return None
    _frames_warmed = True

    def run() -> None:
        import pyarrow as pa
        from pyspark.sql import functions as F

        from etl.runtime.local import local_arrow

        try:
            rows = pa.table({"k": pa.array(["a", "b"]), "v": pa.array([b"x", b"y"]),
                             "n": pa.array([1, 2], pa.int32())})
            local_arrow(spark.createDataFrame(rows).where(F.col("n") > 1).select("k", "v"))
        except Exception as exc:  # noqa: BLE001 -- the night's own frames meet it again
            log.debug("warming the driver's local frames failed: %s", exc)

    thread = threading.Thread(target=run, name="lakeshard-local-frames", daemon=True)
    thread.start()
    return thread
