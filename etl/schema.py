"""The common schema every source adapter produces, and the curated table's schema.

Everything else imports these definitions; nothing re-declares a column list.
"""

from __future__ import annotations

import hashlib

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

__all__ = [
    "arrow_schema",
    "SAMPLE_ID_SEPARATOR",
    "INGEST_SCHEMA",
    "INGEST_COLUMNS",
    "CURATED_SCHEMA",
    "CURATED_COLUMNS",
    "REJECTS_SCHEMA",
    "DEDUP_SCHEMA",
    "DUP_KINDS",
    "RUNS_SCHEMA",
    "UPSTREAM_FIELDS",
    "UPSTREAM_COLUMNS",
    "SOURCE_SCHEMA",
    "SOURCE_COLUMNS",
    "MANIFEST_SCHEMA",
    "ACCOUNTING_SCHEMA",
    "REMOVED",
    "REMOVAL_REASONS",
    "TAKEDOWN_KINDS",
    "TAKEDOWNS_SCHEMA",
    "sample_id_col",
    "sample_id_of",
]

# The separator between source name and source key when hashing the sample id. A
# control character cannot occur in a source name, so ("a", "b_c") and ("a_b", "c")
# never collide.
SAMPLE_ID_SEPARATOR = "\x1f"

# Which record a row is: the lineage every table carries first.
_RECORD_FIELDS = [
    T.StructField("sample_id", T.StringType(), False),
    T.StructField("source", T.StringType(), False),
    T.StructField("source_key", T.StringType(), False),
    T.StructField("source_uri", T.StringType(), True),
]
# What the source said about it.
_SOURCE_FIELDS = [
    T.StructField("caption_original", T.StringType(), True),
    T.StructField("license", T.StringType(), True),
    T.StructField("metadata_json", T.StringType(), True),
]

# What every source adapter returns: one row per input record, before image work.
# `read_status`/`read_reason` carry per-record read failures (a missing file, null
# bytes) so that no record is dropped before it is counted.
INGEST_SCHEMA = T.StructType(
    _RECORD_FIELDS
    + _SOURCE_FIELDS
    + [
        T.StructField("image_bytes", T.BinaryType(), True),
        T.StructField("read_status", T.StringType(), False),
        T.StructField("read_reason", T.StringType(), True),
    ]
)
INGEST_COLUMNS = tuple(INGEST_SCHEMA.fieldNames())

# The curated Lance table: one row per accepted sample, kept or flagged.
CURATED_SCHEMA = T.StructType(
    _RECORD_FIELDS
    + _SOURCE_FIELDS
    + [
        T.StructField("image", T.BinaryType(), False),
        T.StructField("width", T.IntegerType(), False),
        T.StructField("height", T.IntegerType(), False),
        T.StructField("original_width", T.IntegerType(), False),
        T.StructField("original_height", T.IntegerType(), False),
        T.StructField("original_format", T.StringType(), True),
        # Byte counts: the source's encoded image, and the stored JPEG (`image`).
        T.StructField("original_size_bytes", T.LongType(), False),
        T.StructField("image_size_bytes", T.LongType(), False),
        T.StructField("image_sha256", T.StringType(), False),
        # 64-bit difference hash of the stored image (udfs.images.dhash64), signed.
        T.StructField("dhash", T.LongType(), False),
        T.StructField("aspect_ratio", T.DoubleType(), False),
        T.StructField("flags", T.ArrayType(T.StringType(), False), False),
        T.StructField("keep", T.BooleanType(), False),
        T.StructField("filter_reason", T.StringType(), True),
        T.StructField("run_id", T.StringType(), False),
        T.StructField("ingested_at", T.TimestampType(), False),
    ]
)
CURATED_COLUMNS = tuple(CURATED_SCHEMA.fieldNames())

# The Delta `rejects` table: one row per record that did not make it, and why.
REJECTS_SCHEMA = T.StructType(
    _RECORD_FIELDS
    + [
        T.StructField("stage", T.StringType(), False),
        T.StructField("reason", T.StringType(), False),
        T.StructField("detail", T.StringType(), True),
        T.StructField("run_id", T.StringType(), False),
    ]
)

