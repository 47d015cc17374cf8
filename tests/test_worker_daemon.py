"""Spark's Python daemon as lakeshard runs it (etl/runtime/worker_daemon.py): the tasks'
workers fork from a daemon that imported PySpark from the installed package and the
modules curate's tasks need, and a failed preload leaves the daemon working."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from support import make_config

from etl.runtime.worker_daemon import prefer_installed_pyspark, preload
from etl.session import spark_conf

DAEMON = "etl.runtime.worker_daemon"


def test_spark_tasks_fork_from_the_preloading_daemon(spark):
    def probe(_):
        import os
        import sys

        import pyspark

        parent = os.getppid()
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            cmdline = f.read().split(b"\0")
        with open(f"/proc/{parent}/maps") as f:
            maps = f.read()
        yield (b" ".join(cmdline).decode(), pyspark.__file__,
               "PIL/_imaging" in maps, "pandas/_libs" in maps,
               "etl.transforms.prepare_task" in sys.modules)

    seen = spark.sparkContext.parallelize(range(2), 2).mapPartitions(probe).collect()
    assert len(seen) == 2
    for cmdline, pyspark_file, pil, pandas, prepare_task in seen:
        assert f"-m {DAEMON} pyspark.worker" in cmdline
        # PySpark from the installed package (compiled), not from Spark's pyspark.zip.
        assert ".zip" not in pyspark_file and pyspark_file.endswith("__init__.py")
        # The daemon itself mapped Pillow's and pandas' extensions: imported before fork.
        assert pil and pandas and prepare_task


def _zip(path):
    path.parent.mkdir(parents=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pyspark/__init__.py", "")
    return str(path)


def test_only_the_installed_packages_own_zip_is_dropped(tmp_path):
    site = tmp_path / "site"
    (site / "pyspark").mkdir(parents=True)
    (site / "pyspark" / "__init__.py").write_text("")
    own = _zip(site / "pyspark" / "python" / "lib" / "pyspark.zip")
    py4j = str(site / "pyspark" / "python" / "lib" / "py4j-src.zip")
    path = [own, py4j, str(tmp_path / "elsewhere"), str(site)]
    assert prefer_installed_pyspark(path)
    assert path == [py4j, str(tmp_path / "elsewhere"), str(site)]

    # A Spark distribution's zip (a cluster's SPARK_HOME) is not the package's: kept.
    other = _zip(tmp_path / "spark-home" / "python" / "lib" / "pyspark.zip")
    path = [other, py4j, str(site)]
    assert not prefer_installed_pyspark(path)
    assert path == [other, py4j, str(site)]

    # No installed package beside the zip: kept.
    path = [own, py4j]
    assert not prefer_installed_pyspark(path)
    assert path == [own, py4j]


def test_a_failed_preload_is_reported_on_stderr_only(capsys):
    assert preload(("json", "lakeshard_no_such_module")) == ["lakeshard_no_such_module"]
    out, err = capsys.readouterr()
    assert out == ""  # the daemon's stdout carries its port to Spark, nothing else
    assert "preloading lakeshard_no_such_module failed" in err
    assert "ModuleNotFoundError" in err


def test_the_daemon_starts_and_reports_its_port_when_a_preload_fails():
    """The daemon writes its port first on stdout; a module that fails to preload does
    not stop it (run as Spark runs it: ``python -m``, a worker module argument)."""
    code = ("import sys, runpy; import etl.runtime.worker_daemon as d; "
            "d.PRELOAD = ('lakeshard_no_such_module',); "
            "sys.argv = ['x', 'pyspark.worker']; d.main()")
    env = {**os.environ, "PYTHON_WORKER_FACTORY_SECRET": "s"}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        port = int.from_bytes(proc.stdout.read(4), "big")  # pyspark.daemon's write_int
        assert 0 < port < 65536
    finally:
        proc.stdin.close()  # the daemon exits when Spark's end of stdin closes
        proc.wait(timeout=30)
    err = proc.stderr.read()
    assert b"preloading lakeshard_no_such_module failed" in err


def test_local_runs_use_it_and_a_cluster_chooses(tmp_path):
    assert spark_conf(make_config(tmp_path))["spark.python.daemon.module"] == DAEMON
    cluster = make_config(tmp_path, spark={"master": "spark://h:7077"})
    assert "spark.python.daemon.module" not in spark_conf(cluster)
    own = make_config(tmp_path, spark={"master": "spark://h:7077",
                                       "conf": {"spark.python.daemon.module": DAEMON}})
    assert spark_conf(own)["spark.python.daemon.module"] == DAEMON


def _daemons() -> set[int]:
    """The worker daemons of lakeshard's module under this process (its Spark's; not the
    workers they fork, whose parent is a daemon, nor another process's Spark)."""
    def cmdline(pid) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode()
        except OSError:
            return ""

    def parent(pid) -> int:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    def ours(pid: int) -> bool:
        while pid > 1:
            pid = parent(pid)
            if pid == os.getpid():
                return True
        return False

    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit() and f"-m {DAEMON} pyspark.worker" in cmdline(name):
            try:
                if f"-m {DAEMON}" not in cmdline(parent(name)) and ours(int(name)):
                    found.add(int(name))
            except OSError:
                pass  # exited meanwhile
    return found


def test_workers_started_ahead_are_the_ones_arrow_tasks_fork_from(spark):
    """start_python_workers starts the daemon that the next Arrow job's tasks (curate's
    fetch + prepare is a mapInArrow) fork from -- not a second one -- in the caller's
    job group."""
    from etl.runtime.warm import start_python_workers

    def parent_pid(batches):
        import os

        import pyarrow as pa

        for _ in batches:
            yield pa.record_batch([pa.array([os.getppid()], pa.int64())], names=["ppid"])

    sc = spark.sparkContext
    sc.setJobGroup("warm-workers", "start the Python workers ahead")
    try:
        thread = start_python_workers(spark, "test: start the Python workers")
        assert thread is not None
        thread.join(120)
        assert not thread.is_alive()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    (job,) = sc.statusTracker().getJobIdsForGroup("warm-workers")
    assert sc.statusTracker().getJobInfo(job).status == "SUCCEEDED"
    daemons = _daemons()
    assert daemons
    seen = spark.range(4, numPartitions=2).mapInArrow(parent_pid, "ppid long").collect()
    assert len(seen) == 2 and {r.ppid for r in seen} <= daemons
    assert _daemons() == daemons  # the tasks started no daemon of their own
