"""etl.transforms.bronze on a few rows: which manifest rows are live, the fingerprint a
skip decision sees (null for a record the next run retries), and which records a
takedown names. Diffing a listing against the manifest and refusing taken-down rows:
test_bronze_accounting.py and test_removals.py."""

from __future__ import annotations

from datetime import datetime

from support import frame

from etl.schema import MANIFEST_SCHEMA, TAKEDOWNS_SCHEMA
from etl.transforms.bronze import (
    TAKEN_DOWN,
    known_fingerprint,
    live,
    takedown_identifiers,
    taken_down_ids,
    taken_down_records,
)

AT = datetime(2026, 3, 4, 5, 6, 7)


def _manifest(spark, rows):
    """Manifest rows from (sample_id, status, reason, fingerprint)."""
    return frame(spark, MANIFEST_SCHEMA, [
        {"sample_id": sid, "source_key": sid, "status": status, "reason": reason,
         "fingerprint": fp} for sid, status, reason, fp in rows
    ], source="s", run_id="r0", ingested_at=AT)


MANIFEST = [
    ("kept", "accepted", None, "10:1"),
    ("bad", "rejected", "undecodable", "10:2"),      # bad for good: not retried
    ("slow", "rejected", "timeout", "10:3"),         # transient: retried
    ("limited", "rejected", "http_429", "10:4"),     # transient: retried
    ("down", "rejected", "http_503", "10:5"),        # a server error: retried
    ("ours", "rejected", "internal_error", "10:6"),  # lakeshard's bug: retried
    ("gone", "removed", "source_removed", "10:7"),
    ("forgotten", "removed", "taken_down", "10:8"),
]


def test_live_rows_are_the_accepted_and_the_rejected(spark):
    got = {r.sample_id for r in live(_manifest(spark, MANIFEST)).collect()}
    assert got == {"kept", "bad", "slow", "limited", "down", "ours"}


def test_a_record_the_next_run_retries_has_no_known_fingerprint(spark):
    manifest = _manifest(spark, MANIFEST)
    got = {r.sample_id: r.fingerprint
           for r in manifest.select("sample_id", known_fingerprint()).collect()}
    assert got == {"kept": "10:1", "bad": "10:2", "slow": None, "limited": None,
                   "down": None, "ours": None, "gone": "10:7", "forgotten": "10:8"}


def _takedowns(spark, rows):
    """Takedown rows from (request_id, kind, value, sample_id)."""
    return frame(spark, TAKEDOWNS_SCHEMA, [
        {"request_id": req, "kind": kind, "value": value, "sample_id": sid,
         "origin": "given" if kind == "key" else "matched"}
        for req, kind, value, sid in rows
    ], requested_at=AT, run_id="r0")


TAKEDOWNS = [
    ("t2", "key", "s:kept", "kept"),          # a key names its record's id
    ("t1", "sample_id", "kept", "kept"),      # the same id in an earlier request
    ("t2", "url", "https://example.org/a.jpg", None),
    ("t3", "image_sha256", "ab" * 32, "bad"),
    ("t3", "sample_id", "gone", "gone"),
    ("t4", "sample_id", "forgotten", "forgotten"),
    ("t4", "key", "s:never-ingested", None),  # a key nothing matched: no id
]


def test_takedown_identifiers_are_one_row_per_kind_and_value_with_the_first_request(spark):
    got = sorted(tuple(r) for r in takedown_identifiers(_takedowns(spark, TAKEDOWNS))
                 .select("kind", "value", "request_id").collect())
    assert got == [
        ("image_sha256", "ab" * 32, "t3"),
        ("sample_id", "bad", "t3"),  # the hash's matched record is named by its id too
        ("sample_id", "forgotten", "t4"),
        ("sample_id", "gone", "t3"),
        ("sample_id", "kept", "t1"),
        ("url", "https://example.org/a.jpg", "t2"),
    ]
    assert {r.sample_id for r in taken_down_ids(_takedowns(spark, TAKEDOWNS)).collect()} == {
        "kept", "bad", "gone", "forgotten"}


def test_taken_down_records_are_those_not_yet_removed_as_taken_down(spark):
    got = {tuple(r) for r in taken_down_records(_manifest(spark, MANIFEST),
                                                _takedowns(spark, TAKEDOWNS)).collect()}
    # "forgotten" is already removed as taken down; "slow" is named by no request.
    assert got == {("kept", "s", "accepted", TAKEN_DOWN), ("bad", "s", "rejected", TAKEN_DOWN),
                   ("gone", "s", "removed", TAKEN_DOWN)}
