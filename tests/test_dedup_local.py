"""Dedup's planners are implementations of one rule set (etl.transforms.dedup_rules):
the driver's plan (plan_local) and Spark's (plan_dedup) against a brute-force clustering
written here, against each other night after night, and the whole increment -- planned
in the driver, by Spark over the table, or answered from the table's metadata -- on
copies of one real root; the stats carried forward equal to stats counted again."""

from __future__ import annotations

import random
from collections import Counter
from datetime import datetime, timedelta

import pytest

from etl.config import DedupConfig
from etl.jobs.dedup import DedupRun
from etl.transforms.dedup import ASSIGNMENT_COLUMNS, ROW_COLUMNS, plan_dedup
from etl.transforms.dedup_local import plan_local, update_stats

ROW_DDL = ("sample_id string, source string, image_sha256 string, dhash long, width int, "
           "height int, original_width int, original_height int, ingested_at timestamp")
T0 = datetime(2026, 1, 1)


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


class Table:
    """Curated rows (ROW_COLUMNS) with planted exact and near duplicates."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.rows: dict[str, dict] = {}
        self.serial = 0

    def _flip(self, h: int, bits: int) -> int:
        u = h & ((1 << 64) - 1)
        for b in self.rng.sample(range(64), bits):
            u ^= 1 << b
        return _signed(u)

    def add(self, n: int) -> list[str]:
        added = []
        for _ in range(n):
            self.serial += 1
            sid = f"r{self.serial:04d}"
            pick = self.rng.random()
            existing = list(self.rows.values())
            if existing and pick < 0.2:  # an exact copy of some row
                base = self.rng.choice(existing)
                sha, dhash = base["image_sha256"], base["dhash"]
            elif existing and pick < 0.5:  # a near copy (1-6 bits: some beyond 4)
                base = self.rng.choice(existing)
                sha, dhash = f"sha{self.serial}", self._flip(base["dhash"], self.rng.randint(1, 6))
            else:
                sha, dhash = f"sha{self.serial}", _signed(self.rng.getrandbits(64))
            w, h = self.rng.choice([(64, 64), (128, 64), (64, 128), (128, 128)])
            self.rows[sid] = {
                "sample_id": sid, "source": self.rng.choice(["a", "b", "c"]),
                "image_sha256": sha, "dhash": dhash, "width": w, "height": h,
                "original_width": w * self.rng.choice([1, 2]), "original_height": h,
                "ingested_at": T0 + timedelta(minutes=self.rng.randint(0, 5)),
            }
            added.append(sid)
        return added

    def remove(self, n: int) -> None:
        for sid in self.rng.sample(sorted(self.rows), n):
            del self.rows[sid]

    def reimage(self, n: int) -> None:
        """Rows whose image changed (same id, new bytes): some to a copy of another."""
        for sid in self.rng.sample(sorted(self.rows), n):
            other = self.rng.choice(list(self.rows.values()))
            self.rows[sid] = {**self.rows[sid], "image_sha256": f"new-{sid}",
                              "dhash": self._flip(other["dhash"], self.rng.randint(0, 2))}

    def frame(self, spark):
        cols = ROW_COLUMNS
        return spark.createDataFrame([tuple(r[c] for c in cols) for r in self.rows.values()],
                                     ROW_DDL)


def _collect(df) -> list[dict]:
    return sorted((r.asDict() for r in df.collect()), key=lambda r: r["sample_id"])


def _apply(table: dict[str, dict], changes, removed) -> dict[str, dict]:
    out = {k: v for k, v in table.items() if k not in set(removed)}
    out.update({r["sample_id"]: dict(r) for r in changes})
    return out


def _stats(assignments: dict[str, dict]) -> dict:
    by: dict[str, Counter] = {}
    for r in assignments.values():
        by.setdefault(r["source"], Counter())[r["dup_kind"]] += 1
    clusters = {r["dup_cluster_id"]: r["cluster_size"] for r in assignments.values()
                if r["cluster_size"] > 1}
    sizes = Counter(clusters.values())
    return {"by": {s: dict(sorted(k.items())) for s, k in sorted(by.items())},
            "clusters": len(clusters), "sizes": {str(k): sizes[k] for k in sorted(sizes)}}


def _hamming(a: int, b: int) -> int:
    return bin((a ^ b) & ((1 << 64) - 1)).count("1")


def _policy_key(policy, priority):
    """The canonical order, written from the rules' text (not from the code)."""
    def key(r):
        out = []
        for criterion in policy:
            if criterion == "resolution":
                out += [-r["original_width"] * r["original_height"], -r["width"] * r["height"]]
            elif criterion == "source_priority":
                out.append(priority.index(r["source"]) if r["source"] in priority
                           else len(priority))
            else:
                out.append(r["ingested_at"])
        return (*out, r["sample_id"])
    return key


