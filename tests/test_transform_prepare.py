"""etl.transforms.prepare on a few rows built in the test: every row kept with a status,
the curated and rejects rows it splits into, the outcome counts (the run's accounting
as data), and the failure examples a failed stage prints."""

from __future__ import annotations

from datetime import datetime

import pyarrow as pa
import pytest
from pyspark.sql import functions as F
from support import jpeg_bytes, png_bytes

from etl.config import PrepareConfig
from etl.schema import CURATED_COLUMNS, INGEST_SCHEMA
from etl.transforms.prepare import (
    accepted_rows,
    failure_examples,
    outcome_counts,
    prepare_images,
    rejected_rows,
)


def _ingest_rows(spark, rows):
    return spark.createDataFrame(rows, INGEST_SCHEMA)


def _prepared(spark):
    rows = [
        ("id1", "s1", "k1", None, "a red square", None, None, jpeg_bytes((30, 20)), "ok", None),
        ("id2", "s1", "k2", None, None, None, None, png_bytes((8, 6)), "ok", None),
        ("id3", "s1", "k3", None, None, None, None, b"garbage", "ok", None),
        ("id4", "s2", "k4", None, "x", None, None, None, "rejected", "missing_image"),
        ("id5", "s2", "k5", None, "y", None, None, b"", "ok", None),
    ]
    return prepare_images(_ingest_rows(spark, rows), PrepareConfig(min_side=10))


def test_prepare_keeps_every_row_with_a_status(spark):
    got = {r.sample_id: (r.status, r.stage, r.reason) for r in _prepared(spark).collect()}
    assert got == {
        "id1": ("ok", "prepare", None),
        "id2": ("ok", "prepare", None),
        "id3": ("rejected", "prepare", "undecodable"),
        "id4": ("rejected", "ingest", "missing_image"),
        "id5": ("rejected", "prepare", "empty"),
    }


def test_accepted_and_rejected_split_the_rows(spark):
    prepared = _prepared(spark)
    at = datetime(2026, 1, 2, 3, 4, 5)
    acc = accepted_rows(prepared, run_id="r1", ingested_at=at)
    assert tuple(acc.columns) == CURATED_COLUMNS
    rows = {r.sample_id: r for r in acc.collect()}
    assert set(rows) == {"id1", "id2"}
    assert (rows["id1"].width, rows["id1"].height) == (30, 20)
    assert rows["id1"].image[:2] == b"\xff\xd8"
    assert rows["id1"].image_size_bytes == len(rows["id1"].image)
    assert rows["id2"].original_format == "PNG" and rows["id1"].run_id == "r1"
    # 30x20 passes min_side=10; 8x6 is kept in the table but flagged.
    assert (rows["id1"].keep, rows["id1"].filter_reason) == (True, None)
    assert (rows["id2"].keep, rows["id2"].filter_reason) == (False, "too_small")
    assert len(rows["id1"].image_sha256) == 64 and isinstance(rows["id1"].dhash, int)
    rej = {r.sample_id: r.reason for r in rejected_rows(prepared, run_id="r1").collect()}
    assert rej == {"id3": "undecodable", "id4": "missing_image", "id5": "empty"}


def test_rejected_rows_held_here_are_the_rows_spark_tasks_build(spark):
    """The rejects curate builds on the driver from prepared rows it holds: the rows,
    values and types the same rule gives in Spark's tasks for the same rows."""
    prepared = _prepared(spark)
    mine = rejected_rows(prepared.toArrow(), run_id="r1")
    theirs = rejected_rows(prepared, run_id="r1").toArrow()
    assert mine.schema.names == theirs.schema.names
    assert [f.type for f in mine.schema] == [f.type for f in theirs.schema]
    key = [("sample_id", "ascending")]
    assert mine.sort_by(key).to_pylist() == theirs.sort_by(key).to_pylist()
    assert {r["sample_id"]: (r["stage"], r["reason"], r["run_id"]) for r in mine.to_pylist()
            } == {"id3": ("prepare", "undecodable", "r1"), "id4": ("ingest", "missing_image",
                                                                   "r1"),
                  "id5": ("prepare", "empty", "r1")}


