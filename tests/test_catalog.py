"""Each table object's driver path and Spark path give the same table on the same data:
the curated rows a rewrite replaces, the manifest rows a run records, the manifest's
accepted count. Expectations are computed here from the rows written, not by the code
under test."""

from __future__ import annotations

import shutil
from datetime import datetime

import lance
import pyarrow as pa
import pytest
from conftest import make_config

from etl.lakehouse import catalog as catalog_mod
from etl.lakehouse.catalog import Catalog
from etl.schema import MANIFEST_SCHEMA

pytestmark = pytest.mark.slow

NOW = datetime(2026, 1, 2, 3, 4, 5)


def _manifest_row(i: int, status: str = "accepted", run_id: str = "r1") -> dict:
    row = {f.name: None for f in MANIFEST_SCHEMA.fields}
    row.update(sample_id=f"s{i:03d}", source="src", source_key=f"k{i}", status=status,
               run_id=run_id, ingested_at=NOW, fingerprint=f"fp{i}",
               reason=None if status == "accepted" else "undecodable")
    return row


def _catalog(spark, root, ids: int | None = None):
    """The catalog of a root; `ids`: its driver/Spark bound (``driver.ids``; 0: every
    batch takes the Spark path)."""
    driver = {} if ids is None else {"driver": {"ids": ids}}
    return Catalog.of(spark, make_config(root, **driver))


def _manifest(spark, cat, rows):
    spark.createDataFrame(rows, MANIFEST_SCHEMA).write.format("delta").save(
        cat.manifest.path)


def _table(spark, path):
    return sorted(tuple(r) for r in spark.read.format("delta").load(path).collect())


def test_curated_replace_driver_and_spark_paths_delete_the_same_rows(spark, tmp_path):
    held = [f"s{i:03d}" for i in range(40)]
    asked = held[::3] + ["absent-1", "absent-2"]  # some held, some not
    ids = spark.createDataFrame([(i,) for i in asked], "sample_id string")
    left = {}
    for name, bound in (("driver", 10_000), ("spark", 0)):
        cat = _catalog(spark, tmp_path / name, bound)
        lance.write_dataset(pa.table({"sample_id": held, "n": list(range(40))}),
                            cat.curated.path)
        deleted = cat.curated.replace(spark, ids, len(asked))
        assert deleted == len(held[::3]), name
        left[name] = sorted(lance.dataset(cat.curated.path).to_table()["sample_id"]
                            .to_pylist())
    assert left["driver"] == left["spark"] == sorted(set(held) - set(held[::3]))


@pytest.mark.parametrize("changed", [False, True], ids=["all-new", "some-changed"])
def test_manifest_merge_driver_append_and_spark_merge_leave_the_same_table(
        spark, tmp_path, changed):
    old = [_manifest_row(i) for i in range(5)]
    new = [_manifest_row(i, run_id="r2") for i in range(5, 9)]
    if changed:  # a record reprocessed: now rejected (a MERGE must update it)
        new.append(_manifest_row(2, status="rejected", run_id="r2"))
    tables = {}
    for name, bound in (("driver", 10_000), ("spark", 0)):
        cat = _catalog(spark, tmp_path / name, bound)
        _manifest(spark, cat, old)
        before = cat.manifest.snapshot()
        version = cat.manifest.version()
        cat.manifest.merge(spark.createDataFrame(new, MANIFEST_SCHEMA), count=len(new),
                           before=before)
        assert cat.manifest.version() == version + 1, name  # one commit either way
        from deltalake import DeltaTable

        last = DeltaTable(cat.manifest.path).history(1)[0]
        op = last["operation"]
        assert op == ("MERGE" if name == "spark" or changed else "WRITE"), (name, op)
        # The driver path commits with delta-rs (a MERGE too when a record is held).
        assert last.get("engineInfo", "").startswith("delta-rs") == (name == "driver")
        tables[name] = _table(spark, cat.manifest.path)
    expected = {r["sample_id"]: r for r in old} | {r["sample_id"]: r for r in new}
    want = sorted(tuple(r[f.name] for f in MANIFEST_SCHEMA.fields) for r in expected.values())
    assert tables["driver"] == tables["spark"] == want


