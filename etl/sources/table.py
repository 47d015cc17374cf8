"""`table`: parquet files with embedded image bytes plus caption and metadata columns.

The `columns:` mapping names the source columns for the common fields, e.g.
``{key: id, image: jpg, caption: alt_text}``; a nested field is written with a dot
(``image: image.bytes`` for Hugging Face datasets exported to parquet). Every column
not mapped (and not binary) is kept as JSON in `metadata_json`.
"""

from __future__ import annotations

import pyarrow.dataset as pads
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from etl.config import ConfigError, SourceConfig
from etl.sources.base import SourceAdapter, is_local_path, local_path, require_exists

__all__ = ["TableSource"]

_FORMATS = ("parquet",)


class TableSource(SourceAdapter):
    kind = "table"
    mappable = frozenset({"key", "image", "caption", "license"})
    required_mapping = frozenset({"key", "image"})

    def validate_config(self, source: SourceConfig, where: str) -> None:
        super().validate_config(source, where)
        fmt = source.format or "parquet"
        if fmt not in _FORMATS:
            raise ConfigError(f"{where}.format: {fmt!r} is not one of {', '.join(_FORMATS)}")

    def check_inputs(self, source: SourceConfig) -> None:
        require_exists(source)
        if not is_local_path(source.path):
            return  # object stores are checked by Spark's own listing
        schema = pads.dataset(str(local_path(source.path)), format="parquet").schema
        for field_name, column in sorted(source.columns.items()):
            top = column.split(".", 1)[0]
            if top not in schema.names:
                raise ConfigError(
                    f"source {source.name!r}: columns.{field_name} maps to {column!r}, "
                    f"which the table lacks (its columns: {', '.join(schema.names)})"
                )

    def read(self, spark: SparkSession, source: SourceConfig) -> DataFrame:
        df = spark.read.parquet(source.path)
        cols = source.columns
        mapped_top = {c.split(".", 1)[0] for c in cols.values()}
        rest = [
            f.name
            for f in df.schema.fields
            if f.name not in mapped_top and not isinstance(f.dataType, T.BinaryType)
        ]
        image = F.col(cols["image"]).cast("binary")
        key = F.col(cols["key"]).cast("string")
        status = (
            F.when(key.isNull(), F.lit("missing_key"))
            .when(image.isNull(), F.lit("missing_image"))
        )
        return df.select(
            # A row without a key is still counted: it gets a content-derived key and
            # is rejected as missing_key.
            F.coalesce(
                key, F.concat(F.lit("null-key:"), F.sha2(F.coalesce(image, F.lit(b"")), 256))
            ).alias("source_key"),
            F.col("_metadata.file_path").alias("source_uri"),
            _opt(cols, "caption").alias("caption_original"),
            _opt(cols, "license").alias("license"),
            (F.to_json(F.struct(*rest)) if rest else F.lit(None).cast("string")).alias(
                "metadata_json"
            ),
            image.alias("image_bytes"),
            F.when(status.isNull(), F.lit("ok")).otherwise(F.lit("rejected")).alias(
                "read_status"
            ),
            status.alias("read_reason"),
        )

def _opt(cols: dict, field_name: str):
    if field_name in cols:
        return F.col(cols[field_name]).cast("string")
    return F.lit(None).cast("string")
