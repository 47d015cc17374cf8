"""The whole sample pipeline with ``storage.root`` in a bucket of a real S3-protocol
server on 127.0.0.1 (moto's, started and stopped here), run as users run it: the
``lakeshard`` command on the embedded default (conf/local.yaml) with only the root moved
to ``s3://`` -- the six sample sources stay on local disk. Spark reaches the bucket
through S3A, pylance through its object store, the MDS writer and the run lock through
boto3, all configured by the standard AWS environment alone.

Root ``a``: the uninterrupted run (31 seen, 23 accepted, 8 rejected), read back by
independent readers (pylance, delta-rs, ``StreamingDataset(remote=...)``), then
``verify-export``, ``lakeshard sql``, a second run that changes nothing -- while the
server answers every 9th request with ``503 SlowDown`` --, ``compact`` and ``versions``.

Root ``b``, one chain of faults (four runs instead of one pipeline per fault): the server
goes away in the middle of curate's Lance write and comes back; a run is SIGKILLed in
curate (Lance committed, Delta not yet merged); a run is SIGKILLed in export (one MDS
partition uploaded); a plain rerun must then leave exactly root ``a``'s result.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml
from conftest import JARS_DIR, REPO
from s3server import S3Server

from etl.config import default_config_text

pytestmark = pytest.mark.slow

BUCKET = "lakeshard-e2e"
# Distinctive credentials: they must appear in no log line, table, report or manifest.
ACCESS_KEY = "AKIALAKESHARDE2ETEST"
SECRET_KEY = "lakeshard/e2e+Secret/Key-never-logged"
TOKEN = "lakeshard-e2e-session-token-never-logged"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server().start()
    server.client().create_bucket(Bucket=BUCKET)
    work = tmp_path_factory.mktemp("s3-e2e")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "AWS_ENDPOINT_URL": server.endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_SESSION_TOKEN": TOKEN,
        "AWS_REGION": "us-east-1",
        "XDG_CACHE_HOME": str(work / "cache"),  # the smoke model's default cache
    }
    for key in ("LAKESHARD_KILL_AT", "S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        env.pop(key, None)
    yield server, env, work
    server.stop()


def _conf(work, name: str, report: bool = True) -> str:
    """conf/local.yaml with storage.root in the bucket (and this machine's JARs; small
    Spark settings for two cores, as the other end-to-end tests use)."""
    raw = yaml.safe_load(default_config_text())
    raw["storage"]["root"] = f"s3://{BUCKET}/{name}"
    raw["spark"]["master"] = "local[2]"
    raw["spark"]["jars_dir"] = str(JARS_DIR)
    raw["spark"]["conf"].update({"spark.ui.enabled": "false",
                                 "spark.sql.shuffle.partitions": "2",
                                 "spark.databricks.delta.snapshotPartitions": "2"})
    raw["run"]["progress_interval_s"] = 0
    raw["run"]["report"] = report
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _lakeshard(env, work, *args, kill_at=None, on_line=None) -> subprocess.CompletedProcess:
    """`lakeshard ARGS` in `work` (where the samples are built), in its own session;
    `on_line(line)` sees each line of its stderr as it comes."""
    run_env = dict(env)
    if kill_at:
        run_env["LAKESHARD_KILL_AT"] = kill_at
    proc = subprocess.Popen([sys.executable, "-m", "etl.cli", *args], cwd=work, env=run_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    err: list[str] = []

    def pump():
        for line in proc.stderr:
            err.append(line)
            if on_line is not None:
                on_line(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        out = proc.stdout.read()
        proc.wait(timeout=1200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    reader.join(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(err))


def _keys(client, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for p in pages for o in p.get("Contents", []))


def _storage_options(server) -> dict:
    return {"aws_endpoint": server.endpoint, "aws_region": "us-east-1",
            "aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": SECRET_KEY,
            "aws_session_token": TOKEN, "allow_http": "true"}


def _delta(server, root: str, table: str):
    """A Delta table of `root`, read by delta-rs (not Spark), as a list of dicts."""
    from deltalake import DeltaTable

    opts = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_SESSION_TOKEN": TOKEN, "AWS_ALLOW_HTTP": "true",
            "AWS_S3_ALLOW_UNSAFE_RENAME": "true"}
    dt = DeltaTable(f"s3://{BUCKET}/{root}/delta/{table}", storage_options=opts)
    return dt, dt.to_pyarrow_table().to_pylist()


def _lance(server, root: str):
    import lance

    return lance.dataset(f"s3://{BUCKET}/{root}/lance/default/curated.lance",
                         storage_options=_storage_options(server))


def _state(server, env, work, root: str) -> dict:
    """What a run leaves under `root`, minus what legitimately differs between runs."""
    from mds_read import read_mds

    rows = []
    for r in _lance(server, root).to_table().to_pylist():
        rows.append({k: v for k, v in r.items()
                     if k not in ("run_id", "ingested_at", "caption_smoke_at")})
    rows.sort(key=lambda r: r["sample_id"])
    _, rejects = _delta(server, root, "rejects")
    rejects = sorted((r["sample_id"], r["source"], r["source_key"], r["stage"], r["reason"])
                     for r in rejects)
    _, manifest_rows = _delta(server, root, "manifest")
    manifest_rows = sorted((r["sample_id"], r["status"]) for r in manifest_rows)
    client = server.client()
    prefix = f"{root}/mds/default/"
    shards = {}
    for key in _keys(client, prefix):
        if key.endswith(".mds"):
            body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            shards[key.rsplit("/", 1)[1] + f"@{len(body)}"] = body
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key=prefix + "manifest.json")
                          ["Body"].read())
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN", "AWS_REGION")
    samples = read_mds(str(work / f"stream-{root}-{time.time_ns()}"),
                       remote=f"s3://{BUCKET}/{prefix}",
                       env={**{k: env[k] for k in keys if k in env},
                            "S3_ENDPOINT_URL": server.endpoint})
    streamed = sorted((s["sample_id"], s.get("caption")) for s in samples)
    return {"rows": rows, "rejects": rejects, "manifest_rows": manifest_rows,
            "checksum": manifest["checksum"], "samples": manifest["samples"],
            "shard_bytes": sorted(len(b) for b in shards.values()), "streamed": streamed}


def _assert_no_secrets(server, env, texts: list[str], prefix: str) -> None:
    """Neither the secret key nor the session token (nor the key id) in any output or
    any object under `prefix` -- logs, ledger, reports, manifests, tables."""
    secrets = (SECRET_KEY, TOKEN, ACCESS_KEY)
    for text in texts:
        for s in secrets:
            assert s not in text
    client = server.client()
    for key in _keys(client, prefix):
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        for s in secrets:
            assert s.encode() not in body, (key, s)
    _, ledger = _delta(server, prefix.rstrip("/"), "runs")
    for row in ledger:
        for value in row.values():
            for s in secrets:
                assert s not in str(value)


@pytest.fixture(scope="module")
def uninterrupted(s3):
    server, env, work = s3
    conf = _conf(work, "a")
    t0 = time.monotonic()
    res = _lakeshard(env, work, "run", "--conf", conf)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return conf, res, time.monotonic() - t0


def test_sample_pipeline_on_s3(s3, uninterrupted):
    server, env, work = s3
    conf, first, _ = uninterrupted
    client = server.client()
    # What the run printed: the accounting of the local run.
    total = re.search(r"^total\s+(\d+)\s+(\d+)\s+(\d+)", first.stdout, re.M)
    assert total and total.groups() == ("31", "23", "8"), first.stdout[-3000:]
    assert f"report          : s3://{BUCKET}/a/reports/" in first.stdout
    # ... and what independent readers find in the bucket.
    _, accounting = _delta(server, "a", "accounting")
    by_outcome: dict[str, int] = {}
    for r in accounting:
        by_outcome[r["status"]] = by_outcome.get(r["status"], 0) + r["count"]
    ds = _lance(server, "a")
    _, rejects = _delta(server, "a", "rejects")
    assert ds.count_rows() == 23 and len(rejects) == 8
    assert by_outcome.get("accepted", 0) == 23 and by_outcome.get("rejected", 0) == 8
    assert ds.count_rows(filter="caption_smoke_status = 'ok'") == 23  # captioned there
    # The export: rows kept and not a non-canonical duplicate, streamed back from S3.
    _, dedup = _delta(server, "a", "dedup")
    dropped = {r["sample_id"] for r in dedup if not r["is_canonical"]}
    kept = sorted(r["sample_id"] for r in ds.to_table(columns=["sample_id", "keep"])
                  .to_pylist() if r["keep"] and r["sample_id"] not in dropped)
    state = _state(server, env, work, "a")
    assert [sid for sid, _ in state["streamed"]] == kept and state["samples"] == len(kept)
    # Summaries and the caption report landed in the bucket; nothing on local disk but
    # the samples and the cache (no spark-warehouse/, no lakeshard-data/lance).
    keys = _keys(client, "a/")
    assert any(k.endswith("/summary.json") for k in keys)
    assert any(k.startswith("a/_lock") for k in keys) is False  # released
    assert sorted(os.listdir(work)) == ["a.yaml", "cache", "lakeshard-data", *sorted(
        n for n in os.listdir(work) if n.startswith("stream-"))]
    assert sorted(os.listdir(work / "lakeshard-data")) == ["samples"]
    assert (work / "cache" / "lakeshard" / "models" / "tiny-qwen2_5_vl").is_dir()

    res = _lakeshard(env, work, "verify-export", "default", "--conf", conf)
    assert res.returncode == 0 and res.stdout.rstrip().endswith("OK"), res.stdout + res.stderr
    res = _lakeshard(env, work, "sql", "SELECT count(*) AS n, sum(CAST(keep AS INT)) AS k "
                     "FROM curated_meta", "--conf", conf)
    assert res.returncode == 0, res.stderr[-3000:]
    n_keep = ds.count_rows(filter="keep")
    assert re.search(rf"\|\s*23\s*\|\s*{n_keep}\s*\|", res.stdout), res.stdout

    # A second run changes nothing -- with every 9th request throttled (503 SlowDown),
    # which each client (S3A, pylance, boto3, pyarrow) must retry.
    before = {k: client.head_object(Bucket=BUCKET, Key=k)["ETag"]
              for k in keys if "/delta/runs/" not in k and "/delta/accounting/" not in k
              and "/reports/" not in k and "/_lakeshard/exports/" not in k}
    versions = {t: _delta(server, "a", t)[0].version() for t in ("manifest", "rejects")}
    dedup_rows = sorted(map(repr, _delta(server, "a", "dedup")[1]))
    server.throttle_every(9)
    try:
        second = _lakeshard(env, work, "run", "--conf", conf)
    finally:
        throttled = server.throttled
        server.throttle_every(0)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert throttled > 20
    # seen, accepted, rejected, errors, flagged: 0 -- all 31 records unchanged, none removed.
    assert re.search(r"^total\s+0\s+0\s+0\s+0\s+0\s+31\s+0$", second.stdout, re.M), \
        second.stdout
    assert _lance(server, "a").version == ds.version
    assert {t: _delta(server, "a", t)[0].version() for t in versions} == versions
    # dedup's rows too (its table properties may move on: it re-records the curated
    # version it covers, which the caption stage advanced after it -- as on local disk).
    assert sorted(map(repr, _delta(server, "a", "dedup")[1])) == dedup_rows
    after = {k: client.head_object(Bucket=BUCKET, Key=k)["ETag"] for k in before}
    assert after == before

    # Compaction and time travel on S3: the rows stay, every version is readable. The
    # sample's 23 rows are one fragment (curate appends one per 512 accepted rows), so
    # compaction rewrites nothing and keeps the version.
    ids = sorted(ds.to_table(columns=["sample_id"]).column(0).to_pylist())
    assert len(ds.get_fragments()) == 1
    compact = _lakeshard(env, work, "compact", "--conf", conf)
    assert compact.returncode == 0, compact.stderr[-3000:]
    now = _lance(server, "a")
    assert re.search(r": 1 -> 1 fragment\(s\) \(0 rewritten\)", compact.stdout), compact.stdout
    assert now.version == ds.version
    assert sorted(now.to_table(columns=["sample_id"]).column(0).to_pylist()) == ids
    first_version = min(v["version"] for v in now.versions())
    assert first_version < ds.version
    assert _lance(server, "a").checkout_version(first_version).count_rows() == 23
    versions = _lakeshard(env, work, "versions", "--conf", conf)
    assert versions.returncode == 0 and re.search(rf"^\s*{now.version}\s", versions.stdout,
                                                   re.M), versions.stdout
    _assert_no_secrets(server, env, [first.stdout, first.stderr, second.stdout,
                                     second.stderr, res.stdout, res.stderr, compact.stdout,
                                     compact.stderr], "a/")


def test_outage_and_kills_then_a_rerun_give_the_uninterrupted_result(s3, uninterrupted):
    server, env, work = s3
    conf_a, _, _ = uninterrupted
    conf = _conf(work, "b", report=False)  # the report is no table: save its time
    client = server.client()
    lance_data = f"/{BUCKET}/b/lance/default/curated.lance/data/"

    # 1. The server goes away right after the first Lance data file of curate is stored,
    #    and comes back once the run has reported the failed stage.
    server.stop_after(lambda method, path: method == "PUT" and path.startswith(lance_data))

    def restart_on_failure(line: str) -> None:
        if '"stage_failed"' in line and server.down:
            server.start()

    # --log-format json: the run's events on stderr as a log shipper reads them.
    res = _lakeshard(env, work, "run", "--conf", conf, "--log-format", "json",
                     on_line=restart_on_failure)
    if server.down:
        server.start()
    assert server.tripped.is_set()
    assert res.returncode != 0
    failed = re.search(r'"event": "stage_failed".*', res.stderr)
    assert failed and '"stage": "curate"' in failed.group(0), res.stderr[-5000:]
    # The error names the table ("could not write to / commit to / read the Lance table
    # at s3://..."), whichever request of the write the outage hit.
    assert re.search(rf"Lance table at s3://{BUCKET}/b/lance/default/curated\.lance",
                     failed.group(0)), failed.group(0)
    # Nothing half-committed: no Lance version, no bronze Delta version.
    assert not [k for k in _keys(client, "b/lance/") if "/_versions/" in k]
    for table in ("manifest", "rejects"):
        assert not _keys(client, f"b/delta/{table}/_delta_log/0"), table
    _assert_no_secrets(server, env, [res.stdout, res.stderr], "b/")

    # 2. SIGKILL in curate after the Lance commit, before the Delta merges; 3. SIGKILL
    #    in export after partition 0 is uploaded.
    for point in ("curate:lance_written", "export:part-00000"):
        res = _lakeshard(env, work, "run", "--conf", conf, kill_at=point)
        assert res.returncode == -signal.SIGKILL, (point, res.stderr[-5000:])
        assert _keys(client, "b/_lock/"), f"{point}: a killed run leaves its lock"
    assert not _keys(client, "b/mds/default/manifest.json")  # no export yet

    # 4. A plain rerun: exactly what the uninterrupted run left on root a.
    res = _lakeshard(env, work, "run", "--conf", conf)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "recovered the stale lock of crashed run" in res.stdout
    assert not _keys(client, "b/_lock/")
    got, expected = _state(server, env, work, "b"), _state(server, env, work, "a")
    assert got["rows"] == expected["rows"]          # nothing lost, nothing duplicated
    assert got["rejects"] == expected["rejects"]
    assert got["manifest_rows"] == expected["manifest_rows"]
    assert got["streamed"] == expected["streamed"]
    assert got["checksum"] == expected["checksum"]  # byte-identical shards
    assert got["shard_bytes"] == expected["shard_bytes"]
    # No stale attempt of the killed export left beside the committed one.
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key="b/mds/default/manifest.json")
                          ["Body"].read())
    shard_keys = [k for k in _keys(client, "b/mds/default/") if k.endswith(".mds")]
    assert len(shard_keys) == manifest["shards"]
    _, events = _delta(server, "b", "runs")
    latest = {}  # the ledger is append-only: each run's and stage's latest event
    for r in sorted(events, key=lambda r: r["recorded_at"]):
        latest[(r["run_id"], r["stage"])] = r
    ledger = list(latest.values())
    runs = sorted(r["status"] for r in ledger if r["stage"] == "run")
    assert runs in (["crashed", "crashed", "failed", "ok"], ["crashed", "crashed", "crashed",
                                                               "ok"]), runs
    assert not [r for r in ledger if r["status"] == "running"]
