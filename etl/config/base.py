"""Building blocks of the config models: the strict, frozen section base class and the
value types every section shares.

Scalars are strict (``batch_size: "8"`` or ``lock: 1`` is an error, not a coercion);
lists in YAML become tuples. Validators raise :class:`FieldError` to name a field
below the model being validated (``FieldError("bands", "...")`` inside ``dedup``
reads ``dedup.bands: ...``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

__all__ = [
    "Section",
    "FieldError",
    "Name",
    "Column",
    "Text",
    "Strings",
    "StrMap",
    "Device",
    "keyed",
    "local_path",
]


class FieldError(ValueError):
    """A validation error about `field` (a dotted path below the model validated)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class Section(BaseModel):
    """A config section: unknown keys are errors, values are checked strictly, and
    the parsed object is immutable (safe to share with executors)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}$")
_COLUMN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:[0-9]+)$")


def _matches(pattern: re.Pattern, what: str):
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{value!r} is not {what}")
        return value

    return AfterValidator(check)


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("expected a non-empty string")
    return value


# A non-empty string.
Text = Annotated[str, AfterValidator(_not_blank)]
# Names of sources, exports, encoders, namespaces: they become folder and column parts.
Name = Annotated[
    str,
    _matches(_NAME_RE, "a valid name (letters, digits, '_' or '-', starting with a letter)"),
]
# A plain column name of the curated table.
Column = Annotated[str, _matches(_COLUMN_RE, "a plain column name")]
# Where a model runs: cpu, cuda (the GPU Spark assigns to the task) or cuda:N.
Device = Annotated[str, _matches(_DEVICE_RE, "one of cpu, cuda, cuda:N")]
# A YAML list of strings.
Strings = Annotated[tuple[Text, ...], Field(strict=False)]


def _scalars_as_text(raw: Any) -> Any:
    """YAML scalars (true, 4, 0.5) as the strings Spark settings and column maps are."""
    if not isinstance(raw, Mapping):
        return raw
    out = {}
    for key, value in raw.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, int | float):
            value = str(value)
        out[str(key)] = value
    return out


# A mapping of strings to strings (scalars are turned into their text).
StrMap = Annotated[dict[str, str], BeforeValidator(_scalars_as_text)]


def keyed(raw: Any) -> Any:
    """``{name: {settings}}`` -> ``{name: {name: name, settings}}``: sections keyed by
    their name in YAML (exports, caption versions, encoders) get it as a field."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        return raw  # the dict type check reports it
    out = {}
    for name, body in raw.items():
        body = {} if body is None else body
        if isinstance(body, Mapping):
            if "name" in body:
                raise FieldError(f"{name}.name", "unknown key 'name' (the key above names it)")
            body = {"name": name, **body}
        out[name] = body
    return out


def local_path(path: str) -> str:
    """An absolute local path: executors and the driver agree on it whatever their
    working directory."""
    return str(Path(path.removeprefix("file://")).expanduser().resolve())
