"""The partition-wise MDS writer, read back with streaming.StreamingDataset."""

from __future__ import annotations

import json
import os

import pytest
from conftest import jpeg_bytes
from PIL import Image
from pyspark.sql import functions as F

from etl.writers.mds import MDS_COLUMNS, export_mds


@pytest.fixture(autouse=True)
def _clean_streaming_shm():
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    yield


def _rows(spark, n):
    data = [
        (jpeg_bytes((16 + i, 16), color=(i * 7 % 255, 10, 10)), f"caption {i}", f"id{i:03d}",
         "s" + str(i % 2), 16 + i, 16, 32 + i, 32)
        for i in range(n)
    ]
    schema = ("image binary, caption string, sample_id string, source string, width int, "
              "height int, original_width int, original_height int")
    return spark.createDataFrame(data, schema), data


def read_all(path):
    from streaming import StreamingDataset

    ds = StreamingDataset(local=path, shuffle=False, batch_size=1)
    return [ds[i] for i in range(len(ds))]


def _files(root):
    return {
        os.path.relpath(os.path.join(dp, f), root): open(os.path.join(dp, f), "rb").read()
        for dp, _, fs in os.walk(root)
        for f in fs
    }


def test_export_writes_one_subdir_per_task_and_one_root_index(spark, tmp_path):
    df, data = _rows(spark, 25)
    out = str(tmp_path / "exp")
    res = export_mds(df, out, partitions=3, size_limit=1 << 16, compression=None,
                     hashes=("xxh64",), work_id="w1")
    assert res.samples == 25
    assert sorted(os.listdir(out)) == ["index.json", "part-00000", "part-00001", "part-00002"]
    index = json.load(open(os.path.join(out, "index.json")))
    assert sum(s["samples"] for s in index["shards"]) == 25
    assert all(s["raw_data"]["basename"].startswith("part-000") for s in index["shards"])
    assert sorted(index["shards"][0]["column_names"]) == sorted(MDS_COLUMNS)
    assert os.listdir(tmp_path) == ["exp"]  # no staging or attempt leftovers

    by_id = {s["sample_id"]: s for s in read_all(out)}
    assert len(by_id) == 25
    for _image, caption, sid, source, w, h, ow, _oh in data:
        s = by_id[sid]
        assert isinstance(s["image"], Image.Image) and s["image"].format == "JPEG"
        assert s["image"].size == (w, h)
        assert (s["caption"], s["source"], s["width"], s["original_width"]) == (
            caption, source, w, ow
        )
    # JPEG bytes pass through unchanged: the shards hold exactly the input bytes.
    shard_bytes = b"".join(
        open(os.path.join(out, s["raw_data"]["basename"]), "rb").read() for s in index["shards"]
    )
    assert all(image in shard_bytes for image, *_ in data)


def test_reexport_is_identical_and_replaces_the_old_one(spark, tmp_path):
    df, _ = _rows(spark, 12)
    out = str(tmp_path / "exp")
    export_mds(df, out, partitions=2, size_limit=1 << 16, compression=None, hashes=(),
               work_id="a")
    first = _files(out)
    export_mds(df.orderBy(F.desc("caption")), out, partitions=2, size_limit=1 << 16,
               compression=None, hashes=(), work_id="b")
    assert _files(out) == first
    assert os.listdir(tmp_path) == ["exp"]


def test_compressed_export_reads_back(spark, tmp_path):
    df, data = _rows(spark, 6)
    out = str(tmp_path / "z")
    export_mds(df, out, partitions=2, size_limit=1 << 16, compression="zstd", hashes=(),
               work_id="z")
    assert sorted(s["caption"] for s in read_all(out)) == sorted(d[1] for d in data)


def test_non_jpeg_bytes_fail_and_leave_no_export(spark, tmp_path):
    df, _ = _rows(spark, 2)
    bad = df.withColumn("image", F.lit(b"\x89PNG not a jpeg"))
    with pytest.raises(Exception, match="not a JPEG"):
        export_mds(bad, str(tmp_path / "bad"), partitions=1, size_limit=1 << 16,
                   compression=None, hashes=(), work_id="x")
    assert os.listdir(tmp_path) == []