def _reject_row(i: int, reason: str = "undecodable", detail: str | None = None,
                run_id: str = "r1") -> dict:
    return {"sample_id": f"s{i:03d}", "source": "src", "source_key": f"k{i}",
            "source_uri": f"file:/d/{i}.jpg", "stage": "prepare", "reason": reason,
            "detail": detail, "run_id": run_id}


@pytest.mark.parametrize("held", ["no-table", "others", "same-record"])
def test_rejects_merge_driver_append_and_spark_merge_leave_the_same_table(
        spark, tmp_path, held):
    """A first run's rejects, or a night's rejects of records the table holds none of,
    are one delta-rs append; a record the table already holds (a run that died after its
    rejects and before its manifest) takes the MERGE, which adds no second row."""
    from deltalake import DeltaTable

    from etl.schema import REJECTS_SCHEMA

    old = {"no-table": [], "others": [_reject_row(i) for i in range(3)],
           "same-record": [_reject_row(i) for i in range(3, 6)]}[held]
    new = [_reject_row(i, run_id="r2") for i in range(3, 6)] + [
        _reject_row(7, "duplicate_key", "copy 2 of key k7", "r2")]
    tables, ops = {}, {}
    for name, bound in (("driver", 10_000), ("spark", 0)):
        cat = _catalog(spark, tmp_path / name, bound)
        if old:
            spark.createDataFrame(old, REJECTS_SCHEMA).write.format("delta").save(
                cat.rejects.path)
        cat.rejects.merge(spark.createDataFrame(new, REJECTS_SCHEMA), count=len(new))
        last = DeltaTable(cat.rejects.path).history(1)[0]
        ops[name] = last["operation"], last.get("engineInfo", "")[:8]
        tables[name] = sorted(tuple(r) for r in spark.read.format("delta").load(
            cat.rejects.path).select(*REJECTS_SCHEMA.fieldNames()).collect())
    assert ops == {"driver": ("MERGE" if held == "same-record" else "WRITE", "delta-rs"),
                   "spark": ("MERGE", "Apache-S")}
    # Keyed by (sample_id, stage, reason, detail): a row already there is kept with the
    # run that first wrote it.
    keyed = {(r["sample_id"], r["stage"], r["reason"], r["detail"]): r for r in new}
    keyed |= {(r["sample_id"], r["stage"], r["reason"], r["detail"]): r for r in old}
    want = sorted(tuple(r[f] for f in REJECTS_SCHEMA.fieldNames()) for r in keyed.values())
    assert tables["driver"] == tables["spark"] == want


def test_a_first_write_creates_the_table_without_spark_with_its_schema(spark, tmp_path):
    """The table a first run's write creates (by delta-rs) is the one Spark would have:
    the schema's columns, types and nullability, read back by Spark."""
    from deltalake import DeltaTable

    from etl.schema import REJECTS_SCHEMA

    cat = _catalog(spark, tmp_path)
    cat.rejects.merge(spark.createDataFrame([], REJECTS_SCHEMA), count=0)
    assert [h["operation"] for h in DeltaTable(cat.rejects.path).history()] == [
        "CREATE TABLE"]  # created, and no empty commit after it
    got = spark.read.format("delta").load(cat.rejects.path).schema
    assert [(f.name, f.dataType, f.nullable) for f in got.fields] == [
        (f.name, f.dataType, f.nullable) for f in REJECTS_SCHEMA.fields]