# The Delta `dedup` table: one row per curated sample, its duplicate cluster and role.
# dup_kind is the row's relation to its cluster's canonical member (DUP_KINDS).
DUP_KINDS = ("unique", "canonical", "exact", "near")
DEDUP_SCHEMA = T.StructType(
    [
        T.StructField("sample_id", T.StringType(), False),
        T.StructField("source", T.StringType(), False),
        T.StructField("image_sha256", T.StringType(), False),
        T.StructField("dhash", T.LongType(), False),
        T.StructField("dup_cluster_id", T.StringType(), False),
        T.StructField("is_canonical", T.BooleanType(), False),
        T.StructField("dup_kind", T.StringType(), False),
        T.StructField("cluster_size", T.LongType(), False),
        T.StructField("run_id", T.StringType(), False),
    ]
)

# The Delta `runs` ledger: one row per run (stage = "run") and per stage of a run.
_COUNTS = T.MapType(T.StringType(), T.LongType(), False)
RUNS_SCHEMA = T.StructType(
    [
        T.StructField("run_id", T.StringType(), False),
        T.StructField("stage", T.StringType(), False),
        T.StructField("status", T.StringType(), False),  # running|ok|failed|crashed|skipped
        T.StructField("config_hash", T.StringType(), False),
        T.StructField("code_version", T.StringType(), False),
        T.StructField("host", T.StringType(), True),
        T.StructField("started_at", T.TimestampType(), False),
        T.StructField("ended_at", T.TimestampType(), True),
        T.StructField("seconds", T.DoubleType(), True),
        T.StructField("inputs", _COUNTS, True),
        T.StructField("outputs", _COUNTS, True),
        T.StructField("table_versions", _COUNTS, True),
        T.StructField("export_manifests", T.StringType(), True),  # JSON
        T.StructField("note", T.StringType(), True),
        # When the event was appended (the ledger is append-only: the latest event of a
        # (run_id, stage) is its status). Null on rows a MERGE-era ledger wrote.
        T.StructField("recorded_at", T.TimestampType(), True),
    ]
)


# Curation a source already carries, kept as the source gave it (never recomputed):
# `columns: {quality: aesthetic, nsfw: NSFW, watermark: pwatermark, pii: pii}`.
UPSTREAM_FIELDS = [
    T.StructField("upstream_quality", T.DoubleType(), True),
    T.StructField("upstream_nsfw", T.StringType(), True),
    T.StructField("upstream_watermark", T.DoubleType(), True),
    T.StructField("upstream_pii", T.StringType(), True),
]
UPSTREAM_COLUMNS = tuple(f.name for f in UPSTREAM_FIELDS)

# Where a record's image is when the source does not embed it: a URI (local path,
# file://, http(s)://, s3://, or a tar shard) and an optional byte range inside it.
_IMAGE_REF_FIELDS = [
    T.StructField("image_ref", T.StringType(), True),
    T.StructField("image_offset", T.LongType(), True),
    T.StructField("image_length", T.LongType(), True),
]
# What a source adapter returns (after `finish_ingest`): the ingest columns, the
# upstream flags, the image reference, and the record's fingerprint (file size and
# modification time for folders and tars; null for tables, which are keyed).
SOURCE_SCHEMA = T.StructType(
    list(INGEST_SCHEMA.fields)
    + UPSTREAM_FIELDS
    + _IMAGE_REF_FIELDS
    + [T.StructField("fingerprint", T.StringType(), True)]
)
SOURCE_COLUMNS = tuple(SOURCE_SCHEMA.fieldNames())

# A record that left: the manifest's status, and why (the `reason` of the row).
# `source_removed`: its source no longer lists it; `taken_down`: `lakeshard forget`.
REMOVED = "removed"
REMOVAL_REASONS = ("source_removed", "taken_down")

# The bronze manifest (Delta, `<root>/delta/manifest`): one row per source record ever ingested,
# accepted, rejected or removed, MERGEd on sample_id. It references the image (source_uri /
# image_ref) instead of copying it; the prepared JPEG lives in the curated table.
MANIFEST_SCHEMA = T.StructType(
    _RECORD_FIELDS
    + _SOURCE_FIELDS
    + UPSTREAM_FIELDS
    + _IMAGE_REF_FIELDS
    + [
        T.StructField("fingerprint", T.StringType(), True),
        T.StructField("status", T.StringType(), False),  # accepted | rejected | removed
        # Where a reject happened; for a removed record, the table it left (curated for
        # a record that had been accepted, rejects for one that had been rejected).
        T.StructField("stage", T.StringType(), True),
        T.StructField("reason", T.StringType(), True),
        T.StructField("run_id", T.StringType(), False),
        T.StructField("ingested_at", T.TimestampType(), False),
        # sha256 of the source's image bytes as fetched (before prepare): what a takedown
        # by image hash also matches. Null for records read before lakeshard kept it.
        T.StructField("original_sha256", T.StringType(), True),
        T.StructField("removed_at", T.TimestampType(), True),
    ]
)