def test_accepted_rows_held_here_are_the_rows_spark_builds(spark):
    """The curated rows curate appends from the driver, built from prepared rows it holds:
    the columns, types and values (images included) Spark's projection gives for the
    same rows."""
    prepared = _prepared(spark)
    at = datetime(2026, 1, 2, 3, 4, 5)
    mine = accepted_rows(prepared.toArrow(), run_id="r1", ingested_at=at)
    theirs = accepted_rows(prepared, run_id="r1", ingested_at=at).toArrow()
    assert mine.schema.names == list(CURATED_COLUMNS) == theirs.schema.names
    assert [f.type for f in mine.schema] == [f.type for f in theirs.schema]
    key = [("sample_id", "ascending")]
    assert mine.sort_by(key).to_pylist() == theirs.sort_by(key).to_pylist()
    assert sorted(mine.column("sample_id").to_pylist()) == ["id1", "id2"]


def _spark_aggregate(prepared):
    """The outcome counts as one Spark aggregate, written here: what `outcome_counts`
    must give however it runs (the smallest failed (key, detail) per group, as Spark's
    min of a struct orders it)."""
    example = F.min(F.when(
        F.col("status") != "ok",
        F.struct(F.col("source_key").alias("key"), F.col("detail").alias("detail"))))
    return prepared.groupBy(
        "source", "stage", "status", "reason",
        F.col("prepared.filter_reason").alias("filter_reason")).agg(
        F.count(F.lit(1)).alias("count"), example.alias("example"))


def _plain(rows):
    return sorted(((r.source, r.stage, r.status, r.reason, r.filter_reason, r["count"],
                    None if r.example is None else tuple(r.example)) for r in rows), key=repr)


def test_outcome_counts_balance(spark):
    rows = outcome_counts(_prepared(spark)).rows
    counts = {(r.source, r.status, r.reason, r.filter_reason): r["count"] for r in rows}
    assert counts == {
        ("s1", "ok", None, None): 1,
        ("s1", "ok", None, "too_small"): 1,
        ("s1", "rejected", "undecodable", None): 1,
        ("s2", "rejected", "missing_image", None): 1,
        ("s2", "rejected", "empty", None): 1,
    }


def test_failure_examples_put_internal_errors_first_then_the_commonest():
    def row(source, status, reason, count, key=None, detail=None, stage="prepare"):
        return {"source": source, "stage": stage, "status": status, "reason": reason,
                "filter_reason": None, "count": count,
                "example": None if key is None else {"key": key, "detail": detail}}

    outcome = [
        row("s", "ok", None, 50),
        row("s", "rejected", "empty", 2, key="e.png", detail=None),  # no detail: no colon
        row("s", "rejected", "undecodable", 7, key="u.png", detail="not an image"),
        row("t", "rejected", "undecodable", 7, key="v.png", detail="truncated"),
        row("t", "rejected", "http_404", 9, key="https://x/a", detail="404", stage="fetch"),
        row("t", "error", "internal_error", 1, key="i.png", detail="KeyError: 'x'"),
        row("t", "rejected", "timeout", 30),  # no example: not shown
    ]
    assert failure_examples(outcome, 10) == (
        "t i.png: prepare internal_error: KeyError: 'x'",
        "t https://x/a: fetch http_404: 404",
        "s u.png: prepare undecodable: not an image",  # same count: by source
        "t v.png: prepare undecodable: truncated",
        "s e.png: prepare empty",
    )
    assert failure_examples(outcome, 2) == failure_examples(outcome, 10)[:2]
    assert failure_examples(outcome[:1], 3) == ()


