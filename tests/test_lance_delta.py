"""Lance through the `lance` data source and Delta, in one session."""

from __future__ import annotations

import os

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest


def _frame(spark, n=50, offset=0):
    return spark.range(offset, offset + n).selectExpr(
        "id",
        "cast(id % 5 as string) as bucket",
        "cast(id as int) * 10 as width",
        "cast(concat('img', id) as binary) as image",
    )


def test_lance_and_delta_in_one_session(spark, tmp_path):
    lpath, dpath = str(tmp_path / "t.lance"), str(tmp_path / "d")
    _frame(spark, 10).write.format("lance").mode("overwrite").save(lpath)
    _frame(spark, 5, offset=10).write.format("lance").mode("append").save(lpath)
    spark.sql(f"CREATE OR REPLACE TEMPORARY VIEW lt USING lance OPTIONS (path '{lpath}')")
    assert spark.sql("SELECT count(*) AS n, max(id) AS m FROM lt").first() == (15, 14)

    spark.sql(f"CREATE TABLE delta.`{dpath}` (id BIGINT, note STRING) USING delta")
    spark.sql(f"INSERT INTO delta.`{dpath}` VALUES (1, 'a'), (2, 'b')")
    spark.sql(f"INSERT INTO delta.`{dpath}` SELECT id, bucket FROM lt WHERE id >= 13")
    got = sorted(tuple(r) for r in spark.sql(f"SELECT * FROM delta.`{dpath}`").collect())
    assert got == [(1, "a"), (2, "b"), (13, "3"), (14, "4")]


def test_each_spark_write_is_one_lance_version_and_old_versions_read_back(spark, tmp_path):
    path = str(tmp_path / "v.lance")
    _frame(spark, 20).repartition(3).write.format("lance").mode("overwrite").save(path)
    assert lance.dataset(path).version == 1
    assert len(lance.dataset(path).get_fragments()) == 3  # one fragment per task
    _frame(spark, 7, offset=100).write.format("lance").mode("append").save(path)
    _frame(spark, 4).write.format("lance").mode("overwrite").save(path)
    ds = lance.dataset(path)
    assert (ds.version, ds.count_rows()) == (3, 4)
    counts = [
        spark.read.format("lance").option("version", str(v)).load(path).count() for v in (1, 2, 3)
    ]
    assert counts == [20, 27, 4]


def test_filter_option_is_evaluated_by_lance_and_matches_arrow(spark, tmp_path):
    path = str(tmp_path / "f.lance")
    _frame(spark, 200).repartition(4).write.format("lance").mode("overwrite").save(path)
    table = lance.dataset(path).to_table()
    cases = {
        "bucket = '3' AND width >= 500": pc.and_(
            pc.equal(table["bucket"], "3"), pc.greater_equal(table["width"], 500)
        ),
        "id IN (1, 2, 199) OR id < 0": pc.is_in(table["id"], pa.array([1, 2, 199])),
        "width < 30": pc.less(table["width"], 30),
    }
    for where, mask in cases.items():
        df = spark.read.format("lance").option("filter", where).load(path)
        got = sorted(r.id for r in df.select("id").collect())
        assert got == sorted(table.filter(mask)["id"].to_pylist()), where


def test_queries_on_one_dataframe_do_not_leak_filters(spark, tmp_path):
    # Regression: with Spark's Python filter pushdown on, the second query returned
    # the rows of the first query's predicate.
    path = str(tmp_path / "leak.lance")
    _frame(spark, 200).write.format("lance").mode("overwrite").save(path)
    df = spark.read.format("lance").load(path)
    assert df.where("bucket = '3' AND width >= 500").count() == 30
    assert sorted(r.id for r in df.where("id IN (1, 2, 199) OR id < 0").collect()) == [1, 2, 199]
    assert df.count() == 200


