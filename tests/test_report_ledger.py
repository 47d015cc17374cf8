"""One real run (in-process, sample sources): the report, its figures and how it
renders in headless Chromium; the run ledger and `lakeshard runs`; structured events,
progress and the Spark job groups that name each stage."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess

import lance
import numpy as np
import pytest
from conftest import make_config
from PIL import Image

from etl import tables
from etl.jobs.dedup import DedupRun
from etl.ledger import read_runs
from etl.sample_sources import FOLDER_BAD, FOLDER_FLAGGED, FOLDER_PHOTOS, TABLE_PHOTOS

pytestmark = pytest.mark.slow


def _not_blank(path, min_colors=64) -> None:
    im = np.asarray(Image.open(path).convert("RGB"))
    assert im.shape[0] > 100 and im.shape[1] > 100, path
    colors = len(np.unique(im.reshape(-1, 3), axis=0))
    non_white = float((im.min(axis=2) < 240).mean())
    assert colors >= min_colors and non_white > 0.02, (path, colors, non_white)


@pytest.fixture(scope="module")
def finished_run(spark, tmp_path_factory):
    from etl.pipeline.runner import run_pipeline

    root = tmp_path_factory.mktemp("report")
    cfg = make_config(
        root,
        sources=[
            {"name": "photos", "kind": "image_folder", "path": str(root / "in" / "photos"),
             "sample": True},
            {"name": "alt", "kind": "table", "path": str(root / "in" / "alt.parquet"),
             "columns": {"key": "id", "image": "jpg", "caption": "alt_text"}, "sample": True},
        ],
        exports={"train": {"partitions": 2, "include_duplicates": True}},
        run={"progress_interval_s": 0.2, "report_samples": 4},
    )
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.INFO)
    events_log = logging.getLogger("lakeshard.events")
    events_log.addHandler(handler)
    events_log.setLevel(logging.INFO)
    try:
        out = run_pipeline(cfg)
    finally:
        events_log.removeHandler(handler)
    events = [json.loads(r.getMessage()) for r in records]
    return cfg, out, events


def test_report_figures_match_the_sample_definitions(spark, finished_run):
    cfg, out, _ = finished_run
    report_dir = os.path.dirname(out.report)
    assert out.report == os.path.join(tables.layout(cfg).reports_dir, out.run_id, "index.html")
    data = json.load(open(os.path.join(report_dir, "report.json")))

    # Expected from the sample definitions, not from the pipeline.
    status = {r["source"]: r for r in data["status"]}
    assert (status["photos"]["kept"], status["photos"]["flagged"],
            status["photos"]["rejected"]) == (len(FOLDER_PHOTOS), len(FOLDER_FLAGGED),
                                              len(FOLDER_BAD))
    assert (status["alt"]["kept"], status["alt"]["flagged"], status["alt"]["rejected"]) == (
        len(TABLE_PHOTOS), 0, 2)
    reasons = {(r["kind"], r["reason"]): r["count"] for r in data["reasons"]}
    assert reasons == {("rejected", "empty"): 1, ("rejected", "truncated"): 1,
                       ("rejected", "undecodable"): 2, ("rejected", "missing_image"): 1,
                       ("flagged", "too_small"): len(FOLDER_FLAGGED)}
    n_captioned = sum(c is not None for _, c in FOLDER_PHOTOS.values()) + len(
        FOLDER_FLAGGED) + len(TABLE_PHOTOS)
    (captions,) = data["captions"]
    assert captions["version"] == "caption_original" and captions["captions"] == n_captioned
    # Duplicates: what the Delta dedup table holds, per source and kind.
    kinds = {}
    for r in spark.read.format("delta").load(tables.layout(cfg).dedup).collect():
        kinds.setdefault(r["source"], []).append(r["dup_kind"])
    per_source = {r["source"]: r for r in data["dedup"]["per_source"]}
    assert set(per_source) == {"photos", "alt"}
    for source, got in per_source.items():
        mine = kinds.get(source, [])
        assert got["rows"] == len(mine) == status[source]["kept"] + status[source]["flagged"]
        for kind in ("canonical", "exact", "near", "unique"):
            assert got[kind] == mine.count(kind), (source, kind)
    assert data["dedup"]["uncovered"] == 0  # nothing added after dedup ran
    # The corpus-wide counts were kept per fragment / file for the next report.
    for table in ("curated", "rejects"):
        assert json.load(open(tables.layout(cfg).counts_cache(table)))["payload"]["parts"], table
    # The report times itself after; caption has no versions configured here.
    assert set(data["seconds"]) == {"curate", "dedup", "caption", "export"}
    assert set(out.seconds) == {"curate", "dedup", "caption", "export", "report"}

    # Contact sheets: kept rows with their captions, the flagged one with its reason.
    ds = lance.dataset(tables.layout(cfg).curated)
    rows = {r["sample_id"]: r for r in ds.to_table(
        columns=["sample_id", "keep", "caption_original", "filter_reason"]).to_pylist()}
    assert len(data["contact_kept"]) == 4
    assert all(rows[s]["keep"] for s in data["contact_kept"])
    assert [rows[s]["filter_reason"] for s in data["contact_flagged"]] == ["too_small"]
    page = open(out.report, encoding="utf-8").read()
    for sid in data["contact_kept"]:
        assert f"thumbs/{sid}.jpg" in page
        assert os.path.isfile(os.path.join(report_dir, "thumbs", f"{sid}.jpg"))
        if rows[sid]["caption_original"]:
            assert rows[sid]["caption_original"][:30].replace("&", "&amp;") in page
    for name in data["figures"].values():
        assert f'src="{name}"' in page or name.startswith("contact_")
        _not_blank(os.path.join(report_dir, name))
    assert json.load(open(os.path.join(report_dir, "summary.json")))["report"] == out.report


def test_the_report_starts_no_spark_job_when_the_driver_reads_its_figures(spark, finished_run,
                                                                          tmp_path):
    """Counts kept per fragment and file, the dedup stats, pylance and delta-rs: the
    run's report ran no Spark job, and neither does drawing it again."""
    from etl.report import write_report

    cfg, out, _ = finished_run
    tracker = spark.sparkContext.statusTracker()
    assert tracker.getJobIdsForGroup(f"lakeshard-{out.run_id}-report") == []
    sc = spark.sparkContext
    sc.setJobGroup("report-again", "the report drawn again")
    try:
        index = write_report(spark, cfg, out, str(tmp_path))
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert tracker.getJobIdsForGroup("report-again") == []
    # The same figures as the run's own report (whose time the timings now include).
    again = json.load(open(tmp_path / "report.json"))
    first = json.load(open(os.path.join(os.path.dirname(out.report), "report.json")))
    assert again.pop("seconds") == {**first.pop("seconds"), "report": out.seconds["report"]}
    assert again == first
    assert open(index, encoding="utf-8").read() == open(out.report, encoding="utf-8").read()


