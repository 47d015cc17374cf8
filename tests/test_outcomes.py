"""Honest outcomes: an exception in lakeshard's own code is `internal_error`, not bad
data; a stage over its failure budget ends `failed` (ledger, exit code 4) with the
budget, the counts and examples; the next run retries; the console shows people the
stage lines and the summary, and every event lands in events.jsonl; the stale-dedup
warning compares rows, not version numbers."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil

import lance
import pyarrow as pa
import pytest
from conftest import JARS_DIR, make_config, png_bytes

from etl import tables
from etl.config import BudgetsConfig, ConfigError
from etl.pipeline.budgets import check_budget
from etl.runtime.stage import RowTally
from udfs.faults import RAISE_ENV

# --------------------------------------------------------------------- budgets


def test_budgets_name_the_budget_the_counts_and_examples():
    budgets = BudgetsConfig()  # 0.1 % internal errors, caption 5 % failed, 10 rows all failed
    assert check_budget("curate", RowTally(rows=1000, ok=999, internal_errors=1), budgets) is None
    breach = check_budget("curate", RowTally(rows=999, ok=998, internal_errors=1,
                                             examples=("photos a.png: prepare internal_error: "
                                                       "KeyError: 'x'",)), budgets)
    assert breach.budget == "run.budgets.internal_error_rate"
    assert "1 of 999 rows (0.10 %) ended internal_error; at most 0.10 % may" in breach.message
    assert "  photos a.png: prepare internal_error: KeyError: 'x'" in breach.message
    assert "the next run retries these rows" in breach.message

    # Caption: 5 % may fail; 1 in 20 passes, 2 in 20 fail the stage.
    assert check_budget("caption", RowTally(rows=20, ok=19, failed=1), budgets) is None
    breach = check_budget("caption", RowTally(rows=20, ok=18, failed=2,
                                              failed_label="caption_v_status = failed"),
                          budgets)
    assert breach.budget == "run.budgets.failed_rate.caption"
    assert "2 of 20 rows (10.00 %) ended caption_v_status = failed; at most 5.00 % may" in (
        breach.message)
    # Rejected records are data: no rate limit on curate by default...
    assert check_budget("curate", RowTally(rows=20, ok=1, failed=19), budgets) is None
    # ...but a stage where not one of at least 10 rows got through fails.
    assert check_budget("curate", RowTally(rows=9, ok=0, failed=9), budgets) is None
    breach = check_budget("curate", RowTally(rows=10, ok=0, failed=10,
                                             failed_label="rejected"), budgets)
    assert breach.budget == "run.budgets.all_failed_min_rows"
    assert "none of its 10 rows got through (10 rejected, 0 internal_error)" in breach.message
    # Nothing processed, or a stage that reports no rows: nothing to judge.
    assert check_budget("curate", RowTally(rows=0, ok=0), budgets) is None
    assert check_budget("export", None, budgets) is None
    strict = BudgetsConfig(internal_error_rate=0, failed_rate={"curate": 0.5},
                           all_failed_min_rows=0)
    assert check_budget("curate", RowTally(rows=10, ok=0, failed=10), strict).budget == (
        "run.budgets.failed_rate.curate")
    assert check_budget("caption", RowTally(rows=10, ok=0, failed=10), strict) is None


def test_budget_stage_names_are_checked_before_spark(tmp_path):
    with pytest.raises(ConfigError, match=r"run\.budgets\.failed_rate\.captoin: unknown "
                       r"stage 'captoin' \(registered: curate, dedup, caption, export"):
        make_config(tmp_path, run={"budgets": {"failed_rate": {"captoin": 0.1}}})
    with pytest.raises(ConfigError, match=r"run\.budgets\.internal_error_rate: must be <= 1"):
        make_config(tmp_path, run={"budgets": {"internal_error_rate": 5}})


# ------------------------------------------------------------ counts, examples


def test_internal_errors_are_counted_apart_from_rejects():
    from etl.transforms.accounting import source_counts
    from etl.transforms.prepare import failure_examples

    def row(status, reason, count, stage="prepare", key=None, detail=None):
        return {"source": "s", "stage": stage, "status": status, "reason": reason,
                "filter_reason": None, "count": count,
                "example": None if key is None else {"key": key, "detail": detail}}

    outcome = [
        row("ok", None, 5),
        row("rejected", "undecodable", 2, key="b.png", detail="not a recognised image"),
        row("error", "internal_error", 3, key="c.png", detail="KeyError: 'x' (at m.py:1)"),
        row("rejected", "internal_error", 1, stage="fetch", key="u1", detail="TypeError: t"),
        row("rejected", "missing_file", 4, stage="fetch", key="u2", detail="gone"),
    ]
    (c,) = source_counts(outcome, ["s"], {"s": 7})
    assert (c.seen, c.accepted, c.rejected, c.internal_errors, c.unchanged) == (15, 5, 6, 4, 7)
    assert c.reasons == {"missing_file": 4, "undecodable": 2}  # internal errors not here
    assert failure_examples(outcome, 3) == (
        "s c.png: prepare internal_error: KeyError: 'x' (at m.py:1)",
        "s u1: fetch internal_error: TypeError: t",
        "s u2: fetch missing_file: gone",
    )


def test_accounting_table_rows_give_internal_errors_their_own_outcome(spark):
    from datetime import datetime

    from etl.transforms.accounting import accounting_rows

    outcome = spark.createDataFrame(
        [("s", "prepare", "ok", None, None, 5), ("s", "prepare", "rejected", "empty", None, 1),
         ("s", "prepare", "error", "internal_error", None, 2)],
        "source string, stage string, status string, reason string, filter_reason string, "
        "count long",
    )
    rows = accounting_rows(outcome, {}, run_id="r", run_at=datetime(2026, 1, 1)).collect()
    got = {(r["status"], r["reason"]): r["count"] for r in rows}
    assert got == {("accepted", None): 5, ("rejected", "empty"): 1,
                   ("error", "internal_error"): 2}


def test_a_fetch_bug_is_internal_error_not_a_bad_reference(tmp_path, monkeypatch):
    from udfs import fetch

    path = tmp_path / "a.png"
    path.write_bytes(png_bytes())
    assert fetch.fetch_ref(str(path)).status == "ok"

    def broken(path, opts, rng, rules):
        return {}["no such key"]  # a bug in the fetch code itself

    monkeypatch.setattr(fetch, "_local", broken)
    res = fetch.fetch_ref(str(path))
    assert res.status == "internal_error" and res.data is None
    assert res.detail.startswith("KeyError: 'no such key' (at test_outcomes.py:")
    assert "in fetch_ref" in res.detail


def test_a_fetch_bug_reading_a_sidecar_is_internal_error_not_a_bad_sidecar(tmp_path,
                                                                          monkeypatch):
    """image_folder reads `.txt`/`.json` sidecars through fetch_ref: a bug there is the
    record's internal_error (counted apart, retried), not `invalid_sidecar`."""
    from etl.sources.image_folder import _sidecar_udf
    from udfs import fetch

    (tmp_path / "a.txt").write_text("a cat on a mat\n")
    (tmp_path / "a.json").write_text(json.dumps({"license": "cc-by"}))
    parse = _sidecar_udf({"caption": "caption", "license": "license"},
                         max_caption_chars=65536, follow_symlinks=False).func
    out = parse(str(tmp_path / "a.txt"), str(tmp_path / "a.json"))
    assert (out["read_status"], out["read_reason"], out["caption_original"],
            out["license"]) == ("ok", None, "a cat on a mat", "cc-by")

    def broken(path, opts, rng, rules):
        raise TypeError("a bug in the fetch code")

    monkeypatch.setattr(fetch, "_local", broken)
    out = parse(str(tmp_path / "a.txt"), str(tmp_path / "a.json"))
    assert (out["read_status"], out["read_reason"]) == ("rejected", "internal_error")
    assert json.loads(out["metadata_json"])["detail"].startswith(
        "TypeError: a bug in the fetch code (at test_outcomes.py:")
    out = parse(str(tmp_path / "a.txt"), None)  # the caption file alone
    assert out["read_reason"] == "internal_error"


