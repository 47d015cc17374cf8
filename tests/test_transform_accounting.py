"""etl.transforms.accounting on a few rows: per-source counts (internal errors apart
from rejects), removal counts by the table each record left, and the accounting
table's rows. Expectations are written out by hand."""

from __future__ import annotations

from datetime import UTC, datetime

from etl.transforms.accounting import (
    SourceCounts,
    accounting_rows,
    removal_counts,
    removal_rows,
    source_counts,
)

AT = datetime(2026, 1, 1)
OUTCOME = ("source string, stage string, status string, reason string, "
           "filter_reason string, count long")


def test_internal_errors_are_counted_apart_from_rejects():
    from etl.transforms.accounting import source_counts
    from etl.transforms.prepare import failure_examples

    def row(status, reason, count, stage="prepare", key=None, detail=None):
        return {"source": "s", "stage": stage, "status": status, "reason": reason,
                "filter_reason": None, "count": count,
                "example": None if key is None else {"key": key, "detail": detail}}

    outcome = [
        row("ok", None, 5),
        row("rejected", "undecodable", 2, key="b.png", detail="not a recognised image"),
        row("error", "internal_error", 3, key="c.png", detail="KeyError: 'x' (at m.py:1)"),
        row("rejected", "internal_error", 1, stage="fetch", key="u1", detail="TypeError: t"),
        row("rejected", "missing_file", 4, stage="fetch", key="u2", detail="gone"),
    ]
    (c,) = source_counts(outcome, ["s"], {"s": 7})
    assert (c.seen, c.accepted, c.rejected, c.internal_errors, c.unchanged) == (15, 5, 6, 4, 7)
    assert c.reasons == {"missing_file": 4, "undecodable": 2}  # internal errors not here
    assert failure_examples(outcome, 3) == (
        "s c.png: prepare internal_error: KeyError: 'x' (at m.py:1)",
        "s u1: fetch internal_error: TypeError: t",
        "s u2: fetch missing_file: gone",
    )


def test_accounting_table_rows_give_internal_errors_their_own_outcome(spark):
    from datetime import datetime

    from etl.transforms.accounting import accounting_rows

    outcome = spark.createDataFrame(
        [("s", "prepare", "ok", None, None, 5), ("s", "prepare", "rejected", "empty", None, 1),
         ("s", "prepare", "error", "internal_error", None, 2)],
        "source string, stage string, status string, reason string, filter_reason string, "
        "count long",
    )
    rows = accounting_rows(outcome.collect(), {}, run_id="r",
                           run_at=datetime(2026, 1, 1)).to_pylist()
    got = {(r["status"], r["reason"]): r["count"] for r in rows}
    assert got == {("accepted", None): 5, ("rejected", "empty"): 1,
                   ("error", "internal_error"): 2}


def test_source_counts_follow_the_config_order_with_filters_removals_and_scans():
    def row(source, status, reason, count, filter_reason=None):
        return {"source": source, "stage": "prepare", "status": status, "reason": reason,
                "filter_reason": filter_reason, "count": count, "example": None}

    outcome = [
        row("b", "ok", None, 4),
        row("b", "ok", None, 2, filter_reason="too_small"),
        row("b", "ok", None, 1, filter_reason="extreme_aspect"),
        row("b", "rejected", None, 1),  # a reject without a reason is counted as unknown
        row("b", "rejected", "empty", 3),
        row("a", "rejected", "empty", 1),
        row("x", "ok", None, 9),  # a source not configured: not counted
    ]
    removed = [{"source": "b", "reason": "source_removed", "count": 2},
               {"source": "b", "reason": "taken_down", "count": 1},
               {"source": "b", "reason": "source_removed", "count": 3}]
    a, b, c = source_counts(outcome, ["a", "b", "c"], {"b": 5, "c": 2}, removed,
                            scans={"b": "listing"})
    assert a == SourceCounts("a", seen=1, accepted=0, rejected=1, reasons={"empty": 1})
    assert b == SourceCounts(
        "b", seen=11, accepted=7, rejected=4, reasons={"empty": 3, "unknown": 1},
        filtered={"extreme_aspect": 1, "too_small": 2}, unchanged=5,
        removed={"source_removed": 5, "taken_down": 1}, removal_scan="listing")
    assert c == SourceCounts("c", seen=0, accepted=0, rejected=0, unchanged=2)


def test_removal_counts_name_the_table_each_record_left(spark):
    removed = spark.createDataFrame(
        [("1", "a", "accepted", "source_removed"), ("2", "a", "accepted", "source_removed"),
         ("3", "a", "rejected", "source_removed"), ("4", "a", "accepted", "taken_down"),
         ("5", "b", "rejected", "taken_down")],
        "sample_id string, source string, status string, reason string")
    got = {(r["source"], r["stage"], r["reason"]): r["count"]
           for r in removal_counts(removed).collect()}
    assert got == {("a", "curated", "source_removed"): 2, ("a", "rejects", "source_removed"): 1,
                   ("a", "curated", "taken_down"): 1, ("b", "rejects", "taken_down"): 1}


def test_accounting_rows_add_unchanged_and_removed_rows(spark):
    outcome = spark.createDataFrame(
        [("a", "prepare", "ok", None, None, 3), ("a", "prepare", "ok", None, "too_small", 1),
         ("a", "fetch", "rejected", None, None, 2), ("b", "ingest", "rejected", "empty", None, 1)],
        OUTCOME)
    removed = [{"source": "b", "stage": "curated", "reason": "source_removed", "count": 2},
               {"source": "b", "stage": "rejects", "reason": "taken_down", "count": 0}]
    rows = accounting_rows(outcome.collect(), {"a": 4, "b": 0}, run_id="r", run_at=AT,
                           removed=removed)
    assert rows.column_names == ["run_id", "run_at", "source", "status", "stage", "reason",
                                 "filter_reason", "count"]
    collected = rows.to_pylist()
    # Built on the driver as the table's rows: `run_at` (naive, UTC) is that UTC instant.
    assert {(r["run_id"], r["run_at"]) for r in collected} == {
        ("r", AT.replace(tzinfo=UTC))}
    assert sorted((tuple(r.values())[2:] for r in collected), key=str) == sorted([
        ("a", "accepted", None, None, None, 3),
        ("a", "accepted", None, None, "too_small", 1),
        ("a", "rejected", "fetch", "unknown", None, 2),  # no reason: unknown, never null
        ("b", "rejected", "ingest", "empty", None, 1),
        ("a", "unchanged", None, None, None, 4),  # b skipped none: no row
        ("b", "removed", "curated", "source_removed", None, 2),  # a zero count: no row
    ], key=str)


def test_removal_rows_are_removed_status_rows_of_the_collected_counts(spark):
    rows = removal_rows(spark, [{"source": "a", "stage": "rejects", "reason": "taken_down",
                                 "count": 3}], run_id="r", run_at=AT).collect()
    assert [tuple(r) for r in rows] == [("r", AT, "a", "removed", "rejects", "taken_down",
                                         None, 3)]
