"""Adding and updating columns of a Lance table from Spark without rewriting image data."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import lance
import pyarrow as pa
import pytest
from pyspark.sql import functions as F

from etl.writers.lance_columns import drop_columns, ensure_columns, write_columns


def _table(spark, path: str, n: int = 30, parts: int = 3):
    rows = [(f"s{i:03d}", os.urandom(2000), i) for i in range(n)]
    df = spark.createDataFrame(rows, "sample_id string, image binary, width int")
    df.repartition(parts).write.format("lance").mode("overwrite").save(path)


def _data_files(path: str) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(path, "data").glob("*.lance"))
    }


def _column(path: str, name: str) -> dict[str, object]:
    t = lance.dataset(path).to_table(columns=["sample_id", name])
    return dict(zip(t.column(0).to_pylist(), t.column(1).to_pylist(), strict=True))


def test_new_column_for_some_rows_leaves_image_files_byte_identical(spark, tmp_path):
    path = str(tmp_path / "t.lance")
    _table(spark, path)
    before = _data_files(path)
    table_bytes = sum(p.stat().st_size for p in Path(path, "data").glob("*.lance"))
    wanted = {f"s{i:03d}": f"caption {i}" for i in range(0, 30, 3)}
    values = spark.createDataFrame(
        list(wanted.items()) + [("nope", "x")], "sample_id string, cap string"
    )

    res = write_columns(spark, path, values)

    after = _data_files(path)
    assert all(after[name] == digest for name, digest in before.items())
    got = _column(path, "cap")
    assert got == {f"s{i:03d}": wanted.get(f"s{i:03d}") for i in range(30)}
    assert (res.rows, res.unmatched, res.columns) == (10, 1, ("cap",))
    # The fragments holding a wanted row (rows land in the 3 fragments at random, so
    # counted from the table, not assumed to be all 3).
    holding = sum(
        1 for f in lance.dataset(path).get_fragments()
        if set(f.to_table(columns=["sample_id"]).column(0).to_pylist()) & set(wanted))
    assert 1 <= holding <= 3
    assert res.fragments == holding and res.version == lance.dataset(path).version
    assert 0 < res.bytes_written < table_bytes / 20
    # The images still read back unchanged and the row count did not move.
    assert lance.dataset(path).count_rows() == 30


def test_updating_an_existing_column_keeps_values_of_rows_not_mentioned(spark, tmp_path):
    path = str(tmp_path / "u.lance")
    _table(spark, path)
    first = spark.createDataFrame(
        [(f"s{i:03d}", "old") for i in range(30)], "sample_id string, cap string"
    )
    write_columns(spark, path, first)
    before = _data_files(path)
    # Values routed by the _fragment_id read option (no join on the key).
    todo = (
        spark.read.format("lance")
        .option("columns", "sample_id,width")
        .option("fragment_id", "true")
        .option("filter", "width >= 25")
        .load(path)
        .select("sample_id", "_fragment_id", F.concat(F.lit("new "), F.col("width")).alias("cap"))
    )
    res = write_columns(spark, path, todo)
    assert res.rows == 5
    got = _column(path, "cap")
    assert got == {f"s{i:03d}": (f"new {i}" if i >= 25 else "old") for i in range(30)}
    after = _data_files(path)
    assert all(after[name] == digest for name, digest in before.items())


def test_append_without_added_columns_reads_null_and_unknown_columns_are_refused(spark, tmp_path):
    path = str(tmp_path / "a.lance")
    _table(spark, path, n=6, parts=2)
    write_columns(
        spark, path, spark.createDataFrame([("s000", 1.5)], "sample_id string, score double")
    )
    more = spark.createDataFrame([("n1", b"x", 7)], "sample_id string, image binary, width long")
    more.write.format("lance").mode("append").save(path)  # width long -> table's int
    ds = lance.dataset(path)
    assert ds.schema.field("width").type == pa.int32()
    assert _column(path, "score") == {
        **{f"s{i:03d}": None for i in range(6)},
        "s000": 1.5,
        "n1": None,
    }
    extra = spark.createDataFrame([("n2", 3)], "sample_id string, brand_new int")
    with pytest.raises(Exception, match="brand_new"):
        extra.write.format("lance").mode("append").save(path)
    assert lance.dataset(path).count_rows() == 7


def test_type_conflicts_are_named_and_drop_is_metadata_only(spark, tmp_path):
    path = str(tmp_path / "d.lance")
    _table(spark, path, n=4, parts=1)
    ensure_columns(path, [pa.field("cap", pa.string())])
    with pytest.raises(ValueError, match="'cap'"):
        ensure_columns(path, [pa.field("cap", pa.int64())])
    before = _data_files(path)
    drop_columns(path, ["cap", "not_there"])
    assert "cap" not in lance.dataset(path).schema.names
    assert _data_files(path) == before
