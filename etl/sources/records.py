"""Turning one source record (a dict: a table row, a JSON sidecar) into the common
fields, in Python, inside Spark tasks. Shared by every adapter that reads records
itself (tables, tars, sidecars) so the rules are the same everywhere:

* the caption must be a string: a field that is present but null or blank is
  ``missing_caption``, a number/list/object is ``invalid_caption`` (the record is
  rejected at ingest; a record with *no* caption field at all is kept uncaptioned);
* upstream flags (quality, NSFW, watermark, PII) are copied, never recomputed;
* every other non-binary field goes to ``metadata_json``;
* a caption longer than the source's ``max_caption_chars`` is ``caption_too_long``
  (the same rule for a .txt sidecar or tar member, a JSON field and a table column);
* JSON from a source (sidecars, tar members, JSONL lines) is parsed with bounded
  nesting (:data:`MAX_JSON_DEPTH`) and size: a bad one is a :class:`RecordError` for
  that record, never an exception (200,000 ``[`` would otherwise blow the stack).
"""

from __future__ import annotations

import datetime as _dt
import decimal
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql import types as T

from etl.schema import SOURCE_SCHEMA

__all__ = [
    "RAW_SCHEMA", "RAW_ARROW_SCHEMA", "FLAG_COLUMNS", "MISSING", "raw_row", "map_fields", "lookup",
    "RecordError", "MAX_JSON_DEPTH", "SIDECAR_MAX_BYTES", "SIDECAR_TIMEOUT_S", "CAPTION_REASONS",
    "parse_json", "parse_json_object", "text_caption", "caption_bytes", "sidecar_problem",
]

# Deepest nesting of JSON a source may hold (objects and arrays); deeper is rejected.
MAX_JSON_DEPTH = 64
# Largest JSON sidecar (folder file or tar member) read; larger is invalid_sidecar.
SIDECAR_MAX_BYTES = 1 << 20
# Deadline of one sidecar read.
SIDECAR_TIMEOUT_S = 10.0
# Caption outcomes a .txt caption beside a JSON sidecar overrides.
CAPTION_REASONS = ("missing_caption", "invalid_caption", "caption_too_long")
# A string (to its closing quote or the end: a started match never fails, so the scan
# is linear whatever the input) or a bracket.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)|[\[\]{}]', re.DOTALL)


@dataclass(frozen=True)
class RecordError:
    """Why one record's data cannot be used: a reject reason and its detail."""

    reason: str
    detail: str


def _too_deep(text: str, max_depth: int) -> bool:
    if text.count("[") + text.count("{") <= max_depth:
        return False  # the common case, answered in C
    depth = 0
    for m in _JSON_TOKENS.finditer(text):
        tok = m.group()
        if tok in "[{":
            depth += 1
            if depth > max_depth:
                return True
        elif tok in "]}":
            depth -= 1
    return False


