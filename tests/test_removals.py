"""Records that leave their source: the decisions on frames of a few rows, the purge of
removed rows' bytes on a real Lance table, and one nightly sequence end to end (a file
deleted from a folder, a tar shard gone and another rewritten, a row gone from a Delta
table with a change data feed and from a parquet file, an append-only source kept)."""

from __future__ import annotations

import io
import json
import os
from datetime import datetime, timedelta

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import files_holding, make_config, write_tar

from etl import tables
from etl.jobs.curate import CurateResult
from etl.jobs.export import ExportRun
from etl.schema import MANIFEST_SCHEMA, SOURCE_SCHEMA, sample_id_of

NOW = datetime(2026, 11, 30, 12, 0, 0)


# ------------------------------------------------------------------ frames of a few rows


def _listed(spark, rows):
    """Source-schema rows from (source, key, source_uri, fingerprint)."""
    names = SOURCE_SCHEMA.fieldNames()
    out = []
    for source, key, uri, fp in rows:
        r = dict.fromkeys(names)
        r.update(sample_id=sample_id_of(source, key), source=source, source_key=key,
                 source_uri=uri, fingerprint=fp, read_status="ok", image_ref=uri)
        out.append(tuple(r[n] for n in names))
    return spark.createDataFrame(out, SOURCE_SCHEMA)


def _manifest(spark, rows):
    """Manifest rows from (source, key, source_uri, fingerprint, status, reason)."""
    names = MANIFEST_SCHEMA.fieldNames()
    out = []
    for source, key, uri, fp, status, reason in rows:
        r = dict.fromkeys(names)
        r.update(sample_id=sample_id_of(source, key), source=source, source_key=key,
                 source_uri=uri, fingerprint=fp, status=status, reason=reason,
                 run_id="r0", ingested_at=NOW)
        out.append(tuple(r[n] for n in names))
    return spark.createDataFrame(out, MANIFEST_SCHEMA)


def test_removed_records_are_what_the_listing_lost_minus_unopened_containers(spark):
    from etl.transforms.bronze import removed_records

    manifest = _manifest(spark, [
        ("f", "a.jpg", "file:/f/a.jpg", "1", "accepted", None),
        ("f", "b.jpg", "file:/f/b.jpg", "1", "accepted", None),  # deleted
        ("f", "bad.jpg", "file:/f/bad.jpg", "1", "rejected", "undecodable"),  # deleted
        ("f", "old.jpg", "file:/f/old.jpg", "1", "removed", "source_removed"),  # long gone
        ("t", "k1", "file:/t/0.tar", "9", "accepted", None),  # shard 0 not opened
        ("t", "k2", "file:/t/1.tar", "9", "accepted", None),  # shard 1 gone
        ("t", "k3", "file:/t/2.tar", "9", "accepted", None),  # shard 2 rewritten without k3
        ("t", "k4", "file:/t/2.tar", "9", "accepted", None),
        ("k", "x", "file:/k.jpg", "1", "accepted", None),  # source not checked
    ])
    listed = _listed(spark, [
        ("f", "a.jpg", "file:/f/a.jpg", "1"),
        ("t", "k4", "file:/t/2.tar", "10"),
        ("t", "k5", "file:/t/2.tar", "10"),  # new
    ])
    got = removed_records(manifest, listed, sources=["f", "t"],
                          skipped={"t": frozenset({"file:/t/0.tar"})}).collect()
    assert sorted((r.source, r.status, r.sample_id) for r in got) == sorted([
        ("f", "accepted", sample_id_of("f", "b.jpg")),
        ("f", "rejected", sample_id_of("f", "bad.jpg")),
        ("t", "accepted", sample_id_of("t", "k2")),
        ("t", "accepted", sample_id_of("t", "k3")),
    ])
    # A change history narrows the check to its candidates, still against the listing
    # (a key deleted and written again is there).
    cands = spark.createDataFrame([(sample_id_of("t", "k3"),), (sample_id_of("t", "k4"),)],
                                  "sample_id string")
    got = removed_records(manifest, listed, sources=["t"], candidates=cands).collect()
    assert [r.sample_id for r in got] == [sample_id_of("t", "k3")]
    assert removed_records(manifest, listed, sources=[]).count() == 0