def test_columns_option_reads_only_those_columns(spark, tmp_path):
    path = str(tmp_path / "c.lance")
    _frame(spark, 5).write.format("lance").mode("overwrite").save(path)
    df = spark.read.format("lance").option("columns", "id,width").load(path)
    assert df.columns == ["id", "width"]
    with pytest.raises(Exception, match="no column 'nope'"):
        spark.read.format("lance").option("columns", "id,nope").load(path).schema  # noqa: B018


def test_pylance_reads_spark_writes_and_spark_reads_pylance_columns(spark, tmp_path):
    path = str(tmp_path / "x.lance")
    _frame(spark, 30).repartition(2).write.format("lance").mode("overwrite").save(path)
    ds = lance.dataset(path)
    t = ds.to_table(columns=["id", "width"], filter="width > 250")
    assert sorted(t["id"].to_pylist()) == list(range(26, 30))

    # pylance adds a column without rewriting the existing data files.
    before = {f.path for frag in ds.get_fragments() for f in frag.data_files()}
    ds.add_columns({"double_width": "width * 2"})
    ds = lance.dataset(path)
    after = {f.path for frag in ds.get_fragments() for f in frag.data_files()}
    assert before < after

    rows = spark.read.format("lance").load(path).select("id", "double_width").collect()
    assert sorted((r.id, r.double_width) for r in rows) == [(i, i * 20) for i in range(30)]


def test_failed_write_commits_nothing(spark, tmp_path):
    from pyspark.sql import functions as F

    path = str(tmp_path / "fail.lance")
    _frame(spark, 10).write.format("lance").mode("overwrite").save(path)
    bad = _frame(spark, 10).withColumn(
        "id", F.when(F.col("id") == 7, F.raise_error(F.lit("boom"))).otherwise(F.col("id"))
    )
    with pytest.raises(Exception, match="boom"):
        bad.write.format("lance").mode("append").save(path)
    ds = lance.dataset(path)
    assert (ds.version, ds.count_rows()) == (1, 10)


def test_list_columns_with_only_empty_lists_in_a_task_write(spark, tmp_path):
    # Regression: Arrow IPC gives an all-empty child array a zero-length offsets
    # buffer, which pylance 14 rejected ("Error converting offset[0] ...").
    path = str(tmp_path / "lists.lance")
    schema = "id long, flags array<string>"
    spark.createDataFrame([(1, []), (2, []), (4, [])], schema).coalesce(1).write.format(
        "lance"
    ).mode("overwrite").save(path)
    spark.createDataFrame([(3, ["a", "b"])], schema).write.format("lance").mode("append").save(
        path
    )
    got = sorted((r["id"], r["flags"]) for r in lance.dataset(path).to_table().to_pylist())
    assert got == [(1, []), (2, []), (3, ["a", "b"]), (4, [])]


def test_the_driver_reads_and_appends_as_the_data_source_does(spark, tmp_path):
    from etl.writers.lance import append_local, read_local

    path = str(tmp_path / "d.lance")
    _frame(spark, 30).repartition(3).write.format("lance").mode("overwrite").save(path)
    # Appended from the driver: the same writer and commit, one more version.
    append_local(path, _frame(spark, 5, offset=30).toArrow())
    ds = lance.dataset(path)
    assert (ds.version, ds.count_rows(), len(ds.get_fragments())) == (2, 35, 4)
    for where in (None, "bucket = '3'", "id > 1000"):
        reader = spark.read.format("lance").option("version", "2").option(
            "columns", "id,bucket,image").option("row_address", "true")
        if where:
            reader = reader.option("filter", where)
        in_spark = reader.load(path)
        here = read_local(spark, path, 2, ["id", "bucket", "image"], where, row_address=True)
        assert here.schema == in_spark.schema
        plan = here._jdf.queryExecution().executedPlan().toString()
        assert "BatchEvalPython" not in plan and "PythonScan" not in plan, plan
        assert sorted(here.collect()) == sorted(in_spark.collect()), where
    addr = read_local(spark, path, 2, ["id"], "id = 31", row_address=True).first()
    assert ds._take_rows([addr._rowaddr], columns=["id"]).to_pylist() == [{"id": 31}]


