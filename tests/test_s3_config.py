"""Object-storage settings without a server: how `storage.s3` and the AWS environment
resolve into one set of client settings, what Spark gets (S3A JARs and settings only
when needed, never credentials), where the paths of an S3 root point, and the checks
that fail before Spark."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import JARS_DIR

from etl.config import ConfigError, parse_config
from etl.config.runtime import S3Config

SECRET = "do-not-copy-this-secret"


@pytest.fixture
def environ():
    """os.environ restored afterwards (etl.storage.use_storage writes into it)."""
    saved = dict(os.environ)
    for key in list(os.environ):
        if key.startswith("AWS_") or key in ("S3_ENDPOINT_URL", "XDG_CACHE_HOME"):
            del os.environ[key]
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def _cfg(root: str, jars_dir=str(JARS_DIR), **storage):
    return parse_config({
        "storage": {"root": root, **storage},
        "spark": {"master": "local[2]", "jars_dir": jars_dir},
        "sources": [{"name": "pics", "kind": "image_folder", "path": "/tmp/none"}],
        "caption": {"versions": {"smoke": {"model": "tiny-qwen2_5_vl"}}},
    })


def test_environment_and_overrides_resolve_to_one_setting():
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_DEFAULT_REGION": "eu-west-3",
           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": SECRET}
    s = S3Config().resolve(env)
    assert (s.endpoint, s.region, s.path_style, s.allow_http) == (
        "http://127.0.0.1:9000", "eu-west-3", True, True)
    # storage.s3 wins over the environment.
    s = S3Config(endpoint="https://minio.internal:9000", region="auto",
                 path_style=False).resolve(env)
    assert (s.endpoint, s.region, s.path_style, s.allow_http) == (
        "https://minio.internal:9000", "auto", False, False)
    # AWS itself: no endpoint, no region guessed, virtual-hosted addressing.
    s = S3Config().resolve({})
    assert (s.endpoint, s.region, s.path_style) == (None, None, False)
    # Mosaic Streaming's S3_ENDPOINT_URL still points everything at a store.
    assert S3Config().resolve({"S3_ENDPOINT_URL": "http://h:1"}).endpoint == "http://h:1"
    exported = S3Config().resolve(env).environment(env)
    assert exported["AWS_ENDPOINT_URL"] == exported["S3_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert exported["AWS_ALLOW_HTTP"] == "true"
    assert exported["AWS_REGION"] == exported["AWS_DEFAULT_REGION"] == "eu-west-3"
    assert (exported["AWS_RETRY_MODE"], exported["AWS_MAX_ATTEMPTS"]) == ("standard", "5")
    assert SECRET not in repr(exported) and SECRET not in repr(S3Config().resolve(env))
    # The user's own retry settings are theirs.
    assert "AWS_MAX_ATTEMPTS" not in S3Config().resolve({}).environment({"AWS_MAX_ATTEMPTS": "9"})


@pytest.mark.parametrize(("storage", "message"), [
    ({"root": "s3://"}, "storage.root: 's3://': expected a local folder or an object-store"),
    ({"root": "s3://b", "s3": {"endpoint": "minio:9000"}},
     "storage.s3.endpoint: 'minio:9000' is not an http(s)://host[:port] URL"),
    ({"root": "s3://b", "s3": {"endpoint": "http://k:s@h:9000"}},
     "storage.s3.endpoint: must not hold credentials"),
    ({"root": "s3://b", "s3": {"endpoint": "http://h:9000", "allow_http": False}},
     "storage.s3.allow_http: false, but endpoint 'http://h:9000' is http://"),
    ({"root": "s3://b", "s3": {"connector": "emrfs"}}, "storage.s3.connector: 'emrfs' is not"),
    ({"root": "s3://b", "cache_dir": "s3://b/cache"}, "storage.cache_dir: 's3://b/cache' must"),
])
def test_bad_storage_settings_name_the_field(storage, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        parse_config({"storage": storage,
                      "sources": [{"name": "x", "kind": "image_folder", "path": "/tmp"}]})


def test_an_http_endpoint_from_the_environment_needs_http_allowed():
    with pytest.raises(ConfigError, match="is http:// but plain HTTP is not allowed"):
        S3Config().resolve({"AWS_ENDPOINT_URL": "http://h:1", "AWS_ALLOW_HTTP": "false"})


def test_spark_gets_s3a_only_when_needed_and_never_credentials(environ, tmp_path):
    from etl.errors import JarsMissingError
    from etl.session import spark_conf

    environ.update({"AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_ACCESS_KEY_ID": SECRET,
                    "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": SECRET,
                    "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    # A laptop run on local disk: no S3A JAR, no S3A setting.
    conf = spark_conf(_cfg(str(tmp_path / "data")))
    assert "/s3a/" not in conf["spark.jars"] and "spark.hadoop.fs.s3.impl" not in conf
    # A root in a bucket: the S3A JARs after Delta's, s3:// mapped, the endpoint set.
    conf = spark_conf(_cfg("s3://bucket/lake"))
    jars = conf["spark.jars"].split(",")
    assert any(Path(j).match("delta-spark_*.jar") for j in jars)
    assert any(Path(j).match("*/s3a/hadoop-aws-3.4.*.jar") for j in jars)
    assert conf["spark.hadoop.fs.s3.impl"] == "org.apache.hadoop.fs.s3a.S3AFileSystem"
    assert conf["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9000"
    assert conf["spark.hadoop.fs.s3a.path.style.access"] == "true"
    assert conf["spark.hadoop.fs.s3a.retry.throttle.limit"] == "20"
    assert conf["spark.executorEnv.AWS_ALLOW_HTTP"] == "true"
    assert conf["spark.sql.warehouse.dir"] == str(tmp_path / "xdg/lakeshard/spark-warehouse")
    assert not any(SECRET in v for v in conf.values())
    assert not any(k.startswith(("spark.executorEnv.AWS_SECRET", "spark.executorEnv.AWS_ACCESS",
                                 "spark.executorEnv.AWS_SESSION")) for k in conf)
    # The platform's own s3:// (EMRFS, Databricks): lakeshard adds nothing.
    for cfg in (_cfg("s3://bucket/lake", jars_dir=None),
                _cfg("s3://bucket/lake", s3={"connector": "platform"})):
        conf = spark_conf(cfg)
        assert "spark.hadoop.fs.s3.impl" not in conf
        assert "/s3a/" not in conf.get("spark.jars", "")
    # Extra JARs in spark.conf add to lakeshard's list.
    cfg = parse_config({"storage": {"root": "s3://bucket/lake"},
                        "spark": {"jars_dir": str(JARS_DIR), "conf": {"spark.jars": "/x/y.jar"}},
                        "sources": [{"name": "p", "kind": "image_folder", "path": "/tmp"}]})
    jars = spark_conf(cfg)["spark.jars"].split(",")
    assert jars[-1] == "/x/y.jar" and any("delta-spark" in j for j in jars)
    # No S3A JARs fetched: the error says how to get them, before Spark.
    empty = tmp_path / "jars"
    empty.mkdir()
    for j in JARS_DIR.glob("*.jar"):
        (empty / j.name).symlink_to(j)
    with pytest.raises(JarsMissingError, match="make jars-s3a"):
        spark_conf(_cfg("s3://bucket/lake", jars_dir=str(empty)))


def test_paths_of_an_object_store_root(environ):
    from etl import tables

    environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9000"
    cfg = parse_config({
        "storage": {"root": "s3a://bucket/lake"},
        "sources": [{"name": "pics", "kind": "image_folder", "path": "/tmp/none"}],
        "exports": {"train": {"partitions": 2}},
    })
    paths = tables.layout(cfg)
    assert paths.manifest == "s3a://bucket/lake/delta/manifest"  # Spark's connector
    assert paths.curated == "s3://bucket/lake/lance/default/curated.lance"  # pylance
    assert tables.export_path(cfg, "train") == "s3://bucket/lake/mds/train"  # boto3
    assert tables.lock_path(cfg) == "s3://bucket/lake/_lock/run.lock"
    # use_storage exported the settings every client reads.
    assert environ["AWS_ALLOW_HTTP"] == "true"
    assert environ["S3_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert environ["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] == "false"


def test_the_smoke_model_builds_in_the_local_cache_before_spark(environ, tmp_path):
    """An S3 root: the smoke caption model goes to storage.cache_dir (checked before
    Spark, by the caption stage's check), not under the root."""
    from etl.jobs.caption import caption_spec, check
    from etl.runtime.stage import RunContext

    cfg = _cfg("s3://bucket/lake", cache_dir=str(tmp_path / "cache"))
    check(cfg, RunContext(run_id="r"))
    spec = caption_spec(cfg, cfg.caption.version(None))
    assert Path(spec.model_path) == tmp_path / "cache" / "models" / "tiny-qwen2_5_vl"
    assert spec.local_files_only
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    bad = _cfg("s3://bucket/lake", cache_dir=str(blocked))
    with pytest.raises(ConfigError, match="caption.versions.smoke.model: could not build"):
        caption_spec(bad, bad.caption.version(None))


def test_an_unreachable_store_is_not_an_absent_table(environ):
    """lance_exists must raise when the store does not answer: "absent" would make a
    writer start the table afresh."""
    from etl import storage, tables

    environ.update({"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x",
                    "AWS_SECRET_ACCESS_KEY": "y", "AWS_REGION": "us-east-1"})
    cfg = _cfg("s3://bucket/lake")
    with pytest.raises(OSError, match="could not read the Lance table at s3://bucket/lake"):
        storage.lance_exists(tables.layout(cfg).curated)