def test_a_removed_record_that_comes_back_is_new_a_taken_down_one_stays_known(spark):
    from etl.transforms.bronze import mark_unchanged

    manifest = _manifest(spark, [
        ("f", "back.jpg", "file:/f/back.jpg", "1", "removed", "source_removed"),
        ("f", "td.jpg", "file:/f/td.jpg", "1", "removed", "taken_down"),
        ("f", "td2.jpg", "file:/f/td2.jpg", "1", "removed", "taken_down"),
    ])
    listed = _listed(spark, [
        ("f", "back.jpg", "file:/f/back.jpg", "1"),
        ("f", "td.jpg", "file:/f/td.jpg", "1"),
        ("f", "td2.jpg", "file:/f/td2.jpg", "2"),  # changed: processed (and refused)
    ])
    got = {r.source_key: r.unchanged for r in mark_unchanged(listed, manifest).collect()}
    assert got == {"back.jpg": False, "td.jpg": True, "td2.jpg": False}


def test_takedowns_refuse_by_key_url_and_both_image_hashes(spark):
    from pyspark.sql import functions as F

    from etl.transforms.bronze import refuse_prepared, refuse_taken_down, takedown_identifiers

    takedowns = spark.createDataFrame(
        [("R1", "key", "f:k1.jpg", sample_id_of("f", "k1.jpg")),
         ("R2", "url", "https://x.test/a.jpg", None),
         ("R3", "image_sha256", "ab" * 32, None),
         ("R3", "sample_id", sample_id_of("f", "m.jpg"), sample_id_of("f", "m.jpg")),
         ("R4", "image_sha256", "cd" * 32, None)],
        "request_id string, kind string, value string, sample_id string")
    ids = takedown_identifiers(takedowns)
    assert {(r.kind, r.value) for r in ids.collect()} == {
        ("sample_id", sample_id_of("f", "k1.jpg")), ("url", "https://x.test/a.jpg"),
        ("image_sha256", "ab" * 32), ("image_sha256", "cd" * 32),
        ("sample_id", sample_id_of("f", "m.jpg"))}

    listed = _listed(spark, [
        ("f", "k1.jpg", "file:/f/k1.jpg", "1"),  # by key
        ("u", "u1", "https://x.test/a.jpg", None),  # by URL
        ("t", "k9", "https://x.test/a.jpg", "1"),  # a tar member at that URI: not by URL
        ("f", "same.jpg", "file:/f/same.jpg", "1"),  # by source bytes' hash
        ("f", "ok.jpg", "file:/f/ok.jpg", "1"),
    ]).withColumn("image_offset", F.when(F.col("source") == "t", F.lit(512).cast("long")))
    before = {r.source_key: (r.read_status, r.read_reason, r.takedown_detail)
              for r in refuse_taken_down(listed, ids).collect()}
    assert before["k1.jpg"] == ("rejected", "taken_down", "takedown R1: same sample id")
    assert before["u1"] == ("rejected", "taken_down", "takedown R2: same url")
    assert before["k9"][0] == before["same.jpg"][0] == before["ok.jpg"][0] == "ok"

    fetched = listed.withColumn(
        "original_sha256", F.when(F.col("source_key") == "same.jpg", F.lit("ab" * 32)))
    after = {r.source_key: (r.read_status, r.read_reason)
             for r in refuse_taken_down(fetched, ids, by_hash=True).collect()}
    assert after["same.jpg"] == ("rejected", "taken_down") and after["ok.jpg"][0] == "ok"

    prepared = spark.createDataFrame(
        [("p1", "ok", "prepare", None, None, "cd" * 32), ("p2", "ok", "prepare", None, None, "ef"),
         ("p3", "rejected", "prepare", "undecodable", "x", "cd" * 32)],
        "sample_id string, status string, stage string, reason string, detail string, "
        "sha string",
    ).withColumn("prepared", F.struct(F.col("sha").alias("image_sha256"))).drop("sha")
    got = {r.sample_id: (r.status, r.reason, r.detail)
           for r in refuse_prepared(prepared, ids).collect()}
    assert got == {"p1": ("rejected", "taken_down", "takedown R4: same image sha256"),
                   "p2": ("ok", None, None), "p3": ("rejected", "undecodable", "x")}


