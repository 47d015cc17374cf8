"""A table of parquet files with embedded images, compared with the manifest in Spark:
a file whose size and mtime curate remembered is not opened (its records count as
unchanged), a changed file is compared record by record, and what left -- a whole file,
one record of a changed file -- is removed. The expectations are what the test does to
the files; "not opened" is shown by a file overwritten with garbage under its old size
and mtime (opened, it would be an ``unreadable_file`` reject that defers removals). The
listing names each image by file and row, and the bytes are read where the record is
prepared: each key's own image (its width tells it)."""

from __future__ import annotations

import os

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import make_config, photo

from etl import tables
from etl.jobs.curate import curate
from etl.lakehouse import source_diff
from etl.lakehouse.curate_state import CurateState
from etl.sources import adapter_for, file_table, finish_ingest

pytestmark = pytest.mark.slow


def _write(path, ids: list[int]) -> None:
    pq.write_table(pa.table({
        "id": [f"k{i}" for i in ids],
        "image": pa.array([photo(i) for i in ids], pa.binary()),
        "caption": [f"caption {i}" for i in ids],
    }), path)


def _manifest(spark, cfg) -> dict[str, tuple[str, str | None]]:
    rows = spark.read.format("delta").load(tables.layout(cfg).manifest).collect()
    return {r.source_key: (r.status, r.reason) for r in rows}


@pytest.mark.parametrize("way", ["files-read-here", "files-read-in-tasks", "spark-join"])
def test_unchanged_table_files_are_not_opened_and_removals_come_out_right(
        spark, tmp_path, monkeypatch, way):
    """Three times, with the same expectations: the files opened after the first night
    read in this process and compared with the manifest's rows read by delta-rs (a
    night's few files within the read bound, the whole table above it), read by Spark's
    tasks and compared with those rows, and compared by Spark's join with the manifest's
    snapshot (``driver.scan_rows: 0``)."""
    scan_rows = 0 if way == "spark-join" else None
    monkeypatch.setattr(file_table, "DRIVER_REF_BYTES", -1)  # listed in Spark's tasks
    here = []  # per comparison: whether the driver answered it
    compared_here = source_diff._compared_here
    monkeypatch.setattr(source_diff, "_compared_here", lambda *a, **k: here.append(
        compared_here(*a, **k)) or here[-1])
    folder = tmp_path / "table"
    folder.mkdir()
    _write(folder / "a.parquet", [0, 1, 2])
    _write(folder / "b.parquet", [3, 4, 5])
    _write(folder / "c.parquet", [6, 7])
    first_bytes = sum((folder / f"{n}.parquet").stat().st_size for n in "abc")
    cfg = make_config(tmp_path / "root", [{
        "name": "t", "kind": "table", "path": str(folder),
        "columns": {"key": "id", "image": "image", "caption": "caption"}}],
        **({} if scan_rows is None else {"driver": {"scan_rows": scan_rows}}))

    # The listing names each image by file and row; it carries no bytes.
    src = cfg.source("t")
    listed = finish_ingest(adapter_for("table").read(spark, src), src).collect()
    assert {(r.source_key, r.image_ref.rsplit("/", 1)[-1], r.image_offset) for r in listed} \
        == {(f"k{i}", f"{name}.parquet", j) for name, ids in (("a", [0, 1, 2]),
            ("b", [3, 4, 5]), ("c", [6, 7])) for j, i in enumerate(ids)}
    assert all(r.image_bytes is None for r in listed)

    (first,) = curate(spark, cfg, "night-1").counts
    assert (first.seen, first.accepted, first.unchanged) == (8, 8, 0)
    # Each key's own image was read back where it was prepared (photo(i) is 60+i wide).
    curated = lance.dataset(tables.layout(cfg).curated).to_table(
        columns=["source_key", "width"]).to_pylist()
    assert {r["source_key"]: r["width"] for r in curated} == {
        f"k{i}": 60 + i for i in range(8)}

    # a.parquet: garbage under its old size and mtime -- the trade of a size+mtime
    # fingerprint, here the proof that it is not opened. b.parquet loses k4 (changed),
    # c.parquet goes, d.parquet is new.
    a = folder / "a.parquet"
    st = a.stat()
    a.write_bytes(b"\0" * st.st_size)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    _write(folder / "b.parquet", [3, 5])
    os.utime(folder / "b.parquet", (st.st_atime + 10, st.st_mtime + 10))
    (folder / "c.parquet").unlink()
    _write(folder / "d.parquet", [8, 9])

    if way == "files-read-here":  # b and d within the bound, as the table was not
        bound = sum((folder / f"{n}.parquet").stat().st_size for n in "bd")
        assert bound < first_bytes
        monkeypatch.setattr(file_table, "DRIVER_REF_BYTES", bound)
    (second,) = curate(spark, cfg, "night-2").counts
    assert [d is not None for d in here] == ([True] if scan_rows is None else [])
    assert [d.in_driver for d in here] == ([True] if way == "files-read-here" else
                                           [False] if here else [])
    assert second.reasons.get("unreadable_file", 0) == 0
    assert (second.seen, second.accepted, second.unchanged) == (2, 2, 5)
    assert second.removed == {"source_removed": 3}
    state = _manifest(spark, cfg)
    assert {k for k, (status, _) in state.items() if status == "accepted"} == {
        "k0", "k1", "k2", "k3", "k5", "k8", "k9"}
    assert {k: v for k, v in state.items() if v[0] == "removed"} == {
        k: ("removed", "source_removed") for k in ("k4", "k6", "k7")}

    # What was remembered holds only at the manifest version it was written after.
    memo = CurateState.of(tables.layout(cfg))
    version = tables_version = _manifest_version(spark, cfg)
    assert set(memo.table_containers(version)["t"]) == {
        f"file:{folder}/{n}.parquet" for n in "abd"}
    assert memo.table_containers(tables_version + 1) == {}

    # k9's last outcome is one the next run retries (a transient failure), as the run
    # that wrote this manifest version left it: d.parquet is opened again, a.parquet
    # (garbage) still is not.
    spark.sql(f"UPDATE delta.`{tables.layout(cfg).manifest}` SET status = 'rejected', "
              "stage = 'fetch', reason = 'timeout' WHERE source_key = 'k9'")
    memo.remember_containers(_manifest_version(spark, cfg), memo.table_containers(version))
    (third,) = curate(spark, cfg, "night-3").counts
    assert (third.seen, third.accepted, third.unchanged) == (1, 1, 6)
    assert third.removed == {}
    assert _manifest(spark, cfg)["k9"] == ("accepted", None)


