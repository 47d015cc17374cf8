"""One source of each kind into one manifest; a second run ingests nothing; three new
records ingest exactly those three; accounting balances on a source of bad records."""

from __future__ import annotations

import json

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import jpeg_bytes, make_config, png_bytes, write_tar
from httpserver import Server

from etl import tables
from etl.jobs.curate import curate
from etl.pipeline.checks import check_sources

pytestmark = pytest.mark.slow


def _img(i):
    return jpeg_bytes(size=(80 + i, 70), color=(10 * i % 255, 100, 200))


def _build(root, server):
    folder = root / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jpg").write_bytes(_img(1))
    (folder / "a.txt").write_text("folder a")
    (folder / "sub" / "b.png").write_bytes(png_bytes(size=(90, 90)))
    (folder / "sub" / "b.json").write_text(json.dumps({"caption": "folder b", "nsfw": "UNLIKELY",
                                                         "aesthetic": 6.1}))
    (root / "shards").mkdir()
    write_tar(root / "shards" / "000.tar", [("k1.jpg", _img(2)), ("k1.txt", b"tar one"),
                                       ("k2.png", png_bytes(size=(70, 80))),
                                       ("k2.json", b'{"caption": "tar two", "q": 0.3}')])
    server.files.update({"u1.jpg": _img(3), "u2.jpg": _img(4)})
    (root / "urls.jsonl").write_text(
        "".join(json.dumps({"id": k, "url": f"{server.url}/img/{k}.jpg", "text": f"url {k}",
                            "punsafe": 0.01}) + "\n" for k in ("u1", "u2")))
    pq.write_table(pa.table({"id": ["p1", "p2"], "jpg": [_img(5), _img(6)],
                             "alt": ["parquet 1", "parquet 2"]}), root / "emb.parquet")
    lance.write_dataset(pa.table({"key": ["l1", "l2"], "img": [_img(7), _img(8)],
                                  "cap": ["lance 1", "lance 2"]}), str(root / "t.lance"))


def _sources(root):
    return [
        {"name": "folder", "kind": "image_folder", "path": str(root / "folder"),
         "columns": {"nsfw": "nsfw", "quality": "aesthetic"}},
        {"name": "tars", "kind": "webdataset", "path": str(root / "shards" / "{000..002}.tar")},
        {"name": "urls", "kind": "table", "path": str(root / "urls.jsonl"),
         "columns": {"key": "id", "url": "url", "caption": "text", "nsfw": "punsafe"}},
        {"name": "emb", "kind": "table", "path": str(root / "emb.parquet"),
         "columns": {"key": "id", "image": "jpg", "caption": "alt"}},
        {"name": "dl", "kind": "delta", "path": str(root / "dl"),
         "columns": {"key": "key", "image": "img", "caption": "cap"}},
        {"name": "ln", "kind": "lance", "path": str(root / "t.lance"),
         "columns": {"key": "key", "image": "img", "caption": "cap"}},
    ]


def _curate(spark, cfg, run_id):
    check_sources(cfg)
    return {c.source: c for c in curate(spark, cfg, run_id).counts}


