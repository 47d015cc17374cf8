"""etl.transforms.dedup_local on a few rows, with the assignments worked out by hand: a
first plan, the next night's increment (a canonical gone, an exact copy arriving), the
stats carried forward from the changes alone, and the size histogram. That the driver's
plan equals Spark's on the same tables: test_dedup_local.py."""

from __future__ import annotations

from datetime import datetime

from etl.config import DedupConfig
from etl.transforms.dedup_local import plan_local, size_histogram, update_stats

H = 0x0123456789ABCDEF
FAR = 0x7EDCBA9876543210
CFG = DedupConfig(threshold=4, bands=6)  # policy: resolution, source priority, earliest


def _row(sid, sha, dhash, side, day):
    return {"sample_id": sid, "source": "s1", "image_sha256": sha, "dhash": dhash,
            "width": side, "height": side, "original_width": side, "original_height": side,
            "ingested_at": datetime(2026, 1, day)}


FIRST = [
    _row("a1", "A", H, 100, 1),
    _row("a2", "A", H, 100, 2),            # an exact copy of a1
    _row("a3", "B", H ^ 0b111, 200, 1),    # 3 bits from both, and bigger: canonical
    _row("b1", "C", FAR, 100, 1),          # unrelated
]


def _view(rows) -> dict[str, tuple]:
    return {r["sample_id"]: (r["dup_cluster_id"], r["is_canonical"], r["dup_kind"],
                             r["cluster_size"]) for r in rows}


def test_a_first_plan_clusters_exact_and_near_copies():
    plan = plan_local(FIRST, [], CFG, "r1")
    assert _view(plan.changes) == {
        "a1": ("a3", False, "near", 3), "a2": ("a3", False, "near", 3),
        "a3": ("a3", True, "canonical", 3), "b1": ("b1", True, "unique", 1)}
    assert [r["sample_id"] for r in plan.changes] == ["a1", "a2", "a3", "b1"]
    assert {r["run_id"] for r in plan.changes} == {"r1"}
    assert (plan.removed, plan.new_rows, plan.pairs) == ([], 4, 1)  # the pair (H, H^7)


def test_the_next_night_changes_only_what_it_touches_and_keeps_cluster_ids():
    prior = plan_local(FIRST, [], CFG, "r1").changes
    current = [r for r in FIRST if r["sample_id"] != "a3"] + [_row("a4", "C", FAR, 100, 3)]
    plan = plan_local(current, prior, CFG, "r2")
    # a3 left: its cluster keeps its id, a1 (earlier than a2) is canonical, a2 is now an
    # exact copy; a4 joins b1's cluster (b1 is earlier: still canonical).
    assert _view(plan.changes) == {
        "a1": ("a3", True, "canonical", 2), "a2": ("a3", False, "exact", 2),
        "a4": ("b1", False, "exact", 2), "b1": ("b1", True, "canonical", 2)}
    assert (plan.removed, plan.new_rows, plan.pairs) == (["a3"], 1, 0)

    # The stats, carried forward from the changes, equal those counted from scratch.
    first = update_stats({"by": {}, "clusters": 0, "sizes": {}}, prior, [], {})
    assert first == {"by": {"s1": {"canonical": 1, "near": 2, "unique": 1}}, "clusters": 1,
                     "sizes": {"3": 1}}
    after = update_stats(first, plan.changes, plan.removed,
                         {r["sample_id"]: r for r in prior})
    assert after == {"by": {"s1": {"canonical": 2, "exact": 2}}, "clusters": 2,
                     "sizes": {"2": 2}}


def test_size_histogram_has_string_keys_in_size_order_and_no_zeros():
    assert size_histogram({10: 2, 3: 1, 2: 0}) == {"3": 1, "10": 2}
    assert list(size_histogram({10: 2, 3: 1})) == ["3", "10"]
    assert size_histogram({}) == {}
