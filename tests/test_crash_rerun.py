"""Crash-safe reruns: SIGKILL `lakeshard run` at named points, rerun, compare.

Each killed run is a real subprocess in its own session, killed with its JVM and
Python workers (``LAKESHARD_KILL_AT``, etl/faults.py). The runs are chained on one
root -- every run after the first starts from the previous crash's leftovers (a stale
lock, ``running`` ledger rows, a half-written table or export) -- and a final plain
rerun must leave exactly the rows of an uninterrupted run on another root: the Lance
table, the Delta rejects and the MDS export, read back through StreamingDataset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lance
import pytest
import yaml
from conftest import JARS_DIR, REPO

from etl import tables
from etl.ledger import latest_runs, read_runs

pytestmark = pytest.mark.slow

# Mid-ingest (rows prepared, nothing written), mid-curate (Lance written, rejects not
# merged), mid-export (one MDS partition published), export staged but not swapped in.
KILL_POINTS = ["curate:prepared", "curate:lance_written", "export:part-00000",
               "export:staged"]


def _conf(tmp_path, name: str) -> str:
    root = tmp_path / name
    conf = {
        "storage": {"root": str(root)},
        "spark": {"master": "local[2]", "jars_dir": str(JARS_DIR),
                  "conf": {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"}},
        "sources": [
            {"name": "photos", "kind": "image_folder", "path": str(root / "in" / "photos"),
             "sample": True},
            {"name": "alt", "kind": "table", "path": str(root / "in" / "alt.parquet"),
             "columns": {"key": "id", "image": "jpg", "caption": "alt_text"}, "sample": True},
        ],
        "exports": {"train": {"partitions": 2, "size_limit": 1 << 20}},
        "run": {"report": False, "progress_interval_s": 0},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(conf))
    return str(path)


def _lakeshard(conf: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("LAKESHARD_KILL_AT", None)
    if kill_at:
        env["LAKESHARD_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, "-m", "etl.cli", "run", "--conf", conf],
        env=env, capture_output=True, text=True, timeout=1200, start_new_session=True,
    )


def _state(spark, cfg) -> dict:
    """Everything a run leaves, minus what legitimately differs between runs."""
    from mds_read import read_mds

    table = lance.dataset(tables.layout(cfg).curated).to_table()
    rows = []
    for r in table.to_pylist():
        r = {k: v for k, v in r.items() if k not in ("run_id", "ingested_at")}
        r["source_uri"] = r["source_uri"].replace(cfg.storage.root, "<root>")  # roots differ
        rows.append(r)
    rows.sort(key=lambda r: r["sample_id"])
    rejects = sorted(
        tuple(r) for r in spark.read.format("delta").load(tables.layout(cfg).rejects)
        .select("sample_id", "source", "source_key", "stage", "reason").collect()
    )
    export = tables.layout(cfg).export_dir("train")
    files = {}
    for dp, _, fs in os.walk(export):
        for f in fs:
            with open(os.path.join(dp, f), "rb") as fh:
                files[os.path.relpath(os.path.join(dp, f), export)] = fh.read()
    manifest = json.loads(files.pop("manifest.json"))
    # Root path and version differ (and with the path, the keys of the settings).
    for key in ("table", "table_version", "export_key", "base_key"):
        manifest.pop(key)
    mds_ids = sorted(s["sample_id"] for s in read_mds(export))
    leftovers = sorted(n for n in os.listdir(tables.layout(cfg).mds_dir) if n.startswith("."))
    return {"rows": rows, "rejects": rejects, "files": files, "manifest": manifest,
            "mds_ids": mds_ids, "leftovers": leftovers}


def test_killed_runs_then_a_plain_rerun_match_an_uninterrupted_run(spark, tmp_path):
    from etl.config import load_config
    from etl.pipeline.runner import run_pipeline
    from etl.tables import lock_path

    # The uninterrupted run, on its own root.
    base_cfg = load_config(_conf(tmp_path, "uninterrupted"))
    run_pipeline(base_cfg)
    expected = _state(spark, base_cfg)
    n_rows = len(expected["rows"])
    assert n_rows > 0 and len({r["sample_id"] for r in expected["rows"]}) == n_rows
    assert expected["mds_ids"] == sorted(
        r["sample_id"] for r in expected["rows"] if r["keep"])

    conf = _conf(tmp_path, "crashed")
    cfg = load_config(conf)
    for point in KILL_POINTS:
        res = _lakeshard(conf, kill_at=point)
        assert res.returncode == -9, (point, res.returncode, res.stderr[-3000:])
        if ":part-" not in point:  # an executor's note dies with the JVM relaying it
            assert f"LAKESHARD_KILL_AT={point}" in res.stderr
        assert os.path.exists(lock_path(cfg)), f"{point}: a killed run leaves its lock"
    # What the kills left: a table written by a killed run, a partial export.
    assert lance.dataset(tables.layout(cfg).curated).count_rows() == n_rows
    assert any(n.startswith(".train.staging-") for n in os.listdir(tables.layout(cfg).mds_dir))
    assert not os.path.exists(tables.layout(cfg).export_dir("train"))

    res = _lakeshard(conf)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "recovered the stale lock of crashed run" in res.stdout
    assert not os.path.exists(lock_path(cfg))

    got = _state(spark, cfg)
    assert got["rows"] == expected["rows"]          # nothing lost, nothing duplicated
    assert got["rejects"] == expected["rejects"]
    assert got["mds_ids"] == expected["mds_ids"]
    assert got["files"] == expected["files"]        # byte-identical index and shards
    assert got["manifest"] == expected["manifest"]
    assert got["leftovers"] == []                   # no staging folders left behind

    # The ledger: the four killed runs are `crashed`, the last one `ok` (latest status
    # per run and stage; the `running` events before each kill stay in the event log).
    events = read_runs(spark, tables.layout(cfg).runs, latest=False)
    ledger = latest_runs(events)
    runs = {r.run_id: r.status for r in ledger.where("stage = 'run'").collect()}
    assert sorted(runs.values()) == ["crashed"] * len(KILL_POINTS) + ["ok"]
    assert ledger.where("status = 'running'").count() == 0
    assert events.where("stage = 'run' AND status = 'running'").count() == len(runs)