def test_a_takedown_matches_every_copy_and_collects_every_identifier(spark):
    from etl.transforms.bronze import match_takedowns, matched_identifiers

    names = MANIFEST_SCHEMA.fieldNames()

    def row(source, key, image_ref, offset, orig, status="accepted"):
        r = dict.fromkeys(names)
        r.update(sample_id=sample_id_of(source, key), source=source, source_key=key,
                 source_uri=image_ref, image_ref=image_ref, image_offset=offset,
                 original_sha256=orig, status=status, run_id="r0", ingested_at=NOW)
        return tuple(r[n] for n in names)

    manifest = spark.createDataFrame([
        row("u", "u1", "https://x.test/a.jpg", None, "11" * 32),
        row("f", "a.jpg", "file:/f/a.jpg", None, "22" * 32),
        row("f", "copy.jpg", "file:/f/copy.jpg", None, "22" * 32),  # same file bytes
        row("t", "k1", "file:/t/0.tar", 512, "33" * 32),
        row("f", "gone.jpg", "file:/f/gone.jpg", None, "44" * 32, status="removed"),
    ], MANIFEST_SCHEMA)
    curated = spark.createDataFrame([
        (sample_id_of("u", "u1"), "u", "aa" * 32),
        (sample_id_of("f", "a.jpg"), "f", "bb" * 32),
        (sample_id_of("f", "copy.jpg"), "f", "bb" * 32),
        (sample_id_of("t", "k1"), "t", "bb" * 32),  # the same picture re-encoded alike
    ], "sample_id string, source string, image_sha256 string")
    given = spark.createDataFrame(
        [("R", "url", "https://x.test/a.jpg"), ("R", "image_sha256", "bb" * 32),
         ("R", "image_sha256", "44" * 32)],
        "request_id string, kind string, value string")
    matches = match_takedowns(given, manifest, curated)
    assert sorted(r.sample_id for r in matches.collect()) == sorted(
        sample_id_of(s, k) for s, k in (("u", "u1"), ("f", "a.jpg"), ("f", "copy.jpg"),
                                        ("t", "k1"), ("f", "gone.jpg")))
    found = matched_identifiers(matches, manifest, curated).collect()

    def ident(source, key):
        return {(r.kind, r.value) for r in found if r.sample_id == sample_id_of(source, key)}

    # A tar member has no URL of its own: only its id and hashes are recorded.
    assert ident("t", "k1") == {("sample_id", sample_id_of("t", "k1")),
                                ("image_sha256", "33" * 32), ("image_sha256", "bb" * 32)}
    assert ident("u", "u1") == {("sample_id", sample_id_of("u", "u1")),
                                ("url", "https://x.test/a.jpg"), ("image_sha256", "11" * 32),
                                ("image_sha256", "aa" * 32)}


