"""Named crash points, for the crash-safety tests.

``fault_point("curate:lance_written")`` does nothing unless the environment variable
``LAKESHARD_KILL_AT`` lists that name (comma-separated); then it SIGKILLs the run's
process group -- the driver, its JVM and the Python daemon, as when a node dies -- and
its own, with no chance to clean up. Points run on the driver or, for names like
``export:part-00000``, inside an executor task: :func:`arm`, called by the driver
before Spark starts, records the driver's process group in the environment that the
JVM and its Python workers inherit (local mode), because Spark's workers run in
process groups of their own. Tests start the run in its own session.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["KILL_ENV", "arm", "fault_point"]

KILL_ENV = "LAKESHARD_KILL_AT"
_PGID_ENV = "LAKESHARD_RUN_PGID"


def arm() -> None:
    """On the driver, before Spark starts: let executor-side points find the run."""
    if os.environ.get(KILL_ENV):
        os.environ[_PGID_ENV] = str(os.getpgrp())


def fault_point(name: str) -> None:
    points = os.environ.get(KILL_ENV)
    if not points or name not in {p.strip() for p in points.split(",")}:
        return
    print(f"lakeshard: {KILL_ENV}={name}: killing the run now", file=sys.stderr, flush=True)
    try:
        run_group = os.environ.get(_PGID_ENV)
        if run_group and int(run_group) != os.getpgrp():
            os.killpg(int(run_group), signal.SIGKILL)  # the driver, from an executor
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)