def _brute_force(rows: dict[str, dict], cfg: DedupConfig, run_id: str) -> list[dict]:
    """A first run by the rules, without LSH or a graph: all pairs compared, clusters
    as connected components by union-find, the first by policy canonical and the name."""
    ids = sorted(rows)
    parent = {i: i for i in ids}

    def find(x):
        while parent[x] != x:
            x = parent[x]
        return x

    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            if _hamming(rows[a]["dhash"], rows[b]["dhash"]) <= cfg.threshold:
                parent[find(b)] = find(a)
    groups: dict[str, list[dict]] = {}
    for i in ids:
        groups.setdefault(find(i), []).append(rows[i])
    out = []
    for group in groups.values():
        group.sort(key=_policy_key(cfg.policy, cfg.source_priority))
        head = group[0]
        for rank, r in enumerate(group):
            kind = ("unique" if len(group) == 1 else "canonical" if rank == 0 else
                    "exact" if r["image_sha256"] == head["image_sha256"] else "near")
            out.append({"sample_id": r["sample_id"], "source": r["source"],
                        "image_sha256": r["image_sha256"], "dhash": r["dhash"],
                        "dup_cluster_id": head["sample_id"], "is_canonical": rank == 0,
                        "dup_kind": kind, "cluster_size": len(group), "run_id": run_id})
    return sorted(out, key=lambda r: r["sample_id"])


def _check_rules(assignments: dict[str, dict], rows: dict[str, dict], cfg: DedupConfig,
                 reassigned: set[str]):
    """What every night's table must satisfy, however it got there: every row assigned,
    rows within the threshold in one cluster (clusters merge, never split), sizes true;
    in the clusters reassigned tonight (policies differ night by night), the first by
    policy canonical and kinds relative to it."""
    assert sorted(assignments) == sorted(rows)
    ids = sorted(rows)
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            if _hamming(rows[a]["dhash"], rows[b]["dhash"]) <= cfg.threshold:
                assert assignments[a]["dup_cluster_id"] == assignments[b]["dup_cluster_id"]
    clusters: dict[str, list[str]] = {}
    for sid, r in assignments.items():
        clusters.setdefault(r["dup_cluster_id"], []).append(sid)
    key = _policy_key(cfg.policy, cfg.source_priority)
    for cid, members in clusters.items():
        head = min((rows[m] for m in members), key=key)
        for m in members:
            r = assignments[m]
            assert r["cluster_size"] == len(members)
            if cid not in reassigned:
                continue
            assert r["is_canonical"] == (m == head["sample_id"])
            want = ("unique" if len(members) == 1 else "canonical" if r["is_canonical"] else
                    "exact" if rows[m]["image_sha256"] == head["image_sha256"] else "near")
            assert r["dup_kind"] == want


@pytest.mark.parametrize("policy", [("resolution", "source_priority", "earliest"),
                                    ("source_priority", "earliest")])
