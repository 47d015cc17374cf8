"""The driver-side commit of an MDS export (etl.writers.mds.commit), without Spark: the
one index merge behind the local and the S3 layout, and the local staging swap."""

from __future__ import annotations

import copy
import hashlib
import json
import os

import pytest

from etl.writers.mds import commit as commit_mod
from etl.writers.mds.commit import LocalCommit, merge_indexes, remote_indexes


def _shard(basename: str, samples: int, nbytes: int, zipped: tuple[str, int] | None = None):
    """A shard entry as MDSWriter writes it in index.json (config keys abridged)."""
    return {
        "samples": samples,
        "raw_data": {"basename": basename, "bytes": nbytes, "hashes": {}},
        "zip_data": None if zipped is None
        else {"basename": zipped[0], "bytes": zipped[1], "hashes": {}},
        "format": "mds",
        "column_names": ["image", "sample_id"],
    }


# What two tasks' routers report: per bucket, an index relative to the bucket's folder.
PART_INDEXES = [
    {
        "128x64": {"version": 2, "shards": [_shard("shard.00000.mds", 3, 300)]},
        "64x64": {"version": 2, "shards": [_shard("shard.00000.mds", 2, 200),
                                           _shard("shard.00001.mds", 1, 100)]},
    },
    {
        "128x64": {"version": 2, "shards": [
            _shard("shard.00000.mds", 4, 400, zipped=("shard.00000.mds.zstd", 150))]},
        "64x64": {"version": 2, "shards": [_shard("shard.00000.mds", 5, 500)]},
    },
]


def _results(dirs: list[str]) -> list[dict]:
    return [
        {"partition": pid, "samples": sum(s["samples"] for i in idx.values() for s in i["shards"]),
         "checksum": f"c{pid}", "resumed": False, "dir": d,
         "indexes": json.dumps(idx, sort_keys=True)}
        for pid, (idx, d) in enumerate(zip(PART_INDEXES, dirs, strict=True))
    ]


def test_merge_prefixes_basenames_in_partition_order_and_leaves_its_input_alone():
    parts = [("p0", PART_INDEXES[0]["64x64"]), ("p1", PART_INDEXES[1]["64x64"])]
    before = copy.deepcopy(parts)
    assert merge_indexes(parts) == {"version": 2, "shards": [
        _shard("p0/shard.00000.mds", 2, 200),
        _shard("p0/shard.00001.mds", 1, 100),
        _shard("p1/shard.00000.mds", 5, 500),
    ]}
    assert parts == before
    assert merge_indexes([]) == {"version": 2, "shards": []}


def test_s3_root_indexes_point_into_each_finished_attempt():
    indexes, keep = remote_indexes("k3y", _results(["part-00000-t7", "part-00001-t9"]), True)
    assert indexes == {
        "128x64": {"version": 2, "shards": [
            _shard("k3y/part-00000-t7/shard.00000.mds", 3, 300),
            _shard("k3y/part-00001-t9/shard.00000.mds", 4, 400,
                   zipped=("k3y/part-00001-t9/shard.00000.mds.zstd", 150)),
        ]},
        "64x64": {"version": 2, "shards": [
            _shard("k3y/part-00000-t7/shard.00000.mds", 2, 200),
            _shard("k3y/part-00000-t7/shard.00001.mds", 1, 100),
            _shard("k3y/part-00001-t9/shard.00000.mds", 5, 500),
        ]},
    }
    # Each attempt's own prefix too: its ids file (what the next export diffs against).
    assert keep == {"128x64/k3y/part-00000-t7/", "64x64/k3y/part-00000-t7/",
                    "128x64/k3y/part-00001-t9/", "64x64/k3y/part-00001-t9/",
                    "k3y/part-00000-t7/", "k3y/part-00001-t9/"}


def _write(path, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)


def test_local_bucketed_commit_moves_buckets_up_and_indexes_each(tmp_path):
    out = str(tmp_path / "train")
    commit = LocalCommit(out, "k3y")
    commit.prepare()
    assert commit.staging == str(tmp_path / ".train.staging-k3y") and commit.remote is None
    for pid, idx in enumerate(PART_INDEXES):
        for bucket, index in idx.items():
            folder = os.path.join(commit.staging, f"part-{pid:05d}", bucket)
            _write(os.path.join(folder, "index.json"), index)
            for s in index["shards"]:
                with open(os.path.join(folder, s["raw_data"]["basename"]), "wb") as f:
                    f.write(b"x")
        _write(os.path.join(commit.staging, f"part-{pid:05d}", "_part.json"), {})

    manifest = commit.commit(_results(["part-00000", "part-00001"]), {"seed": 3}, bucketed=True)

    assert sorted(os.listdir(tmp_path)) == ["train"]
    assert sorted(os.listdir(out)) == ["128x64", "64x64", "manifest.json", "part-00000",
                                       "part-00001"]
    assert os.listdir(os.path.join(out, "part-00000")) == ["_part.json"]
    assert sorted(os.listdir(os.path.join(out, "64x64", "part-00000"))) == [
        "index.json", "shard.00000.mds", "shard.00001.mds"]
    with open(os.path.join(out, "64x64", "index.json"), encoding="utf-8") as f:
        assert json.load(f)["shards"] == [
            _shard("part-00000/shard.00000.mds", 2, 200),
            _shard("part-00000/shard.00001.mds", 1, 100),
            _shard("part-00001/shard.00000.mds", 5, 500),
        ]
    with open(os.path.join(out, "128x64", "index.json"), encoding="utf-8") as f:
        assert json.load(f)["shards"] == [
            _shard("part-00000/shard.00000.mds", 3, 300),
            _shard("part-00001/shard.00000.mds", 4, 400,
                   zipped=("part-00001/shard.00000.mds.zstd", 150)),
        ]
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        assert json.load(f) == manifest == {
            "seed": 3, "export_key": "k3y", "samples": 15, "shards": 5,
            "bytes": 200 + 100 + 300 + 150 + 500,  # a compressed shard counts its zip
            "bucket_samples": {"64x64": 8, "128x64": 7},
            "checksum": hashlib.sha256(b"c0c1").hexdigest(), "part_checksums": ["c0", "c1"],
            "part_ids": [0, 1],
            "parts": [{"partition": i, "samples": r["samples"], "checksum": f"c{i}",
                       "dir": f"part-0000{i}"} for i, r in enumerate(
                           _results(["part-00000", "part-00001"]))],
        }


