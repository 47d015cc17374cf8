"""Export job: the curated Lance table -> an MDS export under <root>/mds/<name>/."""

from __future__ import annotations

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from etl.config import Config
from etl.jobs.curate import CURATED_TABLE
from etl.writers.mds import MDS_COLUMNS, ExportResult, export_mds

__all__ = ["export"]


def export(spark: SparkSession, cfg: Config, name: str, work_id: str) -> ExportResult:
    exp = cfg.export(name)
    curated_path = cfg.storage.lance_table(CURATED_TABLE)
    import lance

    try:
        table = lance.dataset(curated_path)
    except (ValueError, OSError) as exc:
        raise FileNotFoundError(
            f"no curated table at {curated_path}: run `lakeshard curate` first"
        ) from exc
    expected = table.count_rows(filter=exp.where)
    reader = spark.read.format("lance").option("version", str(table.version))
    if exp.where:
        reader = reader.option("filter", exp.where)
    curated = reader.load(curated_path)
    rows = curated.select(
        "image",
        # A sample without a caption trains as unconditional: empty string, not null.
        F.coalesce("caption_original", F.lit("")).alias("caption"),
        "sample_id",
        "source",
        "width",
        "height",
        "original_width",
        "original_height",
    ).select(*MDS_COLUMNS)
    result = export_mds(
        rows,
        cfg.storage.export_dir(name),
        partitions=exp.partitions,
        size_limit=exp.size_limit,
        compression=exp.compression,
        hashes=exp.hashes,
        work_id=work_id,
    )
    if result.samples != expected:
        raise RuntimeError(
            f"export {name!r} has {result.samples} samples, curated table has {expected}"
        )
    return result