def _pattern(i):
    return b"%06d" % i * 3000  # 18 kB, distinct per row, compressible


def _data_bytes(path, fragments):
    return sum(os.path.getsize(os.path.join(path, "data", f.path)) for frag in fragments
               for f in frag.metadata.files)


def test_image_bytes_are_written_without_compression(tmp_path):
    """Binary columns (image files, already compressed) are written with Lance's
    compression set to none, text columns with its defaults; the setting reaches the
    data files (a column that names zstd is written small) and an append to a table
    written before it reads back whole."""
    from etl.writers.lance import append_local, stored_uncompressed

    def rows(start, schema=None):
        return pa.Table.from_pydict({
            "id": pa.array(range(start, start + 300), pa.int64()),
            "caption": pa.array(["a red bicycle against a wall"] * 300),
            "image": pa.array([_pattern(i) for i in range(start, start + 300)], pa.binary()),
        }, schema=schema)

    raw = 300 * 18_000
    new = str(tmp_path / "new.lance")
    append_local(new, rows(0))  # a first write creates the table
    ds = lance.dataset(new)
    assert ds.schema.field("image").metadata == {b"lance-encoding:compression": b"none"}
    assert ds.schema.field("caption").metadata is None
    assert _data_bytes(new, ds.get_fragments()) >= raw
    # A column that names its compression keeps it, in the schema and in the files.
    zstd = {b"lance-encoding:compression": b"zstd"}
    named = pa.schema([pa.field("id", pa.int64()), pa.field("caption", pa.string()),
                       pa.field("image", pa.binary(), metadata=zstd)])
    assert stored_uncompressed(named).field("image").metadata == zstd
    small = str(tmp_path / "zstd.lance")
    append_local(small, rows(0, named))
    assert _data_bytes(small, lance.dataset(small).get_fragments()) < raw / 20
    # A table written by Lance's defaults (before this setting): appended to, its
    # schema unchanged, every row read back.
    old = str(tmp_path / "old.lance")
    lance.write_dataset(rows(0), old)
    append_local(old, rows(300))
    ds = lance.dataset(old)
    assert ds.schema.field("image").metadata is None and len(ds.get_fragments()) == 2
    table = ds.to_table()
    assert sorted(table.column("id").to_pylist()) == list(range(600))
    assert sorted(table.column("image").to_pylist()) == sorted(_pattern(i) for i in range(600))


def test_a_pending_append_is_written_by_tasks_and_committed_here(spark, tmp_path):
    from pyspark.sql.pandas.types import to_arrow_schema

    from etl.writers.lance import pending_append

    path = str(tmp_path / "w.lance")
    df = spark.range(0, 30, 1, 3).selectExpr(  # 3 tasks: ids 0-9, 10-19, 20-29
        "id", "cast(id as int) * 10 as width", "cast(concat('img', id) as binary) as image")

    def run(pending, frame):
        def task(batches):
            # Any task function: here, the even ids of each batch are the rows to write.
            rows = (b.filter(pc.equal(pc.bit_wise_and(b.column(0), 1), 0)) for b in batches)
            yield pa.RecordBatch.from_pylist([{"written": pending.write_task(
                b.cast(pending.schema) for b in rows)}])
        return [r.written for r in frame.mapInArrow(task, "written array<string>").collect()]

    pending = pending_append(path, to_arrow_schema(df.schema))
    lists = run(pending, df)
    assert len(lists) == 3 and all(len(f) == 1 for f in lists)
    assert not os.path.exists(os.path.join(path, "_versions"))  # nothing committed yet
    pending.commit(lists)  # a first commit creates the table
    ds = lance.dataset(path)
    assert (ds.version, ds.count_rows(), len(ds.get_fragments())) == (1, 15, 3)
    got = ds.to_table().to_pylist()
    assert sorted(r["id"] for r in got) == list(range(0, 30, 2))
    assert all(r["width"] == r["id"] * 10 and r["image"] == f"img{r['id']}".encode()
               for r in got)
    # An append is written as the table types its columns; rows of no task: no file.
    more = spark.range(30, 34, 1, 2).selectExpr(
        "id", "cast(id as long) * 10 as width", "cast(concat('img', id) as binary) as image")
    pending = pending_append(path, to_arrow_schema(more.schema))
    assert pending.schema.field("width").type == pa.int32()
    files = set(os.listdir(path + "/data"))
    assert run(pending, more.where("id < 0")) == [[], []]
    assert set(os.listdir(path + "/data")) == files
    pending.commit(run(pending, more))
    ds = lance.dataset(path)
    assert (ds.version, ds.count_rows()) == (2, 17)


