"""A command's options as one typed object: a frozen dataclass per command, declared
beside its stage (``DedupOptions`` above ``etl.jobs.dedup.stage``).

Each field is one command-line flag: its name, help and default are the field's, the
rest (a metavar, a positional, a required flag, a mutually exclusive group) is in the
field's :func:`flag` metadata, which the CLI builds its parser from. A field's default
says what the flag is: ``False`` a switch (``store_true``), a tuple a repeatable flag
(``action="append"``), anything else a value (``type=`` converts it). A stage reads its
options with ``ctx.options_for(DedupOptions)`` -- a misspelt attribute is an
AttributeError --, and a key no field names is a TypeError (:func:`options_from`), never
a silent default.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Flag", "flag", "flags", "is_options", "options_from", "positive"]


def positive(text: str) -> int:
    """An integer >= 1 (``--limit``, ``--sample``): argparse names the flag on failure."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class Flag:
    """How one options field appears on the command line."""

    help: str | None = None
    name: str | None = None  # default: --field-name; "-k" or "--sample-id" when it differs
    positional: bool = False  # `lakeshard sql QUERY`
    nargs: str | None = None  # "*" for a positional list
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    required: bool = False
    type: Callable[[str], Any] | None = None  # converts a value flag's text
    group: str | None = None  # flags of one group exclude each other (--recompute | --drop)


def flag(default: Any = None, help: str | None = None, **how: Any) -> Any:
    """An options field with its flag: ``full: bool = flag(False, "recompare every row")``."""
    meta = {"flag": Flag(help=help, **how)}
    if isinstance(default, list):
        raise TypeError("a repeatable option's default is a tuple, not a list")
    return dataclasses.field(default=default, metadata=meta)


def is_options(obj: Any) -> bool:
    """An instance of a frozen options dataclass."""
    return (dataclasses.is_dataclass(obj) and not isinstance(obj, type)
            and obj.__dataclass_params__.frozen)


def flags(cls: type) -> list[tuple[dataclasses.Field, Flag]]:
    """Each field of an options class with its flag, in declaration order."""
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise TypeError(f"{cls.__name__}: options are a frozen dataclass")
    return [(f, f.metadata.get("flag") or Flag()) for f in dataclasses.fields(cls)]


def options_from(cls: type, values: Mapping[str, Any] | None = None) -> Any:
    """``cls`` from a mapping (parsed flags, a caller's dict): a key no field names is a
    TypeError naming it and the known ones (a bug in the caller, never a silent
    default); a repeatable option's values become a tuple."""
    values = dict(values or {})
    fields = {f.name: f for f, _ in flags(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown option(s) {', '.join(map(repr, unknown))} "
                          f"(known: {', '.join(fields) or 'none'})")
    for name, value in values.items():
        if isinstance(fields[name].default, tuple) and value is not None:
            values[name] = tuple(value)
    return cls(**values)
