"""The errors lakeshard raises on purpose; the CLI maps each to a message and an exit
code. Anything else escaping a command is a bug and keeps its traceback."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "TableMissingError",
    "JarsMissingError",
    "UnsupportedSparkError",
    "MissingExtraError",
    "require",
    "RunLockedError",
    "BudgetExceededError",
]


class ConfigError(ValueError):
    """Bad configuration or arguments; the message names the field (and the file)."""


class TableMissingError(FileNotFoundError):
    """A table a command needs does not exist yet; the message says what creates it."""


class JarsMissingError(RuntimeError):
    """The JARs (or the Java runtime) Spark needs are not where the config says."""


class UnsupportedSparkError(JarsMissingError):
    """The Spark this process runs on lacks what lakeshard needs (a version outside the
    supported range): refused before any work, like missing JARs (exit status 2)."""


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require(module: str, extra: str, purpose: str):
    """Import `module`, or raise :class:`MissingExtraError` naming the extra that brings it
    (`pip install 'lakeshard[<extra>]'`)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != module.split(".")[0]:
            raise  # the module is there but one of its own imports is not
        raise MissingExtraError(
            f"{purpose} needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'lakeshard[{extra}]'", name=module) from None


class RunLockedError(RuntimeError):
    """Another run holds the lock of this storage root."""


class BudgetExceededError(RuntimeError):
    """A stage's failed rows exceeded a failure budget (``run.budgets``): the stage and
    the run are recorded ``failed``. The message names the budget, the counts, example
    errors and what to do; `outcome` is what the run did up to there."""

    def __init__(self, message: str, *, stage: str, budget: str, outcome=None):
        super().__init__(message)
        self.stage = stage
        self.budget = budget
        self.outcome = outcome
