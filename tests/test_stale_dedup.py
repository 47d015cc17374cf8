"""The stale-dedup warning an export logs compares rows, not version numbers: columns
added after dedup and compaction leave the rows it covers as they are; rows appended,
changed or deleted are counted in the warning."""

from __future__ import annotations

import logging

import lance
import pyarrow as pa
from support import make_config

from etl import tables
from etl.lakehouse.dedup_table import DEDUP_CURATED_VERSION, DedupTable


def test_the_stale_dedup_warning_compares_rows_not_versions(spark, tmp_path, caplog):
    """Columns added after dedup (captions, features) leave the rows it covers as they
    are: no warning. Rows appended, changed or deleted: a warning with the counts."""
    from etl.schema import DEDUP_SCHEMA
    from etl.writers.lance_columns import write_columns

    cfg = make_config(tmp_path)
    path, dedup_path = tables.layout(cfg).curated, tables.layout(cfg).dedup
    ids = [f"id{i}" for i in range(6)]
    lance.write_dataset(pa.table({"sample_id": ids, "image_sha256": [f"h{i}" for i in range(6)],
                                  "source": ["s"] * 6}), path, max_rows_per_file=3)
    covered = lance.dataset(path).version
    spark.createDataFrame(
        [(sid, "s", f"h{i}", i, ids[0] if i < 2 else sid, i != 1,
          {0: "canonical", 1: "exact"}.get(i, "unique"), 2 if i < 2 else 1, "r")
         for i, sid in enumerate(ids)], DEDUP_SCHEMA,
    ).write.format("delta").save(dedup_path)
    spark.sql(f"ALTER TABLE delta.`{dedup_path}` SET TBLPROPERTIES "
              f"('{DEDUP_CURATED_VERSION}' = '{covered}')")

    def check(version) -> list[str]:
        """The warnings an export of `version` logs."""
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="etl.lakehouse.dedup_table"):
            DedupTable(spark, cfg).non_canonical_ids(version)
        return [r.getMessage() for r in caplog.records if "dedup covers" in r.getMessage()]

    assert {r.sample_id for r in DedupTable(spark, cfg).non_canonical_ids(covered).collect()} == {
        "id1"}

    # A caption-like column (the caption stage's writer) and a schema-only column.
    write_columns(spark, path, spark.createDataFrame(
        [(sid, f"caption {sid}") for sid in ids], "sample_id string, caption_v string"))
    lance.dataset(path).add_columns({"flag": "true"})
    after_columns = lance.dataset(path).version
    assert after_columns >= covered + 2
    assert check(after_columns) == []

    # Compaction rewrites fragments but not rows: the row comparison says so.
    lance.dataset(path).optimize.compact_files(target_rows_per_fragment=100)
    cov = DedupTable(spark, cfg).coverage(lance.dataset(path).version)
    assert (cov.uncovered, cov.removed, cov.stale) == (0, 0, False)

    # One row appended, one changed (same id, other bytes), one deleted.
    def append(sample_id, sha):
        row = {"sample_id": sample_id, "image_sha256": sha, "source": "s", "flag": True}
        schema = lance.dataset(path).schema
        lance.write_dataset(pa.Table.from_pylist([row], schema=schema), path, mode="append")

    append("id6", "h6")
    lance.dataset(path).delete("sample_id IN ('id4', 'id5')")
    append("id5", "h5-new")
    (warning,) = check(lance.dataset(path).version)
    assert f"dedup covers curated version {covered}" in warning
    assert "2 row(s) were added or changed since" in warning and "1 removed" in warning