def test_outcome_counts_of_held_rows_and_in_spark_tasks_equal_spark_aggregate(spark):
    """One rule, run on rows this process holds and in Spark's tasks (``mapInArrow``,
    the batches' partial counts merged), gives Spark's own aggregate of the same rows."""
    from etl.runtime.local import is_local, local_arrow

    rows = [  # source, stage, status, reason, filter_reason, key, detail
        ("s1", "prepare", "ok", None, None, "k1", None),
        ("s1", "prepare", "ok", None, "too_small", "k2", None),
        ("s1", "prepare", "rejected", "undecodable", None, "k3", "b"),
        ("s1", "prepare", "rejected", "undecodable", None, "k3", None),  # null first
        ("s1", "prepare", "rejected", "undecodable", None, "k30", "a"),
        ("s2", "ingest", "rejected", "missing_image", None, "k\u00e9", "x"),
        ("s2", "ingest", "rejected", "missing_image", None, "kz", "y"),  # by UTF-8 bytes
        ("s2", "fetch", "error", "internal_error", None, "k9", "boom"),
    ]
    table = pa.table({
        "source": [r[0] for r in rows], "stage": [r[1] for r in rows],
        "status": [r[2] for r in rows], "reason": [r[3] for r in rows],
        "prepared": pa.array([{"filter_reason": r[4]} for r in rows],
                             pa.struct([("filter_reason", pa.string())])),
        "source_key": [r[5] for r in rows], "detail": [r[6] for r in rows]})
    local = spark.createDataFrame(table)
    assert is_local(local)

    here = outcome_counts(local_arrow(local)).rows
    in_tasks = outcome_counts(local.repartition(3)).rows  # several batches to merge
    assert _plain(here) == _plain(in_tasks) == _plain(_spark_aggregate(local).collect())
    assert [r.__fields__ for r in here[:1]] == [r.__fields__ for r in in_tasks[:1]] == [
        _spark_aggregate(local).columns]
    examples = {r.reason: tuple(r.example) for r in here if r.example is not None}
    assert examples == {"undecodable": ("k3", None), "missing_image": ("kz", "y"),
                        "internal_error": ("k9", "boom")}


def test_a_tasks_partial_counts_reach_the_driver_folded_one_row_per_group(spark):
    """In Spark's tasks the outcome rule runs per Arrow batch and each task folds its
    batches' partial counts before they leave it: one task of eight 2-row batches sends
    one row per group it saw (not one per group per batch), and the counts, examples and
    fragments are the same as Spark's aggregate."""
    from etl.runtime.local import per_batch
    from etl.transforms.prepare import _OUTCOME_KEYS, _PARTIAL_OUTCOMES, _folded, _outcome_batch
    from etl.transforms.prepare_task import FLAG, WRITTEN

    once = _prepared(spark)
    prepared = once.unionByName(once).unionByName(once)  # each group in several batches
    staged = prepared.withColumns({
        FLAG: F.col("status") == "ok",
        WRITTEN: F.when(F.col("sample_id") == "id1", F.array(F.lit("f1"))),
        "filter_reason": F.col("prepared.filter_reason")}).coalesce(1)
    previous = spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "2")
    try:
        partials = per_batch(staged, _outcome_batch, _PARTIAL_OUTCOMES,
                             [*_OUTCOME_KEYS, "source_key", "detail", FLAG, WRITTEN],
                             fold=_folded).collect()
        got = outcome_counts(staged)
    finally:
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", previous)
    groups = _spark_aggregate(prepared).collect()
    assert len(partials) == len(groups)  # unfolded: a row per group per 2-row batch
    assert sum(r["count"] for r in partials) == prepared.count()
    assert _plain(got.rows) == _plain(groups)
    assert got.fragments == (["f1"], ["f1"], ["f1"]) and got.disagree == 0


def test_outcome_counts_and_the_tasks_fragments_in_one_job(spark):
    """The outcome counts after a fetch + prepare job whose tasks wrote to Lance, in
    Spark's tasks: the same outcome rows as Spark's aggregate, every task's list of
    fragments (it rides on one row of the task), and the rows whose ``_written`` flag
    and status disagree."""
    from etl.transforms.prepare_task import FLAG, WRITTEN

    prepared = _prepared(spark)
    ok = F.col("status") == "ok"
    lists = F.when(F.col("sample_id") == "id1", F.array(F.lit("f1"), F.lit("f2"))) \
        .when(F.col("sample_id") == "id4", F.array(F.lit("f3")))
    staged = prepared.withColumns({FLAG: ok, WRITTEN: lists}).repartition(2)
    got = outcome_counts(staged)
    assert _plain(got.rows) == _plain(_spark_aggregate(prepared).collect())
    assert sorted(got.fragments) == [["f1", "f2"], ["f3"]] and got.disagree == 0
    wrong = prepared.withColumns({FLAG: F.col("sample_id").isin("id1", "id3"),
                                  WRITTEN: F.lit(None).cast("array<string>")})
    # id2 accepted, not written; id3 the reverse
    assert outcome_counts(wrong).disagree == 2 and outcome_counts(wrong).fragments == ()


