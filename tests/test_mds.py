"""The partition-wise MDS writer, read back with streaming.StreamingDataset."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import replace

import numpy as np
import pytest
from conftest import jpeg_bytes
from PIL import Image
from pyspark.sql import functions as F

from etl.transforms.export import FIXED_COLUMNS
from etl.writers.mds import ExportSettings, export_mds


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
    from mds_read import read_mds

    return read_mds(path)


def _files(root):
    return {
        os.path.relpath(os.path.join(dp, f), root): open(os.path.join(dp, f), "rb").read()
        for dp, _, fs in os.walk(root)
        for f in fs
    }


def test_export_writes_one_subdir_per_task_and_one_root_index(spark, tmp_path):
    df, data = _rows(spark, 25)
    out = str(tmp_path / "exp")
    res = export_mds(df, out, ExportSettings(partitions=3, size_limit=1 << 16,
                                             compression=None, hashes=("xxh64",)))
    assert res.samples == 25
    assert sorted(os.listdir(out)) == [
        "index.json", "manifest.json", "part-00000", "part-00001", "part-00002"]
    index = json.load(open(os.path.join(out, "index.json")))
    assert sum(s["samples"] for s in index["shards"]) == 25
    assert all(s["raw_data"]["basename"].startswith("part-000") for s in index["shards"])
    assert sorted(index["shards"][0]["column_names"]) == sorted([*FIXED_COLUMNS, "caption"])
    assert os.listdir(tmp_path) == ["exp"]  # no staging or attempt leftovers
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["samples"] == 25 and manifest["checksum"] == res.checksum

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
    export_mds(df, out, ExportSettings(partitions=2, size_limit=1 << 16, compression=None))
    first = _files(out)
    shutil.rmtree(out)
    export_mds(df.orderBy(F.desc("caption")), out,
               ExportSettings(partitions=2, size_limit=1 << 16, compression=None))
    assert _files(out) == first
    assert os.listdir(tmp_path) == ["exp"]


def test_compressed_export_reads_back(spark, tmp_path):
    df, data = _rows(spark, 6)
    out = str(tmp_path / "z")
    export_mds(df, out, ExportSettings(partitions=2, size_limit=1 << 16, compression="zstd"))
    assert sorted(s["caption"] for s in read_all(out)) == sorted(d[1] for d in data)


def test_non_jpeg_bytes_fail_and_publish_nothing(spark, tmp_path):
    df, _ = _rows(spark, 2)
    bad = df.withColumn("image", F.lit(b"\x89PNG not a jpeg"))
    with pytest.raises(Exception, match="not a JPEG"):
        export_mds(bad, str(tmp_path / "bad"),
                   ExportSettings(partitions=1, size_limit=1 << 16, compression=None))
    assert not os.path.exists(tmp_path / "bad")
    # The staging folder stays for a resume; it holds no finished partition.
    (staging,) = os.listdir(tmp_path)
    assert staging.startswith(".bad.staging-")
    assert not [p for p in os.listdir(tmp_path / staging) if p.startswith("part-")]


def test_rerun_with_same_settings_is_a_no_op_and_other_seed_reorders(spark, tmp_path):
    df, _ = _rows(spark, 10)
    out = str(tmp_path / "exp")
    kw = ExportSettings(partitions=2, size_limit=1 << 16, compression=None)
    first = export_mds(df, out, kw)
    mtime = os.stat(os.path.join(out, "index.json")).st_mtime_ns
    again = export_mds(df, out, kw)
    assert again.checksum == first.checksum and again.resumed_partitions == 2
    assert os.stat(os.path.join(out, "index.json")).st_mtime_ns == mtime  # untouched
    other = export_mds(df, out, replace(kw, seed=7))
    assert other.samples == 10 and other.checksum != first.checksum


def test_interrupted_export_resumes_finished_partitions(spark, tmp_path):
    """A run that died after finishing partition 0 left staging/part-00000 (a task
    publishes its partition by one rename when it finishes). The rerun reuses it as
    written and ends with the same bytes as an export that never failed."""
    df, _ = _rows(spark, 16)
    kw = ExportSettings(partitions=2, size_limit=1 << 16, compression=None)
    clean = export_mds(df, str(tmp_path / "clean"), kw)
    key = json.load(open(tmp_path / "clean" / "manifest.json"))["export_key"]

    staging = tmp_path / f".exp.staging-{key}"
    staging.mkdir()
    shutil.copytree(tmp_path / "clean" / "part-00000", staging / "part-00000")
    (staging / "_attempts" / "part-00001-t99").mkdir(parents=True)  # a dead attempt
    inode = os.stat(staging / "part-00000" / "index.json").st_ino

    out = str(tmp_path / "exp")
    resumed = export_mds(df, out, kw)
    assert resumed.resumed_partitions == 1
    assert os.stat(os.path.join(out, "part-00000", "index.json")).st_ino == inode
    assert resumed.checksum == clean.checksum
    assert _files(out) == _files(str(tmp_path / "clean"))
    assert sorted(os.listdir(tmp_path)) == ["clean", "exp"]


def test_verify_export_passes_and_catches_a_corrupt_shard(spark, tmp_path):
    from etl.jobs.verify_export import verify_export

    df, _ = _rows(spark, 12)
    out = str(tmp_path / "exp")
    export_mds(df, out, ExportSettings(partitions=2, size_limit=1 << 16, compression=None,
                                       hashes=("xxh64",)))
    fds = len(os.listdir("/proc/self/fd"))
    report = verify_export(out, loader_workers=2, loader_samples=8)
    assert report.ok, report.problems
    assert (report.samples, report.images_decoded) == (12, 12) and report.loader_samples >= 8
    # StreamingDataset's shared memory stays in the child that read the export: the
    # caller (a driver verifying export after export) keeps no descriptor of it.
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert not [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")
                and os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/")]

    index = json.load(open(os.path.join(out, "index.json")))
    shard = os.path.join(out, index["shards"][0]["raw_data"]["basename"])
    data = bytearray(open(shard, "rb").read())
    data[-10] ^= 0xFF  # flip bits inside the last sample's bytes
    open(shard, "wb").write(bytes(data))
    problems = verify_export(out, loader_workers=0, loader_samples=4).problems
    assert any("xxh64 hash mismatch" in p for p in problems)
    assert any("checksum" in p for p in problems)


def test_batch_encoder_matches_mdswriter_byte_for_byte():
    """encode_batch must produce exactly what streaming's own MDSWriter.encode_sample
    produces (jpeg aside, which the stock writer re-encodes from a PIL image)."""
    import pyarrow as pa
    from streaming import MDSWriter

    from etl.writers.mds import encode_batch

    columns = {"sample_id": "str", "blob": "bytes", "w": "int32", "score": "float64",
               "n": "int64", "caption": "str"}
    table = pa.table({
        "sample_id": ["a", "bb", "ccc"],
        "blob": [b"", b"\x00\x01", b"xyz" * 50],
        "w": pa.array([1, -2, 300], pa.int32()),
        "score": [0.5, -1.25, 3.0],
        "n": pa.array([2**40, 0, -7], pa.int64()),
        "caption": ["", "ünïcode ✓", "plain"],
    })
    batch = table.slice(1, 2).to_batches()[0]  # a sliced batch: non-zero array offsets
    rows = table.slice(1, 2).to_pylist()
    with MDSWriter(out=tempfile.mkdtemp(), columns=columns) as stock:
        expected = [stock.encode_sample(r) for r in rows]
    assert encode_batch(batch, columns) == expected


def test_batch_encoder_rejects_nulls_and_non_jpeg_bytes():
    import pyarrow as pa

    from etl.writers.mds import encode_batch

    with pytest.raises(ValueError, match="'caption'"):
        encode_batch(pa.record_batch({"caption": ["a", None]}), {"caption": "str"})
    with pytest.raises(ValueError, match="not a JPEG"):
        encode_batch(pa.record_batch({"image": [b"\x89PNG"]}), {"image": "jpeg"})


@pytest.mark.parametrize("compression,hashes", [(None, []), ("zstd:7", ["sha1", "xxh64"])])
def test_shard_files_and_index_match_stock_mdswriter_byte_for_byte(tmp_path, compression,
                                                                   hashes):
    """lakeshard's writer (its own, so that writing imports no torch) gives exactly the
    files and index of streaming's own MDSWriter, across several shards, plain (samples
    written straight to the shard file, hashed on the way) and compressed with MDS
    hashes; the file digests it records are those of the files on disk."""
    import hashlib
    import json

    import pyarrow as pa
    from streaming import MDSWriter

    from etl.writers.mds import encode_batch
    from etl.writers.mds.writer import PassThroughMDSWriter

    columns = {"sample_id": "str", "blob": "bytes", "w": "int32", "caption": "str"}
    rng = np.random.default_rng(3)
    table = pa.table({
        "sample_id": [f"s{i:03d}" for i in range(120)],
        "blob": [rng.bytes(int(n)) for n in rng.integers(0, 30_000, 120)],
        "w": pa.array(rng.integers(-5, 5000, 120), pa.int32()),
        "caption": [f"caption ✓ {i} " * (i % 7) for i in range(120)],
    })
    size_limit = 200_000  # several shards
    with MDSWriter(out=str(tmp_path / "stock"), columns=columns, size_limit=size_limit,
                   compression=compression, hashes=hashes) as w:
        for row in table.to_pylist():
            w.write(row)
    ours = PassThroughMDSWriter(local=str(tmp_path / "ours"), columns=columns,
                                size_limit=size_limit, compression=compression, hashes=hashes)
    with ours:
        for batch in table.to_batches(max_chunksize=17):
            for data in encode_batch(batch, columns):
                ours.write_encoded(data)
    stock_files = sorted(p.name for p in (tmp_path / "stock").iterdir())
    assert stock_files == sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert len(stock_files) > 3  # index.json + several shards
    for name in stock_files:
        assert (tmp_path / "stock" / name).read_bytes() == (tmp_path / "ours" / name).read_bytes()
    for name, digest in ours.digests().items():
        if name != "index.json":
            assert hashlib.sha256((tmp_path / "ours" / name).read_bytes()).hexdigest() == digest
    assert set(ours.digests()) == set(stock_files)
    assert json.loads((tmp_path / "ours" / "index.json").read_text()) == ours.index()
    assert ([s["sample_id"] for s in read_all(str(tmp_path / "ours"))]
            == table.column("sample_id").to_pylist())


def test_the_mds_writer_imports_no_torch():
    """A writing task (or the driver) imports the writer and encodes samples without
    torch, which ``import streaming`` would bring (seconds of CPU in each fresh Python
    worker); streaming's own classes are still importable afterwards in that process."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from etl.writers.mds.lean import lean_streaming\n"
        "lean_streaming()\n"
        "import pyarrow as pa\n"
        "from etl.writers.mds.codec import encode_batch\n"
        "from etl.writers.mds.writer import PassThroughMDSWriter\n"
        "import tempfile, os\n"
        "d = tempfile.mkdtemp()\n"
        "with PassThroughMDSWriter(local=os.path.join(d, 'o'), columns={'a': 'str'},\n"
        "                          size_limit=1 << 20, compression='zstd') as w:\n"
        "    for data in encode_batch(pa.record_batch({'a': ['x', 'y']}), {'a': 'str'}):\n"
        "        w.write_encoded(data)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from streaming import StreamingDataset\n"
        "assert 'torch' in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _inc_rows(spark, rows):
    """`rows`: (sample_id, caption, colour) -> export rows with a JPEG each and the
    colour as the image's identity (what a curated row's image_sha256 is)."""
    data = [(jpeg_bytes((16, 16), color=(c, 10, 10)), cap, sid, "s", 16, 16, 16, 16, str(c))
            for sid, cap, c in rows]
    schema = ("image binary, caption string, sample_id string, source string, width int, "
              "height int, original_width int, original_height int, _identity string")
    return spark.createDataFrame(data, schema)


