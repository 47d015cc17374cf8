"""The run ledger is an append-only event table: one small commit per transition, no
Spark job to write it, the latest event of a (run, stage) its status; a ledger the
MERGE-era code wrote is migrated and read."""

from __future__ import annotations

import shutil
from datetime import datetime, timedelta

from conftest import REPO, make_config
from deltalake import DeltaTable

from etl import ledger, tables
from etl.migrations import migrate

LEGACY_RUNS = REPO / "tests" / "data" / "legacy_v0" / "root" / "delta" / "runs"
T0 = datetime(2026, 11, 30, 12, 0, 0, 123456)  # naive UTC, as the runner writes them


def _base(run_id: str) -> dict:
    return {"run_id": run_id, "config_hash": "c0ffee", "code_version": "0.1+test",
            "host": "here"}


def _row(run_id: str, stage: str, status: str, minute: int, **more) -> dict:
    return {**_base(run_id), "stage": stage, "status": status,
            "started_at": T0 + timedelta(minutes=minute), **more}


def _transitions(path: str, run_id: str, *, fail_dedup: bool, minute: int = 0,
                 spark=None) -> None:
    """What the runner records for stages curate, dedup (caption not selected)."""
    ledger.record(spark, path, [
        _row(run_id, "run", "running", minute),
        _row(run_id, "caption", "skipped", minute, note="not selected"),
        _row(run_id, "curate", "running", minute),
    ])
    ledger.record(spark, path, [
        _row(run_id, "curate", "ok", minute, ended_at=T0 + timedelta(minutes=minute + 1),
             seconds=60.0, inputs={"seen": 7}, outputs={"accepted": 5, "rejected": 2},
             table_versions={"lance:curated": 3}),
        _row(run_id, "dedup", "running", minute + 1),
    ])
    end = "failed" if fail_dedup else "ok"
    ledger.record(spark, path, [
        _row(run_id, "dedup", end, minute + 1, ended_at=T0 + timedelta(minutes=minute + 2),
             note="ValueError: boom" if fail_dedup else None),
        _row(run_id, "run", end, minute, ended_at=T0 + timedelta(minutes=minute + 2)),
    ])


def _statuses(rows) -> dict[tuple[str, str], str]:
    return {(r["run_id"], r["stage"]): r["status"] for r in rows}


def _same_without_spark(spark, path: str, limit: int = 10) -> None:
    """`lakeshard runs` reads the ledger with delta-rs: the same rows as Spark's query
    (every column), runs newest first, each run's own row before its stages."""
    by_spark = [r.asDict() for r in ledger.recent_runs(spark, path, limit=limit)]
    local = ledger.recent_runs_local(path, limit=limit)
    assert local is not None
    key = lambda r: (r["run_id"], r["stage"])  # noqa: E731
    assert sorted(local, key=key) == sorted(by_spark, key=key)
    runs = [r["run_id"] for r in by_spark if r["stage"] == "run"]
    assert [r["run_id"] for r in local if r["stage"] == "run"] == runs
    assert [r["run_id"] for r in local] == sorted((r["run_id"] for r in local), reverse=True)
    for run_id in runs:
        assert next(r for r in local if r["run_id"] == run_id)["stage"] == "run"


