"""Dedup job: the curated table's cheap columns -> Delta `dedup`, per-source stats.
(The analyst views over the result are in :mod:`etl.lakehouse.views`.)

The curated Lance table holds image bytes and is never rewritten here: assignments live
in a Delta table keyed by ``sample_id`` (docs/dedup.md). The table object
(:class:`etl.lakehouse.dedup_table.DedupTable`) decides how to bring it up to date --
from its properties alone, planned in the driver, or planned by Spark over the table --
and writes it; this module is the stage and what it prints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from pyspark.sql import SparkSession

from etl import tables
from etl.config import Config
from etl.lakehouse.dedup_table import DedupResult, DedupTable, SourceDedup
from etl.runtime.options import flag
from etl.runtime.stage import Metrics, RunContext, StageDetail, StageResult

__all__ = [
    "SourceDedup", "DedupResult", "DedupRun", "dedup", "format_dedup", "DedupOptions", "stage",
    "check", "render",
]

log = logging.getLogger(__name__)


def dedup(spark: SparkSession, cfg: Config, run_id: str, *, full: bool = False) -> DedupResult:
    """Annotate duplicates of the curated table; incremental unless `full` or the
    threshold/bands changed since the last run."""
    return DedupTable(spark, cfg).update(run_id, full=full)


def format_dedup(res: DedupResult) -> str:
    lines = [
        f"dedup (Delta)   : {res.path}  version {res.version}, {res.mode} over curated "
        f"version {res.curated_version}: {res.new_rows} new row(s), {res.pairs} near "
        f"pair(s), {res.changed} row(s) changed, {res.removed} removed; "
        f"{res.clusters} duplicate cluster(s)",
    ]
    header = (
        f"{'source':<20} {'rows':>7} {'canonical':>9} {'exact':>7} {'near':>7} "
        f"{'exact rate':>10} {'near rate':>9}"
    )
    lines += [header, "-" * len(header)]
    for c in res.counts:
        lines.append(
            f"{c.source:<20} {c.rows:>7} {c.canonical:>9} {c.exact:>7} {c.near:>7} "
            f"{c.exact_rate:>10.1%} {c.near_rate:>9.1%}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class DedupRun(DedupResult, StageDetail):
    """What the stage did to the dedup table (:meth:`DedupTable.update`'s result), and
    how the run's summary shows it."""

    @classmethod
    def of(cls, res: DedupResult) -> DedupRun:
        return cls(**{f.name: getattr(res, f.name) for f in fields(res)})

    def summary_section(self) -> str:
        return format_dedup(self)


@dataclass(frozen=True)
class DedupOptions:
    """`lakeshard dedup`'s flags."""

    full: bool = flag(False, "recompare every row (default: new rows against everything)")


def stage(spark: SparkSession, cfg: Config, ctx: RunContext) -> StageResult[DedupRun]:
    """exact + near duplicates of the curated table -> Delta `dedup` (new rows only)."""
    if not cfg.dedup.enabled and not ctx.command:
        return StageResult(note="disabled (dedup.enabled: false)")
    res = dedup(spark, cfg, ctx.run_id, full=ctx.options_for(DedupOptions).full)
    by: dict[str, dict[str, int]] = {}
    for c in res.counts:
        for key, value in vars(c).items():
            if isinstance(value, int) and key != "source":
                by.setdefault(key, {})[c.source] = value
    outputs = Metrics({"changed": res.changed, "removed": res.removed,
                       "clusters": res.clusters, "near_pairs": res.pairs}, by=by)
    return StageResult(
        inputs={"new_rows": res.new_rows}, outputs=outputs,
        table_versions={"delta:dedup": res.version},
        note="up to date" if res.new_rows == 0 and res.changed == 0 else None,
        detail=DedupRun.of(res),
    )


def check(cfg: Config, ctx: RunContext) -> None:
    """Before Spark, for `lakeshard dedup`: there is a curated table to dedup."""
    if ctx.command:
        tables.open_curated(cfg)


def render(cfg: Config, opts: DedupOptions, result: StageResult[DedupRun]) -> str:
    """What `lakeshard dedup` prints."""
    return format_dedup(result.made())
