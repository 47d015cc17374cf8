"""The report's corpus-wide counts, kept per Lance fragment and Delta data file
(etl.lakehouse.counts): after appends, deletes, an added column, a compaction and a
damaged cache they equal a scan of the whole table, and only what changed is read."""

from __future__ import annotations

import logging
import os
import re

import lance
import pandas as pd
import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from etl.lakehouse.counts import delta_counts, lance_counts

COLUMNS = ("source", "keep", "filter_reason")


def _rows(start: int, n: int) -> pa.Table:
    ids = range(start, start + n)
    return pa.table({
        "sample_id": [f"s{i:04d}" for i in ids],
        "source": [("a", "b", "c")[i % 3] for i in ids],
        "keep": [i % 5 != 0 for i in ids],
        "filter_reason": [None if i % 5 else ("too_small", "nsfw")[i % 2] for i in ids],
        "image": [bytes([i % 256]) * 64 for i in ids],
    })


def _scan(table: pa.Table, columns) -> dict:
    """The expected counts, from every row (pandas, not the code under test)."""
    frame = table.select(list(columns)).to_pandas()
    grouped = frame.groupby(list(columns), dropna=False).size()
    return {tuple(None if pd.isna(v) else v for v in k): int(n) for k, n in grouped.items()}


def _got(frame: pd.DataFrame, columns) -> dict:
    return {tuple(None if pd.isna(r[c]) else r[c] for c in columns): int(r["count"])
            for _, r in frame.iterrows()}


def _read(caplog) -> tuple[int, int]:
    """(read, of) from the last 'counts:' log line."""
    (line,) = [r.getMessage() for r in caplog.records if "counts:" in r.getMessage()][-1:]
    caplog.clear()
    read, of = re.search(r"(\d+) of (\d+)", line).groups()
    return int(read), int(of)


def test_lance_counts_read_only_changed_fragments_and_equal_a_scan(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="etl.lakehouse.counts")
    path, cache = str(tmp_path / "t.lance"), str(tmp_path / "meta" / "curated.json")
    lance.write_dataset(_rows(0, 90), path, max_rows_per_file=30)  # 3 fragments

    def check(expect_read: int) -> None:
        ds = lance.dataset(path)
        got = lance_counts(ds, COLUMNS, cache)
        assert _got(got, COLUMNS) == _scan(ds.to_table(), COLUMNS)
        assert _read(caplog) == (expect_read, len(ds.get_fragments()))

    check(3)  # nothing cached
    check(0)  # unchanged: nothing read
    lance.write_dataset(_rows(90, 40), path, mode="append", max_rows_per_file=30)
    check(2)  # a night's append: its two fragments
    ds = lance.dataset(path)
    ds.delete("sample_id IN ('s0001', 's0005', 's0100')")  # two fragments get deletions
    check(2)
    # A column added in data files of its own (captions, features): same rows, same
    # values of the counted columns -- nothing is read again.
    ds = lance.dataset(path)
    ds.add_columns({"caption_v2": "concat(sample_id, '!')"})
    assert all(len(f.metadata.files) == 2 for f in lance.dataset(path).get_fragments())
    check(0)
    # A compaction rewrites the fragments: counted again, and the cache forgets the old.
    lance.dataset(path).optimize.compact_files(target_rows_per_fragment=1000)
    check(len(lance.dataset(path).get_fragments()))
    check(0)
    # A damaged or foreign cache is counted again, never trusted.
    with open(cache, "w") as f:
        f.write('{"format": 1, "columns": ["source"')
    check(len(lance.dataset(path).get_fragments()))
    other = lance_counts(lance.dataset(path), ("source",), cache)  # other columns
    assert _got(other, ("source",)) == _scan(lance.dataset(path).to_table(), ("source",))
    caplog.clear()
    check(len(lance.dataset(path).get_fragments()))
    # An older version is counted exactly too (the cache then names its fragments).
    first = lance.dataset(path, version=1)
    assert _got(lance_counts(first, COLUMNS, cache), COLUMNS) == _scan(first.to_table(),
                                                                        COLUMNS)


def test_delta_counts_read_only_new_files_and_equal_a_scan(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="etl.lakehouse.counts")
    path, cache = str(tmp_path / "rejects"), str(tmp_path / "meta" / "rejects.json")
    cols = ("source", "reason")
    assert delta_counts(path, cols, cache) is None  # no table yet

    def rejects(start: int, n: int) -> pa.Table:
        ids = range(start, start + n)
        return pa.table({"sample_id": [f"r{i}" for i in ids],
                         "source": [("a", "b")[i % 2] for i in ids],
                         "reason": [("undecodable", "missing_file", "empty")[i % 3]
                                    for i in ids]})

    counted: set[str] = set()

    def check() -> None:
        """Equal to a scan, having read exactly the data files not counted before."""
        table = DeltaTable(path)
        files = set(table.file_uris())
        got = delta_counts(path, cols, cache)
        assert _got(got, cols) == _scan(table.to_pyarrow_table(), cols)
        assert _read(caplog) == (len(files - counted), len(files))
        counted.clear()
        counted.update(files)

    write_deltalake(path, rejects(0, 30))
    check()  # one file
    check()  # none
    write_deltalake(path, rejects(30, 12), mode="append")
    write_deltalake(path, rejects(42, 5), mode="append")
    check()  # two
    DeltaTable(path).delete("sample_id = 'r3' OR sample_id = 'r31'")  # rewrites two files
    check()
    assert os.path.getsize(cache) > 0
    os.remove(cache)  # lost: counted again
    counted.clear()
    check()
