"""Library warnings that every Spark Python worker would repeat, printed once.

A model-backed stage runs one Python worker per task slot, and each loads the same
library, which prints the same warnings (transformers' processor notice, a deprecation):
on a laptop, every line N times in the driver's console; on a cluster, in every
executor's log. :func:`show_once` makes the first worker of an executor print a given
warning and the others skip it: per distinct message, a marker file is created
exclusively in the Spark application's files folder on that executor
(``SparkFiles.getRootDirectory()``, removed with the application), and only the worker
that creates it prints. Outside a Spark task it does nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings

__all__ = ["show_once"]

_INSTALLED: set[str] = set()


class _FirstInExecutor(logging.Filter):
    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def first(self, text: str) -> bool:
        name = hashlib.sha1(text.encode("utf-8", "replace")).hexdigest()
        try:
            os.close(os.open(os.path.join(self.folder, name),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return True
        except FileExistsError:
            return False
        except OSError:  # a folder we cannot write: printing twice beats printing never
            return True

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        return self.first(f"{record.name}:{record.levelno}:{record.getMessage()}")


def _executor_folder() -> str | None:
    try:
        from pyspark import SparkFiles, TaskContext
    except ImportError:
        return None
    if TaskContext.get() is None:
        return None
    folder = os.path.join(SparkFiles.getRootDirectory(), "lakeshard-shown-once")
    os.makedirs(folder, exist_ok=True)
    return folder


def show_once(*libraries: str) -> None:
    """In this Python worker: Python warnings, and the warnings of `libraries`' own log
    handlers (``"transformers"``), print only where they are first in the executor.
    Call it in a task before the library loads anything; idempotent."""
    folder = _executor_folder()
    if folder is None:
        return
    once = _FirstInExecutor(folder)
    if "warnings" not in _INSTALLED:
        _INSTALLED.add("warnings")
        show = warnings.showwarning

        def show_first(message, category, filename, lineno, file=None, line=None):
            if once.first(f"{category.__name__}:{filename}:{lineno}:{message}"):
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = show_first
    for name in libraries:
        if name in _INSTALLED:
            continue
        _INSTALLED.add(name)
        if name == "transformers":
            # transformers logs through a handler of its own on its library logger,
            # created on first use: create it now to filter it.
            from transformers.utils import logging as hf_logging

            hf_logging.get_logger("transformers")
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(once)
