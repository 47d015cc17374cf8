"""Frames of local data brought back to the driver without a Spark job
(etl.runtime.local): the same Arrow table as Spark's own ``toArrow``."""

from __future__ import annotations

import datetime as dt
import os
import time

import pyarrow as pa
from pyspark.sql import functions as F

from etl.runtime.local import is_local, local_arrow


def _jobs(spark, label, fn):
    sc = spark.sparkContext
    sc.setJobGroup(label, label)
    try:
        out = fn()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return out, len(sc.statusTracker().getJobIdsForGroup(label))


def test_local_data_comes_back_as_toarrow_gives_it_without_a_job(spark):
    # Collected timestamps are naive local times of this process: test in a zone that
    # is not UTC (and has an offset with minutes), so a missed conversion shows.
    old = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Kolkata"
    time.tzset()
    try:
        when = dt.datetime(2026, 3, 29, 1, 30, 5, 123456, tzinfo=dt.UTC)
        table = pa.table({
            "k": ["a", "b", None, "ü字"],
            "b": [b"\x00\xff", None, b"", b"jpeg"],
            "n": pa.array([1, None, -(1 << 40), 7], pa.int64()),
            "t": pa.array([when, None, when + dt.timedelta(days=200), when],
                          pa.timestamp("us", tz="UTC")),
        })
        frame = spark.createDataFrame(table).withColumns({
            "s": F.struct(F.col("k").alias("key"), F.col("n").alias("n"),
                          F.struct(F.col("t").alias("at")).alias("inner")),
            "a": F.array(F.col("k"), F.lit("x")),
            "m": F.create_map(F.lit("key"), F.col("k")),
            "ok": F.col("n") > 0,
        }).where(F.col("k").isNull() | (F.col("k") != "zz"))
        assert is_local(frame)
        here, jobs = _jobs(spark, "local-arrow", lambda: local_arrow(frame))
        assert jobs == 0
        spark_side = frame.toArrow()
        assert here.schema.names == spark_side.schema.names
        assert here.to_pylist() == spark_side.cast(here.schema).to_pylist()
        assert here.column("t")[0].as_py() == when

        grouped = frame.groupBy("ok").count()  # an aggregate: not local data
        assert not is_local(grouped)
        got, jobs = _jobs(spark, "local-arrow-agg", lambda: local_arrow(grouped))
        assert jobs > 0
        assert sorted(got.to_pylist(), key=str) == sorted(
            grouped.toArrow().to_pylist(), key=str)
    finally:
        if old is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = old
        time.tzset()


def test_larger_local_data_comes_back_by_toarrows_job(spark, monkeypatch):
    """Past LOCAL_COLLECT_ROWS rows, handing local data to Python row by row costs more
    than toArrow's job: the same table then comes back by that job."""
    import etl.runtime.local as local

    frame = spark.createDataFrame(pa.table({"n": pa.array(range(40), pa.int64())})) \
        .where(F.col("n") % 2 == 0).select((F.col("n") * 3).alias("m"))
    assert is_local(frame)
    assert local._local_rows(frame) == 20
    small, jobs = _jobs(spark, "local-20", lambda: local_arrow(frame))
    assert jobs == 0
    monkeypatch.setattr(local, "LOCAL_COLLECT_ROWS", 19)
    large, jobs = _jobs(spark, "local-20-over", lambda: local_arrow(frame))
    assert jobs > 0
    assert large.equals(small) and small.column("m").to_pylist() == list(range(0, 120, 6))


def test_python_rows_become_local_data_that_spark_folds(spark):
    """Rows handed over as Arrow: the same rows as ``createDataFrame`` of the list, and
    projections of them are local data (no job), where the list's frame is an RDD."""
    from etl.runtime.local import local_frame

    schema = "k string, n bigint, side struct<status:string, tags:array<string>>, b binary"
    rows = [("a", 1, {"status": "ok", "tags": ["x"]}, b"\x01"),
            ("b", None, ("rejected", None), None), ("c", 3, None, b"")]
    here = local_frame(spark, rows, spark.createDataFrame([], schema).schema)
    listed = spark.createDataFrame(rows, schema)
    assert here.schema == listed.schema
    assert sorted(here.collect()) == sorted(listed.collect())
    projected = here.select("k", F.col("side.status").alias("s")).where("n IS NULL OR n > 0")
    assert is_local(projected) and not is_local(listed.select("k"))
    assert _jobs(spark, "local-frame", projected.collect)[1] == 0
