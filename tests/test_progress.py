"""Stage progress counts records per step: a long mapInArrow over N records, in a job
group with a step's description, is reported under that step with a record count that
reaches N -- one count for the step across its Spark jobs, not one per job -- and the
console line says so."""

from __future__ import annotations

import io
import time


def test_step_records_reach_n_across_jobs(spark, tmp_path):
    from etl.runtime.progress import StageProgress, console, step_label

    def slow(batches):  # defined here: pickled by value for Spark's Python workers
        for batch in batches:
            time.sleep(0.5)
            yield batch

    n = 2000
    path = str(tmp_path / "records.parquet")
    spark.range(n, numPartitions=2).write.parquet(path)
    sc = spark.sparkContext
    stream = io.StringIO()
    sc.setJobGroup("lakeshard-progress-test-curate", "lakeshard curate (test)")
    try:
        with console("text"), StageProgress(spark, "progress-test", "curate",
                                            interval_s=0.5, stream=stream) as progress:
            sc.setJobDescription("lakeshard curate: prepare")
            frame = spark.read.parquet(path).mapInArrow(slow, "id long")
            assert frame.count() == n
            assert frame.filter("id % 2 = 0").count() == n // 2  # a second job, same step
            sc.setJobDescription(None)
            snaps = progress.snapshot()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setJobDescription(None)
    assert progress.records()["prepare"] == n  # both jobs read the n records: not 2n
    assert all(s["records"] <= n for s in snaps)
    lines = [line for line in stream.getvalue().splitlines() if "prepare" in line]
    assert lines, "no progress line for the step"
    assert lines[-1].startswith("[lakeshard] curate · prepare: 2,000 records")
    assert step_label("lakeshard export: write partitions", "export") == "write partitions"
    assert step_label(None, "dedup") == "other"
    assert step_label("Delta: Delta: lakeshard curate: list sources, compare with the "
                      "manifest: Filtering files for query: Compute snapshot for version: 1",
                      "curate") == "list sources, compare with the manifest"
    assert step_label("lakeshard curate: merge Delta rejects, manifest, accounting - MERGE "
                      "operation - writing new files", "curate") == (
        "merge Delta rejects, manifest, accounting")
    assert step_label("lakeshard curate: nothing changed: record accounting",
                      "curate") == "nothing changed: record accounting"
