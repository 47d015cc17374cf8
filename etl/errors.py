"""The errors lakeshard raises on purpose; the CLI maps each to a message and an exit
code. Anything else escaping a command is a bug and keeps its traceback."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "TableMissingError",
    "JarsMissingError",
    "RunLockedError",
]


class ConfigError(ValueError):
    """Bad configuration or arguments; the message names the field (and the file)."""


class TableMissingError(FileNotFoundError):
    """A table a command needs does not exist yet; the message says what creates it."""


class JarsMissingError(RuntimeError):
    """The JARs (or the Java runtime) Spark needs are not where the config says."""


class RunLockedError(RuntimeError):
    """Another run holds the lock of this storage root."""
