"""etl.transforms.dedup on a few rows: the order that picks a cluster's canonical member
(resolution, then source priority, then the earliest, the sample id breaking ties;
Spark's null placement), worked out by hand, and the driver's sort key against it. The
LSH masks: test_transform_dedup_rules.py; near pairs, components and whole plans:
test_dedup.py; the driver's plan against Spark's: test_dedup_local.py."""

from __future__ import annotations

from datetime import datetime

import pytest

from etl.transforms.dedup import canonical_order
from etl.transforms.dedup_local import canonical_key

ROWS = [  # sample_id, source, width, height, original_width, original_height, ingested day
    ("big-late", "web", 64, 64, 400, 300, 9),
    ("big-early", "web", 64, 64, 300, 400, 1),     # same original area: earlier wins
    ("big-mirror", "mirror", 64, 64, 400, 300, 5),  # same area, the preferred source
    ("small", "mirror", 64, 64, 100, 100, 1),
    ("no-original", "mirror", 64, 64, None, None, 1),  # unknown size: last (nulls last)
    ("same-a", "web", 32, 32, 100, 100, 1),        # as "small", a smaller stored image
    ("tie-b", "other", 80, 80, 100, 100, 2),       # as "small", a bigger stored image;
    ("tie-a", "other", 80, 80, 100, 100, 2),       # a full tie: the sample id decides
]
POLICY = ("resolution", "source_priority", "earliest")
PRIORITY = ("mirror", "web")
# By original area (desc), stored area (desc), source rank (mirror, web, others), day.
EXPECTED = ["big-mirror", "big-early", "big-late", "tie-a", "tie-b", "small", "same-a",
            "no-original"]


def _frame(spark):
    return spark.createDataFrame(
        [(sid, src, w, h, ow, oh, datetime(2026, 1, day)) for sid, src, w, h, ow, oh, day
         in ROWS],
        "sample_id string, source string, width int, height int, original_width int, "
        "original_height int, ingested_at timestamp")


POLICIES = (POLICY, ("source_priority", "earliest"), ("earliest", "resolution"))


@pytest.fixture(scope="module")
def spark_orders(spark) -> dict[tuple[str, ...], list[str]]:
    """The sample ids in canonical order, per policy, as Spark sorts them."""
    return {policy: [r.sample_id for r in _frame(spark).orderBy(
        *canonical_order(policy, PRIORITY)).collect()] for policy in POLICIES}


def test_canonical_order_ranks_by_resolution_source_and_age(spark_orders):
    assert spark_orders[POLICY] == EXPECTED
    # Source first: every mirror row before every web row, the rest after.
    assert spark_orders[("source_priority", "earliest")] == [
        "no-original", "small", "big-mirror", "big-early", "same-a", "big-late", "tie-a",
        "tie-b"]
    with pytest.raises(ValueError, match="unknown dedup policy criterion 'newest'"):
        canonical_order(("newest",), ())


def test_the_drivers_canonical_key_sorts_as_spark_does(spark_orders):
    columns = ("sample_id", "source", "width", "height", "original_width",
               "original_height", "ingested_at")
    rows = [dict(zip(columns, (*r[:6], datetime(2026, 1, r[6])), strict=True)) for r in ROWS]
    for policy in POLICIES:
        local_order = [r["sample_id"] for r in sorted(rows, key=canonical_key(policy,
                                                                               PRIORITY))]
        assert local_order == spark_orders[policy], policy