def test_manifest_accepted_from_kept_counts_equals_a_spark_count(spark, tmp_path,
                                                                 monkeypatch):
    cat = _catalog(spark, tmp_path)
    _manifest(spark, cat, [_manifest_row(i, "accepted" if i % 3 else "rejected")
                           for i in range(30)])
    accepted = sum(1 for i in range(30) if i % 3)
    assert cat.manifest.accepted() == accepted  # the kept per-file counts
    monkeypatch.setattr(catalog_mod, "delta_counts", lambda *a, **k: None)
    assert cat.manifest.accepted() == accepted  # Spark's count, as for a table delta-rs
    # does not read


def test_removed_from_curated_from_kept_counts_equals_spark(spark, tmp_path, monkeypatch):
    """Without removals the kept counts answer alone (no Spark read of the manifest);
    with some, the same ids and counts by reason as Spark's own count."""
    cat = _catalog(spark, tmp_path)
    assert cat.manifest.removed_from_curated() == (None, {})  # no manifest yet
    _manifest(spark, cat, [_manifest_row(i) for i in range(6)])
    monkeypatch.setattr(type(cat.manifest), "read", lambda self: pytest.fail("read"))
    assert cat.manifest.removed_from_curated() == (None, {})
    monkeypatch.undo()

    rows = [_manifest_row(i) for i in range(6)]
    for i, reason in ((1, "takedown"), (2, "takedown"), (4, "source_removed")):
        rows[i].update(status="removed", stage="curated", reason=reason)
    rows[5].update(status="removed", stage="ingest", reason="takedown")  # never curated
    shutil.rmtree(cat.manifest.path)
    _manifest(spark, cat, rows)
    expected = {"takedown": 2, "source_removed": 1}
    gone, by_reason = cat.manifest.removed_from_curated()
    assert by_reason == expected
    assert sorted(r.sample_id for r in gone.collect()) == ["s001", "s002", "s004"]
    monkeypatch.setattr(catalog_mod, "delta_counts", lambda *a, **k: None)
    gone, by_reason = cat.manifest.removed_from_curated()  # counted by Spark
    assert by_reason == expected
    assert sorted(r.sample_id for r in gone.collect()) == ["s001", "s002", "s004"]


def test_takedowns_pending_and_purged(spark, tmp_path):
    from etl.schema import TAKEDOWNS_SCHEMA

    cat = _catalog(spark, tmp_path)
    assert cat.takedowns.pending() is None and cat.takedowns.identifiers() is None
    base = {f.name: None for f in TAKEDOWNS_SCHEMA.fields}
    rows = [{**base, "request_id": "q1", "kind": "key", "value": "k1", "origin": "request",
             "sample_id": "s001", "requested_at": NOW, "applied_at": NOW, "purge_version": 3,
             "run_id": "f1"},
            {**base, "request_id": "q2", "kind": "url", "value": "http://x/y.jpg",
             "origin": "request", "requested_at": NOW, "run_id": "f2"}]
    rows = [{k: v for k, v in r.items() if k in base} for r in rows]
    spark.createDataFrame(rows, TAKEDOWNS_SCHEMA).write.format("delta").save(
        cat.takedowns.path)
    assert [r.request_id for r in cat.takedowns.pending().collect()] == ["q2"]
    assert {(r.kind, r.value) for r in cat.takedowns.identifiers().collect()} == {
        ("sample_id", "s001"), ("url", "http://x/y.jpg")}
    cat.takedowns.mark_purged(5, NOW)
    purged = {r.request_id: r.purged_at for r in cat.takedowns.read().collect()}
    assert purged == {"q1": NOW, "q2": None}


def test_catalog_paths_are_the_layouts(tmp_path, spark):
    from etl import tables

    cfg = make_config(tmp_path)
    cat, paths = Catalog.of(spark, cfg), tables.layout(cfg)
    assert (cat.manifest.path, cat.rejects.path, cat.accounting.path, cat.takedowns.path,
            cat.curated.path) == (paths.manifest, paths.rejects, paths.accounting,
                                  paths.takedowns, paths.curated)
    shutil.rmtree(tmp_path, ignore_errors=True)
