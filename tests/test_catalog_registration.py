"""`catalog:`: refused configs name the field (no Spark); a run with a Hive catalog
registers every Delta table by name, with its comment, and a moved root's tables are
registered again at their new location (etl.lakehouse.registration).

The Hive run needs a Spark session with Hive support, which the shared session of the
test process is not (a static setting): it runs in a child process, on a root the
shared session curated, and prints what the catalog holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO
from support import photo_folder

from etl import tables
from etl.config import ConfigError

_BASE = {"storage": {"root": "/data/lakeshard"},
         "sources": [{"name": "p", "kind": "image_folder", "path": "/data/p"}]}


@pytest.mark.parametrize("catalog, storage, spark, field", [
    ({"kind": "sql_server"}, None, None, "catalog.kind"),
    ({"kind": "hive", "database": "Lake-Shard"}, None, None, "catalog.database"),
    ({"kind": "hive", "database": "1st"}, None, None, "catalog.database"),
    ({"kind": "unity"}, None, None, "catalog.catalog"),
    ({"kind": "unity", "catalog": "main"}, {"root": "/Volumes/main/ls/corpus"}, None,
     "storage.root"),
    ({"kind": "hive", "catalog": "main"}, None, None, "catalog.catalog"),
    ({"kind": "glue", "metastore_uri": "thrift://m:9083"}, None, None,
     "catalog.metastore_uri"),
    ({"kind": "hive", "metastore_uri": "http://m:9083"}, None, None,
     "catalog.metastore_uri"),
    ({"kind": "hive"}, {"root": "s3://bucket/lakeshard"}, None, "catalog.metastore_uri"),
    ({"kind": "glue"}, None,
     {"conf": {"spark.hadoop.hive.metastore.client.factory.class": "x.Y"}},
     "spark.conf.spark.hadoop.hive.metastore.client.factory.class"),
    ({"kind": "hive", "comment_prefix": "it's"}, None, None, "catalog.comment_prefix"),
])
def test_a_catalog_it_cannot_use_is_refused_naming_the_field(catalog, storage, spark, field):
    from etl.config import parse_config

    raw = {**_BASE, "catalog": catalog}
    if storage:
        raw["storage"] = storage
    if spark:
        raw["spark"] = spark
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert str(err.value).startswith(f"{field}:"), str(err.value)


def test_catalog_defaults_and_names():
    from etl.config import parse_config

    assert parse_config(_BASE).catalog.kind == "none"
    unity = parse_config({**_BASE, "storage": {"root": "s3://b/ls"},
                          "catalog": {"kind": "unity", "catalog": "main"}}).catalog
    assert unity.qualified("rejects") == "main.lakeshard.rejects"
    hive = parse_config({**_BASE, "catalog": {"kind": "hive",
                                              "metastore_uri": "thrift://m:9083"}})
    assert hive.catalog.qualified("runs") == "lakeshard.runs" and not hive.catalog.embedded


_CHILD = r"""
import json, shutil, sys
sys.path.insert(0, sys.argv[3])
from support import make_config
from etl.pipeline.runner import run_pipeline
from etl.lakehouse.registration import register_tables, catalog_tables
src = [{"name": "photos", "kind": "image_folder", "path": sys.argv[4]}]
a = make_config(sys.argv[1], sources=src, run={"report": False},
                catalog={"kind": "hive", "publish_curated_meta": True})
run_pipeline(a, only=("curate",))  # a run: it registers every Delta table
from etl.session import get_spark
spark = get_spark(a, lance_format=False)
shown = sorted(r.tableName for r in spark.sql("SHOW TABLES IN lakeshard").collect())
comments = {t.name: t.description for t in spark.catalog.listTables("lakeshard")}
count = spark.sql("SELECT count(*) FROM lakeshard.runs").first()[0]
shutil.copytree(sys.argv[1] + "/delta", sys.argv[2] + "/delta")
b = make_config(sys.argv[2], sources=src, catalog={"kind": "hive"})
moved = register_tables(spark, b)
again = register_tables(spark, b)
where = {n: e.location for n, e in catalog_tables(spark, b).items()}
print("RESULT " + json.dumps({"shown": shown, "comments": comments, "runs": count,
                              "moved": moved.moved, "again": again.unchanged,
                              "where": where}))
"""


def test_a_hive_catalog_run_registers_every_table_and_follows_a_moved_root(tmp_path):
    photos = photo_folder(tmp_path / "photos", 3)
    root, moved_root = tmp_path / "root", tmp_path / "moved"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), str(moved_root), str(REPO / "tests"),
         str(photos)], capture_output=True, text=True, cwd=REPO, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    delta = sorted(p.name for p in (root / "delta").iterdir())
    assert {"curated_meta", "rejects", "manifest", "runs"} <= set(delta)
    assert got["shown"] == delta
    assert got["comments"] == {n: f"lakeshard: {tables.DELTA_TABLES[n]}" for n in delta}
    assert got["runs"] > 0  # read through the catalog name
    assert sorted(got["moved"]) == delta and sorted(got["again"]) == delta
    assert got["where"] == {n: str(moved_root / "delta" / n) for n in delta}
    assert (root / "_catalog" / "metastore_db").is_dir()
    assert not (REPO / "derby.log").exists()


def test_the_deploy_files_set_the_catalog():
    from etl.config import load_config
    from etl.config.catalog import GLUE_FACTORY, GLUE_FACTORY_KEY
    from etl.session import catalog_conf

    dbx = load_config(REPO / "conf" / "databricks.yaml").catalog
    assert (dbx.kind, dbx.namespace, dbx.publish_curated_meta) == (
        "unity", "main.lakeshard", True)
    emr = load_config(REPO / "conf" / "emr.yaml")
    assert (emr.catalog.kind, emr.catalog.publish_curated_meta) == ("glue", True)
    assert catalog_conf(emr) == {"spark.sql.catalogImplementation": "hive",
                                 GLUE_FACTORY_KEY: GLUE_FACTORY}
    cluster = {c["Classification"]: c["Properties"] for c in json.loads(
        (REPO / "deploy" / "emr-configurations.json").read_text())}
    assert cluster["spark-hive-site"]["hive.metastore.client.factory.class"] == GLUE_FACTORY
    local = load_config(REPO / "conf" / "local.yaml")
    assert local.catalog.kind == "none" and catalog_conf(local) == {}
