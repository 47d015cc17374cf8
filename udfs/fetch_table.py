"""Reading one record's embedded image out of a parquet table file, inside Spark tasks.

A `table` source whose rows embed their images lists each record as a reference --
its file and row number (``image_ref``, ``image_offset``) -- never its bytes
(:mod:`etl.sources.file_table`); the bytes are read here, for the records that are new or
changed, when they are prepared. A row group's image column is read once and kept while
its rows are fetched: at most :data:`KEEP_GROUPS` row groups per Python worker (the rows
come sorted by file and row, so a task reads each row group it needs once), which bounds
a worker's memory by the table's row groups, not by the table.

Outcomes are fetch statuses (:data:`udfs.fetch.FETCH_STATUSES`), never exceptions:
``missing_file`` (the file is gone), ``truncated`` (the file now has fewer rows),
``too_large``, ``error`` (not parquet any more, or the row's image is no longer bytes).
A file rewritten since it was listed under other row numbers gives the images now at
those numbers: the same trade as a tar shard's byte range, whose size and mtime tell the
next run to read it again.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import pyarrow as pa

from etl.config import FetchConfig
from udfs.fetch_http import FetchResult
from udfs.fetch_local import open_regular

__all__ = ["KEEP_GROUPS", "read_table_row"]

# Row groups whose image column a Python worker keeps (its fetch threads work through
# one row group while the next is read).
KEEP_GROUPS = 2
# Files whose row-group layout (the footer) a worker keeps.
_KEEP_FILES = 64

_T = TypeVar("_T")
_LOCK = threading.Lock()
_GROUPS: OrderedDict[tuple, Future] = OrderedDict()
_FILES: OrderedDict[tuple, Future] = OrderedDict()


def _once(cache: OrderedDict, key: tuple, keep: int, make: Callable[[], _T]) -> _T:
    """`make()` for `key`, made by one thread while the others wait for it; the last
    `keep` keys kept (a failure too, raised to every thread that asks)."""
    with _LOCK:
        future = cache.get(key)
        owner = future is None
        if owner:
            future = cache[key] = Future()
            while len(cache) > keep:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
    if owner:
        try:
            future.set_result(make())
        except BaseException as exc:  # handed to every waiter, then judged by the caller
            future.set_exception(exc)
    return future.result()


def _open(uri: str):
    """A table file for reading: a local one (``file:`` + the path, as listed) refused
    unless it is a regular file; any other through fsspec."""
    if uri.startswith("file:"):
        return open_regular(uri[len("file:"):])
    import fsspec

    return fsspec.open(uri, "rb").open()


def _starts(uri: str) -> list[int]:
    """The first row of each row group of the file, then its row count."""
    import pyarrow.parquet as pq

    with _open(uri) as fh:
        meta = pq.ParquetFile(fh).metadata
    starts = [0]
    for i in range(meta.num_row_groups):
        starts.append(starts[-1] + meta.row_group(i).num_rows)
    return starts


def _image_column(uri: str, group: int, column: str) -> pa.Array:
    """The row group's image column (`column`: dotted into a struct, ``image.bytes``)."""
    import pyarrow.parquet as pq

    top, *inner = column.split(".")
    with _open(uri) as fh:
        values = pq.ParquetFile(fh).read_row_group(group, columns=[top]).column(0)
    values = values.combine_chunks()
    for name in inner:
        values = values.field(name)
    return values


def _as_bytes(value) -> bytes | None:
    """A row's image as :func:`etl.sources.file_table.map_table_rows` reads it."""
    if isinstance(value, str):
        return value.encode("latin-1", errors="replace")
    return bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else None


def read_table_row(uri: str, row: int, column: str, opts: FetchConfig) -> FetchResult:
    """The image of row `row` of the parquet file `uri` (its `column`); never raises."""
    try:
        starts = _once(_FILES, (uri,), _KEEP_FILES, lambda: _starts(uri))
        if not 0 <= row < starts[-1]:
            return FetchResult(None, "truncated", f"row {row} of a file of {starts[-1]} rows")
        group = bisect.bisect_right(starts, row) - 1
        values = _once(_GROUPS, (uri, group, column), KEEP_GROUPS,
                       lambda: _image_column(uri, group, column))
        image = _as_bytes(values[row - starts[group]].as_py())
    except FileNotFoundError as exc:
        return FetchResult(None, "missing_file", str(exc))
    except Exception as exc:  # noqa: BLE001 - a file changed or broken: this row's status
        return FetchResult(None, "error", f"{type(exc).__name__}: {exc}")
    if image is None:
        return FetchResult(None, "error", "the row's image is no longer bytes")
    if len(image) > opts.max_bytes:
        return FetchResult(None, "too_large", f"{len(image)} bytes")
    return FetchResult(image, "ok")
