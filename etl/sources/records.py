"""Turning one source record (a dict: a table row, a JSON sidecar) into the common
fields, in Python, inside Spark tasks. Shared by every adapter that reads records
itself (tables, tars, sidecars) so the rules are the same everywhere:

* the caption must be a string: a field that is present but null or blank is
  ``missing_caption``, a number/list/object is ``invalid_caption`` (the record is
  rejected at ingest; a record with *no* caption field at all is kept uncaptioned);
* upstream flags (quality, NSFW, watermark, PII) are copied, never recomputed;
* every other non-binary field goes to ``metadata_json``.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import json
import math
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
from pyspark.sql import types as T

from etl.schema import SOURCE_SCHEMA

__all__ = [
    "RAW_SCHEMA", "RAW_ARROW_SCHEMA", "FLAG_COLUMNS", "MISSING", "raw_row", "map_fields", "lookup",
]

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
               *, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """caption_original, license, upstream_*, metadata_json, read_status/reason."""
    out: dict[str, Any] = {"read_status": "ok", "read_reason": None}
    caption = lookup(record, mapping["caption"]) if "caption" in mapping else _MISSING
    if caption is _MISSING:
        out["caption_original"] = None
    elif caption is None or (isinstance(caption, str) and not caption.strip()):
        out.update(caption_original=None, read_status="rejected", read_reason="missing_caption")
    elif not isinstance(caption, str):
        out.update(caption_original=None, read_status="rejected", read_reason="invalid_caption")
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
