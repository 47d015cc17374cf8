"""Every SQL recipe in docs/sql.md, run against a small table with known content, and
the Python (pylance, DuckDB) access the page documents."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from conftest import REPO, make_config
from lakehouse_data import ROWS, write_curated

from etl import tables
from etl.lakehouse.views import register_views
from etl.schema import REJECTS_SCHEMA

DOC = REPO / "docs" / "sql.md"
REJECTS = [
    ("a" * 32, "photos", "bad1", None, "prepare", "truncated", None, "run-1"),
    ("b" * 32, "photos", "bad2", None, "prepare", "empty", None, "run-1"),
    ("c" * 32, "photos", "bad3", None, "prepare", "empty", None, "run-1"),
    ("d" * 32, "crawl", "bad4", None, "ingest", "missing_image", None, "run-1"),
]


def recipes() -> dict[str, str]:
    text = DOC.read_text(encoding="utf-8")
    found = re.findall(r"<!-- recipe: (\w+) -->\s*```sql\n(.*?)```", text, flags=re.S)
    return dict(found)


@pytest.fixture(scope="module")
def sql(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("sql-recipes")
    cfg = make_config(root)
    curated = tables.layout(cfg).curated
    rejects = tables.layout(cfg).rejects
    # Version 1: the first 16 rows, row 0 flagged; version 2: all rows, row 0 kept.
    v1 = [dict(r) for r in ROWS[:16]]
    v1[0].update(keep=False, filter_reason="too_small")
    write_curated(spark, curated, v1, parts=2)
    write_curated(spark, curated, ROWS, parts=2)
    spark.createDataFrame(REJECTS, REJECTS_SCHEMA).write.format("delta").save(rejects)
    register_views(spark, cfg)
    paths = {
        "lakeshard-data/lance/default/curated.lance": curated,
        "lakeshard-data/delta/rejects": rejects,
    }

    def run(name: str) -> list[tuple]:
        query = recipes()[name]
        for doc_path, real in paths.items():
            query = query.replace(doc_path, real)
        return [tuple(r) for r in spark.sql(query).collect()]

    run.curated = curated
    return run


def test_every_recipe_in_the_doc_is_tested():
    tested = {
        "counts_by_source", "flagged_by_reason", "rejects_by_reason", "caption_length",
        "caption_length_quantiles", "resolution_histogram", "filtered_sample", "versions",
        "time_travel_view", "time_travel_count", "time_travel_diff",
    }
    assert set(recipes()) == tested


def test_counts_by_source_and_reason(sql):
    want = sorted(
        (s, len(rs), sum(r["keep"] for r in rs), sum(not r["keep"] for r in rs),
         sum(r["caption_original"] is None for r in rs))
        for s in {r["source"] for r in ROWS}
        for rs in [[r for r in ROWS if r["source"] == s]]
    )
    assert sql("counts_by_source") == want
    flagged = Counter((r["source"], r["filter_reason"]) for r in ROWS if not r["keep"])
    assert sql("flagged_by_reason") == sorted((s, f, n) for (s, f), n in flagged.items())
    rejected = Counter((r[1], r[4], r[5]) for r in REJECTS)
    assert sql("rejects_by_reason") == sorted((*k, n) for k, n in rejected.items())


def test_caption_length_distribution(sql):
    lengths = [None if r["caption_original"] is None else len(r["caption_original"])
               for r in ROWS]
    buckets = Counter(None if n is None else n // 20 * 20 for n in lengths)
    want = [(None, buckets.pop(None))] + sorted(buckets.items())
    assert sql("caption_length") == want
    got = {s: (med, mx) for s, med, mx in sql("caption_length_quantiles")}
    for s in {r["source"] for r in ROWS}:
        ls = sorted(len(r["caption_original"]) for r in ROWS
                    if r["source"] == s and r["caption_original"] is not None)
        assert got[s][1] == max(ls) and min(ls) <= got[s][0] <= max(ls)


def test_resolution_histogram(sql):
    hist = Counter(max(r["width"], r["height"]) // 64 * 64 for r in ROWS)
    kept = Counter(max(r["width"], r["height"]) // 64 * 64 for r in ROWS if r["keep"])
    assert sql("resolution_histogram") == [(b, n, kept[b]) for b, n in sorted(hist.items())]


def test_sample_of_filtered_rows_is_deterministic_and_only_flagged(sql):
    first, second = sql("filtered_sample"), sql("filtered_sample")
    flagged = {r["sample_id"]: r for r in ROWS if not r["keep"]}
    assert first == second and len(first) == min(20, len(flagged))
    for sample_id, source, w, h, reason, caption in first:
        r = flagged[sample_id]
        assert (source, w, h, reason, caption) == (
            r["source"], r["width"], r["height"], r["filter_reason"], r["caption_original"]
        )


def test_time_travel_reads_the_older_version(sql):
    assert [v[0] for v in sql("versions")] == [1, 2]
    assert [v[1] for v in sql("versions")] == [16, 24]
    assert sql("time_travel_view") == []
    old = Counter(r["source"] for r in ROWS[:16])
    assert sql("time_travel_count") == sorted(old.items())
    # 8 rows added since version 1; row 0 was flagged in version 1 and is kept now.
    assert sql("time_travel_diff") == [("added", 8), ("flag changed", 1)]


def test_curated_meta_has_no_image_bytes(sql, spark):
    cols = spark.table("curated_meta").columns
    assert "image" not in cols and {"sample_id", "source", "keep", "width"} <= set(cols)


def test_pylance_and_duckdb_access(sql, spark):
    import duckdb
    import lance

    ds_path = sql.curated
    ds = lance.dataset(ds_path)
    t = ds.to_table(filter="source = 'photos' AND keep",
                    columns=["sample_id", "width", "caption_original"])
    want = {r["sample_id"] for r in ROWS if r["source"] == "photos" and r["keep"]}
    assert set(t.column("sample_id").to_pylist()) == want
    assert lance.dataset(ds_path, version=1).count_rows() == 16

    scan = ds.scanner(columns=["source", "keep", "width"], filter="width >= 64")  # noqa: F841
    got = duckdb.sql(
        "SELECT source, count(*) AS n FROM scan GROUP BY source ORDER BY source"
    ).fetchall()
    want_n = Counter(r["source"] for r in ROWS if r["width"] >= 64)
    assert got == sorted(want_n.items())