# The Delta `accounting` table: per run and source, how many records ended where.
# status: accepted | rejected | unchanged (already in the manifest, not reprocessed) |
# removed (left every table this run: stage = the table it left, reason = why).
ACCOUNTING_SCHEMA = T.StructType(
    [
        T.StructField("run_id", T.StringType(), False),
        T.StructField("run_at", T.TimestampType(), False),
        T.StructField("source", T.StringType(), False),
        T.StructField("status", T.StringType(), False),
        T.StructField("stage", T.StringType(), True),
        T.StructField("reason", T.StringType(), True),
        T.StructField("filter_reason", T.StringType(), True),
        T.StructField("count", T.LongType(), False),
    ]
)


# The Delta `takedowns` table: one row per identifier of a takedown request, given or
# found. `origin = given`: as the request named it (kind `key` is SOURCE:KEY, its
# `sample_id` set); `origin = matched`: each identifier of a record the request matched
# (its sample id, its URL when the image is addressed on its own, its image hashes), so
# the same bytes under another name or URL are refused too. Request fields (who, when,
# why, applied, purge) repeat on every row of the request.
TAKEDOWN_KINDS = ("sample_id", "key", "url", "image_sha256")
TAKEDOWNS_SCHEMA = T.StructType(
    [
        T.StructField("request_id", T.StringType(), False),
        T.StructField("requested_at", T.TimestampType(), False),
        T.StructField("requested_by", T.StringType(), True),
        T.StructField("request_reason", T.StringType(), True),
        T.StructField("kind", T.StringType(), False),
        T.StructField("value", T.StringType(), False),
        T.StructField("origin", T.StringType(), False),  # given | matched
        T.StructField("sample_id", T.StringType(), True),
        T.StructField("source", T.StringType(), True),
        T.StructField("run_id", T.StringType(), False),
        # When its records had left every table (null: a run died before that).
        T.StructField("applied_at", T.TimestampType(), True),
        # The first curated version without the removed rows' bytes, and the time from
        # which the versions before it are deleted; when that was done.
        T.StructField("purge_version", T.LongType(), True),
        T.StructField("purge_after", T.TimestampType(), True),
        T.StructField("purged_at", T.TimestampType(), True),
    ]
)


def sample_id_col(source: Column, source_key: Column) -> Column:
    """Stable id: the first 32 hex digits of sha256(source + US + source_key)."""
    joined = F.concat(source, F.lit(SAMPLE_ID_SEPARATOR), source_key)
    return F.substring(F.sha2(joined, 256), 1, 32)


def sample_id_of(source: str, source_key: str) -> str:
    """:func:`sample_id_col` in Python, for ids named on the driver (a takedown by key)."""
    joined = f"{source}{SAMPLE_ID_SEPARATOR}{source_key}".encode()
    return hashlib.sha256(joined).hexdigest()[:32]


def _arrow_type(dtype: T.DataType):
    import pyarrow as pa

    if isinstance(dtype, T.MapType):
        return pa.map_(_arrow_type(dtype.keyType), _arrow_type(dtype.valueType))
    simple = {
        T.StringType: pa.string(), T.LongType: pa.int64(), T.IntegerType: pa.int32(),
        T.DoubleType: pa.float64(), T.BooleanType: pa.bool_(), T.BinaryType: pa.binary(),
        T.TimestampType: pa.timestamp("us", tz="UTC"),
    }
    if type(dtype) not in simple:
        raise TypeError(f"no Arrow type for {dtype.simpleString()}")
    return simple[type(dtype)]


def arrow_schema(schema: T.StructType):
    """`schema` as the Arrow schema delta-rs writes a lakeshard Delta table with (Spark
    reads it back as `schema`); TypeError for a type not mapped."""
    import pyarrow as pa

    return pa.schema([pa.field(f.name, _arrow_type(f.dataType), f.nullable)
                      for f in schema.fields])
