"""Dedup in Spark and as a table: its settings, the LSH search (every pair within the
threshold found, against brute force) and connected components, the Spark planner's
policy and incremental rules on a few rows, the dedup table's recorded stats (used only
while they describe it), and the real pipeline path (curate -> dedup -> export) with an
exact copy, a resized+recompressed copy and an unrelated photo. That the planners give
the same table: test_dedup_local.py; the transforms' helpers worked out by hand:
test_transform_dedup*.py."""

from __future__ import annotations

import io
import json
import os
import random
from datetime import datetime
from importlib import resources

import lance
import pytest
from conftest import make_config
from deltalake import DeltaTable
from PIL import Image

from etl import storage, tables
from etl.config import ConfigError, DedupConfig
from etl.jobs.dedup import DedupRun
from etl.lakehouse.dedup_table import DedupTable, source_counts
from etl.transforms.dedup import (
    ASSIGNMENT_COLUMNS,
    connected_components,
    hash_pairs,
    lsh_masks,
    plan_dedup,
)
from etl.transforms.export import ids_fingerprint


def _flip(h: int, bits: list[int]) -> int:
    for b in bits:
        h ^= 1 << b
    return h


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def _hamming(a: int, b: int) -> int:
    return bin((a ^ b) & ((1 << 64) - 1)).count("1")


# ----------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "dedup, needle",
    [
        ({"threshold": 4, "bands": 4}, "dedup.bands: must be greater than dedup.threshold"),
        ({"threshold": 64}, "dedup.threshold: must be <= 63, got 64"),
        ({"source_priority": ["nope"]}, "dedup.source_priority[0]: 'nope' is not a configured"),
        ({"policy": ["resolution", "biggest"]}, "dedup.policy[1]: 'biggest' is not one of"),
        ({"policy": ["earliest", "earliest"]}, "dedup.policy: a value is listed twice"),
        ({"threshold": 10, "bands": 40}, "dedup.bands: 40 bands with threshold 10 make"),
        ({"treshold": 3}, "dedup: unknown key 'treshold'"),
    ],
)
def test_bad_dedup_config_names_the_field(tmp_path, dedup, needle):
    with pytest.raises(ConfigError) as err:
        make_config(tmp_path, dedup=dedup)
    assert needle in str(err.value)


def test_dedup_and_export_options_parse(tmp_path):
    cfg = make_config(
        tmp_path,
        dedup={"threshold": 3, "bands": 4, "source_priority": ["dummy"]},
        exports={"all": {"include_duplicates": True}, "train": {}},
    )
    assert (cfg.dedup.threshold, cfg.dedup.bands, cfg.dedup.keys_per_hash) == (3, 4, 4)
    assert cfg.export("all").include_duplicates and not cfg.export("train").include_duplicates