def _inodes(out, part):
    return {f: os.stat(os.path.join(out, part, f)).st_ino
            for f in os.listdir(os.path.join(out, part))}


def test_incremental_export_writes_only_what_changed(spark, tmp_path):
    """With the export settings unchanged and only the table's lineage moving, rows that
    join go to a new partition, a partition that lost or changed a row is written again
    (as a new partition), and every other partition stays as it was, same files. What
    streams back is always exactly the current rows."""
    from etl.jobs.verify_export import verify_export

    out = str(tmp_path / "exp")
    kw = ExportSettings(partitions=8, size_limit=1 << 16, compression=None,
                        incremental=True, identity="_identity", manifest={"name": "exp"})
    rows = {f"id{i:03d}": (f"caption {i}", i) for i in range(80)}

    def export(version):
        df = _inc_rows(spark, [(k, c, col) for k, (c, col) in rows.items()])
        return export_mds(df, out, replace(kw, lineage={"table_version": version}))

    def streamed():
        return {s["sample_id"]: s["caption"] for s in read_all(out)}

    def manifest():
        return json.load(open(os.path.join(out, "manifest.json")))

    export(1)
    first = manifest()
    assert first["part_ids"] == list(range(8)) and "increment" not in first
    before = {p: _inodes(out, f"part-{p:05d}") for p in range(8)}

    # Two rows join: one new partition with just them; the four stay, file for file.
    rows.update({"id900": ("new a", 200), "id901": ("new b", 201)})
    res = export(2)
    m = manifest()
    assert m["increment"]["mode"] == "incremental"
    assert (m["increment"]["added"], m["increment"]["departed"], m["increment"]["changed"]) \
        == (2, 0, 0)
    assert m["part_ids"] == list(range(9)) and res.kept_partitions == 8
    assert [p["samples"] for p in m["parts"]][8] == 2
    assert {p: _inodes(out, f"part-{p:05d}") for p in range(8)} == before
    assert streamed() == {k: c for k, (c, _) in rows.items()} and res.samples == 82

    # One row leaves, one changes its caption, one its image: the partitions that held
    # them are rewritten, as new partitions; the others are kept.
    ids = {p["partition"]: set(pq_ids(out, p)) for p in m["parts"]}
    part_of = {sid: p for p, sids in ids.items() for sid in sids}
    gone, recaptioned, reimaged = "id001", "id002", "id003"
    del rows[gone]
    rows[recaptioned] = ("a longer caption", rows[recaptioned][1])
    rows[reimaged] = (rows[reimaged][0], 250)
    touched = {part_of[gone], part_of[recaptioned], part_of[reimaged]}
    res = export(3)
    m = manifest()
    assert (m["increment"]["added"], m["increment"]["departed"], m["increment"]["changed"]) \
        == (0, 1, 2)
    assert set(m["increment"]["rewritten_parts"]) == touched
    kept = [p for p in range(9) if p not in touched]
    assert m["increment"]["kept_parts"] == kept
    assert all(p in m["part_ids"] for p in kept) and not touched & set(m["part_ids"])
    assert min(set(m["part_ids"]) - set(kept)) == 9  # new ids after the last one
    assert all(_inodes(out, f"part-{p:05d}") == before[p] for p in kept if p < 8)
    assert sum(p["samples"] for p in m["parts"]) == len(rows) == res.samples
    assert streamed() == {k: c for k, (c, _) in rows.items()}
    report = verify_export(out, loader_workers=0, loader_samples=4)
    assert report.ok, report.problems
    assert sorted(os.listdir(tmp_path)) == ["exp"]  # no staging left behind

    # Only the lineage moves: nothing is written, every partition kept.
    parts_before = manifest()["part_ids"]
    res = export(4)
    m = manifest()
    assert m["increment"]["written_samples"] == 0 and m["part_ids"] == parts_before
    assert m["table_version"] == 4 and res.samples == len(rows)

    # Most rows change: the whole export is rewritten (and compacted to 8 partitions).
    rows = {k: (c + "!", col) for k, (c, col) in rows.items()}
    export(5)
    m = manifest()
    assert m["increment"]["mode"] == "rewrite" and m["part_ids"] == list(range(8))
    assert streamed() == {k: c for k, (c, _) in rows.items()}
    assert verify_export(out, loader_workers=0, loader_samples=4).ok


