"""Where every input record ended, per source: seen = accepted + rejected + internal
errors (processed this run, by reason), `unchanged` (already ingested, skipped), and
`removed` (records that left every table this run: gone from their source, or taken
down). The curate and forget jobs count with these; the summary prints them; the Delta
`accounting` table keeps them. An internal error (reason ``internal_error``: lakeshard's
own code failed on the record) is not a rejection of the data: it is counted apart
(status ``error`` in the accounting table) and retried by the next run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl.runtime.metrics import Metrics
from etl.schema import ACCOUNTING_SCHEMA, REMOVED, arrow_schema
from udfs.outcomes import INTERNAL_ERROR

__all__ = ["SourceCounts", "ALL_SOURCES", "source_counts", "stage_metrics", "accounting_rows",
           "unchanged_rows", "quiet_accounting", "removal_counts", "removal_rows"]


def _added(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    out = dict(a)
    for key, n in b.items():
        out[key] = out.get(key, 0) + n
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class SourceCounts:
    """Where one source's records ended in one run -- the per-source accounting row
    that the console, summary.json, the report and the ledger render.

    A tally: ``a + b`` adds every count (the reasons key by key; of two sources, the
    total's ``source`` is :data:`ALL_SOURCES`), so ``sum(counts)`` is the run's total
    row; :meth:`to_json` / :meth:`from_json` round-trip it (the entries of
    ``summary.json``'s ``curate.counts``)."""

    source: str
    seen: int
    accepted: int
    rejected: int
    reasons: dict[str, int] = field(default_factory=dict)
    # Accepted but flagged by a light filter (keep = false), by filter reason.
    filtered: dict[str, int] = field(default_factory=dict)
    # Already in the manifest with the same fingerprint: not fetched, not decoded.
    unchanged: int = 0
    # Left every table this run, by reason (source_removed, taken_down).
    removed: dict[str, int] = field(default_factory=dict)
    # How removals were found: "change data feed", "version diff", "listing" (the
    # manifest against what the source lists), "kept" (on_removed: keep), or why none
    # were looked for this run ("deferred: ...").
    removal_scan: str | None = None
    # Records lakeshard's own code failed on (reason internal_error; not in `rejected`).
    internal_errors: int = 0

    @property
    def flagged(self) -> int:
        """Accepted records a light filter flagged (every filter reason)."""
        return sum(self.filtered.values())

    @property
    def removed_total(self) -> int:
        """Records that left every table this run (every reason)."""
        return sum(self.removed.values())

    def why(self) -> str:
        """The reasons as one line: rejected, then flagged, then removed (``k=v, ...``)."""
        return ", ".join(f"{k}={v}" for k, v in
                         {**self.reasons, **self.filtered, **self.removed}.items())

    def row(self) -> dict[str, int | str]:
        """The row the console table and the report's run table show."""
        return {"source": self.source, "seen": self.seen, "accepted": self.accepted,
                "rejected": self.rejected, "errors": self.internal_errors,
                "flagged": self.flagged, "unchanged": self.unchanged,
                "removed": self.removed_total, "reasons": self.why()}

    def __add__(self, other: SourceCounts) -> SourceCounts:
        if not isinstance(other, SourceCounts):
            return NotImplemented
        same = self.source == other.source
        return SourceCounts(
            self.source if same else ALL_SOURCES, self.seen + other.seen,
            self.accepted + other.accepted, self.rejected + other.rejected,
            _added(self.reasons, other.reasons), _added(self.filtered, other.filtered),
            self.unchanged + other.unchanged, _added(self.removed, other.removed),
            self.removal_scan if same and self.removal_scan == other.removal_scan else None,
            internal_errors=self.internal_errors + other.internal_errors,
        )

    def __radd__(self, other: object) -> SourceCounts:
        if other == 0:  # sum()'s start
            return self
        return NotImplemented

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> SourceCounts:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


# The `source` of a sum of several sources' counts.
ALL_SOURCES = "total"


def stage_metrics(counts: Sequence[SourceCounts]) -> tuple[Metrics, Metrics]:
    """Curate's inputs and outputs for the run ledger and the console: records seen
    (and per source); accepted, rejected, flagged, removed (and by reason; removed per
    source), internal errors when there were any."""
    total = sum(counts, SourceCounts(ALL_SOURCES, 0, 0, 0))
    inputs = Metrics({"seen": total.seen}, by={"seen": {c.source: c.seen for c in counts}})
    outs = {"accepted": total.accepted, "rejected": total.rejected,
            "flagged": total.flagged, "removed": total.removed_total}
    if total.internal_errors:
        outs["internal_error"] = total.internal_errors
    outputs = Metrics(outs, by={
        "rejected": total.reasons, "flagged": total.filtered, "removed": total.removed,
        "removed_in": {c.source: c.removed_total for c in counts if c.removed}})
    return inputs, outputs


def source_counts(outcome: Sequence[Mapping], sources: Sequence[str],
                  unchanged: Mapping[str, int],
                  removed: Sequence[Mapping] = (),
                  scans: Mapping[str, str] | None = None) -> tuple[SourceCounts, ...]:
    """Per configured source, in config order, from the collected outcome counts
    (:func:`etl.transforms.prepare.outcome_counts`) and removal counts
    (:func:`removal_counts`)."""
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
        gone: dict[str, int] = {}
        for r in removed:
            if r["source"] == name:
                gone[r["reason"]] = gone.get(r["reason"], 0) + r["count"]
        out.append(
            SourceCounts(
                name, accepted + rejected + errors, accepted, rejected,
                dict(sorted(reasons.items())), dict(sorted(filtered.items())),
                unchanged.get(name, 0), dict(sorted(gone.items())),
                (scans or {}).get(name), internal_errors=errors,
            )
        )
    return tuple(out)


def removal_counts(removed: DataFrame) -> DataFrame:
    """Counts of removed records (``sample_id, source, status, reason``; status = the one
    they had) by ``source``, ``stage`` (the table each left: curated or rejects) and
    ``reason``."""
    stage = F.when(F.col("status") == "accepted", F.lit("curated")).otherwise(F.lit("rejects"))
    return removed.groupBy("source", stage.alias("stage"), "reason").count()


def removal_rows(spark: SparkSession, counts: Sequence[Mapping], *, run_id: str,
                 run_at: datetime) -> DataFrame:
    """Accounting rows of collected :func:`removal_counts`: status ``removed``."""
    return spark.createDataFrame(_removed(counts, run_id=run_id, run_at=run_at),
                                 ACCOUNTING_SCHEMA)


def _removed(counts: Sequence[Mapping], *, run_id: str, run_at: datetime) -> list[tuple]:
    return [(run_id, run_at, r["source"], REMOVED, r["stage"], r["reason"], None, int(r["count"]))
            for r in counts if r["count"]]


def unchanged_rows(unchanged: Mapping[str, int], *, run_id: str, run_at: datetime
                   ) -> list[tuple]:
    """One accounting row per source that skipped records already ingested unchanged."""
    return [(run_id, run_at, src, "unchanged", None, None, None, int(n))
            for src, n in sorted(unchanged.items()) if n]


def quiet_accounting(unchanged: Mapping[str, int], *, run_id: str, run_at: datetime):
    """The whole accounting of a run that processed and removed nothing: its
    `unchanged` rows (an Arrow table built here, as :func:`accounting_rows`)."""
    return accounting_rows((), unchanged, run_id=run_id, run_at=run_at)


def accounting_rows(outcome: Sequence[Mapping], unchanged: Mapping[str, int], *, run_id: str,
                    run_at: datetime, removed: Sequence[Mapping] = ()):
    """The accounting table's rows for one run, as an Arrow table built here from the
    collected :func:`~etl.transforms.prepare.outcome_counts` (a few rows, whatever the
    run's size: no Spark job): one per (source, outcome, stage, reason, filter reason)
    processed (outcome: accepted, rejected, or error for internal errors), one
    `unchanged` row per source that skipped any, and one `removed` row per (source,
    table left, reason) of records removed. `run_at`: naive, in UTC."""
    import pyarrow as pa

    rows = []
    for r in outcome:
        ok = r["status"] == "ok"
        status = "accepted" if ok else "error" if r["reason"] == INTERNAL_ERROR else "rejected"
        rows.append((run_id, run_at, r["source"], status, None if ok else r["stage"],
                     None if ok else r["reason"] or "unknown",
                     r["filter_reason"] if ok else None, int(r["count"])))
    rows += unchanged_rows(unchanged, run_id=run_id, run_at=run_at)
    rows += _removed(removed, run_id=run_id, run_at=run_at)
    names = ACCOUNTING_SCHEMA.fieldNames()
    return pa.Table.from_pylist([dict(zip(names, r, strict=True)) for r in rows],
                                schema=arrow_schema(ACCOUNTING_SCHEMA))