def test_accounting_counts_removals_per_source_and_table_left(spark):
    from etl.transforms.accounting import accounting_rows, removal_counts, source_counts

    removed = spark.createDataFrame(
        [("1", "a", "accepted", "source_removed"), ("2", "a", "rejected", "source_removed"),
         ("3", "a", "accepted", "taken_down"), ("4", "b", "accepted", "source_removed")],
        "sample_id string, source string, status string, reason string")
    counts = [r.asDict() for r in removal_counts(removed).collect()]
    outcome = spark.createDataFrame(
        [("a", "prepare", "ok", None, None, 2)],
        "source string, stage string, status string, reason string, filter_reason string, "
        "count long")
    by_source = {c.source: c for c in source_counts(outcome.collect(), ["a", "b"], {},
                                                    counts, {"a": "listing"})}
    assert by_source["a"].removed == {"source_removed": 2, "taken_down": 1}
    assert (by_source["a"].seen, by_source["a"].removal_scan) == (2, "listing")
    assert by_source["b"].removed == {"source_removed": 1}
    rows = accounting_rows(outcome.collect(), {}, run_id="r", run_at=NOW, removed=counts)
    got = {(r["source"], r["status"], r["stage"], r["reason"]): r["count"]
           for r in rows.to_pylist()}
    assert got == {("a", "accepted", None, None): 2,
                   ("a", "removed", "curated", "source_removed"): 1,
                   ("a", "removed", "rejects", "source_removed"): 1,
                   ("a", "removed", "curated", "taken_down"): 1,
                   ("b", "removed", "curated", "source_removed"): 1}


def test_delta_and_lance_histories_name_the_deleted_keys(spark, tmp_path):
    from etl.config import SourceConfig
    from etl.sources import adapter_for

    def keys(found):
        return found[1], sorted(r.source_key for r in found[0].collect())

    cols = {"key": "meta.id", "image": "img"}  # a key inside a struct, not a string
    delta = str(tmp_path / "plain_delta")  # no change data feed: the versions compared
    spark.createDataFrame([((1,), b"a"), ((2,), b"b"), ((3,), b"c")],
                          "meta struct<id:int>, img binary").write.format("delta").save(delta)
    spark.sql(f"DELETE FROM delta.`{delta}` WHERE meta.id = 2")
    spark.createDataFrame([((4,), b"d")], "meta struct<id:int>, img binary") \
        .write.format("delta").mode("append").save(delta)
    src = SourceConfig(name="d", kind="delta", path=delta, columns=cols)
    adapter = adapter_for("delta")
    assert adapter.snapshot_version(spark, src) == 2
    assert keys(adapter.deleted_keys(spark, src, 0, 2)) == ("version diff", ["2"])
    assert keys(adapter.deleted_keys(spark, src, 1, 2)) == ("version diff", [])

    path = str(tmp_path / "t.lance")
    lance.write_dataset(pa.table({"meta": [{"id": 1}, {"id": 2}], "img": [b"a", b"b"]}), path)
    lance.write_dataset(pa.table({"meta": [{"id": 3}], "img": [b"c"]}), path, mode="append")
    lance.dataset(path).create_scalar_index("img", "BTREE")
    src = SourceConfig(name="l", kind="lance", path=path, columns=cols)
    adapter = adapter_for("lance")
    # Appends and an index: the transaction log alone says nothing was deleted.
    assert keys(adapter.deleted_keys(spark, src, 1, 3)) == ("version diff", [])
    lance.dataset(path).delete("meta.id = 1")
    now = adapter.snapshot_version(spark, src)
    assert keys(adapter.deleted_keys(spark, src, 1, now)) == ("version diff", ["1"])
    lance.dataset(path).cleanup_old_versions(versions=[1])
    assert adapter.deleted_keys(spark, src, 1, now) is None  # history gone: full diff


def test_on_removed_is_delete_or_keep(tmp_path):
    from etl.errors import ConfigError

    src = {"name": "s", "kind": "image_folder", "path": str(tmp_path)}
    assert make_config(tmp_path, sources=[src]).sources[0].on_removed == "delete"
    assert make_config(tmp_path, sources=[{**src, "on_removed": "keep"}]) \
        .sources[0].on_removed == "keep"
    with pytest.raises((ConfigError, ValueError), match="on_removed"):
        make_config(tmp_path, sources=[{**src, "on_removed": "archive"}])
    cfg = make_config(tmp_path, lakehouse={"takedown_retention_hours": 24,
                                           "removal_retention_hours": None})
    assert cfg.lakehouse.takedown_retention_hours == 24
    assert cfg.lakehouse.removal_retention_hours is None


