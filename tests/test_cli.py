"""The `lakeshard` command as users run it (a real subprocess)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import yaml
from conftest import JARS_DIR


def _lakeshard(*args, cwd=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "etl.cli", *args],
        capture_output=True, text=True, cwd=cwd, timeout=timeout,
    )


def _write_conf(tmp_path, **over):
    conf = {
        "storage": {"root": str(tmp_path / "data")},
        "spark": {"master": "local[2]", "jars_dir": str(JARS_DIR),
                  "conf": {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"}},
        "sources": [
            {"name": "pics", "kind": "image_folder", "path": str(tmp_path / "pics"),
             "sample": True},
        ],
        "exports": {"default": {"partitions": 2}},
    }
    conf.update(over)
    path = tmp_path / "conf.yaml"
    path.write_text(yaml.safe_dump(conf))
    return path


def test_bad_config_fails_fast_naming_the_field(tmp_path):
    conf = _write_conf(tmp_path)
    raw = yaml.safe_load(conf.read_text())
    raw["sources"][0]["kind"] = "ftp"
    conf.write_text(yaml.safe_dump(raw))
    t0 = time.monotonic()
    res = _lakeshard("run", "--conf", str(conf))
    assert res.returncode == 2
    assert "sources[0] (pics).kind: unknown kind 'ftp'" in res.stderr
    assert "SparkSession" not in res.stderr and time.monotonic() - t0 < 30


def test_missing_source_path_fails_before_spark(tmp_path):
    conf = _write_conf(tmp_path)
    raw = yaml.safe_load(conf.read_text())
    raw["sources"][0].update(sample=False, path=str(tmp_path / "nowhere"))
    conf.write_text(yaml.safe_dump(raw))
    res = _lakeshard("curate", "--conf", str(conf))
    assert res.returncode == 2
    assert "'pics': path" in res.stderr and "does not exist" in res.stderr
    assert not (tmp_path / "data").exists()


def test_missing_jars_say_which_command_fixes_it(tmp_path):
    conf = _write_conf(tmp_path)
    raw = yaml.safe_load(conf.read_text())
    raw["spark"]["jars_dir"] = str(tmp_path / "nojars")
    conf.write_text(yaml.safe_dump(raw))
    res = _lakeshard("curate", "--conf", str(conf))
    assert res.returncode == 2 and "make jars" in res.stderr


def test_unknown_export_name_is_refused(tmp_path):
    res = _lakeshard("export", "--conf", str(_write_conf(tmp_path)), "--name", "nope")
    assert res.returncode == 2 and "no export named 'nope'" in res.stderr


@pytest.mark.slow
def test_run_prints_the_per_source_table_and_outputs(tmp_path):
    res = _lakeshard("run", "--conf", str(_write_conf(tmp_path)))
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "pics" in out and "seen" in out and "accepted" in out
    assert "curated (Lance)" in out and "export (MDS)" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("pics"))
    seen, accepted, rejected = (int(x) for x in line.split()[1:4])
    assert seen == accepted + rejected and accepted == 7 and rejected == 3
    assert (tmp_path / "data" / "mds" / "default" / "index.json").exists()
    # The console is for people: stage lines and the summary, no JSON events; the run's
    # events.jsonl holds them all.
    assert "lakeshard.events" not in res.stderr and '{"event"' not in res.stderr
    assert "[lakeshard] curate: started" in res.stderr
    assert "[lakeshard] export: done in" in res.stderr
    (run_id,) = re.findall(r"^lakeshard run (\S+)$", out, re.M)
    events_file = tmp_path / "data" / "reports" / run_id / "events.jsonl"
    events = [json.loads(ln) for ln in events_file.read_text().splitlines()]
    names = [e["event"] for e in events]
    assert names[0] == "run_start" and names[-1] == "run_end"
    for stage in ("curate", "dedup", "caption", "export"):
        assert ("stage_start", stage) in [(e["event"], e.get("stage")) for e in events]
        assert ("stage_end", stage) in [(e["event"], e.get("stage")) for e in events]

    # Again, nothing new: nothing to warn about (dedup covers every row).
    res = _lakeshard("run", "--conf", str(_write_conf(tmp_path)))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "dedup covers" not in res.stderr, res.stderr
    # No warning of lakeshard's own (the JVM's start-up lines come before any setting).
    assert not re.search(r"^WARNING (etl|udfs|lakeshard)", res.stderr, re.M), res.stderr
    assert "[lakeshard] dedup: done in" in res.stderr

    res = _lakeshard("verify-export", "--conf", str(_write_conf(tmp_path)), "default")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.strip().endswith("OK") and "7 images decoded" not in res.stdout
    assert "6 images decoded" in res.stdout  # the 7th accepted image is flagged, not exported

    res = _lakeshard("sql", "--conf", str(_write_conf(tmp_path)),
                     "SELECT count(*) AS n FROM curated")
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"^\|\s*7\|$", res.stdout, re.M), res.stdout


@pytest.mark.slow
def test_jpeg_audit_on_the_sample_source(tmp_path):
    conf = _write_conf(tmp_path)
    res = _lakeshard("jpeg-audit", "--conf", str(conf), "--source", "pics", "--sample", "3",
                     "--generations", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    gens = [ln.split() for ln in lines if ln.strip()[:1].isdigit()]
    assert [g[0] for g in gens] == ["1", "2"]
    assert all(float(g[1]) > 30 for g in gens)  # mean PSNR in dB
    (report,) = (tmp_path / "data" / "reports").glob("jpeg-audit-pics-*")
    assert (report / "audit.png").stat().st_size > 1000
    assert (report / "audit.json").exists()
    assert _lakeshard("jpeg-audit", "--conf", str(conf), "--source", "nope").returncode == 2