def test_both_planners_equal_a_brute_force_first_run(spark, policy):
    table = Table(11)
    table.add(90)
    cfg = DedupConfig(policy=policy, source_priority=("c", "a"))
    want = _brute_force(table.rows, cfg, "run0")
    assert any(r["dup_kind"] == "exact" for r in want)
    assert any(r["dup_kind"] == "near" for r in want)
    local = plan_local(list(table.rows.values()), [], cfg, "run0")
    assert (local.changes, local.removed, local.new_rows) == (want, [], 90)
    spark_plan = plan_dedup(table.frame(spark), None, cfg, "run0")
    assert _collect(spark_plan.changes) == want and spark_plan.removed.count() == 0
    assert spark_plan.pairs == local.pairs == len({
        (min(a["dhash"], b["dhash"]), max(a["dhash"], b["dhash"]))
        for a in table.rows.values() for b in table.rows.values()
        if 0 < _hamming(a["dhash"], b["dhash"]) <= cfg.threshold})


POLICIES = (("resolution", "source_priority", "earliest"), ("earliest", "resolution"),
            ("source_priority", "earliest"))


def test_driver_plan_equals_spark_plan_night_after_night(spark):
    """Four nights on one table, each planned with another canonical policy."""
    seed = 1
    table = Table(seed)
    table.add(120)
    cfg = DedupConfig(policy=POLICIES[0], source_priority=("b", "a"))
    first = plan_dedup(table.frame(spark), None, cfg, "run0")
    assignments = {r["sample_id"]: r for r in _collect(first.changes)}
    stats = _stats(assignments)
    prior_df = None
    for night in range(1, 5):
        cfg = DedupConfig(policy=POLICIES[night % 3], source_priority=("b", "a"))
        table.add(25)
        table.remove(6)
        table.reimage(5)
        prior_df = spark.createDataFrame(
            [tuple(r[c] for c in ASSIGNMENT_COLUMNS) for r in assignments.values()],
            "sample_id string, source string, image_sha256 string, dhash long, "
            "dup_cluster_id string, is_canonical boolean, dup_kind string, "
            "cluster_size long, run_id string")
        expected = plan_dedup(table.frame(spark), prior_df, cfg, f"run{night}")
        want_changes = _collect(expected.changes)
        want_removed = sorted(r["sample_id"] for r in expected.removed.collect())

        got = plan_local(list(table.rows.values()), list(assignments.values()), cfg,
                         f"run{night}")
        assert got.changes == want_changes
        assert got.removed == want_removed
        assert (got.new_rows, got.pairs) == (expected.new_rows, expected.pairs)
        assert want_changes, "the night changed nothing: the scenario tests nothing"

        stats = update_stats(stats, got.changes, got.removed, assignments)
        assignments = _apply(assignments, got.changes, got.removed)
        assert stats == _stats(assignments)
        _check_rules(assignments, table.rows, cfg, {r["dup_cluster_id"] for r in got.changes})
        assert stats["clusters"] > 0