def parse_json(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON value from a source, or a RecordError (reason ``malformed_json``): bad
    UTF-8, bad syntax, nesting deeper than `max_depth`."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    except UnicodeDecodeError as exc:
        return RecordError("malformed_json", f"not UTF-8: {exc.reason} at byte {exc.start}")
    if _too_deep(text, max_depth):
        return RecordError("malformed_json", f"nested deeper than {max_depth}")
    try:
        return json.loads(text)
    except RecursionError:  # nesting hidden from the scan: still this record's fault
        return RecordError("malformed_json", f"nested deeper than {max_depth}")
    except ValueError as exc:
        return RecordError("malformed_json", f"not JSON: {str(exc)[:200]}")


def parse_json_object(data: bytes | str, max_depth: int = MAX_JSON_DEPTH
                      ) -> dict | RecordError:
    """A JSON sidecar: an object (blank: an empty one), else a RecordError."""
    if not (data.strip() if isinstance(data, (bytes, str)) else data):
        return {}
    value = parse_json(data, max_depth)
    if isinstance(value, RecordError):
        return value
    if not isinstance(value, dict):
        return RecordError("malformed_json", f"not a JSON object but a {type(value).__name__}")
    return value


def caption_bytes(max_chars: int) -> int:
    """The most bytes a caption of `max_chars` characters takes in UTF-8 (with room
    for surrounding white space): the read cap of a caption file."""
    return 4 * max_chars + 1024


def text_caption(data: bytes, max_chars: int) -> str | None | RecordError:
    """A caption file's text, stripped (None: blank), or a RecordError."""
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return RecordError("invalid_caption", "not UTF-8 text")
    if len(text) > max_chars:
        return RecordError("caption_too_long", f"{len(text)} characters, over {max_chars}")
    return text or None


def sidecar_problem(status: str, detail: str | None, kind: str) -> tuple[str, str]:
    """The reject (reason, detail) of a sidecar (`kind`: txt or json) that could not be
    read: a link or a special file keeps its reason, an oversized one is
    caption_too_long (txt) or invalid_sidecar (json)."""
    what = f"the .{kind} sidecar"
    if status in ("symlink", "not_a_file", "timeout", "missing_file"):
        return status, f"{what}: {detail}"
    if status == "too_large":
        return ("caption_too_long" if kind == "txt" else "invalid_sidecar",
                f"{what} is too large ({detail})")
    return ("invalid_caption" if kind == "txt" else "invalid_sidecar",
            f"{what}: {status}: {detail}")

# What an adapter's `read` returns: the source columns minus the two finish_ingest adds.
RAW_SCHEMA = T.StructType(
    [f for f in SOURCE_SCHEMA.fields if f.name not in ("sample_id", "source")]
)


def _arrow_schema() -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(RAW_SCHEMA)


RAW_ARROW_SCHEMA = _arrow_schema()

# mapping key -> (common column, python type)
FLAG_COLUMNS = {
    "quality": ("upstream_quality", float),
    "nsfw": ("upstream_nsfw", str),
    "watermark": ("upstream_watermark", float),
    "pii": ("upstream_pii", str),
}
MISSING = _MISSING = object()


def lookup(record: Mapping[str, Any], dotted: str) -> Any:
    """`a.b` looks into nested dicts (Hugging Face `image.bytes`); _MISSING if absent."""
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time, decimal.Decimal)):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _flag(value: Any, kind: type) -> Any:
    if value is _MISSING or value is None:
        return None
    if kind is float:
        if isinstance(value, bool):
            return float(value)
        try:
            out = float(value)
        except (TypeError, ValueError):
            return None
        return out if math.isfinite(out) else None
    return value if isinstance(value, str) else json.dumps(_jsonable(value))


def map_fields(record: Mapping[str, Any], mapping: Mapping[str, str],
               *, exclude: frozenset[str] = frozenset(),
               max_caption_chars: int | None = None) -> dict[str, Any]:
    """caption_original, license, upstream_*, metadata_json, read_status/reason."""
    out: dict[str, Any] = {"read_status": "ok", "read_reason": None}
    caption = lookup(record, mapping["caption"]) if "caption" in mapping else _MISSING
    if caption is _MISSING:
        out["caption_original"] = None
    elif caption is None or (isinstance(caption, str) and not caption.strip()):
        out.update(caption_original=None, read_status="rejected", read_reason="missing_caption")
    elif not isinstance(caption, str):
        out.update(caption_original=None, read_status="rejected", read_reason="invalid_caption")
    elif max_caption_chars is not None and len(caption.strip()) > max_caption_chars:
        out.update(caption_original=None, read_status="rejected",
                   read_reason="caption_too_long")
    else:
        out["caption_original"] = caption.strip()
    lic = lookup(record, mapping["license"]) if "license" in mapping else _MISSING
    out["license"] = lic if isinstance(lic, str) and lic else None
    for key, (column, kind) in FLAG_COLUMNS.items():
        out[column] = _flag(lookup(record, mapping[key]), kind) if key in mapping else None
    used = {c.split(".", 1)[0] for c in mapping.values()} | set(exclude)
    rest = {k: _jsonable(v) for k, v in record.items()
            if k not in used and not isinstance(v, (bytes, bytearray, memoryview))}
    out["metadata_json"] = json.dumps(rest, sort_keys=True, default=str) if rest else None
    return out


def raw_row(**values: Any) -> dict[str, Any]:
    """A full RAW_SCHEMA row: unspecified columns are null."""
    row = dict.fromkeys(RAW_SCHEMA.fieldNames())
    row.update(values)
    return row