def test_luma_mean_says_why_it_is_null_and_a_bug_fails(monkeypatch):
    from PIL import ImageStat

    from udfs.features import luma_mean

    value, error = luma_mean(png_bytes((40, 30), color=(100, 100, 100)))
    assert error is None and 99 <= value <= 101
    assert luma_mean(b"") == (None, "empty: no image bytes")
    value, error = luma_mean(b"these bytes are not an image")
    assert value is None and error.startswith("undecodable: UnidentifiedImageError")

    def broken(*a, **k):
        raise ValueError("a bug of ours, not the image's")

    monkeypatch.setattr(ImageStat, "Stat", broken)
    with pytest.raises(ValueError, match="a bug of ours"):
        luma_mean(png_bytes())


# --------------------------------------------------------------------- console


def test_console_text_json_and_the_events_file(tmp_path, capsys):
    from etl.runtime.progress import EventsFile, console, event, say

    log = logging.getLogger("etl.something")
    root_handlers = logging.getLogger().handlers[:]
    events = tmp_path / "events.jsonl"
    with EventsFile(str(events)):
        with console("text"):
            event("stage_start", stage="curate")
            say("curate: started")
            log.info("detail nobody asked for")
            log.warning("a warning people should see")
        err = capsys.readouterr().err
        assert err.splitlines() == ["[lakeshard] curate: started",
                                    "WARNING etl.something: a warning people should see"]
        with console("json"):
            event("stage_end", stage="curate", seconds=1.5)
            say("curate: done")  # a line for people: not in JSON mode
            log.info("an info record")
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
        assert [(e["event"], e.get("stage"), e.get("message")) for e in lines] == [
            ("stage_end", "curate", None), ("log", None, "an info record")]
        assert lines[1]["level"] == "INFO" and lines[1]["logger"] == "etl.something"
        with console("text", verbose=True):
            event("progress", stage="curate", tasks_done=1)
        assert '"event": "progress"' in capsys.readouterr().err
    event("after", stage="none")  # the file is closed: not recorded
    assert [json.loads(line)["event"] for line in events.read_text().splitlines()] == [
        "stage_start", "stage_end", "progress"]
    assert logging.getLogger().handlers == root_handlers  # the console restored logging