def test_the_largest_clusters_read_by_delta_rs_equal_spark(spark, finished_run):
    from etl.report.data import _delta_rs_dataset, largest_clusters

    cfg, _, _ = finished_run
    path = tables.layout(cfg).dedup
    dataset = _delta_rs_dataset(path)
    assert dataset is not None and dataset is not False  # delta-rs reads this table
    by_spark = largest_clusters(spark, path, 2, None)
    assert by_spark and largest_clusters(spark, path, 2, dataset) == by_spark
    # Each cluster as the dedup table holds it: canonical member first, the largest first.
    sizes = [c[0]["cluster_size"] for c in by_spark]
    assert sizes == sorted(sizes, reverse=True)
    for cluster in by_spark:
        assert cluster[0]["is_canonical"]
        assert len({m["dup_cluster_id"] for m in cluster}) == 1


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="no chromium: `make browser` installs it")
def test_report_renders_in_headless_chromium(finished_run, tmp_path):
    _, out, _ = finished_run
    shot = tmp_path / "shot.png"
    res = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--allow-file-access-from-files", "--window-size=1280,7000",
         f"--screenshot={shot}", f"file://{out.report}"],
        capture_output=True, text=True, timeout=180,
    )
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    _not_blank(shot, min_colors=1000)  # charts and the contact sheets' photos
    # The figures loaded: the top of the page (the timings chart) is not all white.
    top = np.asarray(Image.open(shot).convert("L"))[:600]
    assert (top < 200).mean() > 0.01


