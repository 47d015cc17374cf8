"""Table-changing lakehouse commands as stages: `features add`, `embed`, `compact`.

Each runs under the run lock and writes the ledger like any stage of `lakeshard run`
(:mod:`etl.pipeline.runner`); the work itself is in :mod:`etl.lakehouse`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import SparkSession

from etl import tables
from etl.config import Config
from etl.errors import ConfigError
from etl.lakehouse.embeddings import EmbedResult, embed_captions
from etl.lakehouse.features import FeatureResult, add_features, feature
from etl.lakehouse.indexes import ensure_scalar_indexes
from etl.lakehouse.maintenance import CompactResult, compact
from etl.runtime.options import flag
from etl.runtime.stage import RunContext, StageDetail, StageResult

__all__ = [
    "FeaturesAdded", "Embedded", "Compacted", "FeaturesOptions", "EmbedOptions",
    "check_features", "require_curated", "features_stage",
    "embed_stage", "compact_stage", "render_features", "render_embed", "render_compact",
]


@dataclass(frozen=True)
class FeaturesOptions:
    """`lakeshard features list | add NAME…`: the stage is `add`; `list` only reads."""

    action: str = flag("add", positional=True, choices=("list", "add"))
    names: tuple[str, ...] = flag((), "feature names (see `features list`)", positional=True,
                                  nargs="*")
    only_missing: bool = flag(False, "only rows without a value")


@dataclass(frozen=True)
class EmbedOptions:
    """`lakeshard embed`'s flags."""

    all: bool = flag(False, "re-embed every caption, not only new")


@dataclass(frozen=True)
class FeaturesAdded(StageDetail):
    """What `lakeshard features add` wrote."""

    result: FeatureResult


@dataclass(frozen=True)
class Embedded(StageDetail):
    """What `lakeshard embed` wrote."""

    result: EmbedResult


@dataclass(frozen=True)
class Compacted(StageDetail):
    """What `lakeshard compact` rewrote and removed."""

    result: CompactResult


def check_features(cfg: Config, ctx: RunContext) -> None:
    """Before Spark: at least one known feature, and a curated table to add it to."""
    names = ctx.options_for(FeaturesOptions).names
    if not names:
        raise ConfigError("features add: name at least one feature")
    for name in names:
        feature(name)
    tables.open_curated(cfg)


def features_stage(spark: SparkSession, cfg: Config, ctx: RunContext
                   ) -> StageResult[FeaturesAdded]:
    opts = ctx.options_for(FeaturesOptions)
    res = add_features(spark, tables.layout(cfg).curated, list(opts.names),
                       only_missing=opts.only_missing)
    return StageResult(outputs={"rows": res.rows, "bytes": res.bytes_written},
                       table_versions={"lance:curated": res.version},
                       detail=FeaturesAdded(res))


def embed_stage(spark: SparkSession, cfg: Config, ctx: RunContext) -> StageResult[Embedded]:
    res = embed_captions(spark, tables.layout(cfg).curated, cfg.lakehouse.embedding,
                         only_missing=not ctx.options_for(EmbedOptions).all)
    return StageResult(outputs={"rows": res.rows, "bytes": res.bytes_written},
                       table_versions={"lance:curated": res.version}, detail=Embedded(res))


def compact_stage(spark: SparkSession, cfg: Config, ctx: RunContext
                  ) -> StageResult[Compacted]:
    path = tables.layout(cfg).curated
    res = compact(path, cfg.lakehouse)
    ensure_scalar_indexes(path, cfg.lakehouse.scalar_indexes)
    return StageResult(
        outputs={"fragments": res.fragments_after, "versions_removed": res.versions_removed,
                 "bytes_removed": res.bytes_removed},
        table_versions={"lance:curated": tables.open_curated(cfg).version},
        detail=Compacted(res),
    )


def require_curated(cfg: Config, ctx: RunContext) -> None:
    """Before Spark: the curated table exists."""
    tables.open_curated(cfg)


def render_features(cfg: Config, opts: FeaturesOptions,
                    result: StageResult[FeaturesAdded]) -> str:
    """What `lakeshard features add` prints."""
    r = result.made().result
    return (
        f"{', '.join(r.names)}: {r.rows} rows -> version {r.version}; "
        f"wrote {r.bytes_written} bytes = {r.ratio:.5f} of the table's {r.table_bytes} "
        f"bytes; image data files {'unchanged' if r.image_files_unchanged else 'CHANGED'}"
    )


def render_embed(cfg: Config, opts: EmbedOptions, result: StageResult[Embedded]) -> str:
    """What `lakeshard embed` prints."""
    r = result.made().result
    return (
        f"{cfg.lakehouse.embedding.column}: embedded {r.rows} captions in {r.fragments} "
        f"fragment(s), {r.bytes_written} bytes written; vector index "
        f"{r.index_type or 'none'}; version {r.version}"
    )


def render_compact(cfg: Config, opts: None, result: StageResult[Compacted]) -> str:
    """What `lakeshard compact` prints."""
    r = result.made().result
    return (
        f"{tables.layout(cfg).curated}: {r.fragments_before} -> {r.fragments_after} "
        f"fragment(s) ({r.fragments_rewritten} rewritten); version {r.version_before} -> "
        f"{r.version_after}; removed {r.versions_removed} old version(s), "
        f"{r.bytes_removed} bytes; oldest readable version {r.oldest_version}"
    )
