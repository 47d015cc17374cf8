"""Source adapters against real files on disk; config errors before any Spark job."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import jpeg_bytes, make_config, png_bytes, write_tar

from etl.config import ConfigError, SourceConfig
from etl.schema import SOURCE_COLUMNS
from etl.sources import adapter_for, finish_ingest
from etl.sources.listing import expand_braces
from udfs.fetch import fetch_ref


def _read(spark, src):
    adapter = adapter_for(src.kind)
    adapter.check_inputs(src)
    df = finish_ingest(adapter.read(spark, src), src)
    assert tuple(df.columns) == SOURCE_COLUMNS
    return {r.source_key: r for r in df.collect()}


def _bytes(row):
    """The image bytes a row carries or references."""
    if row.image_bytes is not None:
        return row.image_bytes
    return fetch_ref(row.image_ref, row.image_offset, row.image_length).data


def test_image_folder_recursive_with_sidecars_and_empty_files(spark, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.jpg").write_bytes(jpeg_bytes())
    (tmp_path / "a.txt").write_text("  a red square \n")
    (tmp_path / "sub" / "b.PNG").write_bytes(png_bytes())
    (tmp_path / "sub" / "c.jpg").write_bytes(jpeg_bytes())
    (tmp_path / "sub" / "c.json").write_text(json.dumps(
        {"caption": "from json", "lic": "CC0", "wm": 0.25, "photographer": "ann"}))
    (tmp_path / "sub" / "empty.jpg").write_bytes(b"")
    (tmp_path / "readme.md").write_text("not an image")
    src = SourceConfig(name="f", kind="image_folder", path=str(tmp_path),
                       columns={"license": "lic", "watermark": "wm"})
    rows = _read(spark, src)
    assert set(rows) == {"a.jpg", "sub/b.PNG", "sub/c.jpg", "sub/empty.jpg"}
    assert rows["a.jpg"].caption_original == "a red square"
    assert rows["sub/b.PNG"].caption_original is None
    c = rows["sub/c.jpg"]
    assert (c.caption_original, c.license, c.upstream_watermark) == ("from json", "CC0", 0.25)
    assert json.loads(c.metadata_json) == {"photographer": "ann"}
    assert _bytes(rows["a.jpg"]) == jpeg_bytes()
    assert _bytes(rows["sub/empty.jpg"]) == b""  # counted, rejected later as empty
    assert all(r.read_status == "ok" for r in rows.values())
    # size:mtime of the image (and its sidecars): what incremental runs compare
    assert rows["a.jpg"].fingerprint.startswith(f"{len(jpeg_bytes())}:")
    assert "|txt:" in rows["a.jpg"].fingerprint


def test_image_folder_missing_path_fails_before_spark(tmp_path):
    src = SourceConfig(name="gone", kind="image_folder", path=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="'gone'.*does not exist"):
        adapter_for(src.kind).check_inputs(src)


def test_webdataset_groups_members_by_key_over_brace_patterns(spark, tmp_path):
    write_tar(tmp_path / "s-00.tar", [("x/001.jpg", jpeg_bytes()), ("x/001.txt", b"first"),
                                 ("002.png", png_bytes()), ("002.json", b'{"caption": "2nd"}')])
    write_tar(tmp_path / "s-01.tar", [("003.webp", b"RIFF"), ("003.cls", b"7")])
    write_tar(tmp_path / "s-02.tar", [("004.jpg", b"not in the pattern")])
    src = SourceConfig(name="w", kind="webdataset", path=str(tmp_path / "s-{00..01}.tar"))
    rows = _read(spark, src)
    assert set(rows) == {"x/001", "002", "003"}
    assert (rows["x/001"].caption_original, rows["002"].caption_original) == ("first", "2nd")
    assert _bytes(rows["x/001"]) == jpeg_bytes() and _bytes(rows["002"]) == png_bytes()
    assert rows["003"].image_bytes is None and _bytes(rows["003"]) == b"RIFF"
    assert rows["x/001"].source_uri.endswith("s-00.tar")


def test_brace_expansion():
    assert expand_braces("a{1,2}-{08..10}") == ["a1-08", "a1-09", "a1-10", "a2-08", "a2-09",
                                               "a2-10"]


def _write_table(path, rows):
    schema = pa.schema([("id", pa.string()), ("img", pa.binary()), ("alt", pa.string()),
                        ("score", pa.float64())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def test_table_maps_columns_and_keeps_the_rest_as_metadata(spark, tmp_path):
    path = tmp_path / "t.parquet"
    _write_table(path, [
        {"id": "1", "img": jpeg_bytes(), "alt": "cap one", "score": 0.5},
        {"id": "2", "img": None, "alt": "no bytes", "score": 0.1},
        {"id": None, "img": b"zz", "alt": "no key", "score": 0.2},
    ])
    src = SourceConfig(name="t", kind="table", path=str(path),
                       columns={"key": "id", "image": "img", "caption": "alt",
                                "quality": "score"})
    rows = _read(spark, src)
    assert rows["1"].caption_original == "cap one" and rows["1"].upstream_quality == 0.5
    assert rows["1"].metadata_json is None  # every column mapped
    assert (rows["1"].read_status, rows["2"].read_status) == ("ok", "rejected")
    assert rows["2"].read_reason == "missing_image"
    nokey = [r for k, r in rows.items() if k.startswith("null-key:")]
    assert len(nokey) == 1 and nokey[0].read_reason == "missing_key"
    assert rows["1"].source_uri.endswith("t.parquet")


def test_table_csv_and_jsonl_with_url_references(spark, tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.jpg").write_bytes(jpeg_bytes())
    (tmp_path / "list.csv").write_text(
        "key,path,caption,extra\nk1,imgs/a.jpg,a csv caption,x\n"
        f"k2,{(tmp_path / 'imgs' / 'a.jpg').as_uri()},second,y\n")
    rows = _read(spark, SourceConfig(name="c", kind="table", path=str(tmp_path / "list.csv"),
                                     columns={"key": "key", "url": "path", "caption": "caption"}))
    assert _bytes(rows["k1"]) == jpeg_bytes() and _bytes(rows["k2"]) == jpeg_bytes()
    assert json.loads(rows["k1"].metadata_json) == {"extra": "x"}
    (tmp_path / "list.jsonl").write_text(
        json.dumps({"k": 1, "u": "https://example.org/a.jpg", "c": "x", "NSFW": "UNLIKELY"})
        + "\n")
    rows = _read(spark, SourceConfig(name="j", kind="table", path=str(tmp_path / "list.jsonl"),
                                     columns={"key": "k", "url": "u", "caption": "c",
                                              "nsfw": "NSFW"}))
    r = rows["1"]
    assert (r.image_ref, r.source_uri, r.upstream_nsfw) == (
        "https://example.org/a.jpg", "https://example.org/a.jpg", "UNLIKELY")


def test_table_over_a_glob_and_a_brace_pattern(spark, tmp_path):
    (tmp_path / "parts").mkdir()
    for i in range(3):
        _write_table(tmp_path / "parts" / f"part-{i}.parquet",
                     [{"id": f"r{i}", "img": jpeg_bytes(), "alt": f"row {i}", "score": 0.0}])
    (tmp_path / "parts" / "_SUCCESS").write_bytes(b"")
    columns = {"key": "id", "image": "img", "caption": "alt"}
    for pattern, keys in [("parts/part-*.parquet", {"r0", "r1", "r2"}),
                          ("parts/part-{0,2}.parquet", {"r0", "r2"})]:
        src = SourceConfig(name="p", kind="table", path=str(tmp_path / pattern), columns=columns)
        adapter_for(src.kind).check_inputs(src)  # the pattern is not a path to exist
        rows = _read(spark, src)
        assert set(rows) == keys and rows["r0"].caption_original == "row 0"
    src = SourceConfig(name="p", kind="table", path=str(tmp_path / "parts" / "*.csv"),
                       columns=columns)
    with pytest.raises(ConfigError, match=r"'p': path .*\*\.csv' matches no parquet"):
        adapter_for(src.kind).check_inputs(src)
    src = SourceConfig(name="gone", kind="table", path=str(tmp_path / "gone.parquet"),
                       columns=columns)
    with pytest.raises(ConfigError, match="'gone'.*does not exist"):
        adapter_for(src.kind).check_inputs(src)


def test_table_mapping_to_missing_column_fails_before_spark(tmp_path):
    path = tmp_path / "t.parquet"
    _write_table(path, [{"id": "1", "img": b"x", "alt": "a", "score": 1.0}])
    src = SourceConfig(name="t", kind="table", path=str(path),
                       columns={"key": "id", "image": "image_bytes"})
    needle = "columns.image maps to 'image_bytes', which the table lacks"
    with pytest.raises(ConfigError, match=needle):
        adapter_for(src.kind).check_inputs(src)


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_text_table_mapping_to_missing_column_fails(tmp_path, fmt):
    path = tmp_path / f"t.{fmt}"
    path.write_text("id,url\n1,a.jpg\n" if fmt == "csv" else '{"id": 1, "url": "a.jpg"}\n')
    src = SourceConfig(name="t", kind="table", path=str(path),
                       columns={"key": "id", "url": "url", "caption": "text"})
    with pytest.raises(ConfigError, match="'t': columns.caption maps to 'text'"):
        adapter_for(src.kind).check_inputs(src)


def test_lance_and_delta_mapping_checked_against_the_table(tmp_path):
    import lance

    lance.write_dataset(pa.table({"key": ["a"], "img": [b"x"]}), str(tmp_path / "t.lance"))
    src = SourceConfig(name="ln", kind="lance", path=str(tmp_path / "t.lance"),
                       columns={"key": "key", "image": "jpg"})
    with pytest.raises(ConfigError, match="'ln': columns.image maps to 'jpg'"):
        adapter_for(src.kind).check_inputs(src)
    src = SourceConfig(name="dl", kind="delta", path=str(tmp_path),
                       columns={"key": "key", "image": "img"})
    with pytest.raises(ConfigError, match="'dl': path: .*not a Delta table"):
        adapter_for(src.kind).check_inputs(src)


@pytest.mark.parametrize(
    "source, needle",
    [
        ({"kind": "ftp", "path": "/x"}, r"sources\[0\] \(s\)\.kind: unknown kind 'ftp'"),
        ({"kind": "table", "path": "/x", "columns": {"key": "k"}},
         r"\(s\)\.columns: map exactly one of 'image'"),
        ({"kind": "delta", "path": "/x", "columns": {"key": "k", "image": "i", "url": "u"}},
         r"\(s\)\.columns: map exactly one of 'image'"),
        ({"kind": "lance", "path": "/x", "columns": {"image": "i"}},
         r"\(s\)\.columns\.key: required"),
        ({"kind": "webdataset", "path": "/x", "columns": {"key": "k"}},
         r"\(s\)\.columns: 'key' is not a field a webdataset source can map"),
        ({"kind": "table", "path": "/x", "format": "xml",
          "columns": {"key": "k", "image": "i"}}, r"\(s\)\.format: 'xml'"),
    ],
)
def test_bad_source_config_names_the_source_and_field(tmp_path, source, needle):
    with pytest.raises(ConfigError, match=needle):
        make_config(tmp_path, sources=[{"name": "s", **source}])


def test_fetch_config_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="fetch.per_host"):
        make_config(tmp_path, fetch={"per_host": 0})
    with pytest.raises(ConfigError, match="fetch: unknown key 'proxy'"):
        make_config(tmp_path, fetch={"proxy": "x"})


def test_webdataset_pattern_matching_nothing_fails_before_spark(tmp_path):
    src = SourceConfig(name="w", kind="webdataset", path=str(tmp_path / "s-{0..3}.tar"))
    with pytest.raises(ConfigError, match="'w': path .* matches no tar shard"):
        adapter_for(src.kind).check_inputs(src)


def test_list_tar_reads_one_shard_into_records_and_rejects(tmp_path):
    """`list_tar` without Spark: each key's record points at its image's bytes in the
    shard; a caption without an image, a link member, an oversized caption and a bad
    sidecar are rejects on their key; data after the last member is a ``broken_tar``
    reject of its own, after the records."""
    import tarfile

    from conftest import tar_bytes

    from etl.sources.webdataset import list_tar

    image = jpeg_bytes()
    shard = tar_bytes([
        ("a/001.jpg", image), ("a/001.txt", b"first"),
        ("002.txt", b"a caption, no image"),
        ("003.jpg", image), ("003.json", b'{"caption": "from json", "license": "cc-by"}'),
        ("004.jpg", (tarfile.SYMTYPE, "/etc/passwd")), ("004.txt", b"linked"),
        ("005.jpg", image), ("005.txt", b"x" * 64),
        ("006.jpg", image), ("006.json", b"[1, 2]"),
    ])
    path = tmp_path / "s.tar"
    path.write_bytes(shard + b"not a tar header" * 64)
    rows = list_tar(f"file:{path}", path.stat().st_size, "fp1",
                    {"caption": "caption", "license": "license"}, max_caption_chars=16)
    by_key = {r["source_key"]: r for r in rows}
    with tarfile.open(path) as tf:  # where the members end: the garbage is read from there
        last = tf.getmembers()[-1]
    end = last.offset_data + -(-last.size // 512) * 512
    assert rows[-1]["source_key"] == f"s.tar#broken@{end}"
    assert rows[-1]["read_reason"] == "broken_tar"
    outcome = {k: (r["read_status"], r["read_reason"]) for k, r in by_key.items()
               if "#" not in k}
    assert outcome == {
        "a/001": ("ok", None), "002": ("rejected", "missing_image"), "003": ("ok", None),
        "004": ("rejected", "symlink"), "005": ("rejected", "caption_too_long"),
        "006": ("rejected", "invalid_sidecar"),
    }
    assert (by_key["a/001"]["caption_original"], by_key["003"]["caption_original"],
            by_key["003"]["license"]) == ("first", "from json", "cc-by")
    for key in ("a/001", "003", "005", "006"):
        r = by_key[key]
        assert r["image_ref"] == f"file:{path}" and r["fingerprint"] == "fp1"
        assert shard[r["image_offset"]:r["image_offset"] + r["image_length"]] == image
    assert by_key["002"]["image_ref"] is None
    meta = json.loads(by_key["004"]["metadata_json"])  # the link is named, never listed
    assert meta["tar_members"] == ["004.txt"] and "'004.jpg' is a link" in meta["reject_detail"]

    # Cut inside the last image: that key is truncated, the others stay as they were.
    cut = tmp_path / "cut.tar"
    cut.write_bytes(shard[:by_key["006"]["image_offset"] + 10])
    rows = {r["source_key"]: r for r in list_tar(f"file:{cut}", cut.stat().st_size, "fp2",
                                                 {"caption": "caption"})}
    assert rows["006"]["read_reason"] == "truncated"
    assert rows["a/001"]["read_status"] == "ok"

    not_a_tar = tmp_path / "n.tar"
    not_a_tar.write_bytes(b"\x01" * 2048)
    assert [(r["source_key"], r["read_reason"]) for r in list_tar(
        f"file:{not_a_tar}", 2048, "fp3", {})] == [("n.tar#unreadable", "broken_tar")]


def test_a_small_local_table_is_read_on_the_driver_as_spark_tasks_read_it(
        spark, tmp_path, monkeypatch):
    import os

    from etl.runtime.local import is_local
    from etl.sources import file_table

    root = tmp_path / "tables"
    (root / "imgs").mkdir(parents=True)
    (root / "imgs" / "a.jpg").write_bytes(jpeg_bytes())
    pq.write_table(pa.table({"id": ["p1", "p2", None], "u": ["imgs/a.jpg", "../x.jpg", "y"],
                             "c": ["one", "two", "three"], "q": [0.1, 0.2, 0.3]}),
                   root / "a.parquet")
    (root / "b.csv").write_text("id,u,c,q\nc1,imgs/a.jpg,csv,1\nc2,only,two\n")
    (root / "c.jsonl").write_text(
        json.dumps({"id": "j1", "u": "https://example.org/j.jpg", "c": "json"})
        + "\nnot json\n")
    (root / "d.parquet").write_bytes(b"PAR1 not a parquet file")
    os.mkfifo(root / "e.csv")
    src = SourceConfig(name="t", kind="table", path=str(root),
                       columns={"key": "id", "url": "u", "caption": "c", "quality": "q"})
    adapter = adapter_for("table")

    def read():
        df = finish_ingest(adapter.read(spark, src), src)
        return df, sorted(tuple(r) for r in df.collect())

    here, rows_here = read()
    monkeypatch.setattr(file_table, "DRIVER_REF_BYTES", -1)  # parquet: listed by reference
    in_tasks, rows_in_tasks = read()
    # On the driver: local data, no Python worker in the plan; above the bound: tasks.
    assert is_local(here) and not is_local(in_tasks)
    assert rows_here == rows_in_tasks
    got = {r[SOURCE_COLUMNS.index("source_key")]: r[SOURCE_COLUMNS.index("read_reason")]
           for r in rows_here}
    assert got == {"p1": None, "p2": "outside_source", "null-key:a.parquet#2": "missing_key",
                   "c1": None, "b.csv#row3": "malformed_row", "j1": None,  # its line
                   "c.jsonl#line2": "malformed_row", "d.parquet#unreadable": "unreadable_file",
                   "e.csv#unreadable": "unreadable_file"}
