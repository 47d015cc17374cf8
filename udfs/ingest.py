"""Fetch and prepare in one batch function: each image's bytes cross from the JVM to
Python at most once (a row that carries them) or never (a row that references them).
Spark's tasks run it in a ``mapInArrow`` (:mod:`etl.transforms.prepare_task`, which may
also write the accepted rows there, so that the JPEG never comes back); a night's few
records run it on the driver.

Per Arrow batch, :func:`fetch_prepare_batches` starts the batch's fetches (exactly as
:func:`udfs.fetch.fetch_udf`: each row under its source's :class:`RefRules`, on the
worker's fetch pool with its per-host limits and retries), then finishes the batch
before: waits for its fetches, prepares every row to prepare on the ``prepare.threads``
pool (:func:`udfs.images.prepare_many`) and hashes the source bytes (sha256, the
manifest's ``original_sha256``). So the downloads of one batch overlap the decoding of
the one before, as they did across the two UDFs.

A row is one of: not to be processed (a read that already failed: all fields null);
to be fetched first (a reference; a failed fetch is its ``fetch_status``, and it is not
prepared); or prepared from the bytes it carries (none: ``empty``). Per-row failures are
data as in the two modules it joins; a bug in this module fails the task.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
from pyspark.sql import types as T
from pyspark.sql.pandas.types import to_arrow_schema

from udfs.arrow_types import nullable_type
from udfs.fetch import RefRules, clip_detail, start_fetches
from udfs.images import PREPARED_TYPE, prepare_many, prepared_columns

if TYPE_CHECKING:
    from etl.config import FetchConfig, PrepareConfig

__all__ = ["FETCH_FIELDS", "FETCH_PREPARE_TYPE", "FETCH_PREPARE_ARROW", "fetch_prepare_batches"]

# The fetch's own fields (null where the row was not fetched), then the source bytes'
# hash (null where there are none), then PREPARED_TYPE's fields, flat and nullable (null
# where the row was not prepared): the Spark side nests them back into the `prepared`
# struct. Flat because pyspark builds a nested struct from one dict per row.
FETCH_FIELDS = (
    T.StructField("fetch_status", T.StringType(), True),
    T.StructField("fetch_detail", T.StringType(), True),
    T.StructField("fetch_attempts", T.IntegerType(), True),
)
FETCH_PREPARE_TYPE = T.StructType([
    *FETCH_FIELDS,
    T.StructField("original_sha256", T.StringType(), True),
    *nullable_type(PREPARED_TYPE).fields,
])
# The batches the batch function yields: nullable throughout (udfs/arrow_types.py).
FETCH_PREPARE_ARROW = to_arrow_schema(nullable_type(FETCH_PREPARE_TYPE))


@dataclass(frozen=True)
class _Started:
    """One batch whose fetches are under way."""
    process: list[bool]  # per row: fetch (when it has a reference) and prepare
    given: list  # per row: the bytes it carries (None: none, or a reference instead)
    fetched: dict[int, Future]  # row -> its fetch


def _start(process: pa.Array, sources: pa.Array, refs: pa.Array, offsets: pa.Array,
           lengths: pa.Array, images: pa.Array, opts: FetchConfig,
           rules: Mapping[str, RefRules]) -> _Started:
    todo = [bool(p) for p in process.to_pylist()]
    row_rules = [rules[s] for s in sources.to_pylist()]  # a source missing from `rules` is a bug
    ref_of = refs.to_pylist()
    rows = [i for i, r in enumerate(ref_of) if todo[i] and r is not None]
    at, length = offsets.to_pylist(), lengths.to_pylist()
    futures = start_fetches([ref_of[i] for i in rows], [at[i] for i in rows],
                            [length[i] for i in rows], [row_rules[i] for i in rows], opts)
    return _Started(todo, images.to_pylist(), dict(zip(rows, futures, strict=True)))


def _finish(batch: _Started, opts: PrepareConfig) -> pa.RecordBatch:
    n = len(batch.process)
    status: list[str | None] = [None] * n
    detail: list[str | None] = [None] * n
    attempts: list[int | None] = [None] * n
    source = list(batch.given)
    for i, future in batch.fetched.items():
        res = future.result()  # fetch_ref never raises
        status[i], detail[i], attempts[i] = res.status, clip_detail(res.detail), res.attempts
        source[i] = res.data  # bytes a failed fetch kept are still hashed, as before
    prepare = [i for i in range(n) if batch.process[i] and status[i] in (None, "ok")]
    results = prepare_many([source[i] for i in prepare], opts)
    prepared: list = [None] * n
    for i, res in zip(prepare, results, strict=True):
        prepared[i] = res
    columns = {
        "fetch_status": status, "fetch_detail": detail, "fetch_attempts": attempts,
        "original_sha256": [None if b is None else hashlib.sha256(b).hexdigest()
                            for b in source],
        **prepared_columns(prepared),
    }
    return pa.RecordBatch.from_arrays(
        [pa.array(columns[f.name], f.type) for f in FETCH_PREPARE_ARROW],
        schema=FETCH_PREPARE_ARROW)


def fetch_prepare_batches(
    batches: Iterator[tuple[pa.Array, ...]], fetch: FetchConfig,
    rules: Mapping[str, RefRules], prepare: PrepareConfig,
) -> Iterator[pa.RecordBatch]:
    """The batch function: batches of Arrow arrays (process, source, ref, offset,
    length, image) -> record batches of :data:`FETCH_PREPARE_ARROW`, one batch behind
    (its fetches run while the batch before is prepared). `ref` is given only for rows
    to fetch, `image` only for rows to prepare from the bytes they carry; rows not to
    process are all null. Arrow in and out: no pandas frame per batch."""
    pending: _Started | None = None
    for process, sources, refs, offsets, lengths, images in batches:
        started = _start(process, sources, refs, offsets, lengths, images, fetch, rules)
        if pending is not None:
            yield _finish(pending, prepare)
        pending = started
    if pending is not None:
        yield _finish(pending, prepare)
