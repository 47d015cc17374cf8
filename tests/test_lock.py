"""The run lock: one holder per root, a live holder refuses the next run (before Spark
starts), stale locks (dead process, reused pid, old heartbeat, torn file) are taken
over. Two backends: a file (O_EXCL) and an object on S3 (conditional writes), the
latter against moto's S3 server on 127.0.0.1 -- plus the checks only an object store
needs: racing runs cannot both win, a store that ignores If-None-Match is refused, and
an outage never turns into a second holder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import yaml
from s3server import S3Server
from support import JARS_DIR, REPO, dead_pid, scoped_env

from etl.errors import ConfigError, RunLockedError
from etl.runtime.lock import RunLock, _S3Backend

# ------------------------------------------------------------------ a file


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
    path.write_text(json.dumps({"pid": dead_pid(), "host": holder.host,
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


# ------------------------------------------------------------------ an object on S3

BUCKET = "lakeshard-lock"


@pytest.fixture(scope="module")
def s3():
    server = S3Server().start()
    env = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
           "AWS_ALLOW_HTTP": "true"}
    with scoped_env(env):
        server.client().create_bucket(Bucket=BUCKET)
        yield server
        server.stop()


@pytest.fixture
def url(s3, request):
    return f"s3://{BUCKET}/{request.node.name}/_lock/run.lock"


def _body(s3, url) -> dict | None:
    key = url.split(f"{BUCKET}/", 1)[1]
    try:
        return json.loads(s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
    except s3.client().exceptions.NoSuchKey:
        return None


def _put(s3, url, body: bytes) -> None:
    s3.client().put_object(Bucket=BUCKET, Key=url.split(f"{BUCKET}/", 1)[1], Body=body)


def test_s3_second_run_is_refused_and_release_deletes_the_object(s3, url):
    with RunLock(url, "run-a") as held:
        assert _body(s3, url)["run_id"] == "run-a" and held.recovered is None
        with pytest.raises(RunLockedError, match=r"holds s3://.*run run-a, pid \d+ on "):
            RunLock(url, "run-b").acquire()
    assert _body(s3, url) is None
    lock = RunLock(url, "run-c").acquire()
    assert lock.recovered is None
    lock.release()


def test_s3_stale_locks_are_taken_over(s3, url):
    host = RunLock(url, "probe").host
    now = time.time()
    _put(s3, url, json.dumps({"pid": dead_pid(), "host": host, "run_id": "crashed",
                              "started": now, "heartbeat": now}).encode())
    lock = RunLock(url, "next").acquire()
    assert lock.recovered.run_id == "crashed" and _body(s3, url)["run_id"] == "next"
    lock.release()
    # Another host: stale only once its heartbeat is older than stale_after_s.
    other = {"pid": 1, "host": "other-host", "run_id": "remote", "started": now,
             "heartbeat": now - 5}
    _put(s3, url, json.dumps(other).encode())
    with pytest.raises(RunLockedError, match="run remote"):
        RunLock(url, "mine", stale_after_s=60).acquire()
    _put(s3, url, json.dumps({**other, "heartbeat": now - 120}).encode())
    lock = RunLock(url, "mine", stale_after_s=60).acquire()
    assert lock.recovered.run_id == "remote"
    lock.release()
    # A torn body (a run killed while writing it): its age is the object's own.
    _put(s3, url, b'{"pid": 12')
    with pytest.raises(RunLockedError):
        RunLock(url, "too-soon", stale_after_s=60).acquire()
    lock = RunLock(url, "after-torn", stale_after_s=0.5)
    time.sleep(1.1)
    lock.acquire()
    assert lock.recovered is not None
    lock.release()


def test_s3_heartbeat_advances_and_stops_once_taken_over(s3, url):
    lock = RunLock(url, "beating", heartbeat_s=0.1).acquire()
    first = _body(s3, url)["heartbeat"]
    time.sleep(0.6)
    assert _body(s3, url)["heartbeat"] > first
    # Someone else takes it over (as a run would after a long stall): the old holder's
    # heartbeat must never write it again, and its release must not delete it.
    _put(s3, url, json.dumps({"pid": 1, "host": "other-host", "run_id": "usurper",
                              "started": time.time(), "heartbeat": time.time()}).encode())
    time.sleep(0.5)
    lock.release()
    assert _body(s3, url)["run_id"] == "usurper"
    _put(s3, url, json.dumps({"pid": 1, "host": "x", "run_id": "old", "started": 0,
                              "heartbeat": 0}).encode())
    RunLock(url, "cleanup", stale_after_s=1).acquire().release()


def _race(url: str, n: int) -> tuple[list[RunLock], list[int], list[Exception]]:
    """`n` runs (threads, each its own lock and S3 client) acquire at one barrier."""
    barrier = threading.Barrier(n)
    won, refused, errors = [], [], []

    def contend(i: int) -> None:
        lock = RunLock(url, f"run-{i}")
        barrier.wait()
        try:
            lock.acquire()
            won.append(lock)
        except RunLockedError:
            refused.append(i)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won, refused, errors


def test_s3_racing_runs_cannot_both_win(s3, url):
    """Eight runs start at one barrier, six times over: every round exactly one holds
    the lock, the rest are refused."""
    for _ in range(6):
        won, refused, errors = _race(url, 8)
        assert not errors and len(won) == 1 and len(refused) == 7
        assert _body(s3, url)["run_id"] == won[0].run_id
        won[0].release()


def test_s3_a_store_ignoring_conditional_writes_is_refused(s3, url, monkeypatch):
    """A store that drops If-None-Match would let two runs both "win": the lock checks
    first, and refuses with the way out (run.lock_path)."""
    real = s3._app

    def ignore_conditions(environ, start_response):
        environ.pop("HTTP_IF_NONE_MATCH", None)
        return real(environ, start_response)

    monkeypatch.setattr(s3, "_app", ignore_conditions)
    monkeypatch.setattr(_S3Backend, "_checked", set())
    with pytest.raises(ConfigError, match="ignores conditional writes.*run.lock_path"):
        RunLock(url, "unsafe").acquire()
    assert _body(s3, url) is None


def test_s3_an_outage_while_holding_never_makes_a_second_holder(s3, url):
    """The store goes away while a run holds the lock: its heartbeat fails quietly, its
    release logs instead of raising (the run's own error stays the one reported), and
    after the outage a run on this host takes the lock over only once the holder's
    process is gone -- here it is alive, so the next run is refused."""
    lock = RunLock(url, "holder", heartbeat_s=0.1).acquire()
    s3.stop()
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        lock.release()  # logs: the store does not answer
        assert time.monotonic() - t0 < 120
    finally:
        s3.start()
    assert _body(s3, url)["run_id"] == "holder"  # left behind, not half-deleted
    with pytest.raises(RunLockedError, match="run holder"):
        RunLock(url, "next").acquire()  # the holder's process (this one) is alive
