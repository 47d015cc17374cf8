"""Spark's Python daemon, with the imports every lakeshard task needs done once.

Spark starts one daemon per executor (``python -m pyspark.daemon``) and forks a Python
worker from it for each task slot. Each forked worker then imports what the task's
function needs: for curate's fetch + prepare, pyarrow, Pillow, lakeshard's batch
function and -- for the Lance fragment it writes -- ``pyarrow.dataset``, which imports
pandas (the batch function itself is Arrow in and out); ~0.4 s of CPU per worker, paid
on the critical path of the night's first Python job by every slot at once. And the daemon itself
imports PySpark from ``pyspark.zip``, which holds no compiled code: Python compiles
those modules again in every new daemon (~0.4 s more, before any worker forks).

Run as the daemon module (``spark.python.daemon.module``, set by
:func:`etl.session.spark_conf` where the executors are this interpreter), this module

* imports PySpark from the installed package when the ``pyspark.zip`` on the path is
  that same package's own copy (a pip-installed PySpark, where ``SPARK_HOME`` is the
  package): the same files, but compiled once, at install;
* imports :data:`PRELOAD` in the daemon of the tasks' workers (``pyspark.worker``), so
  that every forked worker starts with them;
* then runs PySpark's daemon unchanged.

A module of :data:`PRELOAD` that fails to import is left for the task that needs it to
raise where Spark reports task failures; the daemon goes on. Nothing here writes to
stdout: the daemon's first write there is the port Spark reads.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import traceback

__all__ = ["PRELOAD", "prefer_installed_pyspark", "preload", "main"]

# What curate's fetch + prepare task imports (etl/transforms/prepare_task.py and the
# batch function under it); the export's and dedup's tasks share most of it. Not torch,
# CUDA or the captioner: a CUDA context must not exist in a process that forks.
PRELOAD = (
    "pandas",  # imported by pyarrow.dataset (under Lance's writer), not by lakeshard's code
    "pyarrow",
    "pyarrow.compute",
    "pyarrow.dataset",
    "PIL.Image",
    "simplejpeg",
    "pyspark.sql.pandas.serializers",
    "etl.transforms.prepare_task",
)


def prefer_installed_pyspark(path: list[str]) -> bool:
    """Drop from `path` the ``pyspark.zip`` of the PySpark package installed further down
    `path` (its ``python/lib/pyspark.zip``), so that ``import pyspark`` finds the
    installed, compiled copy of the same files. Any other zip (a Spark distribution's, a
    cluster's) stays where it is. Returns whether `path` changed."""
    zips = [p for p in path if os.path.basename(p) == "pyspark.zip"]
    if not zips:
        return False
    rest = [p for p in path if p not in zips]
    spec = importlib.machinery.PathFinder.find_spec("pyspark", rest)
    if spec is None or not spec.submodule_search_locations:
        return False
    package = os.path.realpath(list(spec.submodule_search_locations)[0])
    own = os.path.join(package, "python", "lib", "pyspark.zip")
    if not any(os.path.realpath(z) == own for z in zips):
        return False
    path[:] = [p for p in path if os.path.realpath(p) != own]
    return True


def preload(modules: tuple[str, ...] | None = None) -> list[str]:
    """Import `modules` (default :data:`PRELOAD`); returns those that failed (reported
    on stderr)."""
    failed = []
    for name in PRELOAD if modules is None else modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 -- the task that needs it raises it again
            failed.append(name)
            print(f"lakeshard worker daemon: preloading {name} failed; the task that "
                  f"needs it imports it itself:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
    return failed


def main() -> None:
    if "pyspark" not in sys.modules:  # nothing imported it before this module ran
        prefer_installed_pyspark(sys.path)
    # Spark names the module the daemon's workers run (pyspark.daemon's own argument):
    # only the tasks' pyspark.worker needs the preload.
    if sys.argv[1:2] in ([], ["pyspark.worker"]):
        preload()
    from pyspark import daemon

    daemon.manager()


if __name__ == "__main__":
    main()