def test_each_transition_is_one_append_and_the_latest_event_is_the_status(spark, tmp_path):
    from etl.lakehouse.views import register_ledger_views
    from etl.pipeline.summary import format_runs

    cfg = make_config(tmp_path)
    path = tables.layout(cfg).runs
    group = "test-ledger-appends"
    spark.sparkContext.setJobGroup(group, "ledger appends")
    try:
        _transitions(path, "r1-failed", fail_dedup=True)
        _transitions(path, "r2-rerun", fail_dedup=False, minute=10)
        ledger.record(None, path, [_row("r3-killed", "run", "running", 20),
                                   _row("r3-killed", "curate", "running", 20)])
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    # Written by delta-rs in this process: no Spark job at all.
    assert spark.sparkContext.statusTracker().getJobIdsForGroup(group) == []

    # One commit per record() call, each a plain append (never a MERGE).
    history = DeltaTable(path).history()
    assert len(history) == 7
    assert {h["operation"] for h in history} <= {"WRITE", "CREATE TABLE"}
    assert all(h.get("operationParameters", {}).get("mode", "Append") == "Append"
               for h in history)
    events = ledger.read_runs(spark, path, latest=False)
    assert events.count() == 3 + 2 + 2 + 3 + 2 + 2 + 2

    # The latest status of each run and stage; the killed run is still `running`.
    latest = ledger.read_runs(spark, path).collect()
    assert _statuses(latest) == {
        ("r1-failed", "run"): "failed", ("r1-failed", "caption"): "skipped",
        ("r1-failed", "curate"): "ok", ("r1-failed", "dedup"): "failed",
        ("r2-rerun", "run"): "ok", ("r2-rerun", "caption"): "skipped",
        ("r2-rerun", "curate"): "ok", ("r2-rerun", "dedup"): "ok",
        ("r3-killed", "run"): "running", ("r3-killed", "curate"): "running",
    }
    curate = next(r for r in latest if (r.run_id, r.stage) == ("r1-failed", "curate"))
    assert curate.inputs == {"seen": 7} and curate.table_versions == {"lance:curated": 3}
    assert curate.outputs == {"accepted": 5, "rejected": 2}
    assert (curate.started_at, curate.ended_at) == (T0, T0 + timedelta(minutes=1))
    failed = next(r for r in latest if (r.run_id, r.stage) == ("r1-failed", "dedup"))
    assert failed.note == "ValueError: boom"

    # The next run takes over the killed run's lock: its open stages become `crashed`,
    # by appending; the `running` events stay in the log.
    assert ledger.mark_crashed(spark, path, "r3-killed", "stale lock taken over") == 2
    assert ledger.mark_crashed(spark, path, "r3-killed", "again") == 0
    rows = ledger.recent_runs(spark, path)
    assert [r["run_id"] for r in rows if r["stage"] == "run"] == [
        "r3-killed", "r2-rerun", "r1-failed"]  # newest first
    killed = [r for r in rows if r["run_id"] == "r3-killed"]
    assert {r["status"] for r in killed} == {"crashed"}
    assert {r["note"] for r in killed} == {"stale lock taken over"}
    assert all(r["started_at"] == T0 + timedelta(minutes=20) for r in killed)
    assert events.where("run_id = 'r3-killed' AND status = 'running'").count() == 2

    _same_without_spark(spark, path)
    _same_without_spark(spark, path, limit=2)
    text = format_runs(ledger.recent_runs_local(path), path, stages=True)
    assert "caption:skipped curate:ok dedup:failed" in text
    assert "caption:skipped curate:ok dedup:ok" in text
    assert "accepted=5, rejected=2" in text and "lance:curated=3" in text

    # The same status table as SQL views.
    assert register_ledger_views(spark, cfg) == ["runs", "run_events"]
    by_sql = spark.sql("SELECT run_id, stage, status FROM runs").collect()
    assert _statuses(by_sql) == _statuses(rows)
    assert spark.sql("SELECT count(*) FROM run_events").first()[0] == 18


def test_a_ledger_the_merge_era_wrote_is_migrated_and_appended_to(spark, tmp_path):
    before = DeltaTable(str(LEGACY_RUNS)).to_pyarrow_table().to_pylist()
    assert "recorded_at" not in before[0]  # the fixture is the old shape
    cfg = make_config(tmp_path / "root")
    path = tables.layout(cfg).runs
    shutil.copytree(LEGACY_RUNS, path)
    expected = {(r["run_id"], r["stage"]): r["status"] for r in before}
    # `lakeshard runs` reads it as it is (it only reads: it migrates nothing).
    assert _statuses(ledger.recent_runs(spark, path)) == expected
    _same_without_spark(spark, path)

    assert migrate(spark, cfg) == ["runs: the ledger is append-only (added recorded_at)"]
    assert migrate(spark, cfg) == []  # the layout marker says it is done
    assert "recorded_at" in spark.read.format("delta").load(path).columns

    # The old rows read as they were: each key's status, untouched.
    (old_run,) = {r["run_id"] for r in before}
    assert _statuses(ledger.recent_runs(spark, path)) == expected

    # New events go in beside them, and an event for an old key wins over its row.
    _transitions(path, "new-run", fail_dedup=False, minute=60)
    ledger.record(None, path, [{**_base(old_run), "stage": "export", "status": "failed",
                                "started_at": T0, "note": "appended later"}])
    latest = _statuses(ledger.recent_runs(spark, path))
    _same_without_spark(spark, path)
    assert latest == {**expected, (old_run, "export"): "failed",
                      ("new-run", "run"): "ok", ("new-run", "caption"): "skipped",
                      ("new-run", "curate"): "ok", ("new-run", "dedup"): "ok"}


def test_a_ledger_spark_created_with_features_of_its_own_still_records(spark, tmp_path):
    """A ledger created by Spark with table features (deletion vectors, row tracking,
    as a Databricks default may) is appended to -- by delta-rs where it can write the
    table, else by Spark -- and reads back the same."""
    from etl.schema import RUNS_SCHEMA

    path = str(tmp_path / "runs")
    spark.createDataFrame([], RUNS_SCHEMA).write.format("delta").option(
        "delta.enableDeletionVectors", "true").option(
        "delta.enableRowTracking", "true").save(path)
    _transitions(path, "r1", fail_dedup=True, spark=spark)
    ledger.record(spark, path, [_row("r1", "dedup", "running", 5)])  # a rerun of dedup
    latest = _statuses(ledger.recent_runs(spark, path))
    # delta-rs leaves a table with deletion vectors to Spark (it would not apply them).
    assert ledger.recent_runs_local(path) is None
    assert latest == {("r1", "run"): "failed", ("r1", "caption"): "skipped",
                      ("r1", "curate"): "ok", ("r1", "dedup"): "running"}