def test_append_frame_writes_in_tasks_and_commits_here(spark, tmp_path):
    from pyspark.sql import functions as F

    from etl.writers.lance import append_frame

    path = str(tmp_path / "a.lance")
    # A first write creates the table: one fragment per task, one version.
    assert append_frame(_frame(spark, 20).repartition(3), path) == 20
    ds = lance.dataset(path)
    assert (ds.version, ds.count_rows(), len(ds.get_fragments())) == (1, 20, 3)
    # An append is cast to the table's types: one more version.
    more = _frame(spark, 5, offset=20).withColumn("id", F.col("id").cast("int"))
    assert append_frame(more, path) == 5
    ds = lance.dataset(path)
    assert (ds.version, ds.count_rows()) == (2, 25)
    assert ds.schema.field("id").type == pa.int64()
    got = {r["id"]: r["width"] for r in ds.to_table(columns=["id", "width"]).to_pylist()}
    assert got == {i: i * 10 for i in range(25)}
    # Spark reads what was appended as the data source wrote it.
    assert spark.read.format("lance").load(path).where("id >= 20").count() == 5
    with pytest.raises(ValueError, match="no column 'nope'"):
        append_frame(_frame(spark, 2).withColumn("nope", F.lit(1)), path)
    # A failed task commits nothing.
    bad = _frame(spark, 10).withColumn(
        "id", F.when(F.col("id") == 7, F.raise_error(F.lit("boom"))).otherwise(F.col("id")))
    with pytest.raises(Exception, match="boom"):
        append_frame(bad, path)
    assert (lance.dataset(path).version, lance.dataset(path).count_rows()) == (2, 25)


def test_a_pipeline_session_registers_format_lance_on_its_first_read(tmp_path):
    """`get_spark(..., lance_format=False)` (a pipeline run's session) leaves format
    ``lance`` unregistered -- registering makes Spark start a Python process -- until
    the first `lance_reader`; then plain ``format("lance")`` works too. A fresh process:
    the shared test session has it registered already."""
    import subprocess
    import sys

    from support import REPO

    path = str(tmp_path / "t.lance")
    lance.write_dataset(pa.table({"sample_id": ["a", "b", "c"], "width": [1, 2, 3]}), path)
    script = f"""
import sys
sys.path.insert(0, {str(REPO / "tests")!r})
from support import make_config
from etl.session import get_spark
from etl.writers.lance import lance_reader
spark = get_spark(make_config({str(tmp_path)!r}), lance_format=False)
manager = spark._jsparkSession.sessionState().dataSourceManager()
print("before", manager.dataSourceExists("lance"))
print("read", lance_reader(spark).load({path!r}).count())
print("after", manager.dataSourceExists("lance"))
print("plain", spark.read.format("lance").option("columns", "width").load({path!r}).count())
print("again", lance_reader(spark).load({path!r}).count())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.split(" ")[0] in
             ("before", "read", "after", "plain", "again")]
    assert lines == ["before False", "read 3", "after True", "plain 3", "again 3"]
