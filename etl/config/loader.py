"""YAML -> :class:`Config`, with errors that name the file and the field.

pydantic's errors are rewritten in the terms of the YAML a user wrote:
``sources[0] (pics).path: required field is missing``,
``caption.versions.smoke.batch_size: must be >= 1, got 0``,
``storage: unknown key 'rooot' (allowed: namespace, root)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from etl.config.base import FieldError
from etl.config.root import Config
from etl.errors import ConfigError

__all__ = ["parse_config", "load_config", "default_config_text"]

_EXPECTED = {
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "tuple_type": "expected a list",
    "list_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
}
_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def _where(loc: tuple, raw: Any) -> str:
    """``("sources", 0, "path")`` -> ``sources[0] (pics).path``."""
    out = ""
    node = raw
    for part in loc:
        if part == "[key]":  # a mapping's key failed: the key is the previous part
            continue
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
            if isinstance(node, Mapping) and isinstance(node.get("name"), str):
                name = node["name"]  # as written, unless it is not a plain one-line name
                out += f" ({name})" if name.isprintable() and len(name) <= 64 else \
                    f" ({name[:64]!r})"
        else:
            out += f".{part}" if out else str(part)
            node = node.get(part) if isinstance(node, Mapping) else None
    return out or "config"


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The model class validating the mapping at `loc` (for the allowed keys)."""
    model: Any = Config
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        if isinstance(model, type) and issubclass(model, BaseModel):
            field = model.model_fields.get(part)
            model = field.annotation if field else None
        # Unwrap Optional / tuple[X, ...] / dict[str, X] down to a model class.
        while model is not None and get_origin(model) is not None:
            args = [a for a in get_args(model) if a is not type(None) and a is not Ellipsis]
            if get_origin(model) is dict and not isinstance(part, int):
                model = args[-1] if args else None
                break
            model = args[0] if args else None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _message(err: dict, raw: Any) -> str:
    loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
    value = err.get("input")
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        allowed = f" (allowed: {', '.join(sorted(model.model_fields))})" if model else ""
        return f"{_where(loc[:-1], raw)}: unknown key {loc[-1]!r}{allowed}"
    where = _where(loc, raw)
    if kind == "missing":
        return f"{where}: required field is missing"
    if kind in _EXPECTED:
        got = type(value).__name__ if kind.startswith(("dict", "model")) else repr(value)
        return f"{where}: {_EXPECTED[kind]}, got {got}"
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        return f"{where}: must be {op} {ctx[key]}, got {value!r}"
    if kind == "literal_error":
        return f"{where}: {value!r} is not one of {ctx.get('expected')}"
    if kind in ("too_short", "string_too_short"):
        return f"{where}: expected a non-empty {'list' if kind == 'too_short' else 'string'}"
    if kind == "value_error":
        exc = ctx.get("error")
        if isinstance(exc, FieldError):
            return f"{_join(where, exc.field)}: {exc.message}"
        return f"{where}: {exc}"
    return f"{where}: {err['msg']}"


def _join(where: str, field: str) -> str:
    return field if where == "config" else f"{where}.{field}"


def parse_config(raw: Any) -> Config:
    """Parse and validate a config mapping (already loaded from YAML)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config: expected a mapping, got {type(raw).__name__}")
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        # A list whose items failed also reports "too short" (0 valid items): noise.
        errors = [
            e for e in exc.errors()
            if not (e["type"] == "too_short" and isinstance(e.get("input"), list | tuple)
                    and e["input"])
        ] or exc.errors()
        # The first error, in the user's terms; more than one: say how many.
        first = _message(errors[0], raw)
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(first + more) from None


def default_config_text() -> str:
    """The embedded default config (conf/local.yaml, shipped inside the package)."""
    return resources.files("conf").joinpath("local.yaml").read_text(encoding="utf-8")


def load_config(path: str | Path | None = None) -> Config:
    """Load a YAML config file; ``None`` loads the embedded local default."""
    if path is None:
        text, origin = default_config_text(), "embedded conf/local.yaml"
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--conf: config file {str(p)!r} does not exist")
        text, origin = p.read_text(encoding="utf-8"), str(p)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin}: not valid YAML: {exc}") from exc
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc}") from None