def test_ledger_has_a_row_per_run_and_stage(spark, finished_run):
    from etl.ledger import recent_runs, recent_runs_local
    from etl.pipeline.summary import format_runs

    cfg, out, _ = finished_run
    path = tables.layout(cfg).runs
    rows = {r["stage"]: r for r in recent_runs(spark, path) if r["run_id"] == out.run_id}
    assert set(rows) == {"run", "curate", "dedup", "caption", "export"}
    assert {r["status"] for r in rows.values()} == {"ok"}
    n = len(FOLDER_PHOTOS) + len(FOLDER_FLAGGED) + len(TABLE_PHOTOS)
    seen = n + len(FOLDER_BAD) + 2
    cur = rows["curate"]
    assert cur["inputs"]["seen"] == seen
    assert (cur["outputs"]["accepted"], cur["outputs"]["rejected"]) == (n, seen - n)
    assert cur["table_versions"]["lance:curated"] == lance.dataset(
        tables.layout(cfg).curated).version
    manifest = json.loads(rows["export"]["export_manifests"])["train"]
    with open(os.path.join(tables.layout(cfg).export_dir("train"), "manifest.json")) as f:
        on_disk = json.load(f)
    assert (manifest["samples"], manifest["checksum"]) == (on_disk["samples"],
                                                           on_disk["checksum"])
    assert manifest["samples"] == n - len(FOLDER_FLAGGED)
    run = rows["run"]
    assert run["note"] == out.report and run["config_hash"] and run["code_version"]
    assert run["ended_at"] >= cur["ended_at"] >= cur["started_at"] >= run["started_at"]
    text = format_runs(recent_runs(spark, path), path, stages=True)
    assert out.run_id in text and "curate:ok dedup:ok caption:ok export:ok" in text
    assert f"accepted={n}" in text
    # `lakeshard runs` reads the ledger with delta-rs (no Spark session): the same page.
    assert format_runs(recent_runs_local(path), path, stages=True) == text


def test_events_progress_and_job_groups(spark, finished_run):
    _, out, events = finished_run
    kinds = [(e["event"], e.get("stage")) for e in events
             if e["event"] not in ("progress", "step_end")]
    stages = [(f"stage_{e}", s) for s in ("curate", "dedup", "caption", "export")
              for e in ("start", "end")]
    assert kinds == [("run_start", None), *stages, ("run_end", None)]
    # Curate's steps, timed, between its start and end.
    names = [e["event"] for e in events]
    steps = [i for i, e in enumerate(events) if e["event"] == "step_end"]
    assert steps and all(events[i]["stage"] == "curate" for i in steps)
    assert names.index("stage_start") < steps[0] and steps[-1] < names.index("stage_end")
    assert all(e["run_id"] == out.run_id for e in events)
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and all(0 <= e["tasks_done"] <= e["tasks_total"] for e in progress)
    tracker = spark.sparkContext.statusTracker()
    for stage in ("curate", "export"):  # caption: nothing to do, no Spark job
        assert tracker.getJobIdsForGroup(f"lakeshard-{out.run_id}-{stage}"), stage
    # dedup: a first run over a small curated table, planned in the driver.
    assert out.detail("dedup", DedupRun).mode == "full (driver)"
    assert tracker.getJobIdsForGroup(f"lakeshard-{out.run_id}-dedup") == []


def test_a_failing_stage_is_recorded_and_releases_the_lock(spark, finished_run):
    from etl.config import ConfigError, ExportConfig
    from etl.pipeline.runner import run_pipeline
    from etl.tables import lock_path

    cfg, _, _ = finished_run
    bad = cfg.model_copy(
        update={"exports": {"bad": ExportConfig(name="bad", where="no_such_col > 1")}}
    )
    with pytest.raises(ConfigError, match="exports.bad.where"):
        run_pipeline(bad, only=("export",), run_id="failing-run")
    assert not os.path.exists(lock_path(cfg))
    rows = {r["stage"]: r for r in read_runs(spark, tables.layout(cfg).runs)
            .where("run_id = 'failing-run'").collect()}
    assert {k: r["status"] for k, r in rows.items()} == {
        "run": "failed", "export": "failed", "curate": "skipped", "dedup": "skipped",
        "caption": "skipped"}
    assert "no_such_col" in rows["export"]["note"]


def test_a_run_that_fails_in_its_last_stage_leaves_no_drafted_report_behind(
        spark, tmp_path, monkeypatch):
    """The report's table part is drafted in a private folder while a last stage that
    keeps the tables runs; when that stage crashes (no report for such a failure), the
    draft's figures and thumbnails reach no report folder, and its folder is removed."""
    import tempfile

    from etl.pipeline import runner
    from etl.pipeline.stages import Stage

    cfg = make_config(tmp_path)
    made, real = [], tempfile.mkdtemp

    def mkdtemp(**kw):
        made.append(real(**kw))
        return made[-1]

    monkeypatch.setattr(runner.tempfile, "mkdtemp", mkdtemp)

    def crash(spark, cfg, ctx):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        runner.run_stages(cfg, [Stage("export", crash, "a crashing export",
                                      keeps_tables=True)], run_id="r-crash", summary=True)
    drafts = [d for d in made if "lakeshard-report-" in d]
    assert drafts and not any(os.path.exists(d) for d in drafts)
    folder = tables.layout(cfg).report_dir("r-crash")
    assert sorted(os.listdir(folder)) == ["events.jsonl"]
    assert read_runs(spark, tables.layout(cfg).runs).where("run_id = 'r-crash'").count() > 0
