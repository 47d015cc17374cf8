"""The errors lakeshard raises on purpose; the CLI maps each to a message and an exit
code. Anything else escaping a command is a bug and keeps its traceback."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "TableMissingError",
    "JarsMissingError",
    "RunLockedError",
    "BudgetExceededError",
]


class ConfigError(ValueError):
    """Bad configuration or arguments; the message names the field (and the file)."""


class TableMissingError(FileNotFoundError):
    """A table a command needs does not exist yet; the message says what creates it."""


class JarsMissingError(RuntimeError):
    """The JARs (or the Java runtime) Spark needs are not where the config says."""


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