def _picture(rng, size=(96, 80)):
    import numpy as np
    from PIL import Image

    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    a, b, c = rng.uniform(-1, 1, 3)
    base = np.sin(a * x / 7 + b * y / 9 + c * 3) * 100 + 128
    img = np.stack([base, base[::-1], base[:, ::-1]], -1) + rng.normal(0, 8, (h, w, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype("uint8"))


@pytest.mark.slow
def test_driver_increment_equals_spark_increment_on_the_same_table(spark, tmp_path):
    """The first night, then the same next night -- new pictures (copies and near copies
    among them), deleted files, files replaced by other pictures -- each deduplicated
    twice from copies of the same root: planned in the driver, and by Spark over the
    whole table. Same table after."""
    import shutil

    import numpy as np
    from conftest import make_config

    from etl import tables
    from etl.pipeline.runner import run_pipeline

    rng = np.random.default_rng(5)
    photos = tmp_path / "photos"
    photos.mkdir()
    pics = [_picture(rng) for _ in range(24)]
    for i, pic in enumerate(pics):
        pic.save(photos / f"p{i:02d}.jpg", quality=90)
    pics[0].save(photos / "copy_of_0.jpg", quality=90)  # an exact copy
    pics[1].resize((120, 100)).save(photos / "near_1.jpg", quality=70)  # a near copy

    def config(root, driver_rows):
        return make_config(root, sources=[{"name": "photos", "kind": "image_folder",
                                           "path": str(photos)}],
                           dedup={"driver_max_rows": driver_rows})

    def table(root):
        path = tables.layout(config(root, 0)).dedup
        return sorted(tuple(r[c] for c in ASSIGNMENT_COLUMNS if c != "run_id")
                      for r in spark.read.format("delta").load(path).collect())

    # The first night both ways too: planned in the driver (a table within
    # driver_max_rows), and by Spark over the table.
    run_pipeline(config(tmp_path / "root", 50_000), only=("curate",))
    shutil.copytree(tmp_path / "root", tmp_path / "first_by_spark")
    first_d = run_pipeline(config(tmp_path / "root", 50_000),
                           only=("dedup",)).detail("dedup", DedupRun)
    first_s = run_pipeline(config(tmp_path / "first_by_spark", 0),
                           only=("dedup",)).detail("dedup", DedupRun)
    assert (first_d.mode, first_s.mode) == ("full (driver)", "full")
    assert first_d.new_rows == first_s.new_rows == 26
    assert (first_d.pairs, first_d.changed, first_d.clusters, first_d.counts) == (
        first_s.pairs, first_s.changed, first_s.clusters, first_s.counts)
    assert table(tmp_path / "root") == table(tmp_path / "first_by_spark")
    assert first_d.clusters >= 2  # the exact copy's and the near copy's

    # The night: 2 copies and 2 near copies of stored pictures, 2 new ones, 3 files
    # deleted, 2 replaced by other pictures (one by a copy of a stored picture).
    for i, j in ((2, 0), (3, 4)):
        pics[j].save(photos / f"night_copy_{i}.jpg", quality=90)
    pics[5].resize((160, 120)).save(photos / "night_near_5.jpg", quality=75)
    pics[1].resize((140, 120)).save(photos / "night_near_1.jpg", quality=75)
    for i in range(2):
        _picture(rng).save(photos / f"night_new_{i}.jpg", quality=90)
    for name in ("p06.jpg", "p07.jpg", "copy_of_0.jpg"):
        (photos / name).unlink()
    _picture(rng).save(photos / "p08.jpg", quality=90)
    pics[9].save(photos / "p10.jpg", quality=90)
    run_pipeline(config(tmp_path / "root", 50_000), only=("curate",))
    shutil.copytree(tmp_path / "root", tmp_path / "root2")

    by_driver = run_pipeline(config(tmp_path / "root", 50_000), only=("dedup",))
    by_spark = run_pipeline(config(tmp_path / "root2", 0), only=("dedup",))
    d, s = by_driver.detail("dedup", DedupRun), by_spark.detail("dedup", DedupRun)
    assert (d.mode, s.mode) == ("incremental (driver)", "incremental")
    assert d.new_rows == s.new_rows >= 6 and d.removed == s.removed >= 3
    assert (d.changed, d.clusters, d.counts) == (s.changed, s.clusters, s.counts)

    assert table(tmp_path / "root") == table(tmp_path / "root2")
    # The driver's plan (updates and deletes among its rows) was one delta-rs MERGE.
    from deltalake import DeltaTable

    ops = {(h["operation"], h.get("engineInfo", "")[:8]) for h in DeltaTable(
        tables.layout(config(tmp_path / "root", 0)).dedup).history(3)}
    assert ("MERGE", "delta-rs") in ops
    assert any(r[6] == "near" for r in table(tmp_path / "root"))
    assert any(r[6] == "exact" for r in table(tmp_path / "root"))
    # Each run's carried-forward stats equal the other's counted ones: the next night's
    # shortcuts start from the truth.
    again = run_pipeline(config(tmp_path / "root", 50_000),
                         only=("dedup",)).detail("dedup", DedupRun)
    assert again.from_metadata and (again.counts, again.clusters) == (s.counts, s.clusters)


def test_stored_rows_on_the_driver_equal_the_spark_query(spark):
    """The rows an increment needs from the dedup table -- near neighbours of new hashes
    (an LSH key in common), previous rows of changed ids, rows of clusters named after
    them, then their clusters' members -- found in Spark and on the driver (Arrow compute
    over the table read by delta-rs) are the same rows; expected ids written here."""
    import pyarrow as pa

    from etl.lakehouse.dedup_increment import stored_rows
    from etl.schema import DEDUP_SCHEMA, arrow_schema

    rng = random.Random(11)
    cfg = DedupConfig()
    base = [_signed(rng.getrandbits(64)) for _ in range(12)]
    rows = []
    for i, h in enumerate(base):  # clusters of two: c0 = {s00, s01}, c1 = {s02, s03}, ...
        rows.append({"sample_id": f"s{i:02d}", "source": "src", "image_sha256": f"h{i}",
                     "dhash": h, "dup_cluster_id": f"s{i - i % 2:02d}",
                     "is_canonical": i % 2 == 0, "dup_kind": "canonical" if i % 2 == 0
                     else "near", "cluster_size": 2, "run_id": "r1"})
    u = base[4] & ((1 << 64) - 1)
    near = _signed(u ^ 1)  # one bit from s04: shares every band but one
    added = [{"sample_id": "new1", "dhash": near}, {"sample_id": "new2", "dhash": None}]
    ids = {"new1", "new2", "s09", "s10"}  # s09 changed; s10 names cluster s10
    table = spark.createDataFrame([tuple(r[f] for f in DEDUP_SCHEMA.fieldNames())
                                   for r in rows], DEDUP_SCHEMA)
    in_spark = stored_rows(spark, table, cfg, added, ids)
    local = stored_rows(spark, pa.Table.from_pylist(rows, schema=arrow_schema(DEDUP_SCHEMA)),
                        cfg, added, ids)
    # s04 (near new1) brings its cluster-mate s05; s09 brings s08; s10 and s11.
    assert sorted(local) == sorted(in_spark) == ["s04", "s05", "s08", "s09", "s10", "s11"]
    assert local == {k: {c: v[c] for c in ASSIGNMENT_COLUMNS} for k, v in in_spark.items()}


def test_duplicate_ids_read_on_the_driver_keep_an_exports_partitions(spark, tmp_path):
    """The non-canonical ids (read by delta-rs: a frame of unknown size, so the join is a
    shuffle by sample_id) left out of a curated read of 2,000 rows, then spread over 8
    partitions by sample_id as the MDS writer does. With the join's shuffle also 8 wide,
    Spark drops the repartition as redundant and adaptive execution coalesces that
    shuffle (fewer than 8 partitions: an export failed so, 'tasks reported partitions
    [0]'); under the writer's settings every one of the 8 is kept."""
    import lance
    import pyarrow as pa
    from deltalake import write_deltalake
    from support import make_config

    from etl.lakehouse import dedup_table as module
    from etl.schema import DEDUP_SCHEMA, arrow_schema
    from etl.writers.delta import set_properties
    from etl.writers.mds import _write_conf

    cfg = make_config(tmp_path)
    table = module.DedupTable(spark, cfg)
    ids = [f"s{i:05d}" for i in range(2000)]
    version = lance.write_dataset(pa.table({"sample_id": ids}), table.curated_path).version
    rows = [{"sample_id": i, "source": "src", "image_sha256": i, "dhash": n,
             "dup_cluster_id": ids[n - n % 50], "is_canonical": n % 50 == 0,
             "dup_kind": "canonical" if n % 50 == 0 else "exact", "cluster_size": 50,
             "run_id": "r1"} for n, i in enumerate(ids)]
    write_deltalake(table.path, pa.Table.from_pylist(rows, schema=arrow_schema(DEDUP_SCHEMA)))
    set_properties(spark, table.path, {module.DEDUP_PARAMS: table.params,
                                       module.DEDUP_CURATED_VERSION: str(version)})
    dups = table.non_canonical_ids(version)
    assert sorted(r.sample_id for r in dups.collect()) == [
        i for n, i in enumerate(ids) if n % 50]
    curated = spark.read.format("lance").load(table.curated_path).select("sample_id")

    def spread() -> list[int]:
        rows = curated.join(dups, "sample_id", "left_anti").repartition(8, "sample_id")
        return rows.mapInArrow(lambda batches: batches, rows.schema).rdd.glom().map(
            len).collect()

    before = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "8")  # the join's shuffle: 8 wide
    try:
        plain = spread()
        with _write_conf(spark, None):
            kept = spread()
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", before)
    assert len(plain) < 8 and sum(plain) == 40  # what the writer must not get
    assert len(kept) == 8 and sum(kept) == 40


