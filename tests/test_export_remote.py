"""An export to s3:// from a local root -- against a real S3-protocol server on 127.0.0.1
(moto's server mode), with the `lakeshard` command run as users run it and the store
named the standard way (AWS_ENDPOINT_URL). The whole root on S3: test_s3_pipeline.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from conftest import JARS_DIR
from support import scoped_env

pytestmark = pytest.mark.slow

BUCKET = "lakeshard-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with scoped_env(env):
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
        client.create_bucket(Bucket=BUCKET)
        yield env, client
    server.stop()


def _lakeshard(env, *args):
    return subprocess.run(
        [sys.executable, "-m", "etl.cli", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **env},
    )


def _keys(client, prefix):
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for p in pages for o in p.get("Contents", []))


def test_export_to_s3_streams_back_verifies_and_cleans_up(s3, tmp_path):
    env, client = s3
    url = f"s3://{BUCKET}/exports/default"
    # Leftovers of a failed attempt from an earlier run: must be gone afterwards.
    client.put_object(
        Bucket=BUCKET, Key="exports/default/deadbeef/part-00000-t99/x.mds", Body=b"junk"
    )
    conf = {
        "storage": {"root": str(tmp_path / "data")},
        "spark": {
            "master": "local[2]",
            "jars_dir": str(JARS_DIR),
            "conf": {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"},
        },
        "sources": [
            {"name": "pics", "kind": "image_folder", "path": str(tmp_path / "pics"), "sample": True}
        ],
        "exports": {
            "default": {
                "partitions": 2,
                "size_limit": 65536,
                "path": url,
                "where": None,
                "include_duplicates": True,
            }
        },
    }
    path = tmp_path / "conf.yaml"
    path.write_text(yaml.safe_dump(conf))

    res = _lakeshard(env, "run", "--conf", str(path))
    assert res.returncode == 0, res.stderr[-3000:]
    keys = _keys(client, "exports/default/")
    assert "exports/default/index.json" in keys and "exports/default/manifest.json" in keys
    assert not any("deadbeef" in k for k in keys)
    shard_keys = [k for k in keys if k.endswith(".mds")]
    assert shard_keys and all("/part-0000" in k for k in shard_keys)
    # Nothing was left on local disk by the writers.
    assert not (tmp_path / "data" / "mds").exists() or not any(
        (tmp_path / "data" / "mds").iterdir()
    )

    import lance
    from mds_read import read_mds

    table = lance.dataset(str(tmp_path / "data" / "lance" / "default" / "curated.lance"))
    expected = sorted(table.to_table(columns=["sample_id"]).column(0).to_pylist())
    got = read_mds(str(tmp_path / "cache"), remote=url)
    assert sorted(s["sample_id"] for s in got) == expected
    assert all(s["image"].format == "JPEG" for s in got)

    res = _lakeshard(env, "verify-export", "default", "--conf", str(path))
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr[-2000:]
    before = {k: client.head_object(Bucket=BUCKET, Key=k)["ETag"] for k in keys}
    res = _lakeshard(env, "export", "--conf", str(path))  # up to date: no work, no writes
    assert res.returncode == 0, res.stderr[-2000:]
    after = {
        k: client.head_object(Bucket=BUCKET, Key=k)["ETag"]
        for k in _keys(client, "exports/default/")
    }
    assert after == before
