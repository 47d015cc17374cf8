"""Which curated rows and columns an export writes, decided before any Spark job.

:func:`export_columns` maps MDS columns to curated columns and checks them against the
table; :func:`latent_export_columns` adds an encoder's stored latents;
:func:`export_rows` leaves out non-canonical duplicates (and rows a takedown names)
and shapes the columns (caption nulls become ``""``, ints are int32) -- image bytes and
latents stay out of the frame and are taken from Lance by row address inside the
writing task.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
import xxhash
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from etl.columns import latent_columns, table_latents
from etl.config import ExportConfig
from etl.errors import ConfigError
from udfs.latents import MDS_DTYPE

__all__ = [
    "FIXED_COLUMNS",
    "export_columns",
    "latent_export_columns",
    "export_rows",
    "ids_fingerprint",
]

# Columns every export has (MDS encodings); `image` holds the stored JPEG bytes unchanged.
FIXED_COLUMNS: dict[str, str] = {
    "image": "jpeg",
    "sample_id": "str",
    "source": "str",
    "width": "int32",
    "height": "int32",
    "original_width": "int32",
    "original_height": "int32",
}


def export_columns(exp: ExportConfig, table_columns: list[str]) -> dict[str, str]:
    """MDS column -> curated column, checked against the table before any Spark job."""
    where = f"exports.{exp.name}"
    mapping = {c: c for c in FIXED_COLUMNS}
    for out, src in exp.captions.items():
        if out in mapping:
            raise ConfigError(f"{where}.captions: {out!r} clashes with the column {out!r}")
        mapping[out] = src
    for col in exp.columns:
        if col in mapping:
            raise ConfigError(f"{where}.columns: {col!r} is already exported")
        mapping[col] = col
    for out, src in mapping.items():
        if src not in table_columns:
            raise ConfigError(
                f"{where}: column {src!r} (for {out!r}) is not in the curated table "
                f"(its columns: {', '.join(table_columns)})"
            )
    return mapping


def latent_export_columns(
    exp: ExportConfig, schema: pa.Schema
) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """For an export with ``latents``: (MDS column -> curated column, MDS column ->
    ``ndarray`` encoding, curated latent columns that must be non-null)."""
    present = {(m["encoder"], m["caption"]): m for m in table_latents(schema)}
    mapping: dict[str, str] = {}
    encodings: dict[str, str] = {}
    required: list[str] = []
    for enc in exp.latents:
        for key, caption in exp.captions.items():
            m = present.get((enc, caption))
            if m is None:
                raise ConfigError(
                    f"exports.{exp.name}.latents: the curated table has no latents of "
                    f"encoder {enc!r} for {caption!r} (caption {key!r}): run "
                    f"`lakeshard latents --encoder {enc}` with {caption!r} in latents.captions"
                )
            names = latent_columns(caption, enc)
            t, h = m["max_tokens"], m["hidden_size"]
            mapping[f"latent_{key}_{enc}"] = names.latent
            encodings[f"latent_{key}_{enc}"] = f"ndarray:{MDS_DTYPE[m['dtype']]}:{t},{h}"
            mapping[f"attention_mask_{key}_{enc}"] = names.mask
            encodings[f"attention_mask_{key}_{enc}"] = f"ndarray:uint8:{t}"
            required.append(names.latent)
    return mapping, encodings, required


def export_rows(curated: DataFrame, mapping: dict[str, str], *, captions: set[str],
                fetched: set[str], duplicates: DataFrame | None, row_address: str,
                identity: str | None = None) -> DataFrame:
    """The rows and columns to write: `curated` without the `duplicates` ids (those
    dedup marks non-canonical, and any a takedown names), with the
    row address (to take `fetched` columns from Lance in the task) and every other
    mapped column, renamed to its MDS name. A caption a sample lacks is ``""`` (it
    trains unconditionally), never null. `identity` (a curated column, e.g. the image's
    sha256) comes along as ``_identity``: part of a row's fingerprint, not written."""
    if duplicates is not None:
        curated = curated.join(duplicates, "sample_id", "left_anti")
    selected = [F.col(row_address)]
    if identity is not None:
        selected.append(F.col(identity).alias("_identity"))
    for out, src in mapping.items():
        if out in fetched:
            continue
        col = F.col(src)
        if out in captions:
            col = F.coalesce(col.cast("string"), F.lit(""))
        elif FIXED_COLUMNS.get(src) == "int32":
            col = col.cast("int")
        selected.append(col.alias(out))
    return curated.select(*selected)


def ids_fingerprint(ids: DataFrame | Iterable[str]) -> int:
    """A content fingerprint of a set of sample ids (order-free): an unchanged set keeps
    an export's key, so a rerun stays a no-op. `ids`: a frame's ``sample_id`` column
    (one Spark aggregate), or ids the driver holds, hashed in this process as Spark
    does -- ``xxhash64`` of a string is XXH64 of its UTF-8 bytes with seed 42, as a
    signed long (bit for bit, or an export's key would change with the path that
    computed it)."""
    if isinstance(ids, DataFrame):
        row = ids.select(F.bit_xor(F.xxhash64("sample_id")).alias("h")).first()
        return row["h"] or 0
    h = 0
    for sid in ids:
        h ^= xxhash.xxh64_intdigest(sid.encode("utf-8"), seed=42)
    return h - (1 << 64) if h >= 1 << 63 else h
