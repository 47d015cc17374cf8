"""Operating it: the run lock, the stage registry, `run:` config, entrypoints, job
definitions, the wheel. Fast: no Spark, except the refused-run subprocess (which must
refuse before Spark starts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
import zipfile
from importlib import import_module

import pytest
import yaml
from conftest import JARS_DIR, REPO, make_config

from etl.config import ConfigError
from etl.runtime.lock import RunLock, RunLockedError

# ------------------------------------------------------------------ lock


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_lock_refuses_a_second_run_and_names_the_holder(tmp_path):
    path = str(tmp_path / "run.lock")
    with RunLock(path, "run-a"):
        with pytest.raises(RunLockedError, match=r"run run-a, pid \d+ on "):
            RunLock(path, "run-b").acquire()
    # Released: the next run gets it, and it was not a recovery.
    lock = RunLock(path, "run-c").acquire()
    assert lock.recovered is None
    lock.release()
    assert not os.path.exists(path)


def test_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path):
    path = tmp_path / "run.lock"
    holder = RunLock(str(path), "crashed-run")
    path.write_text(json.dumps({"pid": _dead_pid(), "host": holder.host,
                                "run_id": "crashed-run", "started": time.time(),
                                "heartbeat": time.time()}))
    lock = RunLock(str(path), "next-run").acquire()
    assert lock.recovered is not None and lock.recovered.run_id == "crashed-run"
    assert json.loads(path.read_text())["run_id"] == "next-run"
    lock.release()


def test_lock_whose_pid_was_reused_by_another_process_is_stale(tmp_path):
    path = tmp_path / "run.lock"
    mine = RunLock(str(path), "x")
    live = {"pid": os.getpid(), "host": mine.host, "run_id": "old", "started": time.time(),
            "heartbeat": time.time()}
    path.write_text(json.dumps(live))  # no pid_start (e.g. not Linux): a live holder
    with pytest.raises(RunLockedError):
        RunLock(str(path), "new").acquire()
    if not os.path.exists("/proc/self/stat"):
        return
    path.write_text(json.dumps({**live, "pid_start": 1}))  # same pid, another process
    lock = RunLock(str(path), "new").acquire()
    assert lock.recovered.run_id == "old"
    lock.release()


def test_lock_from_another_host_is_stale_only_without_heartbeat(tmp_path):
    path = tmp_path / "run.lock"
    fresh = {"pid": 1, "host": "other-host", "run_id": "remote", "started": time.time(),
             "heartbeat": time.time() - 5}
    path.write_text(json.dumps(fresh))
    with pytest.raises(RunLockedError, match="remote"):
        RunLock(str(path), "mine", stale_after_s=60).acquire()
    path.write_text(json.dumps({**fresh, "heartbeat": time.time() - 120}))
    lock = RunLock(str(path), "mine", stale_after_s=60).acquire()
    assert lock.recovered.run_id == "remote"
    lock.release()


def test_lock_heartbeat_advances_and_a_torn_lock_file_is_stale(tmp_path):
    path = tmp_path / "run.lock"
    lock = RunLock(str(path), "beating", heartbeat_s=0.05).acquire()
    first = json.loads(path.read_text())["heartbeat"]
    time.sleep(0.4)
    assert json.loads(path.read_text())["heartbeat"] > first
    lock.release()
    path.write_text('{"pid": 12')  # a run killed while writing its lock
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    lock = RunLock(str(path), "after-torn", stale_after_s=60).acquire()
    assert lock.recovered is not None
    lock.release()


def test_a_concurrent_cli_run_is_refused_before_spark(tmp_path):
    conf = tmp_path / "conf.yaml"
    root = tmp_path / "data"
    conf.write_text(yaml.safe_dump({
        "storage": {"root": str(root)},
        "spark": {"master": "local[2]", "jars_dir": str(JARS_DIR)},
        "sources": [{"name": "pics", "kind": "image_folder", "path": str(tmp_path / "p"),
                     "sample": True}],
    }))
    with RunLock(str(root / "_lock" / "run.lock"), "nightly-1"):
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "etl.cli", "run", "--conf", str(conf)],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 3, res.stderr[-2000:]
    assert "refused: another lakeshard run holds" in res.stderr
    assert "run nightly-1" in res.stderr
    assert "SparkSession" not in res.stderr and time.monotonic() - t0 < 60


# ------------------------------------------------------------------ stages and config


def test_stage_selection_keeps_registry_order():
    from etl.pipeline.stages import STAGES

    names = list(STAGES.names())
    assert names[:1] == ["curate"] and names[-1] == "export"
    pick = lambda *a, **k: [s.name for s in STAGES.select(*a, **k)]  # noqa: E731
    assert pick(None) == names
    assert pick(("export", "curate")) == ["curate", "export"]
    assert pick(None, skip=("curate",)) == [n for n in names if n != "curate"]
    assert pick(("curate",), only=("export",)) == ["export"]
    with pytest.raises(ValueError, match="--skip: unknown stage 'dedupe'"):
        STAGES.select(None, skip=("dedupe",))
    for stage in STAGES:  # every registered target imports and is callable
        assert callable(stage.load())


@pytest.mark.parametrize(
    ("run", "storage", "message"),
    [
        ({"stages": ["curate", "captions"]}, None, "run.stages[1]: unknown stage 'captions'"),
        ({"stages": []}, None, "run.stages: expected a non-empty list"),
        ({}, "gs://bucket/corpus", "run.lock_path: storage.root is on gs://, where"),
        ({"lock_path": "gs://b/lock"}, None,
         "run.lock_path: 'gs://b/lock': an object-store lock must be s3://bucket/key"),
        ({"progress_interval_s": -1}, None, "run.progress_interval_s: must be >= 0"),
        ({"heartbeat_s": 60, "stale_lock_s": 60}, None, "run.heartbeat_s: 60 must be below"),
        ({"report": "yes"}, None, "run.report: expected true or false"),
        ({"lock": True, "color": 1}, None, "run: unknown key 'color'"),
    ],
)
def test_bad_run_config_names_the_field(tmp_path, run, storage, message):
    from etl.config import parse_config
    from etl.pipeline.preflight import check_config

    cfg = make_config(tmp_path)
    raw = {"storage": {"root": storage or str(tmp_path)}, "run": run,
           "sources": [{"name": "x", "kind": "image_folder", "path": str(tmp_path)}]}
    assert cfg.run.lock  # defaults parse
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(parse_config(raw))


def test_remote_root_without_lock_is_allowed_when_said_so(tmp_path):
    from etl.config import parse_config

    cfg = parse_config({"storage": {"root": "s3://bucket/corpus"}, "run": {"lock": False},
                        "sources": [{"name": "x", "kind": "image_folder", "path": "s3://b/x"}]})
    assert cfg.run.lock is False


# ------------------------------------------------------------------ entrypoints, deploy


def _scripts() -> dict[str, str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def _resolve(target: str):
    module, _, func = target.partition(":")
    return getattr(import_module(module), func)


def test_console_scripts_and_entrypoint_files_point_at_main():
    scripts = _scripts()
    for name in ("lakeshard", "lakeshard-run", "lakeshard-curate", "lakeshard-export"):
        assert callable(_resolve(scripts[name])), name
    for path in sorted((REPO / "etl" / "entrypoints").glob("[a-z]*.py")):
        mod = import_module(f"etl.entrypoints.{path.stem}")
        assert callable(mod.main) and 'if __name__ == "__main__"' in path.read_text()


def test_entrypoint_passes_its_arguments_to_the_subcommand(tmp_path, capsys):
    from etl.entrypoints import run as run_entry

    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({"storage": {"root": str(tmp_path)}, "run": {"stages": ["x"]},
                                    "sources": [{"name": "a", "kind": "image_folder",
                                                 "path": str(tmp_path)}]}))
    with pytest.raises(SystemExit) as exit_:  # the config reached `run`, and the
        run_entry.main(["--conf", str(conf)])  # entry point exits with its status
    assert exit_.value.code == 2
    assert "run.stages[0]: unknown stage 'x'" in capsys.readouterr().err


# The deploy files (deploy/*.json) and the entry points' exit statuses:
# tests/test_platform_deploy.py, with the platforms' own client libraries.


def test_wheel_contains_the_package_configs_and_entry_points(tmp_path):
    src = tmp_path / "src"
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((REPO / rel).read_bytes())
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    (whl,) = (tmp_path / "dist").glob("lakeshard-*-py3-none-any.whl")
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names
                            if n.endswith(".dist-info/entry_points.txt"))
        metadata = next(z.read(n).decode() for n in names
                        if n.endswith(".dist-info/METADATA"))
    # What a platform runtime brings is never a hard requirement: installing the wheel
    # there leaves its pyspark, Delta and GPU stack alone (docs/operations.md).
    assert "Requires-Python: <3.14,>=3.11" in metadata
    hard = {re.split(r"[<>=!~ ;\[]", line.split(": ", 1)[1])[0].lower()
            for line in metadata.splitlines()
            if line.startswith("Requires-Dist: ") and "extra ==" not in line}
    runtime = {"pyspark", "delta-spark", "torch", "torchvision", "transformers",
               "sentence-transformers", "matplotlib", "duckdb", "scikit-image", "vllm"}
    assert hard and not hard & runtime, hard & runtime
    assert {"pylance", "mosaicml-streaming", "deltalake"} <= hard
    assert {"pyspark", "delta-spark"} <= {
        re.split(r"[<>=!~ ;\[]", line.split(": ", 1)[1])[0].lower()
        for line in metadata.splitlines() if 'extra == "spark"' in line}
    assert {"conf/local.yaml", "conf/databricks.yaml", "conf/emr.yaml",
            "etl/entrypoints/run.py", "udfs/images.py"} <= names
    for script, target in _scripts().items():
        assert f"{script} = {target}" in entry_points
