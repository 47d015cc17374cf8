"""Source adapters against real files on disk."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import jpeg_bytes, png_bytes

from etl.config import ConfigError, SourceConfig
from etl.schema import INGEST_COLUMNS
from etl.sources import adapter_for, finish_ingest


def _read(spark, src):
    adapter = adapter_for(src.kind)
    adapter.check_inputs(src)
    df = finish_ingest(adapter.read(spark, src), src)
    assert tuple(df.columns) == INGEST_COLUMNS
    return {r.source_key: r for r in df.collect()}


def test_image_folder_recursive_with_sidecar_captions_and_empty_files(spark, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.jpg").write_bytes(jpeg_bytes())
    (tmp_path / "a.txt").write_text("  a red square \n")
    (tmp_path / "sub" / "b.PNG").write_bytes(png_bytes())
    (tmp_path / "sub" / "empty.jpg").write_bytes(b"")
    (tmp_path / "readme.md").write_text("not an image")
    src = SourceConfig(name="f", kind="image_folder", path=str(tmp_path))
    rows = _read(spark, src)
    assert set(rows) == {"a.jpg", "sub/b.PNG", "sub/empty.jpg"}
    assert rows["a.jpg"].caption_original == "a red square"
    assert rows["sub/b.PNG"].caption_original is None
    assert rows["a.jpg"].image_bytes == jpeg_bytes()
    assert rows["sub/empty.jpg"].image_bytes == b""  # counted, rejected later as empty
    assert all(r.read_status == "ok" for r in rows.values())


def test_image_folder_missing_path_fails_before_spark(tmp_path):
    src = SourceConfig(name="gone", kind="image_folder", path=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="'gone'.*does not exist"):
        adapter_for(src.kind).check_inputs(src)


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
                       columns={"key": "id", "image": "img", "caption": "alt"})
    rows = _read(spark, src)
    assert rows["1"].caption_original == "cap one"
    assert json.loads(rows["1"].metadata_json) == {"score": 0.5}
    assert (rows["1"].read_status, rows["2"].read_status) == ("ok", "rejected")
    assert rows["2"].read_reason == "missing_image"
    nokey = [r for k, r in rows.items() if k.startswith("null-key:")]
    assert len(nokey) == 1 and nokey[0].read_reason == "missing_key"
    assert rows["1"].source_uri.endswith("t.parquet")


def test_table_mapping_to_missing_column_fails_before_spark(tmp_path):
    path = tmp_path / "t.parquet"
    _write_table(path, [{"id": "1", "img": b"x", "alt": "a", "score": 1.0}])
    src = SourceConfig(name="t", kind="table", path=str(path),
                       columns={"key": "id", "image": "image_bytes"})
    needle = "columns.image maps to 'image_bytes', which the table lacks"
    with pytest.raises(ConfigError, match=needle):
        adapter_for(src.kind).check_inputs(src)