def test_an_increments_read_of_stored_rows_follows_the_new_rows_keys(spark, tmp_path):
    """An increment's read of the dedup table is bounded by the new rows' LSH keys and
    ids, not by the table: of 4,000 stored rows (random hashes, clusters of two), the
    filtered reads take out the rows that share a band combination with a new hash, the
    rows named by an id, and their clusters' members -- counted here from the blocks
    themselves and brute-force Hamming distances -- and the plan keeps only those within
    the threshold. The delta-rs scan in the driver and Spark's read agree."""
    import pyarrow as pa
    from deltalake import write_deltalake
    from support import make_config

    from etl.lakehouse import dedup_table as module
    from etl.lakehouse.dedup_increment import stored_lookup
    from etl.schema import DEDUP_SCHEMA, arrow_schema

    rng = random.Random(5)
    cfg = DedupConfig()  # threshold 4, 6 blocks: a key is any 2 blocks in common
    bounds = [round(i * 64 / cfg.bands) for i in range(cfg.bands + 1)]

    def blocks_equal(a: int, b: int) -> int:
        x = (a ^ b) & ((1 << 64) - 1)
        return sum(((x >> lo) & ((1 << (hi - lo)) - 1)) == 0
                   for lo, hi in zip(bounds, bounds[1:], strict=False))

    base = [_signed(rng.getrandbits(64)) for _ in range(2000)]
    rows = []
    for i in range(4000):  # s0000 and s0001 share base[0]'s cluster, 2 bits apart
        h = base[i // 2] if i % 2 == 0 else _signed((base[i // 2] & ((1 << 64) - 1)) ^ 0b101)
        rows.append({"sample_id": f"s{i:04d}", "source": "src", "image_sha256": f"h{i}",
                     "dhash": h, "dup_cluster_id": f"s{i - i % 2:04d}",
                     "is_canonical": i % 2 == 0, "dup_kind": "canonical" if i % 2 == 0
                     else "near", "cluster_size": 2, "run_id": "r1"})
    near = _signed((base[7] & ((1 << 64) - 1)) ^ (1 << 40))  # 1 bit from s0014
    far = [_signed(rng.getrandbits(64)) for _ in range(5)]
    added = [{"sample_id": "new0", "dhash": near}] + [
        {"sample_id": f"new{j + 1}", "dhash": h} for j, h in enumerate(far)]
    ids = {r["sample_id"] for r in added} | {"s0101"}  # s0101 changed its image
    # Expected, from the blocks and distances (not the code's masks or filters):
    new_hashes = [r["dhash"] for r in added]
    shares_key = [r for r in rows if any(blocks_equal(r["dhash"], h) >= cfg.bands - cfg.threshold
                                         for h in new_hashes)]
    candidates = {r["sample_id"] for r in shares_key} | {
        r["sample_id"] for r in rows if r["sample_id"] in ids or r["dup_cluster_id"] in ids}
    within = {r["sample_id"] for r in rows if r["sample_id"] in ids or any(
        (((r["dhash"] ^ h) & ((1 << 64) - 1)).bit_count() <= cfg.threshold)
        for h in new_hashes)}
    clusters = {r["dup_cluster_id"] for r in rows if r["sample_id"] in within}
    members = [r for r in rows if r["dup_cluster_id"] in clusters]
    expected = within | {r["sample_id"] for r in members}
    assert expected == {"s0014", "s0015", "s0100", "s0101"}

    table = module.DedupTable(spark, make_config(tmp_path))
    write_deltalake(table.path, pa.Table.from_pylist(rows, schema=arrow_schema(DEDUP_SCHEMA)))
    local = stored_lookup(spark, table.scan_local(), cfg, added, ids)
    frame = spark.createDataFrame([tuple(r[f] for f in DEDUP_SCHEMA.fieldNames())
                                   for r in rows], DEDUP_SCHEMA)
    in_spark = stored_lookup(spark, frame, cfg, added, ids)
    assert sorted(local.rows) == sorted(in_spark.rows) == sorted(expected)
    # Spark takes out the rows sharing a key and measures them; the driver measures
    # every batch's hashes in numpy and takes out only the rows within the threshold.
    named = {r["sample_id"] for r in rows if r["sample_id"] in ids or r["dup_cluster_id"] in ids}
    assert in_spark.read == len(candidates) + len(members)
    assert local.read == len(within | named) + len(members)
    assert local.read <= in_spark.read < 20  # of 4,000 stored rows


def test_near_hashes_equal_brute_force_hamming_distances():
    """The driver's vectorised distance check (numpy over each batch, a stored hash
    measured against the new hashes it shares an LSH key with) finds exactly the stored
    hashes within the threshold of some new hash, by brute force here: signed hashes,
    nulls, new hashes that share keys with each other, exact copies, and every distance
    from 0 to 8 bits."""
    import pyarrow as pa

    from etl.lakehouse.dedup_increment import _NearHashes
    from etl.transforms.dedup import lsh_masks

    rng = random.Random(17)
    cfg = DedupConfig()

    def flip(h: int, bits: int) -> int:
        u = h & ((1 << 64) - 1)
        for b in rng.sample(range(64), bits):
            u ^= 1 << b
        return _signed(u)

    new = [_signed(rng.getrandbits(64)) for _ in range(300)]
    new += [flip(new[i], 1) for i in range(20)]  # new hashes sharing keys
    stored = [_signed(rng.getrandbits(64)) for _ in range(20000)]
    stored += [flip(rng.choice(new), d) for d in range(9) for _ in range(40)]
    stored += [None] * 5
    rng.shuffle(stored)
    added = [{"sample_id": f"n{i}", "dhash": h} for i, h in enumerate(new)]
    added.append({"sample_id": "n-null", "dhash": None})
    near = _NearHashes(added, lsh_masks(cfg.threshold, cfg.bands), cfg.threshold)
    got = near.near(pa.array(stored, pa.int64())).tolist()
    expected = [h is not None and any(((h ^ n) & ((1 << 64) - 1)).bit_count() <= cfg.threshold
                                      for n in new) for h in stored]
    assert got == expected
    assert 200 < sum(expected) < 400  # the planted copies within 4 bits, not the random
    # Measured a few pairs at a time, and with numpy 1's byte-wise bit count: the same.
    import numpy as np

    from etl.lakehouse import dedup_increment

    values = np.array([h for h in stored if h is not None], np.int64).view(np.uint64)
    counts = [bin(int(v)).count("1") for v in values]
    assert dedup_increment._bit_count(values).tolist() == counts
    real = np.bitwise_count
    try:
        del np.bitwise_count
        assert dedup_increment._bit_count(values).tolist() == counts
    finally:
        np.bitwise_count = real
    small = dedup_increment._PAIRS
    try:
        dedup_increment._PAIRS = 3
        assert near.near(pa.array(stored, pa.int64())).tolist() == expected
    finally:
        dedup_increment._PAIRS = small
