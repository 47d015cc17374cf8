"""Where every input record ended, per source: seen = accepted + rejected + internal
errors (processed this run, by reason) and `unchanged` (already ingested, skipped). The
curate job counts with these; the summary prints them; the Delta `accounting` table
keeps them. An internal error (reason ``internal_error``: lakeshard's own code failed on
the record) is not a rejection of the data: it is counted apart (status ``error`` in the
accounting table) and retried by the next run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from etl.schema import ACCOUNTING_SCHEMA
from udfs.outcomes import INTERNAL_ERROR

__all__ = ["SourceCounts", "source_counts", "accounting_rows"]


@dataclass(frozen=True)
class SourceCounts:
    source: str
    seen: int
    accepted: int
    rejected: int
    reasons: dict[str, int] = field(default_factory=dict)
    # Accepted but flagged by a light filter (keep = false), by filter reason.
    filtered: dict[str, int] = field(default_factory=dict)
    # Already in the manifest with the same fingerprint: not fetched, not decoded.
    unchanged: int = 0
    # Records lakeshard's own code failed on (reason internal_error; not in `rejected`).
    internal_errors: int = 0


def source_counts(outcome: Sequence[Mapping], sources: Sequence[str],
                  unchanged: Mapping[str, int]) -> tuple[SourceCounts, ...]:
    """Per configured source, in config order, from the collected outcome counts
    (:func:`etl.transforms.prepare.outcome_counts`)."""
    out = []
    for name in sources:
        mine = [r for r in outcome if r["source"] == name]
        accepted = sum(r["count"] for r in mine if r["status"] == "ok")
        errors = sum(r["count"] for r in mine if r["reason"] == INTERNAL_ERROR)
        rejected = sum(r["count"] for r in mine if r["status"] != "ok") - errors
        reasons: dict[str, int] = {}
        filtered: dict[str, int] = {}
        for r in mine:
            if r["status"] != "ok" and r["reason"] != INTERNAL_ERROR:
                key = r["reason"] or "unknown"
                reasons[key] = reasons.get(key, 0) + r["count"]
            elif r["filter_reason"]:
                filtered[r["filter_reason"]] = filtered.get(r["filter_reason"], 0) + r["count"]
        out.append(
            SourceCounts(
                name, accepted + rejected + errors, accepted, rejected,
                dict(sorted(reasons.items())), dict(sorted(filtered.items())),
                unchanged.get(name, 0), internal_errors=errors,
            )
        )
    return tuple(out)


def accounting_rows(outcome: DataFrame, unchanged: Mapping[str, int], *, run_id: str,
                    run_at: datetime) -> DataFrame:
    """The accounting table's rows for one run: one per (source, outcome, stage, reason,
    filter reason) processed (outcome: accepted, rejected, or error for internal
    errors), plus one `unchanged` row per source that skipped any."""
    ok = F.col("status") == "ok"
    processed = outcome.select(
        F.lit(run_id).alias("run_id"),
        F.lit(run_at).alias("run_at"),
        "source",
        F.when(ok, F.lit("accepted")).when(F.col("reason") == INTERNAL_ERROR, F.lit("error"))
        .otherwise(F.lit("rejected")).alias("status"),
        F.when(~ok, F.col("stage")).alias("stage"),
        F.when(~ok, F.coalesce("reason", F.lit("unknown"))).alias("reason"),
        F.when(ok, F.col("filter_reason")).alias("filter_reason"),
        F.col("count").cast("long").alias("count"),
    )
    skipped = outcome.sparkSession.createDataFrame(
        [(run_id, run_at, src, "unchanged", None, None, None, int(n))
         for src, n in sorted(unchanged.items()) if n],
        ACCOUNTING_SCHEMA,
    )
    return processed.unionByName(skipped).select(*ACCOUNTING_SCHEMA.fieldNames())
