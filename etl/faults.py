"""Named crash points, for the crash-safety tests.

``fault_point("curate:lance_written")`` does nothing unless the environment variable
``LAKESHARD_KILL_AT`` lists that name (comma-separated); then it SIGKILLs the whole
process group it runs in -- the driver, its JVM and the Python workers, as when a
node dies -- with no chance to clean up. Points run on the driver or, for names like
``export:part-00000``, inside an executor task (the workers inherit the environment
in local mode). Tests start the run in its own session so only the run dies.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["KILL_ENV", "fault_point"]

KILL_ENV = "LAKESHARD_KILL_AT"


def fault_point(name: str) -> None:
    points = os.environ.get(KILL_ENV)
    if not points or name not in {p.strip() for p in points.split(",")}:
        return
    print(f"lakeshard: {KILL_ENV}={name}: killing the run now", file=sys.stderr, flush=True)
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)
