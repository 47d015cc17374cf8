"""Named points where a test makes lakeshard's own executor code raise.

``raise_point("prepare:convert")`` does nothing unless the environment variable
``LAKESHARD_RAISE_AT`` lists that name (comma-separated); then it raises
:class:`InjectedFault`. The point sits in lakeshard's code path, not in the data, so a
test can show that an exception in our own code ends as ``internal_error`` -- and fails
the stage on its budget -- instead of passing for bad data. :class:`InjectedFault` is a
``ValueError``, a type Pillow also raises for bad bytes: what makes it an internal error
is where it was raised, not its type.

The variable reaches Spark's Python workers the way any environment does: inherited in
local mode when set before Spark starts, and through ``SparkContext.environment``, which
the runner fills from the driver's environment before each run (a worker pool is keyed
by it, so a session that is already running gets workers with the fault armed).
The crash points (SIGKILL) are :mod:`etl.runtime.faults`.
"""

from __future__ import annotations

import os

__all__ = ["RAISE_ENV", "InjectedFault", "raise_point"]

RAISE_ENV = "LAKESHARD_RAISE_AT"


class InjectedFault(ValueError):
    """Raised at a point named in ``LAKESHARD_RAISE_AT``."""


def raise_point(name: str) -> None:
    points = os.environ.get(RAISE_ENV)
    if points and name in {p.strip() for p in points.split(",")}:
        raise InjectedFault(f"{RAISE_ENV}={name}: injected fault in lakeshard's own code")