def test_cli_dedup_bad_config_and_missing_table_fail_before_spark(tmp_path):
    import subprocess
    import sys

    import yaml

    conf = {"storage": {"root": str(tmp_path / "data")},
            "sources": [{"name": "pics", "kind": "image_folder", "path": str(tmp_path)}],
            "dedup": {"threshold": 5, "bands": 5}}
    path = tmp_path / "conf.yaml"
    path.write_text(yaml.safe_dump(conf))
    res = subprocess.run([sys.executable, "-m", "etl.cli", "dedup", "--conf", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "dedup.bands: must be greater than" in res.stderr
    conf["dedup"] = {}
    path.write_text(yaml.safe_dump(conf))
    res = subprocess.run([sys.executable, "-m", "etl.cli", "dedup", "--conf", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "run `lakeshard curate` first" in res.stderr
    assert "SparkSession" not in res.stderr


# ----------------------------------------------------------------------- LSH


@pytest.mark.parametrize("threshold, bands", [(0, 1), (3, 4), (4, 6), (6, 8)])
def test_every_pair_within_the_threshold_shares_a_key(threshold, bands):
    masks = lsh_masks(threshold, bands)
    assert len(masks) == len(set(masks))
    rng = random.Random(threshold * 100 + bands)
    for _ in range(2000):
        a = rng.getrandbits(64)
        b = _flip(a, rng.sample(range(64), rng.randint(0, threshold)))
        assert any(_signed(a) & m == _signed(b) & m for m in masks)


def test_hash_pairs_equal_brute_force_and_only_with_a_new_side(spark):
    rng = random.Random(7)
    hashes = [rng.getrandbits(64) for _ in range(150)]
    for _ in range(40):  # planted near copies, 1..6 bits away
        hashes.append(_flip(rng.choice(hashes), rng.sample(range(64), rng.randint(1, 6))))
    hashes = sorted({_signed(h) for h in hashes})
    new = set(hashes[::3])
    df = spark.createDataFrame([(h, h in new) for h in hashes], "dhash long, is_new boolean")

    got = {(r.a, r.b): r.distance for r in hash_pairs(df, 4, 6, all_new=False).collect()}
    want = {
        (a, b): _hamming(a, b)
        for i, a in enumerate(hashes) for b in hashes[i + 1:]
        if _hamming(a, b) <= 4 and (a in new or b in new)
    }
    assert want and got == want

    everything = df.withColumn("is_new", df.is_new | ~df.is_new)  # a first run: all new
    got_all = {(r.a, r.b) for r in hash_pairs(everything, 4, 6, all_new=True).collect()}
    assert got_all == {
        (a, b) for i, a in enumerate(hashes) for b in hashes[i + 1:] if _hamming(a, b) <= 4
    }


def test_connected_components_of_a_long_chain_and_a_pair(spark):
    chain = [(f"n{i:03d}", f"n{i + 1:03d}") for i in range(40)]  # 41 nodes, one component
    edges = spark.createDataFrame(
        [*chain, ("x", "y"), ("y", "x"), ("z", "z")], "src string, dst string"
    )
    labels, rounds = connected_components(edges, max_iterations=20)
    got = {r.node: r.label for r in labels.collect()}
    assert got == {**{f"n{i:03d}": "n000" for i in range(41)}, "x": "x", "y": "x"}
    assert rounds <= 10  # pointer jumping: ~log2(40) rounds, not 40


# ----------------------------------------------------------------------- plan


_ROW = ("sample_id string, source string, image_sha256 string, dhash long, width int, "
        "height int, original_width int, original_height int, ingested_at timestamp")
_H = 0x0123456789ABCDEF
_FAR = 0x7EDCBA9876543210


def _row(sid, source, sha, dhash, side, day):
    return (sid, source, sha, dhash, side, side, side, side, datetime(2026, 1, day))


def _state(prior: dict, plan) -> dict:
    """Apply a plan's changes and removals to a {sample_id: assignment} dict."""
    out = {k: v for k, v in prior.items()}
    for r in plan.removed.collect():
        out.pop(r.sample_id)
    for r in plan.changes.collect():
        out[r.sample_id] = r.asDict()
    return out


def test_plan_policy_then_incremental_keeps_ids_and_reassigns_canonical(spark):
    cfg = DedupConfig(threshold=4, bands=6, source_priority=("s2", "s1"))
    first = [
        _row("a1", "s1", "A", _H, 100, 1),
        _row("a2", "s2", "A", _H, 100, 2),             # exact copy, preferred source
        _row("a3", "s1", "B", _H ^ 0b10101, 50, 1),    # near copy (3 bits), smaller
        _row("b1", "s1", "C", _FAR, 100, 1),           # unrelated
        _row("c1", "s1", "E", 42, 80, 3),
        _row("c2", "s1", "F", 42 ^ (1 << 40), 80, 2),  # same size and source: earliest wins
    ]
    plan = plan_dedup(spark.createDataFrame(first, _ROW), None, cfg, "r1")
    state = _state({}, plan)
    view = {k: (v["dup_cluster_id"], v["is_canonical"], v["dup_kind"], v["cluster_size"])
            for k, v in state.items()}
    assert view == {
        "a1": ("a2", False, "exact", 3), "a2": ("a2", True, "canonical", 3),
        "a3": ("a2", False, "near", 3), "b1": ("b1", True, "unique", 1),
        "c1": ("c2", False, "near", 2), "c2": ("c2", True, "canonical", 2),
    }
    assert plan.new_rows == 6 and plan.removed.count() == 0

    prior = spark.createDataFrame(
        [tuple(v[c] for c in ASSIGNMENT_COLUMNS) for v in state.values()],
        "sample_id string, source string, image_sha256 string, dhash long, "
        "dup_cluster_id string, is_canonical boolean, dup_kind string, cluster_size long, "
        "run_id string",
    )
    # Next night: a2 (the canonical) is gone, a bigger near copy and an exact copy of b1
    # arrive, and a1's file was replaced by an unrelated image.
    second = [r for r in first if r[0] not in ("a1", "a2")] + [
        _row("a1", "s1", "Z", 0x5A5A5A5A5A5A5A5A, 100, 1),
        _row("a4", "s1", "D", _signed(_H ^ (1 << 63)), 200, 5),
        _row("b2", "s2", "C", _FAR, 100, 5),
    ]
    plan2 = plan_dedup(spark.createDataFrame(second, _ROW), prior, cfg, "r2")
    assert plan2.new_rows == 3  # a1 (changed), a4, b2
    assert {r.sample_id for r in plan2.removed.collect()} == {"a2"}
    changed = {r.sample_id for r in plan2.changes.collect()}
    assert changed == {"a1", "a3", "a4", "b1", "b2"}  # c1, c2 untouched
    assert all(r.run_id == "r2" for r in plan2.changes.collect())
    state2 = _state(state, plan2)
    view2 = {k: (v["dup_cluster_id"], v["is_canonical"], v["dup_kind"], v["cluster_size"])
             for k, v in state2.items()}
    assert view2 == {
        "a3": ("a2", False, "near", 2), "a4": ("a2", True, "canonical", 2),  # id kept
        "a1": ("a1", True, "unique", 1),
        "b1": ("b1", False, "exact", 2), "b2": ("b1", True, "canonical", 2),  # s2 first
        "c1": ("c2", False, "near", 2), "c2": ("c2", True, "canonical", 2),
    }


# ----------------------------------------------------------------------- the table


def test_recorded_stats_are_used_only_while_they_describe_the_table(spark, tmp_path):
    """The stats property follows the derived-state rules: used at the version it was
    recorded at (or the properties commit after it), with the same settings and format;
    stale, foreign, unreadable or from other settings, it reads as None and the table is
    counted."""
    from etl.lakehouse.dedup_table import DEDUP_PARAMS, DEDUP_STATS
    from etl.schema import DEDUP_SCHEMA
    from etl.writers.delta import set_properties

    cfg = make_config(tmp_path)
    table = DedupTable(spark, cfg)
    rows = [("a", "s", "A", 1, "a", True, "canonical", 2, "r"),
            ("b", "s", "A", 1, "a", False, "exact", 2, "r"),
            ("c", "t", "C", 9, "c", True, "unique", 1, "r"),
            ("d", "t", "D", 99, "d", True, "unique", 1, "r")]
    spark.createDataFrame(rows, DEDUP_SCHEMA).write.format("delta").save(table.path)
    counted = {"by": {"s": {"canonical": 1, "exact": 1}, "t": {"unique": 2}},
               "clusters": 1, "sizes": {"2": 1}}
    assert table.state() == {} and table.stats(table.state()) is None
    assert table.count_stats() == counted

    version, stats = table.write([], [], state=table.state(), covers=7)
    assert stats == counted and version == 1  # the properties: one commit after the data
    assert table.stats(table.state()) == {**counted, "table_version": 0}
    assert table.state()[DEDUP_PARAMS] == table.params

    def recorded(value: str) -> dict | None:
        set_properties(spark, table.path, {DEDUP_STATS: value})
        return table.stats(table.state())

    good = json.dumps({**counted, "table_version": table.version() + 1})
    assert recorded(good) == json.loads(good)
    assert recorded("{not json") is None  # unreadable
    assert recorded(json.dumps({"clusters": 1, "table_version": table.version() + 1})) is None
    assert recorded(json.dumps({**counted, "table_version": table.version() - 1})) is None
    assert recorded(json.dumps({**counted, "table_version": table.version() + 1})) is not None
    other = DedupTable(spark, make_config(tmp_path, dedup={"threshold": 3}))
    assert other.stats(other.state()) is None  # computed with other settings
    assert other.current_stats(other.state()) == counted


# ----------------------------------------------------------------------- pipeline


def _skimage_bytes(name: str) -> bytes:
    return resources.files("skimage").joinpath("data", name).read_bytes()


def _reencoded(name: str, size: tuple[int, int], fmt: str, **kw) -> bytes:
    im = Image.open(io.BytesIO(_skimage_bytes(name))).convert("RGB")
    buf = io.BytesIO()
    im.resize(size, Image.Resampling.LANCZOS).save(buf, format=fmt, **kw)
    return buf.getvalue()


def _by_source(table) -> dict[str, dict[str, int]]:
    """Rows per source and kind, counted here from the table's rows."""
    by: dict[str, dict[str, int]] = {}
    for r in table.collect():
        by.setdefault(r.source, {}).setdefault(r.dup_kind, 0)
        by[r.source][r.dup_kind] += 1
    return by


def _exported_ids(path: str) -> list[str]:
    from mds_read import read_mds

    return sorted(s["sample_id"] for s in read_mds(path))


@pytest.mark.slow
def test_copies_cluster_reruns_keep_ids_and_exports_skip_duplicates(spark, tmp_path):
    from etl.lakehouse.views import register_views
    from etl.pipeline.runner import run_pipeline
    from etl.pipeline.summary import format_outcome

    photos = tmp_path / "in" / "photos"
    files = {
        "orig/astronaut.png": _skimage_bytes("astronaut.png"),
        "copies/astronaut_copy.png": _skimage_bytes("astronaut.png"),  # exact byte copy
        "copies/astronaut_small.jpg": _reencoded("astronaut.png", (256, 256), "JPEG", quality=80),
        "other/coffee.png": _skimage_bytes("coffee.png"),  # unrelated
    }
    for rel, data in files.items():
        (photos / rel).parent.mkdir(parents=True, exist_ok=True)
        (photos / rel).write_bytes(data)
    cfg = make_config(
        tmp_path,
        sources=[{"name": "photos", "kind": "image_folder", "path": str(photos)}],
        exports={"train": {"partitions": 1},
                 "everything": {"partitions": 1, "include_duplicates": True},
                 # Spread over partitions: the duplicates' ids (a small frame) are joined
                 # without undoing the repartition by sample_id.
                 "spread": {"partitions": 3}},
    )

    def state():
        table = lance.dataset(tables.layout(cfg).curated)
        keys = {r["sample_id"]: r["source_key"]
                for r in table.to_table(columns=["sample_id", "source_key"]).to_pylist()}
        rows = spark.read.format("delta").load(tables.layout(cfg).dedup).collect()
        assert sorted(keys) == sorted(r.sample_id for r in rows)  # every row annotated
        return {keys[r.sample_id]: r for r in rows}, {v: k for k, v in keys.items()}

    out = run_pipeline(cfg)
    s1, ids = state()
    astro = s1["orig/astronaut.png"].dup_cluster_id
    assert s1["copies/astronaut_copy.png"].dup_cluster_id == astro
    assert s1["copies/astronaut_small.jpg"].dup_cluster_id == astro
    assert s1["other/coffee.png"].dup_cluster_id != astro
    assert (s1["other/coffee.png"].dup_kind, s1["other/coffee.png"].cluster_size) == ("unique", 1)
    # Same size, source and ingest time: the smaller sample_id is canonical.
    first = min(ids["orig/astronaut.png"], ids["copies/astronaut_copy.png"])
    assert astro == first
    kinds = {k: (r.is_canonical, r.dup_kind) for k, r in s1.items()}
    twin = [k for k in ("orig/astronaut.png", "copies/astronaut_copy.png") if ids[k] != first]
    assert kinds[twin[0]] == (False, "exact")
    assert kinds["copies/astronaut_small.jpg"] == (False, "near")
    # Stats per source, and the exports: duplicates left out unless asked for.
    d = out.detail("dedup", DedupRun)
    assert (d.counts[0].rows, d.counts[0].exact, d.counts[0].near, d.clusters) == (4, 1, 1, 1)
    assert "exact rate" in format_outcome(out)
    # The report's duplicates come from the dedup table: per source, clusters, and a
    # contact sheet of the cluster, canonical member first.
    report_dir = os.path.dirname(out.report)
    rep = json.load(open(os.path.join(report_dir, "report.json")))["dedup"]
    (photos_row,) = rep["per_source"]
    assert {k: photos_row[k] for k in ("source", "rows", "canonical", "exact", "near",
                                       "unique")} == {
        "source": "photos", "rows": 4, "canonical": 1, "exact": 1, "near": 1, "unique": 1}
    assert (photos_row["exact_rate"], photos_row["near_rate"]) == (0.25, 0.25)
    assert (rep["clusters"], rep["rows_in_clusters"], rep["uncovered"]) == (1, 3, 0)
    (sheet,) = rep["contact_clusters"]
    assert sheet[0] == first and sorted(sheet) == sorted(
        ids[k] for k in ("orig/astronaut.png", "copies/astronaut_copy.png",
                         "copies/astronaut_small.jpg"))
    assert os.path.getsize(os.path.join(report_dir, "contact_duplicates.png")) > 0
    page = open(out.report, encoding="utf-8").read()
    assert "largest clusters, canonical member first" in page
    assert "added or changed since dedup ran" not in page
    assert _exported_ids(tables.layout(cfg).export_dir("train")) == sorted(
        [first, ids["other/coffee.png"]])
    assert len(_exported_ids(tables.layout(cfg).export_dir("everything"))) == 4
    assert _exported_ids(tables.layout(cfg).export_dir("spread")) == sorted(
        [first, ids["other/coffee.png"]])
    from etl.jobs.verify_export import verify_export

    report = verify_export(tables.layout(cfg).export_dir("train"))  # table rows - duplicates
    assert report.ok, report.problems
    register_views(spark, cfg)
    row = spark.sql("SELECT * FROM dup_clusters").collect()
    assert [(r.dup_cluster_id, r.cluster_size, r.canonical_sample_id, r.sources) for r in row] \
        == [(astro, 3, first, ["photos"])]
    assert spark.sql("SELECT count(*) FROM curated WHERE is_canonical").first()[0] == 2

    # Rerun, nothing new: same ids, nothing changed.
    d2 = run_pipeline(cfg, only=("curate", "dedup")).detail("dedup", DedupRun)
    s2, _ = state()
    assert d2.mode == "incremental" and d2.changed == 0
    # Decided from the dedup table's properties (curated version, settings, stats): no
    # table read, the same figures as the run that computed them.
    assert d2.from_metadata and d2.new_rows == 0
    assert (d2.counts, d2.clusters, d2.version) == (d.counts, d.clusters, d.version)
    assert {k: r.dup_cluster_id for k, r in s2.items()} == {
        k: r.dup_cluster_id for k, r in s1.items()}

    # New rows: a bigger copy of the astronaut (becomes canonical), a recompressed
    # coffee (joins the coffee row, which keeps its id).
    (photos / "new").mkdir()
    (photos / "new/astronaut_big.png").write_bytes(
        _reencoded("astronaut.png", (1024, 1024), "PNG"))
    (photos / "new/coffee.jpg").write_bytes(_reencoded("coffee.png", (400, 300), "JPEG",
                                                       quality=85))
    d3 = run_pipeline(cfg, export_names=("train",)).detail("dedup", DedupRun)
    s3, ids3 = state()
    assert d3.new_rows == 2
    # Two appended rows: planned in the driver from the rows they touch; the stats it
    # carried forward are those of the table counted again.
    assert d3.mode == "incremental (driver)"
    table = spark.read.format("delta").load(tables.layout(cfg).dedup)
    assert d3.counts == source_counts(_by_source(table), ["photos"])
    assert d3.clusters == table.where("cluster_size > 1").select("dup_cluster_id").distinct(
        ).count() == 2
    for key, r in s1.items():
        assert s3[key].dup_cluster_id == r.dup_cluster_id, key
    assert s3["new/astronaut_big.png"].dup_cluster_id == astro
    assert s3["new/astronaut_big.png"].is_canonical
    assert s3["new/coffee.jpg"].dup_cluster_id == ids3["other/coffee.png"]
    assert not s3["new/coffee.jpg"].is_canonical  # same size; the earlier row wins
    assert _exported_ids(tables.layout(cfg).export_dir("train")) == sorted(
        [ids3["new/astronaut_big.png"], ids3["other/coffee.png"]])

    # Nothing changed since: the export's dedup figures come from its memo (the same
    # curated and dedup versions), so knowing the export is up to date reads no table.
    again = run_pipeline(cfg, only=("export",), export_names=("train",))
    assert again.results["export"].note == "up to date"
    memo = json.loads((tmp_path / "_lakeshard" / "exports" / "train.dedup.json").read_text())
    dedup_rows = spark.read.format("delta").load(tables.layout(cfg).dedup).collect()
    assert memo["payload"]["excluded_duplicates"] == sum(not r.is_canonical for r in dedup_rows)
    assert memo["payload"]["expected"] == 2
    # Counted on the driver (the rows and the duplicates' ids it holds): Spark's figures.
    assert memo["payload"]["duplicates_fingerprint"] == ids_fingerprint(
        spark.read.format("delta").load(tables.layout(cfg).dedup).where("NOT is_canonical"))
    assert memo["key"]["dedup_version"] == storage.delta_version(
        spark, tables.layout(cfg).dedup)
    jobs = spark.sparkContext.statusTracker().getJobIdsForGroup(
        f"lakeshard-{again.run_id}-export")
    assert [spark.sparkContext.statusTracker().getJobInfo(j) for j in jobs] == []

    # A night of new, distinct pictures only: the driver's plan inserts them as their
    # own clusters, one append (delta-rs, no MERGE), and the manifest's rows are
    # appended too; the recorded stats are still those of a recount.
    (photos / "more").mkdir()
    (photos / "more/chelsea.png").write_bytes(_skimage_bytes("chelsea.png"))
    (photos / "more/rocket.jpg").write_bytes(_reencoded("rocket.jpg", (300, 200), "JPEG"))
    d4 = run_pipeline(cfg, only=("curate", "dedup")).detail("dedup", DedupRun)
    s4, _ = state()
    assert (d4.mode, d4.new_rows, d4.changed) == ("incremental (driver)", 2, 2)
    assert all(s4[k].dup_kind == "unique" and s4[k].cluster_size == 1
               for k in ("more/chelsea.png", "more/rocket.jpg"))
    assert {k: r for k, r in s4.items() if not k.startswith("more/")} == s3
    ops = [h["operation"] for h in DeltaTable(tables.layout(cfg).dedup).history(2)]
    assert ops == ["SET TBLPROPERTIES", "WRITE"]  # newest first: no MERGE
    manifest_ops = [h["operation"] for h in DeltaTable(tables.layout(cfg).manifest).history(1)]
    assert manifest_ops == ["WRITE"]
    table = spark.read.format("delta").load(tables.layout(cfg).dedup)
    assert d4.counts == source_counts(_by_source(table), ["photos"])
    assert d4.clusters == 2
    dedup_table = DedupTable(spark, cfg)
    assert dedup_table.stats(dedup_table.state())["sizes"] == {"2": 1, "4": 1}


def test_the_change_feed_gives_each_ids_row_before_its_first_change_and_after_its_last():
    """:func:`_first_and_last` over a change data feed as delta-rs hands it out (string
    views, unsigned versions): an id updated twice (before: its first pre-image; after:
    its last post-image), one inserted then updated (no before), one updated then
    deleted (no after), one deleted then inserted again, and one whose file was
    rewritten without a feed (a delete and an insert in the same version: what was
    there comes first). Expected values written here, row by row."""
    import pyarrow as pa

    from etl.lakehouse.dedup_table import _first_and_last

    events = [  # (id, is_canonical, change type, version)
        ("twice", True, "update_preimage", 3), ("twice", False, "update_postimage", 3),
        ("twice", False, "update_preimage", 5), ("twice", True, "update_postimage", 5),
        ("new", True, "insert", 4), ("new", True, "update_preimage", 5),
        ("new", False, "update_postimage", 5),
        ("gone", True, "update_preimage", 3), ("gone", False, "update_postimage", 3),
        ("gone", False, "delete", 6),
        ("back", False, "delete", 3), ("back", True, "insert", 6),
        ("file", True, "insert", 4), ("file", False, "delete", 4),
    ]
    feed = pa.table({
        "sample_id": pa.array([e[0] for e in events], pa.string_view()),
        "is_canonical": [e[1] for e in events],
        "_change_type": pa.array([e[2] for e in events], pa.string_view()),
        "_commit_version": pa.array([e[3] for e in events], pa.uint64()),
    })
    before, after = _first_and_last(feed)
    assert before.schema.field("sample_id").type == pa.string()
    assert dict(zip(*before.to_pydict().values(), strict=True)) == {
        "twice": True, "gone": True, "back": False, "file": False}
    assert dict(zip(*after.to_pydict().values(), strict=True)) == {
        "twice": True, "new": False, "back": True, "file": True}
    empty = _first_and_last(feed.slice(0, 0))
    assert empty[0].num_rows == empty[1].num_rows == 0


def test_canonical_changes_read_from_the_feed_equal_those_of_a_table_without_one(
        spark, tmp_path):
    """The same dedup rows written twice by delta-rs -- a 3-row table, then a MERGE that
    flips one row, inserts one and leaves one unchanged, then a delete -- into a table
    with a change data feed and one made without (the files added and removed are then
    all delta-rs has): canonical changes since the first version are the same, and are
    the changes made here."""
    import pyarrow as pa
    from deltalake import write_deltalake

    from etl.lakehouse.dedup_table import CHANGE_FEED
    from etl.schema import DEDUP_SCHEMA, arrow_schema
    from etl.writers.delta import merge_dedup_rows

    def row(i, canonical):
        return {"sample_id": i, "source": "s", "image_sha256": f"h{i}", "dhash": 1,
                "dup_cluster_id": "a", "is_canonical": canonical, "dup_kind": "unique",
                "cluster_size": 1, "run_id": "r"}

    schema = arrow_schema(DEDUP_SCHEMA)
    answers = []
    for feed in (True, False):
        table = DedupTable(spark, make_config(tmp_path / str(feed)))
        write_deltalake(table.path, pa.Table.from_pylist(
            [row("a", True), row("b", True), row("c", False)], schema=schema),
            configuration=CHANGE_FEED if feed else None)
        merge_dedup_rows(table.path, pa.Table.from_pylist(
            [row("a", False), row("b", True), row("d", True)], schema=schema), [],
            ASSIGNMENT_COLUMNS)
        merge_dedup_rows(table.path, pa.Table.from_pylist([], schema=schema), ["c"],
                         ASSIGNMENT_COLUMNS)
        assert os.path.isdir(os.path.join(table.path, "_change_data")) is feed
        now, then, same = table.canonical_changes(0)
        answers.append((now, then, dict(zip(*same.to_pydict().values(), strict=True))))
        now2, then2, same2 = table.canonical_changes(2)  # the latest version: none
        assert now2 == then2 == {} and same2.num_rows == 0
        if feed:  # a change file vacuumed: unreadable, so the export diffs in full
            folder = os.path.join(table.path, "_change_data")
            for name in os.listdir(folder):
                os.remove(os.path.join(folder, name))
            assert table.canonical_changes(0) is None
    with_feed, without = answers
    assert with_feed[0] == without[0] == {"a": False, "d": True}
    assert with_feed[1] == without[1] == {"a": True, "c": False}
    # Rows rewritten with the same status: "b" (updated to itself) in both; without a
    # feed, every row of the rewritten file too.
    assert with_feed[2] == {"b": True} and without[2] == {"b": True}