# ------------------------------------------------------------- bytes really gone (Lance)


def _blob(i: int) -> bytes:
    return (f"<image {i:03d}>".encode() * 200) + os.urandom(64)


def _table(path, n_fragments=3, per=4):
    for i in range(n_fragments):
        ids = [f"s{i * per + j:03d}" for j in range(per)]
        lance.write_dataset(
            pa.table({"sample_id": ids, "image": [_blob(i * per + j) for j in range(per)]}),
            path, mode="append" if i else "create")
    lance.dataset(path).create_scalar_index("sample_id", "BTREE")


def test_purge_rewrites_only_the_fragments_that_held_the_rows_and_deletes_old_versions(
        tmp_path):
    from etl.lakehouse.maintenance import purge_removed
    from etl.writers.lance import delete_rows, deleted_per_fragment

    path = str(tmp_path / "t.lance")
    _table(path)
    secret = lance.dataset(path).to_table(filter="sample_id = 's005'")["image"][0].as_py()
    assert files_holding(path, secret)  # the search finds the bytes while they are there
    old_version = lance.dataset(path).version
    untouched = {f.fragment_id: [d.path for d in f.metadata.files]
                 for f in lance.dataset(path).get_fragments()}

    before = deleted_per_fragment(path)
    assert delete_rows(path, ["s005"]) == 1
    after = deleted_per_fragment(path)
    touched = [f for f, n in before.items() if after.get(f) != n]
    assert touched == [1]
    assert files_holding(path, secret)  # a deletion file alone leaves the bytes

    res = purge_removed(path, touched, target_rows=1 << 20, retention_hours=0)
    assert res.done and res.fragments_rewritten == 1 and res.versions_removed > 0
    assert files_holding(path, secret) == []
    ds = lance.dataset(path)
    assert ds.count_rows() == 11 and ds.count_rows(filter="sample_id = 's005'") == 0
    assert ds.count_rows(filter="sample_id = 's004'") == 1  # neighbours copied
    # The other fragments were not rewritten.
    now = {f.fragment_id: [d.path for d in f.metadata.files] for f in ds.get_fragments()}
    assert now[0] == untouched[0] and now[2] == untouched[2]
    with pytest.raises((ValueError, OSError)):
        lance.dataset(path, version=old_version)


def test_with_a_retention_the_old_versions_go_when_it_has_passed(tmp_path):
    from etl.lakehouse.maintenance import pending_purges, purge_removed, run_due_purges
    from etl.writers.lance import delete_rows

    path = str(tmp_path / "t.lance")
    _table(path)
    ds = lance.dataset(path)
    ds.tags.create("before-takedown", ds.version)
    secret = ds.to_table(filter="sample_id = 's001'")["image"][0].as_py()
    old_version = ds.version
    delete_rows(path, ["s001"])
    t0 = datetime(2026, 11, 30, 12, 0)
    res = purge_removed(path, [0], target_rows=1 << 20, retention_hours=24, now=t0)
    assert not res.done and res.due == t0 + timedelta(hours=24)
    assert pending_purges(path) == {res.version: res.due}
    # Time travel still works inside the retention, and the old files still hold it...
    assert lance.dataset(path, version=old_version).count_rows(
        filter="sample_id = 's001'") == 1
    assert files_holding(path, secret)
    # ... but not the current version's files.
    current = {d.path for f in lance.dataset(path).get_fragments() for d in f.metadata.files}
    assert not any(p.endswith(tuple(current)) for p in files_holding(path, secret))

    assert run_due_purges(path, t0 + timedelta(hours=23)) == (0, 0, ())
    removed, _, tags = run_due_purges(path, t0 + timedelta(hours=25))
    assert removed > 0 and tags == ("before-takedown",)
    assert files_holding(path, secret) == [] and pending_purges(path) == {}
    with pytest.raises((ValueError, OSError)):
        lance.dataset(path, version=old_version)


# ------------------------------------------------------------------------ end to end


