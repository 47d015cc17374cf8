"""`image_folder`: a directory tree of images with optional sidecars.

`<stem>.txt` holds the caption; `<stem>.json` may hold the caption and other fields
(`columns:` maps common fields to JSON fields, default `caption: caption`; a `.txt`
caption wins). The listing runs on the driver (local or fsspec), so every file is
counted (Spark's file scan would skip zero-length files) and each record's
fingerprint is the size and mtime of the image and its sidecars: a nightly run
re-reads only what changed. Image bytes are not read here: `image_ref` points at
the file and curate reads it only for new or changed records.
"""

from __future__ import annotations

import json

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from etl.config import ConfigError, SourceConfig
from etl.sources.base import (
    FLAG_KEYS,
    SourceAdapter,
    is_local_path,
    local_path,
    require_exists,
)
from etl.sources.listing import fingerprint, list_files
from etl.sources.records import RAW_SCHEMA, map_fields

__all__ = ["ImageFolderSource", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
_SIDECAR_CAP = 1 << 20

_SIDECAR_FIELDS = [
    "caption_original", "license", "upstream_quality", "upstream_nsfw",
    "upstream_watermark", "upstream_pii", "metadata_json", "read_status", "read_reason",
]
_SIDECAR_TYPE = T.StructType([RAW_SCHEMA[f] for f in _SIDECAR_FIELDS])


class ImageFolderSource(SourceAdapter):
    kind = "image_folder"
    mappable = frozenset({"caption", "license"}) | FLAG_KEYS

    def check_inputs(self, source: SourceConfig) -> None:
        require_exists(source)
        if is_local_path(source.path) and not local_path(source.path).is_dir():
            raise ConfigError(
                f"source {source.name!r}: path {source.path!r} is not a directory "
                "(field sources[].path; kind image_folder reads a folder)"
            )

    def read(
        self, spark: SparkSession, source: SourceConfig, skip: frozenset[str] = frozenset(),
        version: int | None = None,
    ) -> DataFrame:
        files = list_files(source.path)
        by_stem: dict[str, dict] = {}
        for f in files:
            stem, _, ext = f.rel.rpartition(".")
            if not stem:
                continue
            by_stem.setdefault(stem, {}).setdefault(ext.lower(), f)
        rows = []
        for f in files:
            stem, _, ext = f.rel.rpartition(".")
            if not stem or ext.lower() not in IMAGE_EXTENSIONS:
                continue
            side = by_stem.get(stem, {})
            txt, js = side.get("txt"), side.get("json")
            fp = "|".join(
                [fingerprint(f)] + [f"{k}:{fingerprint(s)}" for k, s in
                                    (("txt", txt), ("json", js)) if s is not None]
            )
            rows.append((f.rel, f.uri, txt.uri if txt else None, js.uri if js else None, fp))
        listing = spark.createDataFrame(
            rows,
            "source_key string, source_uri string, txt_uri string, json_uri string, "
            "fingerprint string",
        )
        mapping = {"caption": "caption", **dict(source.columns)}
        side = _sidecar_udf(mapping)(F.col("txt_uri"), F.col("json_uri"))
        out = listing.withColumn("_side", side).select(
            "source_key",
            "source_uri",
            *[F.col("_side")[c].alias(c) for c in _SIDECAR_FIELDS],
            F.lit(None).cast("binary").alias("image_bytes"),
            F.col("source_uri").alias("image_ref"),
            F.lit(None).cast("long").alias("image_offset"),
            F.lit(None).cast("long").alias("image_length"),
            "fingerprint",
        )
        return out.select(*RAW_SCHEMA.fieldNames())


def _sidecar_udf(mapping: dict[str, str]):
    def parse(txt_uri, json_uri):
        from etl.config import FetchConfig
        from udfs.fetch import fetch_ref
        from udfs.outcomes import INTERNAL_ERROR

        opts = FetchConfig(max_bytes=_SIDECAR_CAP)
        record: dict = {}
        bad = None
        internal = None  # the fetch code itself failed: not a bad sidecar
        if json_uri:
            res = fetch_ref(json_uri, opts=opts)
            if res.status == INTERNAL_ERROR:
                internal = res.detail
            try:
                if res.status != "ok":
                    raise ValueError(res.status)
                record = json.loads(res.data.decode("utf-8")) if res.data.strip() else {}
                if not isinstance(record, dict):
                    raise ValueError("not a JSON object")
            except (ValueError, UnicodeDecodeError):
                record, bad = {}, "invalid_sidecar"
        out = map_fields(record, mapping)
        if txt_uri:
            res = fetch_ref(txt_uri, opts=opts)
            if res.status == INTERNAL_ERROR:
                internal = internal or res.detail
            try:
                text = res.data.decode("utf-8").strip() if res.status == "ok" else None
            except UnicodeDecodeError:
                text, bad = None, bad or "invalid_caption"
            if text:
                if out["read_reason"] in ("missing_caption", "invalid_caption"):
                    out.update(read_status="ok", read_reason=None)
                out["caption_original"] = text
        if internal is not None:  # counted apart and retried, whatever else the row says
            out.update(read_status="rejected", read_reason=INTERNAL_ERROR,
                       metadata_json=json.dumps({"detail": internal}))
        elif bad is not None and out["read_status"] == "ok":
            out.update(read_status="rejected", read_reason=bad)
        return out

    return F.udf(parse, _SIDECAR_TYPE)
