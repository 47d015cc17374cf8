"""A source full of bad records: every record is accepted or rejected with a reason,
seen = accepted + rejected per source, and the job finishes."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import jpeg_bytes, make_config, png_bytes, tar_bytes
from httpserver import Server

from etl.jobs.curate import curate
from etl.pipeline.checks import check_sources

pytestmark = pytest.mark.slow


def _corrupt_row_group(path, rg_index):
    """Overwrite the middle of the largest column chunk of one row group."""
    rg = pq.ParquetFile(path).metadata.row_group(rg_index)
    col = max((rg.column(j) for j in range(rg.num_columns)),
              key=lambda c: c.total_compressed_size)
    start = col.dictionary_page_offset or col.data_page_offset
    data = bytearray(path.read_bytes())
    for i in range(start + 20, start + col.total_compressed_size - 20):
        data[i] = 0x5A
    path.write_bytes(bytes(data))


def test_bad_records_are_counted_and_rejected_with_reasons(spark, tmp_path):
    img = jpeg_bytes(size=(80, 80))
    # image_folder: ok, empty file, truncated JPEG, JSON sidecar with a null caption,
    # one with a numeric caption, one that is not JSON.
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "ok.jpg").write_bytes(img)
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "cut.jpg").write_bytes(img[: len(img) // 2])
    for stem, side in [("nullcap", '{"caption": null}'), ("numcap", '{"caption": 42}'),
                       ("badjson", "{not json")]:
        (folder / f"{stem}.png").write_bytes(png_bytes(size=(80, 80)))
        (folder / f"{stem}.json").write_text(side)
    folder_expected = {"empty": 1, "truncated": 1, "missing_caption": 1,
                       "invalid_caption": 1, "invalid_sidecar": 1}

    # webdataset: one good key, a caption without image, a member cut off by the end of
    # the file, a file that is not a tar, an empty tar.
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.tar").write_bytes(tar_bytes([("g.jpg", img), ("g.txt", b"good"),
                                               ("lonely.txt", b"caption only")]))
    cut = tar_bytes([("c.txt", b"cut"), ("c.jpg", img + b"\0" * 4000)])
    (shards / "b.tar").write_bytes(cut[:3000])  # c.jpg's data starts at byte 1536
    (shards / "c.tar").write_bytes(b"this is not a tar archive at all" * 40)
    (shards / "d.tar").write_bytes(b"")
    tar_expected = {"missing_image": 1, "truncated": 1, "broken_tar": 2}

    # table (JSONL of URLs): ok, 404, missing local file, null caption, numeric caption,
    # no key, 3 copies of one key (1 kept, 2 rejected), a line that is not JSON.
    with Server() as server:
        server.files["ok.jpg"] = img
        (tmp_path / "there.jpg").write_bytes(img)
        rows = [
            {"id": "ok", "url": f"{server.url}/img/ok.jpg", "cap": "fine"},
            {"id": "404", "url": f"{server.url}/img/gone.jpg", "cap": "dead link"},
            {"id": "nofile", "url": "nowhere/x.jpg", "cap": "missing file"},
            {"id": "nullcap", "url": "there.jpg", "cap": None},
            {"id": "numcap", "url": "there.jpg", "cap": 3.5},
            {"id": None, "url": "there.jpg", "cap": "no key"},
            {"id": "dup", "url": "there.jpg", "cap": "copy 1"},
            {"id": "dup", "url": "there.jpg", "cap": "copy 2"},
            {"id": "dup", "url": "there.jpg", "cap": "copy 3"},
        ]
        lines = [json.dumps(r) for r in rows] + ["{broken json"]
        (tmp_path / "urls.jsonl").write_text("\n".join(lines) + "\n")
        url_expected = {"http_404": 1, "missing_file": 1, "missing_caption": 1,
                        "invalid_caption": 1, "missing_key": 1, "duplicate_key": 2,
                        "malformed_row": 1}

        # parquet: 3 row groups of 2 rows, the middle one unreadable; plus an empty file.
        pdir = tmp_path / "pq"
        pdir.mkdir()
        t = pa.table({"id": [f"r{i}" for i in range(6)], "img": [img] * 6,
                      "cap": [f"row {i}" for i in range(6)]})
        pq.write_table(t, pdir / "part-0.parquet", row_group_size=2, compression="zstd")
        _corrupt_row_group(pdir / "part-0.parquet", 1)
        (pdir / "part-1.parquet").write_bytes(b"")
        pq_expected = {"unreadable_row_group": 2, "unreadable_file": 1}

        # The list mixes a loopback server and local paths: both allowed explicitly.
        fetch = {"retries": 0, "timeout_s": 5, "allow_networks": ["127.0.0.1/32"]}
        cfg = make_config(tmp_path / "out", fetch=fetch, sources=[
            {"name": "folder", "kind": "image_folder", "path": str(folder)},
            {"name": "tars", "kind": "webdataset", "path": str(shards / "*.tar")},
            {"name": "urls", "kind": "table", "path": str(tmp_path / "urls.jsonl"),
             "columns": {"key": "id", "url": "url", "caption": "cap"}, "allow_local": True},
            {"name": "pq", "kind": "table", "path": str(pdir),
             "columns": {"key": "id", "image": "img", "caption": "cap"}},
        ])
        check_sources(cfg)
        result = curate(spark, cfg, "bad-run")

    counts = {c.source: c for c in result.counts}
    for name, reasons, accepted in [("folder", folder_expected, 1), ("tars", tar_expected, 1),
                                    ("urls", url_expected, 2), ("pq", pq_expected, 4)]:
        c = counts[name]
        assert c.reasons == dict(sorted(reasons.items())), name
        assert c.accepted == accepted, name
        assert c.seen == c.accepted + c.rejected == accepted + sum(reasons.values()), name

    rejects = spark.read.format("delta").load(result.rejects_path).collect()
    by_source: dict[str, int] = {}
    for r in rejects:
        by_source[r.source] = by_source.get(r.source, 0) + 1
    assert by_source == {n: counts[n].rejected for n in counts}
    fetch = {r.source_key: (r.stage, r.reason) for r in rejects if r.stage == "fetch"}
    assert fetch == {"404": ("fetch", "http_404"), "nofile": ("fetch", "missing_file")}
    dups = sorted(r.detail for r in rejects if r.reason == "duplicate_key")
    assert dups == ["copy 2 of key dup", "copy 3 of key dup"]

    acc = spark.read.format("delta").load(result.accounting_path).where("run_id = 'bad-run'")
    stored = {(r.source, r.status): r.n for r in acc.groupBy("source", "status")
              .agg({"count": "sum"}).withColumnRenamed("sum(count)", "n").collect()}
    for name, c in counts.items():
        assert stored.get((name, "accepted"), 0) == c.accepted
        assert stored.get((name, "rejected"), 0) == c.rejected
