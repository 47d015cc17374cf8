"""The fetch UDF over many Arrow batches (it fetches one batch ahead), and the fragments
a curate run appends (accepted rows taken from the prepared rows, no self-join)."""

from __future__ import annotations

import lance
import pyarrow as pa
import pyarrow.parquet as pq
from conftest import jpeg_bytes, make_config
from pyspark.sql import functions as F

from etl import tables
from etl.config import FetchConfig, parse_config
from etl.jobs.curate import curate
from etl.pipeline.checks import check_sources
from etl.transforms.fetch import fetch_images


def _rows_for(spark, refs):
    return spark.createDataFrame(
        [(f"id{i}", "list", ref, "ok") for i, ref in enumerate(refs)],
        "sample_id string, source string, image_ref string, read_status string",
    ).select(
        "sample_id", "source", "image_ref",
        F.lit(None).cast("long").alias("image_offset"),
        F.lit(None).cast("long").alias("image_length"),
        F.lit(None).cast("binary").alias("image_bytes"),
        "read_status", F.lit(None).cast("string").alias("read_reason"),
    )


def test_fetch_over_many_batches_keeps_each_row_with_its_bytes(spark, tmp_path):
    files = []
    for i in range(23):
        path = tmp_path / f"f{i:02d}.bin"
        if i % 7 != 3:  # every seventh file does not exist
            path.write_bytes(f"content of file {i} ".encode() * (i + 1))
        files.append(path)
    cfg = parse_config({
        "storage": {"root": str(tmp_path / "out")},
        "sources": [{"name": "list", "kind": "table", "path": str(tmp_path / "l.parquet"),
                     "columns": {"key": "k", "url": "u"}, "allow_local": True}],
    })
    before = spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "3")  # 8 batches
    try:
        out = fetch_images(_rows_for(spark, [str(p) for p in files]).coalesce(1),
                           FetchConfig(retries=0), cfg.sources).collect()
    finally:
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", before)
    got = {r.image_ref: r for r in out}
    assert len(out) == len(files) == len(got)
    for path in files:
        row = got[str(path)]
        if path.exists():
            assert (row.read_status, row.read_reason) == ("ok", None)
            assert bytes(row.image_bytes) == path.read_bytes()
        else:
            assert (row.read_status, row.read_reason) == ("rejected", "missing_file")
            assert row.image_bytes is None and row.fetch_failed


def test_a_small_run_appends_one_fragment_with_the_upstream_columns(spark, tmp_path):
    n = 40
    quality = [i / 10 for i in range(n)]
    pq.write_table(pa.table({
        "k": [f"k{i}" for i in range(n)],
        "img": [jpeg_bytes((64 + i, 48), color=(i * 5, 100, 200 - i * 4)) for i in range(n)],
        "q": quality,
    }), tmp_path / "t.parquet")
    cfg = make_config(tmp_path / "out", sources=[
        {"name": "emb", "kind": "table", "path": str(tmp_path / "t.parquet"),
         "columns": {"key": "k", "image": "img", "quality": "q"}}])
    check_sources(cfg)
    spark.conf.set("spark.sql.shuffle.partitions", "4")  # the listing: 4 partitions
    try:
        result = curate(spark, cfg, "r1")
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", "2")
    assert result.curated_rows == n
    ds = lance.dataset(tables.layout(cfg).curated)
    assert len(ds.get_fragments()) == 1  # 40 rows: one fragment, not one per partition
    rows = ds.to_table(columns=["source_key", "upstream_quality", "width"]).to_pylist()
    assert {r["source_key"]: r["upstream_quality"] for r in rows} == {
        f"k{i}": quality[i] for i in range(n)}
    assert {r["source_key"]: r["width"] for r in rows} == {f"k{i}": 64 + i for i in range(n)}