def pq_ids(out, part):
    import pyarrow.parquet as pq

    from etl.writers.mds import PART_IDS

    return pq.read_table(os.path.join(out, part["dir"], PART_IDS)).column("sample_id").to_pylist()


def test_an_increment_is_written_whole_past_its_share_partition_count_or_ids():
    """Why an incremental export rewrites everything instead (the manifest's
    ``increment.reason``): more than half its rows to write, more than 4x the configured
    partitions, or partition ids past part-99999; otherwise only what changed."""
    from etl.writers.mds.increment import _rewrite_reason

    def reason(to_write, total=100, parts_after=8, next_id=9):
        return _rewrite_reason(to_write, total, parts_after=parts_after, next_id=next_id,
                               partitions=8)

    assert reason(50) == "only what changed"
    assert reason(51) == "51 of 100 rows to write (> 50%)"
    assert reason(10, parts_after=32) == "only what changed"
    assert reason(10, parts_after=33) == "33 partitions (> 4 x 8): rewritten to compact them"
    assert reason(10, next_id=99_999) == "only what changed"
    assert reason(10, next_id=100_000) == "partition ids exhausted"
    assert reason(60, parts_after=40, next_id=100_000).startswith("60 of 100")  # share first


def test_rows_the_driver_holds_export_as_spark_exports_them(spark, tmp_path, monkeypatch):
    """`held` rows (local data the driver read): the diff is made on the driver and a
    small write too, by the tasks' own partition writer in this process. Export after
    export -- a first one, rows joining, a row leaving and one changing, aspect-ratio
    buckets -- the files and manifest are byte for byte Spark's; past DRIVER_WRITE_ROWS
    the driver's plan is written by Spark tasks, again with the same bytes."""
    from etl.config import BucketSpec
    from etl.writers import mds
    from etl.writers.mds import task as task_mod

    written_here = []
    real = task_mod._write_partition

    def spy(task, batches, index, attempt_id):  # counts the writes made in this process
        written_here.append(task.part_offset + index)
        return real(task, batches, index, attempt_id)

    monkeypatch.setattr(task_mod, "_write_partition", spy)
    rows = {f"id{i:03d}": (f"caption {i}", i) for i in range(40)}
    sizes = {sid: (16 + 9 * (i % 3), 16) for i, sid in enumerate(rows)}

    def frame():
        data = [(jpeg_bytes(sizes.get(sid, (16, 16)), color=(c, 10, 10)), cap, sid, "s",
                 *sizes.get(sid, (16, 16)), 16, 16, str(c)) for sid, (cap, c) in rows.items()]
        return spark.createDataFrame(data, (
            "image binary, caption string, sample_id string, source string, width int, "
            "height int, original_width int, original_height int, _identity string"))

    def export(out, version, held, buckets=None):
        return export_mds(frame(), str(tmp_path / out), ExportSettings(
            partitions=4, size_limit=1 << 12, compression=None, incremental=True,
            identity="_identity", manifest={"name": "exp"},
            lineage={"table_version": version}, buckets=buckets, held=held))

    buckets = BucketSpec(base_resolution=256, patch_size=32)
    steps = [lambda: None, lambda: rows.update({"id900": ("new", 200), "id901": ("x", 201)}),
             lambda: (rows.pop("id001"), rows.update({"id002": ("longer caption", 2)}))]
    for version, step in enumerate(steps):
        step()
        for spec, name in ((None, "plain"), (buckets, "buckets")):
            written_here.clear()
            spark_side = export(f"spark-{name}", version, held=False, buckets=spec)
            assert written_here == []  # Spark's tasks wrote it
            here = export(f"held-{name}", version, held=True, buckets=spec)
            assert written_here and sorted(written_here) == written_here
            assert here == replace(spark_side, path=here.path)
            assert _files(str(tmp_path / f"held-{name}")) == \
                _files(str(tmp_path / f"spark-{name}"))
    increment = json.load(open(tmp_path / "held-plain" / "manifest.json"))["increment"]
    assert (increment["added"], increment["departed"], increment["changed"]) == (0, 1, 1)
    assert {s["sample_id"] for s in read_all(str(tmp_path / "held-plain"))} == set(rows)

    # Too many rows for the driver to write: its plan, written by Spark's tasks.
    monkeypatch.setattr(mds, "DRIVER_WRITE_ROWS", 0)
    rows.update({f"id{i}": ("more", i) for i in range(950, 955)})
    written_here.clear()
    spark_side = export("spark-plain", 3, held=False)
    here = export("held-plain", 3, held=True)
    assert written_here == [] and here == replace(spark_side, path=here.path)
    assert _files(str(tmp_path / "held-plain")) == _files(str(tmp_path / "spark-plain"))


