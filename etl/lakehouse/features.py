"""Feature columns computed over the curated table and added without rewriting it.

``lakeshard features add NAME …`` reads only the feature's input columns (plus each
row's fragment id) from Lance, computes the feature in Spark and writes it with
:func:`etl.writers.lance_columns.write_columns`: one new data file per fragment holding
just that column, one ``Update`` commit. The image data files are not touched, so
adding a feature costs a few bytes per row, not a copy of the table.

A feature is a name, a Spark type, its input columns and a function from those
columns to a Spark ``Column``; add one to :data:`FEATURES` to make it available. A
feature that can fail on a row (one that decodes the image) has ``with_error``: its
function returns ``{value, error}`` and the feature is written as two columns, the
value and ``<name>_error`` -- why the value is null (``undecodable: …``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from pyspark.sql import Column, SparkSession
from pyspark.sql import functions as F

from etl.config import ConfigError
from etl.writers.lance import FRAGMENT_ID, lance_reader

__all__ = [
    "Feature",
    "FEATURES",
    "ASPECT_BUCKETS",
    "aspect_bucket_col",
    "FeatureResult",
    "feature",
    "add_features",
]

log = logging.getLogger(__name__)

# Training-resolution aspect buckets (width:height), narrowest first. A row goes to the
# bucket nearest its width/height on a log scale.
ASPECT_BUCKETS: tuple[tuple[str, float], ...] = (
    ("1:4", 1 / 4), ("1:3", 1 / 3), ("1:2", 1 / 2), ("9:16", 9 / 16), ("2:3", 2 / 3),
    ("3:4", 3 / 4), ("1:1", 1.0), ("4:3", 4 / 3), ("3:2", 3 / 2), ("16:9", 16 / 9),
    ("2:1", 2.0), ("3:1", 3.0), ("4:1", 4.0),
)


def aspect_bucket_col(width: Column, height: Column) -> Column:
    """The nearest bucket of :data:`ASPECT_BUCKETS`: thresholds are the geometric means
    of neighbouring ratios, so "nearest" is measured on log(width/height)."""
    ratio = width.cast("double") / height.cast("double")
    expr = None
    for (label, r), (_, nxt) in zip(ASPECT_BUCKETS, ASPECT_BUCKETS[1:], strict=False):
        cut = math.sqrt(r * nxt)
        expr = F.when(ratio < cut, label) if expr is None else expr.when(ratio < cut, label)
    return expr.otherwise(ASPECT_BUCKETS[-1][0])


def _luma(image: Column) -> Column:
    from udfs.features import luma_mean_udf

    return luma_mean_udf(image)


@dataclass(frozen=True)
class Feature:
    name: str
    spark_type: str
    inputs: tuple[str, ...]
    compute: Callable[..., Column]
    doc: str
    # compute returns struct<value, error>: written as <name> and <name>_error.
    with_error: bool = False

    @property
    def error_column(self) -> str | None:
        return f"{self.name}_error" if self.with_error else None

    def columns(self, inputs: list[Column]) -> list[Column]:
        """The feature's output columns from its input columns."""
        out = self.compute(*inputs)
        if not self.with_error:
            return [out.cast(self.spark_type).alias(self.name)]
        return [out["value"].cast(self.spark_type).alias(self.name),
                out["error"].cast("string").alias(self.error_column)]


FEATURES: dict[str, Feature] = {
    f.name: f
    for f in (
        Feature("aspect_bucket", "string", ("width", "height"), aspect_bucket_col,
                "nearest training aspect bucket of width/height (e.g. 16:9)"),
        Feature("megapixels", "double", ("width", "height"),
                lambda w, h: F.round(w.cast("double") * h / 1e6, 4),
                "stored width*height / 1e6"),
        Feature("caption_words", "int", ("caption_original",),
                lambda c: F.when(c.isNull(), None).otherwise(
                    F.size(F.split(F.trim(c), r"\s+")) - F.when(F.trim(c) == "", 1).otherwise(0)
                ).cast("int"),
                "words in caption_original (null without a caption)"),
        Feature("luma_mean", "double", ("image",), _luma,
                "mean brightness 0-255 of the image (decoded at 1/8 scale); "
                "luma_mean_error: why it is null", with_error=True),
    )
}


def feature(name: str) -> Feature:
    if name not in FEATURES:
        raise ConfigError(
            f"features: unknown feature {name!r} (known: {', '.join(sorted(FEATURES))})"
        )
    return FEATURES[name]


@dataclass(frozen=True)
class FeatureResult:
    names: tuple[str, ...]
    version: int  # table version holding the values
    rows: int  # rows written
    bytes_written: int  # size of the new data files
    table_bytes: int  # size of the table's data files before the write
    image_files_unchanged: bool  # every data file of the table before is still referenced

    @property
    def ratio(self) -> float:
        return self.bytes_written / self.table_bytes if self.table_bytes else 0.0


def add_features(
    spark: SparkSession, path: str, names: list[str], *, only_missing: bool = False
) -> FeatureResult:
    """Compute the named features over the table at `path` and add them as columns,
    in one pass over their input columns and one table version.

    `only_missing`: compute only for rows where the first named column is null (rows
    appended since the last run); other rows keep their values."""
    import lance

    from etl.lakehouse.maintenance import data_bytes
    from etl.writers.lance_columns import write_columns

    feats = [feature(n) for n in dict.fromkeys(names)]  # unknown names fail before Spark
    if not feats:
        raise ConfigError("features: name at least one feature")
    ds = lance.dataset(path)
    inputs = list(dict.fromkeys(c for f in feats for c in f.inputs))
    missing = [c for c in inputs if c not in ds.schema.names]
    if missing:
        raise ConfigError(f"features: input column {missing[0]!r} is not in {path}")
    before_files = _data_files(ds)
    table_bytes = data_bytes(path)
    reader = (
        lance_reader(spark)
        .option("columns", ",".join(dict.fromkeys(("sample_id", *inputs))))
        .option("fragment_id", "true")
        .option("version", str(ds.version))
    )
    if only_missing and feats[0].name in ds.schema.names:
        missing_value = f"{feats[0].name} IS NULL"
        if feats[0].error_column in ds.schema.names:  # a known failure is not missing
            missing_value += f" AND {feats[0].error_column} IS NULL"
        reader = reader.option("filter", missing_value)
    rows = reader.load(path)
    values = rows.select(
        "sample_id",
        FRAGMENT_ID,
        *(col for f in feats for col in f.columns([F.col(c) for c in f.inputs])),
    )
    spark.sparkContext.setJobDescription(f"lakeshard features add {' '.join(names)}")
    res = write_columns(spark, path, values, key="sample_id")
    spark.sparkContext.setJobDescription(None)
    result = FeatureResult(
        names=tuple(f.name for f in feats),
        version=res.version,
        rows=res.rows,
        bytes_written=res.bytes_written,
        table_bytes=table_bytes,
        image_files_unchanged=before_files <= _data_files(lance.dataset(path)),
    )
    log.info("features %s: %d rows, %d bytes (%.4f of the table)", ", ".join(result.names),
             res.rows, res.bytes_written, result.ratio)
    return result


def _data_files(ds) -> set[str]:
    return {f.path for frag in ds.get_fragments() for f in frag.metadata.files}
