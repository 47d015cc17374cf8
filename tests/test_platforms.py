"""Platform stand-ins (`make test-platforms`; skipped by `make test`): each platform of
docs/operations.md's matrix as a venv that has the runtime's Python and pyspark
installed *first*, then the built wheel installed the way that platform installs a
library, then the deploy file's own entry points and arguments through `spark-submit`
with the JARs the deploy file ships (or the runtime's Delta), on the sample sources.

What stands in for what, and what differs (said, not hidden):

* `--master yarn` / a Databricks cluster -> `local[2]`; the driver gets 3 GB
  (`--driver-memory`, a cluster setting on the platforms).
* /home/hadoop/lakeshard/... (EMR) -> the same layout under a temporary folder, filled
  as deploy/emr-bootstrap.sh fills it; /Volumes/... (Databricks) -> a temporary root.
* A Databricks ML runtime's own packages (pyspark, Delta, torch, torchvision,
  transformers, matplotlib, pyarrow, pandas, numpy) -> installed first at the pins of
  constraints.txt, with the runtime's pyspark version; Delta's JARs (the runtime's own
  on Databricks) -> Maven's for that Spark.
* The caption task/step runs on CPU: the stand-in config's caption version is the tiny
  randomly initialised model of conf/local.yaml, and the caption step's GPU resource
  settings (which a machine without a GPU cannot honour) are left out.
* Disk: each cell's venv (~10 GB, torch's CUDA wheels) is removed when the cell ends;
  a run needs ~12 GB free at a time.
* The sample sources are built beforehand by the test venv (they need scikit-image,
  the `samples` extra, which a platform does not install).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from conftest import JARS_DIR, REPO

pytestmark = [
    pytest.mark.platform,
    pytest.mark.skipif(os.environ.get("LAKESHARD_PLATFORMS") != "1",
                       reason="platform stand-ins: `make test-platforms`"),
]

DEPLOY = REPO / "deploy"
PYENV = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
# The runtime packages of a Databricks ML runtime, besides pyspark.
ML_RUNTIME = ["torch", "torchvision", "transformers", "matplotlib", "pyarrow", "pandas",
              "numpy"]


def _python(minor: str) -> str:
    """An interpreter for Python 3.<minor>, or skip saying which is missing."""
    found = shutil.which(f"python3.{minor}")
    if found and subprocess.run([found, "-c", "pass"], capture_output=True).returncode == 0:
        return found
    for v in sorted(PYENV.glob(f"3.{minor}.*"), reverse=True):
        if (v / "bin" / "python").exists():
            return str(v / "bin" / "python")
    pytest.skip(f"no Python 3.{minor} on this machine (pyenv or python3.{minor} on PATH)")


def _run(cmd: list[str], *, env: dict | None = None, timeout: int = 1800, cwd="/"):
    # Not in the checkout, not on its PYTHONPATH: `python -m pip` looks at the working
    # directory too, and would take the checkout's lakeshard.egg-info for an install.
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                         env={**base, **(env or {})})
    assert res.returncode == 0, (cmd[:6], res.stdout[-3000:], res.stderr[-5000:])
    return res


@pytest.fixture(autouse=True)
def _drop_the_venv(tmp_path):
    """A cell's venv is ~10 GB (torch and its CUDA wheels): removed when the cell ends,
    pass or fail (pytest keeps the last runs' tmp_path folders, logs included)."""
    yield
    shutil.rmtree(tmp_path / "venv", ignore_errors=True)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--disable-pip-version-check", "-q", "-w", str(out), str(REPO)])
    (whl,) = out.glob("lakeshard-*-py3-none-any.whl")
    return whl


def _constraints_without_spark(tmp: Path) -> Path:
    """constraints.txt without pyspark/delta-spark: the runtime's versions stand."""
    lines = [ln for ln in (REPO / "constraints.txt").read_text().splitlines()
             if not re.match(r"(?i)(pyspark|delta[-_]spark)==", ln)]
    path = tmp / "runtime-constraints.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def _venv(tmp: Path, python: str, pyspark: str, runtime_extra: list[str]) -> Path:
    """A runtime: that Python, then that pyspark (and the runtime's other packages)."""
    venv = tmp / "venv"
    _run([python, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    _run([*pip, f"pyspark=={pyspark}"])
    if runtime_extra:
        _run([*pip, "-c", str(_constraints_without_spark(tmp)), *runtime_extra])
    return venv


def _version(venv: Path, dist: str) -> str | None:
    res = subprocess.run([str(venv / "bin" / "python"), "-c",
                          f"import importlib.metadata as m; print(m.version({dist!r}))"],
                         capture_output=True, text=True, cwd="/",
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    return res.stdout.strip() if res.returncode == 0 else None


def _install_library(venv: Path, wheel: Path, *, extras: str = "",
                     constraints: bool = False) -> None:
    """The wheel, as the platform installs a library (and nothing else)."""
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    if constraints:
        cmd += ["-c", str(REPO / "constraints.txt")]
    _run([*cmd, f"{wheel}{extras}"])


def _standin_conf(root: Path) -> Path:
    """conf/local.yaml's sources and tiny caption model, on `root`, JARs from spark-submit."""
    raw = yaml.safe_load((REPO / "conf" / "local.yaml").read_text())
    raw["storage"]["root"] = str(root)
    raw["spark"] = {"master": "local[2]", "app_name": "lakeshard-standin", "jars_dir": None,
                    "conf": {"spark.sql.shuffle.partitions": "4", "spark.ui.enabled": "false",
                             "spark.databricks.delta.snapshotPartitions": "4"}}
    for src in raw["sources"]:
        src["path"] = src["path"].replace("lakeshard-data", str(root), 1)
    conf = root.parent / "standin.yaml"
    conf.write_text(yaml.safe_dump(raw, sort_keys=False))
    # The sample sources, built by the test venv (scikit-image): not the platform's job.
    _run([sys.executable, "-m", "etl.cli", "samples", "--conf", str(conf)],
         env={"PYTHONPATH": str(REPO)}, cwd=REPO)
    return conf


def _spark_submit(venv: Path, args: list[str], log: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYSPARK_PYTHON": str(venv / "bin" / "python"),
           "PYSPARK_DRIVER_PYTHON": str(venv / "bin" / "python"),
           "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)  # only what the venv has
    env.pop("SPARK_HOME", None)
    res = subprocess.run([str(venv / "bin" / "spark-submit"), "--driver-memory", "3g", *args],
                         capture_output=True, text=True, timeout=1800, env=env,
                         cwd=log.parent)
    log.write_text(res.stdout + "\n--- stderr ---\n" + res.stderr)
    return res


def _curate_counts(stdout: str) -> tuple[int, int, int]:
    m = re.search(r"^total\s+(\d+)\s+(\d+)\s+(\d+)\s", stdout, flags=re.M)
    assert m, stdout[-3000:]
    return tuple(int(g) for g in m.groups())


def _ledger(root: Path) -> dict[tuple[str, str], str]:
    """The run ledger's latest status per (run id, stage), read here with delta-rs."""
    from deltalake import DeltaTable

    rows = DeltaTable(str(root / "delta" / "runs")).to_pyarrow_table().to_pylist()
    rows.sort(key=lambda r: (r["recorded_at"], r["status"] != "running"))
    return {(r["run_id"], r["stage"]): r["status"] for r in rows}


def _check_outcome(venv: Path, root: Path, conf: Path, jars: list[str], run_id: str,
                   curate_stdout: str, work: Path) -> None:
    from etl.pipeline.stages import STAGES

    assert _curate_counts(curate_stdout) == (31, 23, 8)
    res = _spark_submit(venv, ["--jars", ",".join(jars), "--py-files", jars[0],
                               str(REPO / "tests" / "platform_cli.py"), "verify-export",
                               "default", "--conf", str(conf)], work / "verify.log")
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]
    ledger = _ledger(root)
    assert {run for run, _ in ledger} == {run_id}  # one run
    assert {stage: status for (_, stage), status in ledger.items()} == {
        "run": "ok", **{s: "ok" for s in STAGES.names()}}


# ------------------------------------------------------------------ EMR


def _emr_layout(home: Path, venv: Path) -> dict[str, str]:
    """What deploy/emr-bootstrap.sh puts under /home/hadoop/lakeshard, here."""
    (home / "jars").mkdir(parents=True)
    (home / "entrypoints").mkdir()
    for jar in (JARS_DIR / "spark40").glob("*.jar"):
        shutil.copy(jar, home / "jars")
    for entry in (REPO / "etl" / "entrypoints").glob("*.py"):
        shutil.copy(entry, home / "entrypoints")
    (home / "venv").symlink_to(venv)
    return {"/home/hadoop/lakeshard": str(home)}


_GPU_STEP_CONFS = ("spark.executor.resource.gpu.", "spark.task.resource.gpu.",
                   "spark.executor.cores=", "spark.task.cpus=", "spark.executor.memory")


def _emr_args(step: dict, paths: dict[str, str], conf: Path, run_id: str) -> list[str]:
    args = list(step["Args"])
    assert args[0] == "spark-submit"
    out, i = [], 1
    while i < len(args):
        a = args[i]
        if a == "--conf" and args[i + 1].startswith(_GPU_STEP_CONFS):
            i += 2  # the caption step's GPU resources: no GPU here (module docstring)
            continue
        if a == "--master":
            out += ["--master", "local[2]"]
            i += 2
            continue
        for prefix, local in paths.items():
            a = a.replace(prefix, local)
        out.append(a.replace("@RUN_ID@", run_id))
        i += 1
    conf_at = out.index("--conf", out.index(next(x for x in out if x.endswith(".py"))))
    assert out[conf_at + 1].endswith("/conf/emr.yaml")
    out[conf_at + 1] = str(conf)
    return out


def test_emr_spark_8_standin_runs_the_steps(tmp_path, wheel):
    """emr-spark-8.0.0: Python 3.12, Spark 4.0.2, Delta 4.0.0 (Maven, as the steps ship)."""
    if not (JARS_DIR / "spark40" / "delta-spark_2.13-4.0.0.jar").exists():
        pytest.skip("Delta 4.0.0 JARs missing: make jars-spark40")
    venv = _venv(tmp_path, _python("12"), "4.0.2", [])
    boot = (DEPLOY / "emr-bootstrap.sh").read_text()
    extras = re.search(r'lakeshard-\*\.whl\)(\[[a-z,]+\])"', boot).group(1)
    _install_library(venv, wheel, extras=extras, constraints=True)  # as the bootstrap does
    assert _version(venv, "lakeshard") == "0.1.0"
    assert _version(venv, "pyspark") == "4.0.2"
    assert _version(venv, "delta-spark") is None  # the steps' JARs bring Delta
    paths = _emr_layout(tmp_path / "home", venv)
    root = tmp_path / "data"
    conf = _standin_conf(root)
    run_id = "standin-emr-1"
    steps = json.loads((DEPLOY / "emr-steps.json").read_text())
    outputs = {}
    for step in steps:
        args = _emr_args(step, paths, conf, run_id)
        res = _spark_submit(venv, args, tmp_path / f"{step['Name'].split()[-1]}.log")
        assert res.returncode == 0, (step["Name"], res.stdout[-3000:], res.stderr[-5000:])
        outputs[step["Name"]] = res.stdout
    jars = args[args.index("--jars") + 1].split(",")
    _check_outcome(venv, root, conf, jars, run_id, outputs["lakeshard curate"], tmp_path)


# ------------------------------------------------------------------ Databricks


@pytest.mark.parametrize(("dbr", "pyspark", "delta_jars"), [
    ("17.3", "4.0.2", "spark40"),   # DBR 17.3 LTS: Spark 4.0.0 (4.0.2: the 4.0 line's own)
    ("18", "4.1.4", ""),            # DBR 18 LTS: Spark 4.1.0 (4.1.4: the pinned 4.1)
])
def test_databricks_standin_runs_the_job_tasks(tmp_path, wheel, dbr, pyspark, delta_jars):
    jar_dir = JARS_DIR / delta_jars if delta_jars else JARS_DIR
    jars = sorted(str(p) for p in jar_dir.glob("*.jar"))
    delta = [j for j in jars if Path(j).name.startswith("delta-spark_")]
    if not delta:
        pytest.skip(f"Delta JARs missing in {jar_dir}: make jars jars-spark40")
    jars = delta + [j for j in jars if j not in delta]  # --py-files takes the first
    venv = _venv(tmp_path, _python("12"), pyspark, ML_RUNTIME)
    job = json.loads((DEPLOY / "databricks-job.json").read_text())
    for lib in {lib["whl"] for t in job["tasks"] for lib in t["libraries"]}:
        assert Path(lib).name == wheel.name
    _install_library(venv, wheel)  # a `whl` library: pip, no constraints, no extra
    assert _version(venv, "lakeshard") == "0.1.0"
    assert _version(venv, "pyspark") == pyspark
    root = tmp_path / "data"
    conf = _standin_conf(root)
    run_id = "424242"  # {{job.run_id}}: the job run's number
    tasks = {t["task_key"]: t for t in job["tasks"]}
    order, done = [], set()
    while len(order) < len(tasks):
        key = next(k for k, t in tasks.items() if k not in done
                   and {d["task_key"] for d in t.get("depends_on", [])} <= done)
        order.append(key)
        done.add(key)
    outputs = {}
    for key in order:
        wheel_task = tasks[key]["python_wheel_task"]
        params = [str(conf) if p.endswith("/conf/databricks.yaml") else
                  p.replace("{{job.run_id}}", run_id) for p in wheel_task["parameters"]]
        res = _spark_submit(venv, ["--master", "local[2]", "--jars", ",".join(jars),
                                   "--py-files", jars[0], str(REPO / "tests" / "wheel_task.py"),
                                   wheel_task["package_name"], wheel_task["entry_point"],
                                   *params], tmp_path / f"{key}.log")
        assert res.returncode == 0, (key, res.stdout[-3000:], res.stderr[-5000:])
        outputs[key] = res.stdout
    _check_outcome(venv, root, conf, jars, run_id, outputs["curate"], tmp_path)


# ------------------------------------------------------------------ Python 3.13


def test_wheel_installs_on_python_3_13_and_keeps_the_runtime_pyspark(tmp_path, wheel):
    venv = _venv(tmp_path, _python("13"), "4.0.2", [])
    _install_library(venv, wheel, extras="[caption]", constraints=True)
    assert _version(venv, "pyspark") == "4.0.2"
    res = _run([str(venv / "bin" / "python"), "-c",
                "import pyspark, etl.cli, etl.session, etl.writers.lance, udfs.images; "
                "etl.session.check_spark_version(pyspark.__version__); print('ok')"])
    assert res.stdout.strip() == "ok"
    counts = Counter(p.suffix for p in (venv / "bin").iterdir())
    assert (venv / "bin" / "lakeshard-run").exists(), counts