def test_json_console_errors_are_json_too(tmp_path, capsys):
    from etl.cli import main

    conf = tmp_path / "c.yaml"
    conf.write_text(json.dumps({"storage": {"root": str(tmp_path)}, "sources": [
        {"name": "s", "kind": "image_folder", "path": str(tmp_path)}],
        "run": {"budgets": {"examples": 0}}}))
    assert main(["--log-format", "json", "--conf", str(conf), "curate"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    err = json.loads(line)
    assert err["event"] == "error" and err["exit_code"] == 2
    assert "run.budgets.examples: must be >= 1" in err["message"]


# ----------------------------------------------------------- stale-dedup check


def test_the_stale_dedup_warning_compares_rows_not_versions(spark, tmp_path, caplog):
    """Columns added after dedup (captions, features) leave the rows it covers as they
    are: no warning. Rows appended, changed or deleted: a warning with the counts."""
    from etl.schema import DEDUP_SCHEMA
    from etl.writers.lance_columns import write_columns

    cfg = make_config(tmp_path)
    path, dedup_path = tables.layout(cfg).curated, tables.layout(cfg).dedup
    ids = [f"id{i}" for i in range(6)]
    lance.write_dataset(pa.table({"sample_id": ids, "image_sha256": [f"h{i}" for i in range(6)],
                                  "source": ["s"] * 6}), path, max_rows_per_file=3)
    covered = lance.dataset(path).version
    spark.createDataFrame(
        [(sid, "s", f"h{i}", i, ids[0] if i < 2 else sid, i != 1,
          {0: "canonical", 1: "exact"}.get(i, "unique"), 2 if i < 2 else 1, "r")
         for i, sid in enumerate(ids)], DEDUP_SCHEMA,
    ).write.format("delta").save(dedup_path)
    spark.sql(f"ALTER TABLE delta.`{dedup_path}` SET TBLPROPERTIES "
              f"('{tables.DEDUP_CURATED_VERSION}' = '{covered}')")

    def check(version) -> list[str]:
        """The warnings an export of `version` logs."""
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="etl.tables"):
            tables.non_canonical_ids(spark, cfg, version)
        return [r.getMessage() for r in caplog.records if "dedup covers" in r.getMessage()]

    assert {r.sample_id for r in tables.non_canonical_ids(spark, cfg, covered).collect()} == {
        "id1"}

    # A caption-like column (the caption stage's writer) and a schema-only column.
    write_columns(spark, path, spark.createDataFrame(
        [(sid, f"caption {sid}") for sid in ids], "sample_id string, caption_v string"))
    lance.dataset(path).add_columns({"flag": "true"})
    after_columns = lance.dataset(path).version
    assert after_columns >= covered + 2
    assert check(after_columns) == []

    # Compaction rewrites fragments but not rows: the row comparison says so.
    lance.dataset(path).optimize.compact_files(target_rows_per_fragment=100)
    cov = tables.dedup_coverage(spark, cfg, lance.dataset(path).version)
    assert (cov.uncovered, cov.removed, cov.stale) == (0, 0, False)

    # One row appended, one changed (same id, other bytes), one deleted.
    def append(sample_id, sha):
        row = {"sample_id": sample_id, "image_sha256": sha, "source": "s", "flag": True}
        schema = lance.dataset(path).schema
        lance.write_dataset(pa.Table.from_pylist([row], schema=schema), path, mode="append")

    append("id6", "h6")
    lance.dataset(path).delete("sample_id IN ('id4', 'id5')")
    append("id5", "h5-new")
    (warning,) = check(lance.dataset(path).version)
    assert f"dedup covers curated version {covered}" in warning
    assert "2 row(s) were added or changed since" in warning and "1 removed" in warning


# ------------------------------------------- a bug in prepare, then the retry


def _photo_png(seed: int) -> bytes:
    """A distinct 64x48 'photo' (a gradient with a seed-dependent pattern)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, 64)[None, :, None]
    img = (x + rng.integers(0, 120, size=(48, 1, 3))) % 256
    buf = io.BytesIO()
    Image.fromarray(np.broadcast_to(img, (48, 64, 3)).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def _cli(args: list[str]) -> tuple[int, str, str]:
    """`lakeshard …` in-process (the shared Spark session): exit code, stdout, stderr."""
    from etl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


GOOD = 6  # photos in the source; and one text file named .png


@pytest.fixture(scope="module")
def faulted(spark, tmp_path_factory):
    """`lakeshard curate` with a fault armed in prepare's own code path (every image
    reaching the colour conversion raises there), then again without it."""
    root = tmp_path_factory.mktemp("outcomes")
    pics = root / "pics"
    pics.mkdir()
    for i in range(GOOD):
        (pics / f"p{i}.png").write_bytes(_photo_png(i))
    (pics / "notes.png").write_bytes(b"a text file, not an image\n")
    conf = root / "conf.yaml"
    conf.write_text(json.dumps({
        "storage": {"root": str(root / "data")},
        "spark": {"master": "local[2]", "jars_dir": str(JARS_DIR)},
        "sources": [{"name": "pics", "kind": "image_folder", "path": str(pics)}],
        "run": {"progress_interval_s": 0, "report_samples": 2},
    }))
    # Why an environment fault and not a monkeypatch: prepare runs in Spark's Python
    # workers, which import udfs.images afresh; a patch in this process never reaches
    # them. LAKESHARD_RAISE_AT does: the runner hands it to the workers through
    # SparkContext.environment (a new worker pool), and the point is in our own code
    # (_to_rgb), after Pillow decoded the image -- the bytes are fine.
    os.environ[RAISE_ENV] = "prepare:convert"
    try:
        first = _cli(["--conf", str(conf), "curate", "--run-id", "faulted"])
    finally:
        del os.environ[RAISE_ENV]
    second = _cli(["--conf", str(conf), "curate", "--run-id", "retried"])
    from etl.config import load_config

    return load_config(conf), first, second


def test_a_bug_in_prepare_is_internal_error_and_fails_curate_on_its_budget(spark, faulted):
    cfg, (code, out, err), _ = faulted
    assert code == 4, err[-3000:]
    # The console: the summary first (what was done), then what failed, where, what now.
    line = next(ln for ln in out.splitlines() if ln.startswith("pics"))
    seen, accepted, rejected, errors = (int(x) for x in line.split()[1:5])
    assert (seen, accepted, rejected, errors) == (GOOD + 1, 0, 1, GOOD)
    assert "undecodable=1" in line and "internal_error" not in line  # not a reject reason
    assert f"errors          : {GOOD} record(s) failed on an exception in lakeshard's " in out
    assert "stage curate" in out and "FAILED: stage curate is over its failure budget" in out
    assert "[lakeshard] curate: FAILED in" in err
    assert "lakeshard: run faulted FAILED: stage curate is over its failure budget " \
           "run.budgets.internal_error_rate" in err
    assert f"{GOOD} of {GOOD + 1} rows (85.71 %) ended internal_error" in err
    # An example names the record, the exception and where it was raised.
    example = next(ln for ln in err.splitlines() if ln.startswith("  pics p"))
    assert "prepare internal_error: InjectedFault: LAKESHARD_RAISE_AT=prepare:convert" in (
        example)
    assert "faults.py" in example and "in _to_rgb" in example
    assert "the next run retries these rows" in err

    paths = tables.layout(cfg)
    ledger = {r["stage"]: r for r in tables.read_runs(spark, paths.runs)
              .where("run_id = 'faulted'").collect()}
    assert {k: r["status"] for k, r in ledger.items()} == {
        "run": "failed", "curate": "failed", "dedup": "skipped", "caption": "skipped",
        "export": "skipped"}
    assert ledger["run"]["note"] == (
        "stage curate is over its failure budget run.budgets.internal_error_rate")
    assert "InjectedFault" in ledger["curate"]["note"]
    assert ledger["curate"]["outputs"]["internal_error"] == GOOD
    assert ledger["curate"]["table_versions"]["lance:curated"] >= 1  # committed, not torn

    # The rows are data of their own kind: in rejects with the exception, apart in the
    # accounting, and in the manifest as rejected (which the next run retries).
    rejects = spark.read.format("delta").load(paths.rejects).where("run_id = 'faulted'")
    got = {(r["reason"], r["stage"]) for r in rejects.collect()}
    assert got == {("internal_error", "prepare"), ("undecodable", "prepare")}
    details = [r["detail"] for r in rejects.where("reason = 'internal_error'").collect()]
    assert len(details) == GOOD and all("InjectedFault" in d for d in details)
    acc = {(r["status"], r["reason"]): r["count"] for r in spark.read.format("delta")
           .load(paths.accounting).where("run_id = 'faulted'").collect()}
    assert acc == {("error", "internal_error"): GOOD, ("rejected", "undecodable"): 1}
    # The faulted run's own version of the curated table (the fixture has run the retry
    # since): created, with no rows.
    faulted_version = ledger["curate"]["table_versions"]["lance:curated"]
    assert lance.dataset(paths.curated, version=faulted_version).count_rows() == 0

    # The run's events, and its report, say the same.
    report_dir = os.path.join(paths.reports_dir, "faulted")
    events = [json.loads(ln) for ln in open(os.path.join(report_dir, "events.jsonl"))]
    failed = next(e for e in events if e["event"] == "stage_failed")
    assert failed["budget"] == "run.budgets.internal_error_rate"
    assert failed["tally"]["internal_errors"] == GOOD
    assert events[-1]["event"] == "run_end" and events[-1]["status"] == "failed"
    summary = json.load(open(os.path.join(report_dir, "summary.json")))
    assert (summary["status"], summary["failed_stage"]) == ("failed", "curate")
    report = json.load(open(os.path.join(report_dir, "report.json")))
    (pics_row,) = report["status"]
    assert (pics_row["errors"], pics_row["rejected"], pics_row["kept"]) == (GOOD, 1, 0)
    assert {"kind": "error", "reason": "internal_error", "count": GOOD} in report["reasons"]
    assert "This run FAILED in stage curate" in open(os.path.join(report_dir, "index.html")
                                                     ).read()


def test_the_next_run_retries_the_internal_errors(spark, faulted):
    cfg, _, (code, out, err) = faulted
    assert code == 0, err[-3000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("pics"))
    seen, accepted, rejected, errors, flagged, unchanged = (int(x) for x in line.split()[1:7])
    # The internal errors are processed again; the text file stays rejected, unchanged.
    assert (seen, accepted, rejected, errors, unchanged) == (GOOD, GOOD, 0, 0, 1)
    paths = tables.layout(cfg)
    assert lance.dataset(paths.curated).count_rows() == GOOD
    manifest = spark.read.format("delta").load(paths.manifest)
    assert {r["status"] for r in manifest.where("reason IS NULL").collect()} == {"accepted"}
    assert manifest.where("status = 'accepted'").count() == GOOD
    ledger = {r["stage"]: r["status"] for r in tables.read_runs(spark, paths.runs)
              .where("run_id = 'retried'").collect()}
    assert ledger == {"run": "ok", "curate": "ok", "dedup": "skipped", "caption": "skipped",
                      "export": "skipped"}


# ------------------------------------------- a model whose generate() raises


def test_a_model_that_always_raises_fails_caption_on_its_budget(spark, faulted,
                                                                tmp_path_factory):
    """A Qwen2.5-VL whose generate() always raises, loaded the way any model is -- from
    its folder, its class named by the config (transformers' remote code) -- so it
    reaches the Spark workers without touching lakeshard's code."""
    from etl.tiny_vlm import ensure_tiny_vlm

    cfg, _, _ = faulted
    tiny = ensure_tiny_vlm(tmp_path_factory.getbasetemp() / "caption-models")
    broken = tmp_path_factory.mktemp("models") / "raising-qwen"
    shutil.copytree(tiny, broken)
    config = json.loads((broken / "config.json").read_text())
    config["auto_map"] = {"AutoModelForImageTextToText": "raising.RaisingQwen"}
    (broken / "config.json").write_text(json.dumps(config))
    (broken / "raising.py").write_text(
        "from transformers import Qwen2_5_VLForConditionalGeneration\n\n\n"
        "class RaisingQwen(Qwen2_5_VLForConditionalGeneration):\n"
        "    def generate(self, *args, **kwargs):\n"
        "        raise RuntimeError('this model cannot generate (on purpose)')\n"
    )
    conf = tmp_path_factory.mktemp("conf") / "caption.yaml"
    raw = {
        "storage": {"root": cfg.storage.root},
        "spark": {"master": "local[2]", "jars_dir": str(JARS_DIR)},
        "sources": [{"name": "pics", "kind": "image_folder", "path": cfg.sources[0].path}],
        "caption": {"versions": {"broken": {
            "model": str(broken), "trust_remote_code": True, "max_new_tokens": 4,
            "batch_size": 2, "min_pixels": 784, "max_pixels": 12544}}},
        "run": {"progress_interval_s": 0},
    }
    conf.write_text(json.dumps(raw))
    path = tables.layout(cfg).curated
    before = lance.dataset(path).version
    env = spark.sparkContext.environment  # transformers copies remote code here
    env["HF_MODULES_CACHE"] = str(tmp_path_factory.mktemp("hf-modules"))
    try:
        code, out, err = _cli(["--conf", str(conf), "caption", "--run-id", "raising"])
    finally:
        env.pop("HF_MODULES_CACHE", None)
    assert code == 4, err[-3000:]
    assert f"captioned         : {GOOD} (failed={GOOD})" in out
    assert f"failed            : {GOOD} row(s): generation raised" in out
    assert "lakeshard: run raising FAILED: stage caption is over its failure budget " \
           "run.budgets.failed_rate.caption" in err
    assert f"{GOOD} of {GOOD} rows (100.00 %) ended caption_broken_status = failed" in err
    assert "RuntimeError: this model cannot generate (on purpose)" in err  # an example

    # What was captioned is committed (every row with its status and error), the image
    # files untouched, and the next run will retry the failed rows.
    ds = lance.dataset(path)
    assert ds.version > before
    rows = ds.to_table(columns=["caption_broken_status", "caption_broken_error"]).to_pylist()
    assert [r["caption_broken_status"] for r in rows] == ["failed"] * GOOD
    assert all("cannot generate" in r["caption_broken_error"] for r in rows)
    from etl.config import load_config
    from etl.jobs.caption import plan_caption

    assert plan_caption(load_config(conf), "broken").todo == GOOD
    ledger = {r["stage"]: r for r in tables.read_runs(spark, tables.layout(cfg).runs)
              .where("run_id = 'raising'").collect()}
    assert (ledger["caption"]["status"], ledger["run"]["status"]) == ("failed", "failed")
    assert "run.budgets.failed_rate.caption" in ledger["caption"]["note"]
    assert ledger["caption"]["outputs"] == {"status:failed": GOOD}
