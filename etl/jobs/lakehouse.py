"""Table-changing lakehouse commands as stages: `features add`, `embed`, `compact`.

Each runs under the run lock and writes the ledger like any stage of `lakeshard run`
(:mod:`etl.pipeline.runner`); the work itself is in :mod:`etl.lakehouse`.
"""

from __future__ import annotations

from pyspark.sql import SparkSession

from etl import tables
from etl.config import Config
from etl.errors import ConfigError
from etl.lakehouse.embeddings import embed_captions
from etl.lakehouse.features import add_features, feature
from etl.lakehouse.indexes import ensure_scalar_indexes
from etl.lakehouse.maintenance import compact
from etl.runtime.stage import RunContext, StageResult

__all__ = [
    "check_features", "require_curated", "features_stage", "embed_stage", "compact_stage",
]


def check_features(cfg: Config, ctx: RunContext) -> None:
    """Before Spark: at least one known feature, and a curated table to add it to."""
    names = ctx.option("features", "names") or []
    if not names:
        raise ConfigError("features add: name at least one feature")
    for name in names:
        feature(name)
    tables.open_curated(cfg)


def features_stage(spark: SparkSession, cfg: Config, ctx: RunContext) -> StageResult:
    res = add_features(spark, tables.layout(cfg).curated, list(ctx.option("features", "names")),
                       only_missing=ctx.option("features", "only_missing", False))
    return StageResult(outputs={"rows": res.rows, "bytes": res.bytes_written},
                       table_versions={"lance:curated": res.version}, detail=res)


def embed_stage(spark: SparkSession, cfg: Config, ctx: RunContext) -> StageResult:
    res = embed_captions(spark, tables.layout(cfg).curated, cfg.lakehouse.embedding,
                         only_missing=not ctx.option("embed", "all", False))
    return StageResult(outputs={"rows": res.rows, "bytes": res.bytes_written},
                       table_versions={"lance:curated": res.version}, detail=res)


def compact_stage(spark: SparkSession, cfg: Config, ctx: RunContext) -> StageResult:
    path = tables.layout(cfg).curated
    res = compact(path, cfg.lakehouse)
    ensure_scalar_indexes(path, cfg.lakehouse.scalar_indexes)
    return StageResult(
        outputs={"fragments": res.fragments_after, "versions_removed": res.versions_removed,
                 "bytes_removed": res.bytes_removed},
        table_versions={"lance:curated": tables.open_curated(cfg).version}, detail=res,
    )


def require_curated(cfg: Config, ctx: RunContext) -> None:
    """Before Spark: the curated table exists."""
    tables.open_curated(cfg)