def _img(i):
    """A small JPEG of seeded noise: every i its own picture (and dHash)."""
    import random

    from PIL import Image

    rng = random.Random(i)
    w, h = 72 + 4 * i, 64
    im = Image.frombytes("RGB", (w, h), bytes(rng.randrange(256) for _ in range(w * h * 3)))
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.mark.slow
def test_records_that_leave_their_sources_leave_every_table_and_the_next_export(
        spark, tmp_path):
    from pyspark.sql import functions as F

    from etl.jobs.verify_export import verify_export
    from etl.pipeline.runner import run_pipeline
    from etl.pipeline.summary import format_outcome

    inp = tmp_path / "in"
    (inp / "photos").mkdir(parents=True)
    for i in range(4):
        (inp / "photos" / f"p{i}.jpg").write_bytes(_img(i))
    # An exact duplicate of p0 in the archive: one cluster, p0 canonical (earliest).
    (inp / "archive").mkdir()
    for i in (0, 5):
        (inp / "archive" / f"a{i}.jpg").write_bytes(_img(i))
    (inp / "shards").mkdir()
    write_tar(inp / "shards" / "0.tar", [("k1.jpg", _img(6)), ("k2.jpg", _img(7))])
    write_tar(inp / "shards" / "1.tar", [("k3.jpg", _img(8))])
    write_tar(inp / "shards" / "2.tar", [("k4.jpg", _img(9))])
    pq.write_table(pa.table({"id": ["q1", "q2", "q3"], "jpg": [_img(10), _img(11), _img(12)]}),
                   inp / "rows.parquet")
    dl = str(inp / "dl")
    spark.createDataFrame([("d1", _img(13)), ("d2", _img(14)), ("d3", _img(15))],
                          "key string, img binary").write.format("delta") \
        .option("delta.enableChangeDataFeed", "true").save(dl)
    table = {"key": "id", "image": "jpg"}
    cfg = make_config(
        tmp_path / "root",
        sources=[
            {"name": "photos", "kind": "image_folder", "path": str(inp / "photos")},
            {"name": "archive", "kind": "image_folder", "path": str(inp / "archive"),
             "on_removed": "keep"},
            {"name": "tars", "kind": "webdataset", "path": str(inp / "shards" / "*.tar")},
            {"name": "rows", "kind": "table", "path": str(inp / "rows.parquet"),
             "columns": table},
            {"name": "dl", "kind": "delta", "path": dl,
             "columns": {"key": "key", "image": "img"}},
        ],
        exports={"train": {"partitions": 2, "where": None}},
        dedup={"source_priority": ["photos", "archive"],
               "policy": ["source_priority", "earliest"]},
        lakehouse={"removal_retention_hours": 0},
        run={"report": False},
    )
    paths = tables.layout(cfg)
    first = run_pipeline(cfg, only=("curate", "dedup", "export"))
    assert first.detail("curate", CurateResult).curated_rows == 16
    dedup = {r.sample_id: r for r in spark.read.format("delta").load(paths.dedup).collect()}
    p0, a0 = sample_id_of("photos", "p0.jpg"), sample_id_of("archive", "a0.jpg")
    assert dedup[p0].is_canonical and not dedup[a0].is_canonical
    assert first.detail("export", ExportRun).exports[0].samples == 15  # a0 is p0's duplicate
    secret = lance.dataset(paths.curated).to_table(
        filter=f"sample_id = '{sample_id_of('photos', 'p1.jpg')}'")["image"][0].as_py()
    old_version = lance.dataset(paths.curated).version

    # Between the runs: files and rows disappear from every kind of source.
    for name in ("p0.jpg", "p1.jpg"):
        (inp / "photos" / name).unlink()
    (inp / "archive" / "a5.jpg").unlink()  # on_removed: keep
    (inp / "shards" / "1.tar").unlink()  # a shard gone
    write_tar(inp / "shards" / "0.tar", [("k1.jpg", _img(6))])  # a shard rewritten without k2
    pq.write_table(pa.table({"id": ["q1", "q3"], "jpg": [_img(10), _img(12)]}),
                   inp / "rows.parquet")
    spark.sql(f"DELETE FROM delta.`{dl}` WHERE key = 'd2'")

    second = run_pipeline(cfg, only=("curate", "dedup", "export"))
    cur = second.detail("curate", CurateResult)
    by = {c.source: c for c in cur.counts}
    assert {n: c.removed for n, c in by.items()} == {
        "photos": {"source_removed": 2}, "archive": {}, "tars": {"source_removed": 2},
        "rows": {"source_removed": 1}, "dl": {"source_removed": 1}}
    assert {n: c.removal_scan for n, c in by.items()} == {
        "photos": "listing", "archive": "kept", "tars": "listing", "rows": "listing",
        "dl": "change data feed"}
    # 2.tar not opened (k4 unchanged); the rewritten 0.tar's k1 is processed again.
    assert (by["tars"].unchanged, by["tars"].seen, by["tars"].accepted) == (1, 1, 1)
    gone = {sample_id_of(s, k) for s, k in (("photos", "p0.jpg"), ("photos", "p1.jpg"),
                                            ("tars", "k2"), ("tars", "k3"), ("rows", "q2"),
                                            ("dl", "d2"))}
    assert cur.curated_rows == 16 - 6

    # Every table: curated rows deleted, manifest rows marked, dedup re-elected.
    ds = lance.dataset(paths.curated)
    left = set(ds.to_table(columns=["sample_id"])["sample_id"].to_pylist())
    assert not left & gone and sample_id_of("archive", "a5.jpg") in left
    manifest = {r.sample_id: r for r in spark.read.format("delta").load(paths.manifest)
                .collect()}
    assert {s for s, r in manifest.items() if r.status == "removed"} == gone
    assert {(r.stage, r.reason, r.run_id) for s, r in manifest.items() if s in gone} == {
        ("curated", "source_removed", second.run_id)}
    dedup = {r.sample_id: r for r in spark.read.format("delta").load(paths.dedup).collect()}
    assert not set(dedup) & gone and dedup[a0].is_canonical  # the copy left is canonical
    acc = spark.read.format("delta").load(paths.accounting).where(
        (F.col("run_id") == second.run_id) & (F.col("status") == "removed"))
    assert {(r.source, r.stage, r.reason): r["count"] for r in acc.collect()} == {
        ("photos", "curated", "source_removed"): 2, ("tars", "curated", "source_removed"): 2,
        ("rows", "curated", "source_removed"): 1, ("dl", "curated", "source_removed"): 1}
    text = format_outcome(second)
    assert "removed" in text.splitlines()[2] and "source_removed=2" in text

    # Bytes: the fragments that held them rewritten, the versions before deleted
    # (removal_retention_hours: 0), time travel to them refused.
    assert cur.purge is not None and cur.purge.done
    assert files_holding(paths.curated, secret) == []
    with pytest.raises((ValueError, OSError)):
        lance.dataset(paths.curated, version=old_version)

    # The export after: rebuilt without them (a0 now exported as canonical), manifest
    # counts them, verify-export agrees with the table.
    (exp,) = second.detail("export", ExportRun).exports
    assert exp.samples == 10 and exp.resumed_partitions == 0
    out = json.loads(open(os.path.join(exp.path, "manifest.json")).read())
    assert out["removals"]["removed"] == 6
    assert out["removals"]["by_reason"] == {"source_removed": 6}
    report = verify_export(exp.path, loader_workers=0, loader_samples=4, taken_down=frozenset())
    assert report.ok, report.problems

    # A third run with nothing changed removes nothing and leaves the export as it is.
    third = run_pipeline(cfg, only=("curate", "export"))
    assert all(not c.removed for c in third.detail("curate", CurateResult).counts)
    assert third.detail("export", ExportRun).exports[0].resumed_partitions == 2
    third_counts = third.detail("curate", CurateResult).counts
    assert {c.source: c.removal_scan for c in third_counts}["dl"] == \
        "change data feed"
