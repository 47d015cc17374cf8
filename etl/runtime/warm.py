"""Imports started on a thread while the driver waits for Spark.

A nightly `lakeshard run` is a fresh process: before its first stage it waits seconds
for the driver JVM to start, with its Python thread idle, and later pays imports of its
own on the critical path (the report's matplotlib; streaming's MDS writer, and torch
with it, for an export the driver writes). :func:`import_in_background` starts such
imports on a daemon thread now, so that they overlap the wait; the code that needs a
module imports it as usual, and the import system makes it wait for a module still
being imported. An import that fails on the thread is left for that code to raise.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading

log = logging.getLogger(__name__)

__all__ = ["import_in_background"]


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