def test_the_writer_uploads_each_file_once_written_and_cleans_up_when_an_upload_fails(
        tmp_path):
    """With an upload function (an S3 upload in the tasks), every file -- shards, then
    index.json -- is handed over from its path, with the bytes the digests describe, and
    deleted; the local folder goes at the end. An upload that fails fails the write
    (finish raises it) and still leaves no local folder behind."""
    import hashlib
    import threading

    import pyarrow as pa

    from etl.writers.mds import encode_batch
    from etl.writers.mds.writer import PassThroughMDSWriter

    columns = {"sample_id": "str", "blob": "bytes"}
    batch = pa.record_batch({"sample_id": [f"s{i}" for i in range(40)],
                             "blob": [bytes([i]) * 5000 for i in range(40)]})
    got, lock = {}, threading.Lock()

    def upload(name, path):
        with open(path, "rb") as f:
            data = f.read()
        with lock:
            got[name] = data

    local = tmp_path / "attempt"
    with PassThroughMDSWriter(local=str(local), columns=columns, size_limit=50_000,
                              compression="zstd", hashes=["xxh64"], upload=upload) as w:
        for data in encode_batch(batch, columns):
            w.write_encoded(data)
    assert not local.exists()
    assert set(got) == set(w.digests()) and "index.json" in got and len(got) > 3
    assert {n: hashlib.sha256(d).hexdigest() for n, d in got.items()} == w.digests()
    assert json.loads(got["index.json"]) == w.index()

    def failing(name, path):
        raise OSError(f"no bucket for {name}")

    local = tmp_path / "failed"
    w = PassThroughMDSWriter(local=str(local), columns=columns, size_limit=50_000,
                             upload=failing)
    with pytest.raises((OSError, RuntimeError), match="no bucket"):
        with w:
            for data in encode_batch(batch, columns):
                w.write_encoded(data)
    assert not local.exists()
