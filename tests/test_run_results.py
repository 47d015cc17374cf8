"""Typed run results: the per-source tally adds up and round-trips to JSON, a stage's
metrics keep their flat ledger form, and the ledger row of a transition is built in one
place. No Spark."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from etl.ledger import transition
from etl.pipeline.summary import _counts
from etl.report.console import count_line
from etl.runtime.metrics import Metrics
from etl.runtime.outcome import RunOutcome
from etl.runtime.stage import StageDetail, StageResult
from etl.transforms.accounting import ALL_SOURCES, SourceCounts, stage_metrics

A = SourceCounts("a", seen=6, accepted=3, rejected=2, reasons={"empty": 1, "undecodable": 1},
                 filtered={"too_small": 1}, unchanged=4, removed={"taken_down": 2},
                 removal_scan="listing", internal_errors=1)
B = SourceCounts("b", seen=3, accepted=3, rejected=0, filtered={"too_small": 2},
                 removed={"source_removed": 1}, removal_scan="listing")


def test_tallies_add_up_key_by_key():
    total = A + B
    assert (total.source, total.seen, total.accepted, total.rejected, total.unchanged,
            total.internal_errors) == (ALL_SOURCES, 9, 6, 2, 4, 1)
    assert total.reasons == {"empty": 1, "undecodable": 1}
    assert total.filtered == {"too_small": 3}
    assert total.removed == {"source_removed": 1, "taken_down": 2}
    assert (total.flagged, total.removed_total) == (3, 3)
    assert sum([A, B]) == total == B + A
    assert (A + A).source == "a" and (A + A).removal_scan == "listing"
    assert total.removal_scan is None  # two sources, no one scan


def test_a_tally_round_trips_through_json():
    for c in (A, B, A + B):
        assert SourceCounts.from_json(json.loads(json.dumps(c.to_json()))) == c
    # The shape summary.json has always had for curate.counts.
    assert list(A.to_json()) == ["source", "seen", "accepted", "rejected", "reasons",
                                 "filtered", "unchanged", "removed", "removal_scan",
                                 "internal_errors"]


def test_the_console_row_renders_the_tally():
    assert count_line(A) == (
        f"{'a':<20} {6:>7} {3:>9} {2:>9} {1:>7} {1:>8} {4:>10} {2:>8}  "
        "empty=1, undecodable=1, too_small=1, taken_down=2")
    assert count_line(SourceCounts("c", 0, 0, 0)).endswith("  -")
    assert count_line(A + B, reasons=False) == (
        f"{'total':<20} {9:>7} {6:>9} {2:>9} {1:>7} {3:>8} {4:>10} {3:>8}")


def test_curate_metrics_keep_the_ledger_keys():
    inputs, outputs = stage_metrics([A, B])
    assert inputs.as_map() == {"seen": 9, "seen:a": 6, "seen:b": 3}
    assert dict(outputs) == {"accepted": 6, "rejected": 2, "flagged": 3, "removed": 3,
                             "internal_error": 1}
    assert outputs.as_map() == {
        "accepted": 6, "rejected": 2, "flagged": 3, "removed": 3, "internal_error": 1,
        "rejected:empty": 1, "rejected:undecodable": 1, "flagged:too_small": 3,
        "removed:source_removed": 1, "removed:taken_down": 2,
        "removed_in:a": 2, "removed_in:b": 1}
    # No internal errors: no internal_error key, as before.
    assert "internal_error" not in stage_metrics([B])[1]


def test_metrics_flat_form_round_trips_and_refuses_a_key_with_a_colon():
    m = Metrics({"samples": 5}, by={"samples": {"train": 3, "eval": 2}, "rows": {}})
    assert m.as_map() == {"samples": 5, "samples:train": 3, "samples:eval": 2}
    assert Metrics.from_map(m.as_map()) == m
    assert Metrics.from_map({"status:failed": 4}) == Metrics(by={"status": {"failed": 4}})
    assert dict(Metrics.from_map({"status:failed": 4})) == {}
    assert m == {"samples": 5, "samples:train": 3, "samples:eval": 2}
    with pytest.raises(ValueError, match="rejected:empty"):
        Metrics({"rejected:empty": 1})
    with pytest.raises(ValueError):
        StageResult(outputs={"a:b": 1})
    assert StageResult(outputs={"rows": 2}).outputs == Metrics({"rows": 2})
    # `lakeshard runs` shows a ledger row's totals.
    assert _counts({"rejected": 2, "accepted": 1, "rejected:empty": 2}) == \
        "accepted=1, rejected=2"
    assert _counts(None) == _counts({"status:ok": 1}) == "-"


def test_one_builder_for_a_transitions_ledger_row():
    base = {"run_id": "r", "config_hash": "c", "code_version": "v", "host": "h"}
    t = datetime(2026, 1, 1)
    res = StageResult(inputs={"rows": 2}, outputs=Metrics(by={"status": {"ok": 2}}),
                      table_versions={"lance:curated": 3},
                      manifests={"train": {"samples": 2}}, note="n")
    assert transition(base, "caption", "ok", t, result=res, seconds=1.5) == {
        **base, "stage": "caption", "status": "ok", "started_at": t,
        "inputs": {"rows": 2}, "outputs": {"status:ok": 2},
        "table_versions": {"lance:curated": 3},
        "export_manifests": '{"train": {"samples": 2}}', "note": "n", "seconds": 1.5}
    # A note of the row's own wins over the stage's.
    assert transition(base, "caption", "failed", t, result=res, note="over")["note"] == "over"
    assert transition(base, "run", "running", t) == {
        **base, "stage": "run", "status": "running", "started_at": t}


class _Head(StageDetail):
    def summary_head(self) -> list[str]:
        return ["where outputs landed"]

    def summary_json(self) -> dict:
        return {"curate": {"rows": 3}}

    def source_rows(self) -> list[dict]:
        return [{"source": "a", "seen": 1, "accepted": 1, "rejected": 0, "errors": 0,
                 "flagged": 0, "removed": 0, "reasons": "", "unchanged": 5}]


class _Section(StageDetail):
    def summary_section(self) -> str:
        return "a section\nof two lines"


def test_each_result_renders_its_own_part_of_the_run_summary(tmp_path):
    """The summary asks each stage's result what to show (its head lines, its section,
    its summary.json entries, its report rows), in the order the stages ran; the base
    shows nothing. No stage name is looked up."""
    from etl.pipeline.summary import format_outcome, write_summary
    from etl.report.data import run_tables

    out = RunOutcome(run_id="r", stages=["curate", "dedup", "caption", "export"])
    for name, detail in (("curate", _Head()), ("dedup", _Section()),
                         ("caption", StageDetail())):
        out.results[name] = StageResult(detail=detail, note="n" if name == "dedup" else None)
        out.seconds[name] = 2.0
    assert format_outcome(out).splitlines() == [
        "lakeshard run r", "where outputs landed", "", "a section", "of two lines", "",
        f"stage {'curate':<10} {2.0:8.1f} s", f"stage {'dedup':<10} {2.0:8.1f} s  (n)",
        f"stage {'caption':<10} {2.0:8.1f} s", f"stage {'export':<10} {'skipped':>10}"]
    summary = json.load(open(write_summary(out, str(tmp_path))))
    assert (summary["curate"], summary["exports"]) == ({"rows": 3}, [])
    assert list(summary)[:7] == ["run_id", "status", "failed_stage", "failure", "events",
                                 "curate", "exports"]
    run_rows, stage_rows, _ = run_tables(out)
    assert run_rows == [{"source": "a", "seen": 1, "accepted": 1, "rejected": 0, "errors": 0,
                         "flagged": 0, "removed": 0, "reasons": ""}]
    assert [r["stage"] for r in stage_rows] == ["curate", "dedup", "caption"]


def test_a_runs_result_objects_are_typed_by_the_caller():
    out = RunOutcome(run_id="r", stages=["curate", "dedup"])
    out.results["curate"] = StageResult(detail=_Head())
    out.results["dedup"] = StageResult(note="disabled")
    assert isinstance(out.detail("curate", _Head), _Head)
    assert out.detail("dedup", _Section) is None and out.detail("caption", _Head) is None
    with pytest.raises(TypeError, match="stage 'curate' returned a _Head, not a _Section"):
        out.detail("curate", _Section)
    assert out.details() == [out.results["curate"].detail]
    with pytest.raises(RuntimeError, match="no result object .disabled."):
        out.results["dedup"].made()
