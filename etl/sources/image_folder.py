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
from etl.runtime.local import local_frame
from etl.sources.base import (
    FLAG_KEYS,
    SourceAdapter,
    is_local_path,
    local_path,
    require_exists,
)
from etl.sources.listing import fingerprint, list_files, listed_once, listing_digest
from etl.sources.records import (
    CAPTION_REASONS,
    RAW_SCHEMA,
    SIDECAR_MAX_BYTES,
    SIDECAR_TIMEOUT_S,
    RecordError,
    caption_bytes,
    map_fields,
    parse_json_object,
    sidecar_problem,
    text_caption,
)

__all__ = ["ImageFolderSource", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")

_SIDECAR_FIELDS = [
    "caption_original", "license", "upstream_quality", "upstream_nsfw",
    "upstream_watermark", "upstream_pii", "metadata_json", "read_status", "read_reason",
]
_SIDECAR_TYPE = T.StructType([RAW_SCHEMA[f] for f in _SIDECAR_FIELDS])
# One row of the driver's listing (ImageFolderSource._listed).
_LISTING_FIELDS = ("source_key", "source_uri", "txt_uri", "json_uri", "fingerprint",
                   "problem", "problem_detail")


def _listing_type() -> T.StructType:
    return T.StructType([T.StructField(f, T.StringType(), True) for f in _LISTING_FIELDS])


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

    def listing_digest(self, source: SourceConfig) -> str | None:
        return listing_digest(list_files(source.path, source.follow_symlinks))

    def driver_listing(self, source: SourceConfig) -> dict[str, str | None]:
        return {row[0]: row[4] for row in self._listed(source)}

    def read_keys(self, spark: SparkSession, source: SourceConfig,
                  keys: frozenset[str], on_driver: bool = False) -> DataFrame:
        return self._frame(spark, source, [r for r in self._listed(source) if r[0] in keys],
                           on_driver)

    def read(
        self, spark: SparkSession, source: SourceConfig, skip: frozenset[str] = frozenset(),
        version: int | None = None,
    ) -> DataFrame:
        return self._frame(spark, source, self._listed(source))

    @staticmethod
    def _listed(source: SourceConfig) -> list[tuple]:
        """One row per image, listed on the driver: key, URI, sidecar URIs, fingerprint,
        and the problem that keeps it from being read (None, or reason and detail).
        Within :func:`~etl.sources.listing.one_listing`, made once per folder."""
        return listed_once(("image_folder", source.path, source.follow_symlinks),
                           lambda: ImageFolderSource._rows(source))

    @staticmethod
    def _rows(source: SourceConfig) -> list[tuple]:
        files = list_files(source.path, source.follow_symlinks)
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
            # A record whose image or sidecar may not be read: rejected, nothing opened.
            bad = next(((g, g.problem) for g in (f, txt, js)
                        if g is not None and g.problem is not None), None)
            problem = None if bad is None else \
                (bad[1][0], f"{bad[0].rel.rsplit('/', 1)[-1]!r}: {bad[1][1]}")
            rows.append((
                f.rel, f.uri,
                None if problem else (txt.uri if txt else None),
                None if problem else (js.uri if js else None),
                fp, problem[0] if problem else None, problem[1] if problem else None,
            ))
        return rows

    @staticmethod
    def _frame(spark: SparkSession, source: SourceConfig, rows: list[tuple],
               on_driver: bool = False) -> DataFrame:
        """The rows' source columns; `on_driver`: their sidecars parsed here, not by a
        Python UDF (a handful of records: no Python worker for them)."""
        mapping = {"caption": "caption", **dict(source.columns)}
        parse = _sidecar_parser(mapping, source.max_caption_chars, source.follow_symlinks)
        if on_driver:  # local data: the plans over it fold (no Spark job)
            listing = local_frame(spark, [(*r, parse(r[2], r[3])) for r in rows],
                                  _listing_type().add("_side", _SIDECAR_TYPE, True))
        else:
            listing = spark.createDataFrame(rows, _listing_type()).withColumn(
                "_side", F.udf(parse, _SIDECAR_TYPE)(F.col("txt_uri"), F.col("json_uri")))
        listed_ok = F.col("problem").isNull()
        fields = {c: F.col("_side")[c] for c in _SIDECAR_FIELDS}
        fields["read_status"] = F.when(listed_ok, fields["read_status"]).otherwise("rejected")
        fields["read_reason"] = F.when(listed_ok, fields["read_reason"]) \
            .otherwise(F.col("problem"))
        fields["metadata_json"] = F.when(listed_ok, fields["metadata_json"]).otherwise(
            F.to_json(F.struct(F.col("problem_detail").alias("detail"))))
        out = listing.select(
            "source_key",
            "source_uri",
            *[fields[c].alias(c) for c in _SIDECAR_FIELDS],
            F.lit(None).cast("binary").alias("image_bytes"),
            F.when(listed_ok, F.col("source_uri")).alias("image_ref"),
            F.lit(None).cast("long").alias("image_offset"),
            F.lit(None).cast("long").alias("image_length"),
            "fingerprint",
        )
        return out.select(*RAW_SCHEMA.fieldNames())


def _sidecar_parser(mapping: dict[str, str], max_caption_chars: int, follow_symlinks):
    """(txt URI, json URI) -> the record's sidecar fields (:data:`_SIDECAR_TYPE`)."""

    def parse(txt_uri, json_uri):
        from udfs.fetch import RefRules, fetch_ref
        from udfs.outcomes import INTERNAL_ERROR

        # Sidecars are read as the listing found them, with the folder's link rule.
        rules = RefRules(follow_symlinks=follow_symlinks is not False)
        record: dict = {}
        bad = None
        internal = None  # the fetch code itself failed: not a bad sidecar
        if json_uri:
            res = fetch_ref(json_uri, opts=_sidecar_opts(SIDECAR_MAX_BYTES), rules=rules)
            if res.status == INTERNAL_ERROR:
                internal = res.detail
            elif res.status != "ok":
                bad = sidecar_problem(res.status, res.detail, "json")
            else:
                parsed = parse_json_object(res.data)
                if isinstance(parsed, RecordError):
                    bad = ("invalid_sidecar", parsed.detail)
                else:
                    record = parsed
        out = map_fields(record, mapping, max_caption_chars=max_caption_chars)
        if txt_uri and internal is None:
            res = fetch_ref(txt_uri, opts=_sidecar_opts(caption_bytes(max_caption_chars)),
                            rules=rules)
            if res.status == INTERNAL_ERROR:
                internal = res.detail
            elif res.status != "ok":
                bad = bad or sidecar_problem(res.status, res.detail, "txt")
            else:
                text = text_caption(res.data, max_caption_chars)
                if isinstance(text, RecordError):
                    bad = bad or (text.reason, text.detail)
                elif text:
                    if out["read_reason"] in CAPTION_REASONS:
                        out.update(read_status="ok", read_reason=None)
                    out["caption_original"] = text
        if internal is not None:  # counted apart and retried, whatever else the row says
            out.update(read_status="rejected", read_reason=INTERNAL_ERROR,
                       metadata_json=json.dumps({"detail": internal}))
        elif bad is not None and out["read_status"] == "ok":
            out.update(read_status="rejected", read_reason=bad[0],
                       metadata_json=json.dumps({"detail": bad[1]}))
        return out

    return parse


def _sidecar_opts(max_bytes: int):
    from etl.config import FetchConfig

    return FetchConfig(max_bytes=max_bytes, timeout_s=SIDECAR_TIMEOUT_S)