def test_every_kind_into_one_manifest_then_incremental(spark, tmp_path, monkeypatch):
    with Server() as server:
        _build(tmp_path, server)
        spark.createDataFrame([("d1", _img(9), "delta 1"), ("d2", _img(10), "delta 2")],
                              "key string, img binary, cap string") \
            .write.format("delta").save(str(tmp_path / "dl"))
        cfg = make_config(tmp_path / "out", sources=_sources(tmp_path),
                          fetch={"retries": 0, "timeout_s": 5,
                                 "allow_networks": ["127.0.0.1/32"]})  # the loopback server

        counts = _curate(spark, cfg, "r1")
        for name in ("folder", "tars", "urls", "emb", "dl", "ln"):
            c = counts[name]
            assert (c.seen, c.accepted, c.rejected, c.unchanged) == (2, 2, 0, 0), c
        manifest = spark.read.format("delta").load(tables.layout(cfg).manifest)
        assert manifest.count() == 12
        assert {r.status for r in manifest.collect()} == {"accepted"}
        curated = lance.dataset(tables.layout(cfg).curated)
        rows = {r["source_key"]: r for r in curated.to_table(
            columns=["source", "source_key", "caption_original", "upstream_nsfw",
                     "upstream_quality", "metadata_json"]).to_pylist()}
        assert len(rows) == 12
        expected_captions = {"a.jpg": "folder a", "sub/b.png": "folder b", "k1": "tar one",
                             "k2": "tar two", "u1": "url u1", "u2": "url u2",
                             "p1": "parquet 1", "p2": "parquet 2", "d1": "delta 1",
                             "d2": "delta 2", "l1": "lance 1", "l2": "lance 2"}
        assert {k: r["caption_original"] for k, r in rows.items()} == expected_captions
        assert (rows["sub/b.png"]["upstream_nsfw"], rows["sub/b.png"]["upstream_quality"]) == (
            "UNLIKELY", 6.1)
        assert rows["u1"]["upstream_nsfw"] == "0.01"
        assert json.loads(rows["k2"]["metadata_json"])["q"] == 0.3
        version = curated.version
        old_fragments = {f.fragment_id for f in curated.get_fragments()}
        hits = dict(server.hits)

        # Second run, nothing changed: no record processed, no fetch, no new version --
        # and neither the fetch nor the prepare step is built (no job, no Python worker).
        import etl.jobs.curate as curate_job
        import etl.lakehouse.source_diff as source_diff

        def not_on_a_no_op(*_a, **_k):
            raise AssertionError("a night with nothing new fetched or prepared")

        # The first run left what a quiet night needs: the sources are not even listed
        # into Spark, nothing is compared with the manifest.
        with monkeypatch.context() as m:
            for step in ("fetch_and_prepare", "prepared_outcomes"):
                m.setattr(curate_job, step, not_on_a_no_op)
            for step in ("list_sources", "mark_unchanged"):
                m.setattr(source_diff, step, not_on_a_no_op)
            quiet = _curate(spark, cfg, "r2")
        for c in quiet.values():
            assert (c.seen, c.accepted, c.rejected, c.unchanged) == (0, 0, 0, 2), c
        assert server.hits == hits
        assert lance.dataset(tables.layout(cfg).curated).version == version
        # Without it (derived state is never the truth), the full comparison finds the
        # same: every count, and how each source was looked at for removals.
        (tmp_path / "out" / "_lakeshard" / "curate_quiet.json").unlink()
        with monkeypatch.context() as m:
            m.setattr(curate_job, "fetch_and_prepare", not_on_a_no_op)
            m.setattr(curate_job, "prepared_outcomes", not_on_a_no_op)
            counts = _curate(spark, cfg, "r2b")
        assert counts == quiet
        assert {c.removal_scan for c in counts.values()} == {"listing", "change data feed",
                                                             "version diff"}

        # Three new records: a folder image, a URL row, a new tar shard with one key.
        (tmp_path / "folder" / "c.jpg").write_bytes(_img(11))
        server.files["u3.jpg"] = _img(12)
        with open(tmp_path / "urls.jsonl", "a") as f:
            f.write(json.dumps({"id": "u3", "url": f"{server.url}/img/u3.jpg",
                                "text": "url u3"}) + "\n")
        write_tar(tmp_path / "shards" / "001.tar", [("k3.jpg", _img(13)), ("k3.txt", b"tar three")])
        counts = _curate(spark, cfg, "r3")
        assert {n: (c.seen, c.accepted) for n, c in counts.items()} == {
            "folder": (1, 1), "tars": (1, 1), "urls": (1, 1), "emb": (0, 0), "dl": (0, 0),
            "ln": (0, 0)}
        assert counts["folder"].unchanged == 2 and counts["tars"].unchanged == 2
        assert server.hits.get("/img/u1.jpg") == 1  # old URLs not fetched again
        curated = lance.dataset(tables.layout(cfg).curated)
        # One append (plus one version per scalar index extended to the new fragment).
        assert curated.count_rows() == 15 and curated.version > version
        new = [f for f in curated.get_fragments() if f.fragment_id not in old_fragments]
        assert sum(f.count_rows() for f in new) == 3  # the old fragments were not rewritten
        assert spark.read.format("delta").load(tables.layout(cfg).manifest).count() == 15

        acc = spark.read.format("delta").load(tables.layout(cfg).accounting)
        by_run = {(r.run_id, r.status): r.n for r in acc.groupBy("run_id", "status")
                  .agg({"count": "sum"}).withColumnRenamed("sum(count)", "n").collect()}
        assert by_run == {("r1", "accepted"): 12, ("r2", "unchanged"): 12,
                          ("r2b", "unchanged"): 12,
                          ("r3", "accepted"): 3, ("r3", "unchanged"): 12}


def test_a_retried_record_keeps_the_next_night_from_being_quiet(spark, tmp_path):
    """A record the next run tries again (here an HTTP 500) is fetched again every night:
    the run that failed it leaves no quiet-night document to skip it with."""
    with Server() as server:
        server.files["ok.jpg"] = _img(1)
        (tmp_path / "urls.jsonl").write_text("".join(
            json.dumps({"id": k, "url": f"{server.url}{p}"}) + "\n"
            for k, p in (("ok", "/img/ok.jpg"), ("bad", "/500"))))
        cfg = make_config(tmp_path / "out", sources=[
            {"name": "urls", "kind": "table", "path": str(tmp_path / "urls.jsonl"),
             "columns": {"key": "id", "url": "url"}}],
            fetch={"retries": 0, "timeout_s": 5, "allow_networks": ["127.0.0.1/32"]})
        first = _curate(spark, cfg, "t1")["urls"]
        assert (first.accepted, first.rejected, first.reasons) == (1, 1, {"http_500": 1})
        again = _curate(spark, cfg, "t2")["urls"]
        assert (again.seen, again.unchanged, again.reasons) == (1, 1, {"http_500": 1})
        assert server.hits["/500"] == 2 and server.hits["/img/ok.jpg"] == 1
        doc = tmp_path / "out" / "_lakeshard" / "curate_quiet.json"
        assert not doc.exists() or json.loads(doc.read_text())["key"] is None
