"""`image_folder`: a directory tree of images with optional `<stem>.txt` captions."""

from __future__ import annotations

import re

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl.config import ConfigError, SourceConfig
from etl.sources.base import SourceAdapter, is_local_path, local_path, require_exists

__all__ = ["ImageFolderSource", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")


class ImageFolderSource(SourceAdapter):
    kind = "image_folder"

    def check_inputs(self, source: SourceConfig) -> None:
        require_exists(source)
        if is_local_path(source.path) and not local_path(source.path).is_dir():
            raise ConfigError(
                f"source {source.name!r}: path {source.path!r} is not a directory "
                "(field sources[].path; kind image_folder reads a folder)"
            )

    def read(self, spark: SparkSession, source: SourceConfig) -> DataFrame:
        root = _root_uri(source.path)
        reader = spark.read.format("binaryFile").option("recursiveFileLookup", "true")
        contents = reader.load(source.path)
        # Spark's file scan skips zero-length files, so the listing (which the driver
        # holds anyway) is the record of what was seen; an empty file joins no content
        # and becomes a row with empty bytes, rejected later as `empty`.
        listing = spark.createDataFrame(
            [(_normalise_uri(p),) for p in contents.inputFiles()], "source_uri string"
        )
        files = (
            listing.join(
                contents.select(
                    F.regexp_replace("path", "^file:/+", "file:/").alias("source_uri"),
                    "content",
                ),
                "source_uri",
                "left",
            )
            .select(
                "source_uri",
                F.coalesce("content", F.lit(b"")).alias("content"),
                F.regexp_extract("source_uri", r"\.([^./]+)$", 1).alias("ext"),
                F.regexp_replace("source_uri", r"\.[^./]+$", "").alias("stem_uri"),
            )
        )
        images = files.where(F.lower("ext").isin(*IMAGE_EXTENSIONS))
        captions = files.where(F.lower("ext") == "txt").select(
            "stem_uri",
            F.regexp_replace(F.decode("content", "UTF-8"), r"^\s+|\s+$", "").alias(
                "caption_original"
            ),
        )
        # A stem may have several images (a.jpg and a.png): both get the same caption.
        joined = images.join(captions, "stem_uri", "left")
        return joined.select(
            _relative(F.col("source_uri"), root).alias("source_key"),
            "source_uri",
            F.when(F.length("caption_original") > 0, F.col("caption_original")).alias(
                "caption_original"
            ),
            F.lit(None).cast("string").alias("license"),
            F.lit(None).cast("string").alias("metadata_json"),
            F.col("content").alias("image_bytes"),
            F.lit("ok").alias("read_status"),
            F.lit(None).cast("string").alias("read_reason"),
        )


def _normalise_uri(uri: str) -> str:
    """file:///a/b and file:/a/b name the same file; Spark uses both spellings."""
    return re.sub(r"^file:/+", "file:/", uri)


def _root_uri(path: str) -> str:
    """The prefix Spark's binaryFile puts before every file under `path`."""
    if is_local_path(path):
        return "file:" + str(local_path(path).resolve()).rstrip("/") + "/"
    return path.rstrip("/") + "/"


def _relative(uri, root: str):
    return F.when(uri.startswith(root), F.substring(uri, len(root) + 1, 1 << 20)).otherwise(uri)