def _plain_staging(commit: LocalCommit) -> None:
    commit.prepare()
    for pid in range(2):
        index = {"version": 2, "shards": [_shard("shard.00000.mds", pid + 1, 10)]}
        _write(os.path.join(commit.staging, f"part-{pid:05d}", "index.json"), index)
    _write(os.path.join(commit.staging, "_attempts", "part-00001-t4", "index.json"), {})


def test_local_commit_replaces_an_existing_export_only_once_the_new_one_is_whole(
    tmp_path, monkeypatch
):
    out = tmp_path / "train"
    _write(str(out / "manifest.json"), {"export_key": "old"})
    (out / "old.mds").write_bytes(b"old")
    commit = LocalCommit(str(out), "new")
    assert commit.read_manifest() == {"export_key": "old"}
    _plain_staging(commit)
    results = [{"partition": p, "samples": p + 1, "checksum": f"c{p}"} for p in range(2)]

    def crash(name):  # the run dies after staging, before the swap
        if name == "export:staged":
            raise KeyboardInterrupt(name)

    monkeypatch.setattr(commit_mod, "fault_point", crash)
    with pytest.raises(KeyboardInterrupt):
        commit.commit(results, {}, bucketed=False)
    assert sorted(os.listdir(out)) == ["manifest.json", "old.mds"]  # untouched
    assert commit.read_manifest() == {"export_key": "old"}
    staged = sorted(os.listdir(commit.staging))
    assert staged == ["index.json", "manifest.json", "part-00000", "part-00001"]

    monkeypatch.undo()
    manifest = commit.commit(results, {}, bucketed=False)  # the rerun's commit
    assert sorted(os.listdir(tmp_path)) == ["train"]  # no staging or old folder left
    assert sorted(os.listdir(out)) == ["index.json", "manifest.json", "part-00000",
                                       "part-00001"]
    assert commit.read_manifest() == manifest
    assert manifest["export_key"] == "new" and manifest["samples"] == 3
    with open(out / "index.json", encoding="utf-8") as f:
        assert [s["raw_data"]["basename"] for s in json.load(f)["shards"]] == [
            "part-00000/shard.00000.mds", "part-00001/shard.00000.mds"]


def test_local_commit_without_an_earlier_export_and_an_unreadable_manifest(tmp_path):
    commit = LocalCommit(str(tmp_path / "train"), "k")
    assert commit.read_manifest() is None
    _plain_staging(commit)
    commit.commit([{"partition": p, "samples": p + 1, "checksum": "c"} for p in range(2)],
                  {}, bucketed=False)
    assert sorted(os.listdir(tmp_path)) == ["train"]
    (tmp_path / "train" / "manifest.json").write_text("{torn")
    assert commit.read_manifest() is None


def test_a_task_attempt_publishes_its_partition_and_a_second_finisher_yields(tmp_path):
    """The task side of the local layout: the first attempt to finish renames its folder
    to the partition's, with its record inside; a later attempt of the same partition
    deletes its copy and reports the winner's record instead of its own."""
    from etl.writers.mds.checksum import PART_META
    from etl.writers.mds.task import _publish_local

    part_dir = tmp_path / "part-00003"
    first, second = (tmp_path / "_attempts" / f"part-00003-t{t}" for t in (1, 2))
    for attempt, data in ((first, b"first"), (second, b"second")):
        attempt.mkdir(parents=True)
        (attempt / "shard.00000.mds").write_bytes(data)
    won = {"partition": 3, "samples": 5, "checksum": "aa", "dir": "part-00003", "indexes": "{}"}
    assert _publish_local(won, str(first), str(part_dir)) == won
    assert not first.exists() and (part_dir / "shard.00000.mds").read_bytes() == b"first"
    assert json.loads((part_dir / PART_META).read_text()) == won

    lost = {**won, "checksum": "bb"}
    assert _publish_local(lost, str(second), str(part_dir)) == won
    assert not second.exists() and (part_dir / "shard.00000.mds").read_bytes() == b"first"
    assert json.loads((part_dir / PART_META).read_text()) == won
