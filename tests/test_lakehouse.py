"""The curated Lance table as a lakehouse: features without rewrites, scalar indexes,
versions and compaction, caption embeddings and semantic search."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import lance
import pytest
import yaml
from conftest import REPO, make_config
from lakehouse_data import ROWS, write_curated

from etl import tables
from etl.config import ConfigError
from etl.jobs.lakehouse import Compacted, FeaturesAdded
from etl.lakehouse.features import ASPECT_BUCKETS, add_features
from etl.lakehouse.indexes import ensure_scalar_indexes, indexed_columns, uses_index
from etl.lakehouse.maintenance import compact, current_version, table_versions
from etl.ledger import read_runs


def _file_digests(path: str) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(path, "data").glob("*.lance"))
    }


def _by_id(path: str, *cols: str, version: int | None = None) -> dict[str, tuple]:
    t = lance.dataset(path, version=version).to_table(columns=["sample_id", *cols]).to_pylist()
    return {r["sample_id"]: tuple(r[c] for c in cols) for r in t}


def test_feature_columns_are_added_without_rewriting_image_data(spark, tmp_path):
    path = str(tmp_path / "curated.lance")
    write_curated(spark, path)
    before = _file_digests(path)
    images_before = _by_id(path, "image")
    v0 = current_version(path)

    res = add_features(spark, path, ["aspect_bucket", "caption_words"])

    # Every data file of the table is still there, byte for byte; only new files came.
    after = _file_digests(path)
    assert {n: after[n] for n in before} == before and len(after) > len(before)
    assert res.image_files_unchanged and res.version > v0 and res.rows == len(ROWS)
    new_bytes = sum(os.path.getsize(Path(path, "data", n)) for n in set(after) - set(before))
    assert res.bytes_written == new_bytes
    ratio = res.bytes_written / sum(os.path.getsize(Path(path, "data", n)) for n in before)
    print(f"feature bytes / table bytes = {ratio:.4f}")
    assert ratio < 0.1
    # Values, computed here independently: nearest bucket on a log scale, word counts.
    def bucket(w, h):
        return min(ASPECT_BUCKETS, key=lambda b: abs(math.log(w / h) - math.log(b[1])))[0]

    got = _by_id(path, "aspect_bucket", "caption_words")
    want = {
        r["sample_id"]: (
            bucket(r["width"], r["height"]),
            None if r["caption_original"] is None else len(r["caption_original"].split()),
        )
        for r in ROWS
    }
    assert got == want
    assert _by_id(path, "image") == images_before
    # The version before the feature still reads without it (time travel).
    assert "aspect_bucket" not in lance.dataset(path, version=v0).schema.names


def test_only_missing_computes_features_for_appended_rows_only(spark, tmp_path):
    path = str(tmp_path / "curated.lance")
    write_curated(spark, path, ROWS[:12], parts=2)
    first = add_features(spark, path, ["megapixels"])
    write_curated_append(spark, path, ROWS[12:])
    second = add_features(spark, path, ["megapixels"], only_missing=True)
    assert (first.rows, second.rows) == (12, 12)
    got = _by_id(path, "megapixels")
    assert got == {r["sample_id"]: (round(r["width"] * r["height"] / 1e6, 4),) for r in ROWS}


def write_curated_append(spark, path, rows):
    from etl.schema import CURATED_COLUMNS, CURATED_SCHEMA

    df = spark.createDataFrame([tuple(r[c] for c in CURATED_COLUMNS) for r in rows],
                               CURATED_SCHEMA)
    df.coalesce(1).write.format("lance").mode("append").save(path)


def test_scalar_indexes_are_created_used_and_extended_to_appended_rows(spark, tmp_path):
    path = str(tmp_path / "curated.lance")
    write_curated(spark, path, ROWS[:16], parts=2)
    wanted = {"source": "BITMAP", "keep": "BITMAP", "width": "BTREE", "caption_status": "BITMAP"}
    predicate = "source != 'photos' AND NOT keep AND width >= 100"

    res = ensure_scalar_indexes(path, wanted)

    assert set(res.created) == {"source", "keep", "width"} and res.skipped == ("caption_status",)
    assert indexed_columns(path) == {"source": "BITMAP", "keep": "BITMAP", "width": "BTREE"}
    assert uses_index(path, predicate)
    assert not uses_index(path, "license = 'CC-BY-4.0'")  # no index there: a scan

    def expected(rows):
        return sorted(
            r["sample_id"] for r in rows
            if r["source"] != "photos" and not r["keep"] and r["width"] >= 100
        )

    def lance_ids():
        t = lance.dataset(path).to_table(columns=["sample_id"], filter=predicate)
        return sorted(t.column(0).to_pylist())

    assert lance_ids() == expected(ROWS[:16]) and expected(ROWS[:16])
    # Through Spark, the same predicate as the data source's filter option.
    spark_ids = (
        spark.read.format("lance").option("filter", predicate).option("columns", "sample_id")
        .load(path).toPandas()["sample_id"].sort_values().tolist()
    )
    assert spark_ids == expected(ROWS[:16])

    write_curated_append(spark, path, ROWS[16:])
    again = ensure_scalar_indexes(path, wanted)
    assert set(again.extended) == {"source", "keep", "width"} and not again.created
    frags = {f.fragment_id for f in lance.dataset(path).get_fragments()}
    for idx in lance.dataset(path).list_indices():
        assert set(idx["fragment_ids"]) == frags, idx["name"]
    assert lance_ids() == expected(ROWS)
    # Nothing left to do: no new version.
    assert ensure_scalar_indexes(path, wanted).version == again.version


def test_compact_merges_fragments_and_cleans_versions_past_retention(spark, tmp_path):
    path = str(tmp_path / "curated.lance")
    write_curated(spark, path, ROWS[:8], parts=2)
    for start in range(8, 24, 4):
        write_curated_append(spark, path, ROWS[start : start + 4])
    ensure_scalar_indexes(path, {"source": "BITMAP"})
    ds = lance.dataset(path)
    assert len(ds.get_fragments()) == 6
    cfg = make_config(tmp_path, lakehouse={"retention_days": 0, "retain_versions": 2})
    all_rows = _by_id(path, "source", "image")

    res = compact(path, cfg.lakehouse)

    ds = lance.dataset(path)
    assert (res.fragments_before, res.fragments_after) == (6, 1)
    assert [v.version for v in table_versions(path)] == [ds.version - 1, ds.version]
    assert res.versions_removed > 0 and res.oldest_version == ds.version - 1
    assert _by_id(path, "source", "image") == all_rows
    assert uses_index(path, "source = 'photos'")
    with pytest.raises((ValueError, OSError)):
        lance.dataset(path, version=1).count_rows()


def test_table_changing_commands_take_the_lock_and_write_the_ledger(spark, tmp_path):
    from etl.errors import RunLockedError
    from etl.pipeline.runner import run_command
    from etl.runtime.lock import RunLock
    from etl.tables import lock_path

    cfg = make_config(tmp_path / "root", lakehouse={"retention_days": 0, "retain_versions": 1})
    path = tables.layout(cfg).curated
    write_curated(spark, path, ROWS[:8], parts=2)
    write_curated_append(spark, path, ROWS[8:12])

    # Another run holds the root: the command is refused before it changes anything.
    version = lance.dataset(path).version
    with RunLock(lock_path(cfg), "nightly-7"), pytest.raises(RunLockedError, match="nightly-7"):
        run_command(cfg, "features", {"names": ["megapixels"]})
    assert lance.dataset(path).version == version

    feats = run_command(cfg, "features", {"names": ["megapixels"]}, run_id="feat-1")
    comp = run_command(cfg, "compact", run_id="compact-1")
    assert feats.detail("features", FeaturesAdded).result.rows == 12
    assert comp.detail("compact", Compacted).result.fragments_after == 1
    assert not os.path.exists(lock_path(cfg))
    ledger = read_runs(spark, tables.layout(cfg).runs)  # latest status
    rows = {(r.run_id, r.stage): r for r in ledger.collect()}
    assert {k: r.status for k, r in rows.items()} == {
        ("feat-1", "run"): "ok", ("feat-1", "features"): "ok",
        ("compact-1", "run"): "ok", ("compact-1", "compact"): "ok",
    }
    assert rows[("compact-1", "compact")].table_versions["lance:curated"] == \
        lance.dataset(path).version
    assert rows[("feat-1", "features")].outputs["rows"] == 12


def test_lakehouse_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"lakehouse.scalar_indexes.source: 'HASH'"):
        make_config(tmp_path, lakehouse={"scalar_indexes": {"source": "hash"}})
    with pytest.raises(ConfigError, match=r"lakehouse.embedding.device"):
        make_config(tmp_path, lakehouse={"embedding": {"device": "gpu"}})
    with pytest.raises(ConfigError, match=r"lakehouse.embedding.model"):
        make_config(tmp_path, lakehouse={"embedding": {"model": "bge-large"}})
    with pytest.raises(ConfigError, match=r"lakehouse.retain_versions"):
        make_config(tmp_path, lakehouse={"retain_versions": 0})
    with pytest.raises(ConfigError, match=r"lakehouse: unknown key 'indexes'"):
        make_config(tmp_path, lakehouse={"indexes": {}})


def _conf_file(tmp_path) -> Path:
    cfg = {
        "storage": {"root": str(tmp_path / "root")},
        "spark": {
            "master": "local[2]",
            "jars_dir": str(REPO / ".jars"),
            "conf": {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false",
                     "spark.driver.memory": "1g"},
        },
        "sources": [{"name": "dummy", "kind": "image_folder", "path": str(tmp_path)}],
    }
    path = tmp_path / "conf.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "etl.cli", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_features_cli_refuses_unknown_feature_before_spark(tmp_path):
    conf = _conf_file(tmp_path)
    out = _cli("--conf", str(conf), "features", "add", "sharpness")
    assert out.returncode == 2 and "unknown feature 'sharpness'" in out.stderr


@pytest.mark.slow
def test_embed_then_search_returns_the_planted_best_match(spark, tmp_path):
    from etl.lakehouse.embeddings import DIM, embed_captions

    conf = _conf_file(tmp_path)
    cfg = make_config(tmp_path / "root")
    path = tables.layout(cfg).curated
    write_curated(spark, path)
    before = _file_digests(path)

    res = embed_captions(spark, path, cfg.lakehouse.embedding)

    captioned = [r for r in ROWS if r["caption_original"] is not None]
    assert res.rows == len(captioned) and res.index_type == "IVF_FLAT"
    ds = lance.dataset(path)
    assert str(ds.schema.field("caption_embedding").type) == f"fixed_size_list<item: float>[{DIM}]"
    after = _file_digests(path)
    assert {n: after[n] for n in before} == before  # image files untouched
    assert [d.field_names for d in ds.describe_indices()] == [["caption_embedding"]]
    # Nothing new to embed: nothing written.
    assert embed_captions(spark, path, cfg.lakehouse.embedding).rows == 0

    # The planted caption: only ROWS[0] is exactly about a red bicycle and a brick wall
    # (ROWS[12] repeats it with ", photo 12"); the rest are about other things.
    out = _cli("--conf", str(conf), "search", "a red bicycle against a brick wall", "-k", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3
    top = [line.split()[2] for line in lines]
    assert top[:2] == [ROWS[0]["sample_id"], ROWS[12]["sample_id"]]
    assert float(lines[0].split()[1]) < 0.3 < float(lines[2].split()[1])
    # A prefilter: only rows from another source (in-process this time).
    from etl.lakehouse.embeddings import search

    hits = search(path, "a red bicycle against a brick wall", cfg.lakehouse.embedding, k=2,
                  where="source = 'crawl'")
    crawl = {r["sample_id"] for r in ROWS if r["source"] == "crawl"}
    assert len(hits) == 2 and all(h.sample_id in crawl for h in hits)