def _manifest_version(spark, cfg) -> int:
    from etl.lakehouse.catalog import Catalog

    return Catalog.of(spark, cfg).manifest.version()


def test_the_records_hint_counts_the_rows_of_the_files_to_open(tmp_path, monkeypatch):
    """The hint curate starts the Python workers early by: the rows the parquet files
    not skipped hold, by their footers (written here: 3 + 2 + 4 rows); None for a table
    with a JSONL file (rows unknown without reading it). And the early start follows it:
    more rows in the changed files than the driver prepares starts the workers, fewer
    (or a first run) does not."""

    folder = tmp_path / "table"
    folder.mkdir()
    _write(folder / "a.parquet", [0, 1, 2])
    _write(folder / "b.parquet", [3, 4])
    _write(folder / "c.parquet", [5, 6, 7, 8])
    cfg = make_config(tmp_path, sources=[{
        "name": "t", "kind": "table", "path": str(folder / "*.parquet"),
        "columns": {"key": "id", "image": "image", "caption": "caption"}}])
    (source,) = cfg.sources
    adapter = adapter_for("table")
    files = adapter.containers(source)
    assert len(files) == 3
    assert adapter.records_hint(source) == 9
    a = next(u for u in files if u.endswith("/a.parquet"))
    assert adapter.records_hint(source, frozenset({a})) == 6
    assert adapter.records_hint(source, frozenset(files)) == 0
    (folder / "d.jsonl").write_text('{"id": "j", "caption": "x"}\n')
    jsonl = make_config(tmp_path, sources=[{
        "name": "t", "kind": "table", "path": str(folder / "*"),
        "columns": {"key": "id", "image": "image", "caption": "caption"}}])
    assert adapter.records_hint(jsonl.sources[0]) is None
    (folder / "d.jsonl").unlink()
    urls = make_config(tmp_path, sources=[{  # a URL list: its rows are not its records'
        "name": "u", "kind": "table", "path": str(folder / "*.parquet"),  # bytes
        "columns": {"key": "id", "url": "caption"}}])
    assert not adapter.hints_records(urls.sources[0])
    assert adapter.records_hint(urls.sources[0]) is None

    started = []
    monkeypatch.setattr(source_diff, "start_python_workers",
                        lambda spark, what: started.append(what) or object())

    # The last run's memo: a.parquet unchanged, b.parquet changed; c.parquet is new.
    memo = {"t": {a: (files[a], 3), next(u for u in files if u.endswith("/b.parquet")):
                  ("other", 2)}}
    # b (2 rows, changed) and c (4 rows, new) are to be opened: 6 rows.
    assert source_diff._workers_ahead(None, cfg, memo, 5) is True
    assert source_diff._workers_ahead(None, cfg, memo, 6) is False
    assert source_diff._workers_ahead(None, cfg, {}, 0) is False  # a first run: no memo
    assert len(started) == 1
