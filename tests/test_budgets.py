"""Failure budgets: a stage over its budget ends `failed` (ledger, exit code 4) with the
budget, the counts and examples, and the next run retries. The rules on tallies first;
then real runs: a bug injected into prepare's own code path fails `lakeshard curate`
(one module-scoped pair of runs: the faulted one and its retry), and a model whose
generate() always raises fails `lakeshard caption` on the same root."""

from __future__ import annotations

import json
import os
import shutil

import lance
import pytest
from support import JARS_DIR, cli_in_process, make_config, photo_png, scoped_env

from etl import tables
from etl.config import BudgetsConfig, ConfigError
from etl.ledger import read_runs
from etl.pipeline.budgets import check_budget
from etl.runtime.stage import RowTally
from udfs.faults import RAISE_ENV

# --------------------------------------------------------------------- the rules


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


# ------------------------------------------- a bug in prepare, then the retry


GOOD = 6  # photos in the source; and one text file named .png


@pytest.fixture(scope="module")
def faulted(spark, tmp_path_factory):
    """`lakeshard curate` with a fault armed in prepare's own code path (every image
    reaching the colour conversion raises there), then again without it."""
    root = tmp_path_factory.mktemp("outcomes")
    pics = root / "pics"
    pics.mkdir()
    for i in range(GOOD):
        (pics / f"p{i}.png").write_bytes(photo_png(i))
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
    with scoped_env({RAISE_ENV: "prepare:convert"}):
        first = cli_in_process(["--conf", str(conf), "curate", "--run-id", "faulted"])
    second = cli_in_process(["--conf", str(conf), "curate", "--run-id", "retried"])
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
    ledger = {r["stage"]: r for r in read_runs(spark, paths.runs)
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
    ledger = {r["stage"]: r["status"] for r in read_runs(spark, paths.runs)
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
        code, out, err = cli_in_process(["--conf", str(conf), "caption", "--run-id", "raising"])
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
    ledger = {r["stage"]: r for r in read_runs(spark, tables.layout(cfg).runs)
              .where("run_id = 'raising'").collect()}
    assert (ledger["caption"]["status"], ledger["run"]["status"]) == ("failed", "failed")
    assert "run.budgets.failed_rate.caption" in ledger["caption"]["note"]
    assert ledger["caption"]["outputs"] == {"status:failed": GOOD}