def test_the_tasks_rows_come_back_up_to_the_driver_bound_and_are_persisted_past_it(spark):
    """Curate's fetch + prepare of a night within ``driver.ids`` new records: the rows
    come back to the driver in the one job that made them, and the outcome counts, the
    tasks' fragments and the ``_written`` check are computed here, as Spark's aggregate
    computes them; the rows the later steps read are local data. Past the bound the rows
    are persisted and the same counts come from Spark's tasks. A row whose ``_written``
    flag and status disagree fails the stage."""
    from etl.jobs.curate import _checked
    from etl.runtime.local import is_local
    from etl.transforms.prepare import counted
    from etl.transforms.prepare_task import FLAG, WRITTEN

    prepared = _prepared(spark)
    ok = F.col("status") == "ok"
    lists = F.when(F.col("sample_id") == "id1", F.array(F.lit("f1"), F.lit("f2"))) \
        .when(F.col("sample_id") == "id4", F.array(F.lit("f3")))
    staged = prepared.withColumns({FLAG: ok, WRITTEN: lists})
    expected = _plain(_spark_aggregate(prepared).collect())
    got = counted(staged, new_records=5, bound=5)
    assert _plain(got.outcomes.rows) == expected
    assert sorted(got.outcomes.fragments) == [["f1", "f2"], ["f3"]]
    assert is_local(got.rows) and got.cached is None and got.held is not None
    assert got.rows.schema == prepared.schema
    assert sorted(map(tuple, got.rows.collect()), key=str) == sorted(
        map(tuple, prepared.collect()), key=str)
    past = counted(staged, new_records=5, bound=4)
    assert _plain(past.outcomes.rows) == expected and past.held is None
    assert sorted(past.outcomes.fragments) == [["f1", "f2"], ["f3"]]
    assert past.cached is not None and past.rows.schema == prepared.schema
    assert sorted(map(tuple, past.rows.collect()), key=str) == sorted(
        map(tuple, prepared.collect()), key=str)
    past.cached.unpersist()
    wrong = prepared.withColumns({FLAG: F.col("sample_id").isin("id1", "id3"),
                                  WRITTEN: F.lit(None).cast("array<string>")})
    with pytest.raises(RuntimeError, match="2 row"):
        _checked(counted(wrong, new_records=5, bound=5).outcomes)
    # Without a sink (the driver's few, behind a takedown join): the same counts.
    plain = counted(prepared, new_records=5, bound=5)
    assert _plain(plain.outcomes.rows) == expected
    assert plain.outcomes.fragments == ()


def test_one_projection_equals_with_columns_then_drop(spark):
    """fetch_and_prepare's last step, ``withColumns(...).drop(...)`` built as one
    projection: the same columns, in the same order, with the same types and values."""
    from etl.transforms.prepare import _with_columns

    df = spark.createDataFrame([(1, "a", b"x", None), (2, None, None, 3.5)],
                               "id int, name string, image_bytes binary, score double")
    columns = {"name": F.coalesce("name", F.lit("?")),  # replaced in place
               "size": F.length("image_bytes"),  # new, after the others
               "has_score": F.col("score").isNotNull()}
    want = df.withColumns(columns).drop("image_bytes", "score")
    got = _with_columns(df, df.columns, columns, drop=("image_bytes", "score"))
    assert got.schema == want.schema
    assert got.columns == ["id", "name", "size", "has_score"]
    assert got.collect() == want.collect() == [(1, "a", 1, False), (2, "?", None, True)]
