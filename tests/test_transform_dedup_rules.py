"""etl.transforms.dedup_rules, the parts of dedup's rules both planners share: the LSH
masks worked out by hand, the canonical order's terms, and the name of a cluster
called after its members (checked against the Spark expression it stands for)."""

from __future__ import annotations

import pytest
from pyspark.sql import functions as F

from etl.transforms.dedup_rules import OrderTerm, lsh_masks, members_name, order_terms

LOW, HIGH = (1 << 32) - 1, -(1 << 32)  # the low and the high 32 bits, as signed longs


def test_lsh_masks_are_the_combinations_of_kept_blocks():
    assert lsh_masks(0, 1) == [-1]  # no bit may differ: the whole hash is the key
    assert lsh_masks(1, 2) == [LOW, HIGH]  # one of two halves kept
    assert lsh_masks(0, 2) == [-1]  # both halves kept
    q = [0xFFFF << (16 * i) for i in range(4)]  # 4 blocks of 16 bits, 2 may differ
    signed = [m - (1 << 64) if m >= 1 << 63 else m for m in
              (q[0] | q[1], q[0] | q[2], q[0] | q[3], q[1] | q[2], q[1] | q[3], q[2] | q[3])]
    assert lsh_masks(2, 4) == signed
    # 3 blocks of 64 bits: bounds at round(64/3) = 21 and round(128/3) = 43.
    assert lsh_masks(2, 3) == [(1 << 21) - 1, ((1 << 22) - 1) << 21,
                               (((1 << 21) - 1) << 43) - (1 << 64)]
    for threshold, bands in ((1, 1), (-1, 2), (3, 65)):
        with pytest.raises(ValueError, match="need 0 <= threshold < bands <= 64"):
            lsh_masks(threshold, bands)


def test_order_terms_follow_the_policy_and_end_with_the_sample_id():
    assert order_terms(("source_priority", "resolution", "earliest"), ("a", "b")) == [
        OrderTerm("rank", ("source",), ("a", "b")),
        OrderTerm("product", ("original_width", "original_height")),
        OrderTerm("product", ("width", "height")),
        OrderTerm("value", ("ingested_at",)),
        OrderTerm("value", ("sample_id",)),
    ]
    assert order_terms(("earliest",), ()) == [OrderTerm("value", ("ingested_at",)),
                                              OrderTerm("value", ("sample_id",))]
    with pytest.raises(ValueError, match="unknown dedup policy criterion 'largest'"):
        order_terms(("largest",), ())


def test_members_name_is_sparks_hash_of_the_sorted_ids(spark):
    ids = ["c9", "a1", "b5"]
    row = spark.createDataFrame([(ids,)], "ids array<string>").select(
        F.substring(F.sha2(F.concat_ws(",", F.sort_array("ids")), 256), 1, 32).alias("n")
    ).first()
    assert members_name(ids) == row.n
    assert members_name(list(reversed(ids))) == row.n and len(row.n) == 32
    assert members_name(["a1", "b5"]) != row.n
