"""The per-task side of an export: the function ``mapInArrow`` runs on each partition.

A task writes its partition into a folder scoped to its task attempt and reports one
result row (:data:`RESULT_DDL`) that the driver commits from:

* Locally, into ``<staging>/_attempts/part-00003-t17`` (by task attempt id), then
  renamed to ``<staging>/part-00003`` with its record (:data:`PART_META`) inside --
  first finisher wins; an attempt that finishes second deletes its copy. A rerun finds
  the record and reports the partition as resumed without writing it again.
* With an ``s3://`` export, into ``<remote>/[<bucket>/]<key>/part-00003-t17/`` through
  a local scratch folder that ``MDSWriter`` empties as it uploads; a done-marker under
  ``_lakeshard/<key>/done/`` is written last and is what a rerun resumes from.

With a :class:`BlobSource`, the rows carry their Lance row address instead of the image
bytes, and the task takes the bytes from Lance (:data:`TAKE_ROWS` rows at a time).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from etl.config import BucketSpec
from etl.runtime.faults import fault_point
from etl.runtime.warm import import_in_background
from etl.writers.mds.buckets import BucketRouter
from etl.writers.mds.checksum import PART_IDS, PART_META

__all__ = ["BlobSource", "TAKE_ROWS", "RESULT_DDL", "state_prefix", "partition_writer",
           "write_here", "warm_writer"]


@dataclass(frozen=True)
class BlobSource:
    """MDS columns fetched inside the writing task from a Lance table by row address
    (the DataFrame's ``_rowaddr`` column, read with ``option("row_address", "true")``)."""

    path: str
    version: int
    columns: Mapping[str, str] = field(default_factory=dict)  # MDS column -> Lance column


# Rows whose blobs (image bytes) one take from Lance fetches: bounds a task's memory
# to about TAKE_ROWS images beyond the MDS writer's shard cache.
TAKE_ROWS = 256

_RESULT_FIELDS = [
    ("partition", pa.int32()), ("samples", pa.int64()), ("checksum", pa.string()),
    ("resumed", pa.bool_()), ("dir", pa.string()), ("indexes", pa.string()),
]
# The row each task reports: `dir` is the folder its shards are in (the attempt's, on
# S3), `indexes` its sub-folders' index.json as JSON ({"": ...} without buckets).
RESULT_DDL = ("partition int, samples long, checksum string, resumed boolean, dir string, "
              "indexes string")


def state_prefix(key: str) -> str:
    """Where an S3 export keeps its own state (done-markers) for export `key`."""
    return f"_lakeshard/{key}/"


def _marker(key: str, pid: int) -> str:
    return f"{state_prefix(key)}done/part-{pid:05d}.json"


def _take_blobs(batch: pa.RecordBatch, blobs: BlobSource, ds) -> pa.RecordBatch:
    """`batch` with its ``_rowaddr`` replaced by the blob columns, taken from Lance."""
    import numpy as np

    i = batch.schema.get_field_index("_rowaddr")
    addrs = batch.column(i).to_numpy(zero_copy_only=False)
    order = np.argsort(addrs, kind="stable")  # ascending addresses: sequential reads
    taken = ds._take_rows(addrs[order].tolist(), columns=list(blobs.columns.values()))
    if taken.num_rows != batch.num_rows:
        raise RuntimeError(
            f"took {taken.num_rows} rows from {blobs.path} for {batch.num_rows} addresses"
        )
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    taken = taken.take(pa.array(inverse))
    out = batch.remove_column(i)
    for mds_col, lance_col in blobs.columns.items():
        out = out.append_column(mds_col, taken.column(lance_col).combine_chunks())
    return out


# PART_IDS: a partition's rows (by id) and their fingerprints.
IDS_SCHEMA = pa.schema([("sample_id", pa.string()), ("_fp", pa.int64())])


def _write_ids(ids: list[pa.RecordBatch], attempt: str, store, prefix: str) -> None:
    """The partition's ``sample_id, _fp`` as :data:`PART_IDS`: in the attempt folder
    (locally), or uploaded under the attempt's prefix (S3)."""
    import pyarrow.parquet as pq

    table = pa.Table.from_batches(ids).cast(IDS_SCHEMA) if ids else IDS_SCHEMA.empty_table()
    if store is None:
        pq.write_table(table, os.path.join(attempt, PART_IDS))
        return
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    store.put_bytes(f"{prefix}/{PART_IDS}", sink.getvalue().to_pybytes())


_warming: threading.Thread | None = None


def warm_writer() -> None:
    """Start importing the MDS writer (~0.2 s in a fresh process; no torch) on a
    thread of this process (:mod:`etl.runtime.warm`), so that it overlaps what the
    process does before a write made here (:func:`write_here`), which waits for it.
    Once per process; a failed import is left for :func:`write_here` to raise."""
    global _warming
    if _warming is not None or "etl.writers.mds.writer" in sys.modules:
        return
    _warming = import_in_background("etl.writers.mds.writer", name="lakeshard-mds-import")


def _writer_here() -> None:
    """The import :func:`warm_writer` started, finished (the writer registers
    streaming's bare packages itself when imported)."""
    if _warming is not None:
        _warming.join()


def _read_part_meta(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@dataclass(frozen=True)
class _PartitionTask:
    """The settings every writing task shares (:func:`partition_writer`)."""

    staging: str
    remote: str | None
    key: str
    columns: dict[str, str]
    size_limit: int
    compression: str | None
    hashes: tuple[str, ...]
    blobs: BlobSource | None
    buckets: BucketSpec | None
    quality: int
    part_offset: int
    keep_ids: bool


def partition_writer(
    *,
    staging: str,
    remote: str | None,
    key: str,
    columns: dict[str, str],
    size_limit: int,
    compression: str | None,
    hashes: tuple[str, ...],
    blobs: BlobSource | None,
    buckets: BucketSpec | None,
    quality: int,
    part_offset: int = 0,
    keep_ids: bool = False,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function writing one partition per task. Locally, `staging`
    is the staging folder; with `remote` (an ``s3://`` export folder), shards go to
    ``<remote>/[<bucket>/]<key>/<attempt>/``.

    Task `i` writes partition ``part_offset + i`` (an incremental export numbers its new
    partitions after the ones it keeps). Rows with a ``_fp`` column (their fingerprint)
    also leave the partition's ``sample_id, _fp`` in :data:`PART_IDS` beside its shards:
    what the next export diffs against."""
    task = _PartitionTask(
        staging=staging, remote=remote, key=key, columns=columns, size_limit=size_limit,
        compression=compression, hashes=hashes, blobs=blobs, buckets=buckets,
        quality=quality, part_offset=part_offset, keep_ids=keep_ids,
    )

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        from udfs.worker import settle_imports

        ctx = TaskContext.get()
        from etl.writers.mds.writer import PassThroughMDSWriter  # noqa: F401

        settle_imports()  # keep the daemon's per-task GC cheap after the imports
        return _write_partition(task, batches, ctx.partitionId(), ctx.taskAttemptId())

    write.task = task  # what write_here runs the same partition writes with
    return write


def write_here(write: Callable, partitions: Iterable[Iterable[pa.RecordBatch]]
               ) -> list[dict]:
    """What ``mapInArrow(write, ...)`` does with `write` (:func:`partition_writer`), done
    in this process for a few rows the driver holds: the i-th iterable of Arrow batches
    is partition i, written by the same code as a task's into the same folders, each
    under an attempt of its own (numbered from the clock: never a Spark attempt's of the
    same export). The result rows, in partition order."""
    task: _PartitionTask = write.task
    _writer_here()
    results = []
    for index, batches in enumerate(partitions):
        attempt = time.time_ns() // 1000
        for out in _write_partition(task, iter(batches), index, attempt):
            results.extend(out.to_pylist())
    return results


_RESULT_SCHEMA = pa.schema(_RESULT_FIELDS)


def _result(meta: dict, resumed: bool) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([{**meta, "resumed": resumed}], schema=_RESULT_SCHEMA)


def _write_partition(task: _PartitionTask, batches: Iterator[pa.RecordBatch], index: int,
                     attempt_id: int) -> Iterator[pa.RecordBatch]:
    """One task (partition `index`, attempt `attempt_id`): its partition resumed if an
    earlier run finished it, else written into the attempt's folder and published; one
    result row either way."""
    from etl.writers.remote import S3Store

    pid = task.part_offset + index
    store = S3Store(task.remote) if task.remote else None
    part_dir = os.path.join(task.staging, f"part-{pid:05d}")
    done = (store.get_json(_marker(task.key, pid)) if store
            else _read_part_meta(os.path.join(part_dir, PART_META)))
    if done is not None:  # finished by an earlier, interrupted run
        yield _result(done, resumed=True)
        return
    attempt_name = f"part-{pid:05d}-t{attempt_id}"
    attempt = _attempt_folder(task.staging, store, attempt_name)
    samples, ids, router = _write_shards(task, batches, attempt, store, attempt_name)
    if task.keep_ids:
        _write_ids(ids, attempt, store, f"{task.key}/{attempt_name}")
    meta = {"partition": pid, "samples": samples, "checksum": router.checksum(),
            "dir": attempt_name if store else f"part-{pid:05d}",
            "indexes": json.dumps(router.indexes(), sort_keys=True)}
    if store:
        store.put_json(_marker(task.key, pid), meta)  # last: the partition is done
        shutil.rmtree(attempt, ignore_errors=True)
    else:
        meta = _publish_local(meta, attempt, part_dir)
    fault_point(f"export:part-{pid:05d}")
    yield _result(meta, resumed=False)


def _attempt_folder(staging: str, store, attempt_name: str) -> str:
    """Where this attempt writes: a fresh local scratch folder (S3, emptied as the writer
    uploads), or ``<staging>/_attempts/<attempt>`` cleared of an earlier try."""
    import tempfile

    if store:
        return tempfile.mkdtemp(prefix=f"lakeshard-{attempt_name}-")
    attempt = os.path.join(staging, "_attempts", attempt_name)
    shutil.rmtree(attempt, ignore_errors=True)
    return attempt


def _write_shards(task: _PartitionTask, batches: Iterator[pa.RecordBatch], attempt: str,
                  store, attempt_name: str
                  ) -> tuple[int, list[pa.RecordBatch], BucketRouter]:
    """Stream the partition's batches into MDS writers (one per bucket) under `attempt`:
    the samples written, the ``sample_id, _fp`` batches kept (with `keep_ids`), and the
    closed router (checksum, indexes)."""
    table = None
    if task.blobs is not None:
        import lance

        table = lance.dataset(task.blobs.path, version=task.blobs.version)
    from etl.writers.mds.writer import PassThroughMDSWriter

    def make_writer(local: str, sub: str) -> PassThroughMDSWriter:
        upload = None
        if store is not None:
            prefix = "/".join(p for p in (sub, task.key, attempt_name) if p)

            def upload(name: str, path: str) -> None:
                store.put_file(f"{prefix}/{name}", path)

        return PassThroughMDSWriter(
            local=local, columns=task.columns, compression=task.compression,
            hashes=list(task.hashes), size_limit=task.size_limit, upload=upload,
        )

    samples = 0
    ids: list[pa.RecordBatch] = []
    router = BucketRouter(attempt, make_writer, task.size_limit, task.buckets, task.quality)
    try:
        for batch in batches:  # one Arrow batch at a time: never a whole partition
            if task.keep_ids:
                ids.append(batch.select(["sample_id", "_fp"]))
                batch = batch.drop_columns(["_fp"])
            for part in _with_blobs(batch, task.blobs, table):
                router.write(part, task.columns)
                samples += part.num_rows
    finally:
        router.close()
    return samples, ids, router


def _with_blobs(batch: pa.RecordBatch, blobs: BlobSource | None, table
                ) -> Iterator[pa.RecordBatch]:
    """`batch` as it is without a blob source; else in slices of :data:`TAKE_ROWS` rows
    with their blobs taken from Lance (batches of small columns are large, TAKE_ROWS x 8
    per Spark batch: the slices bound memory)."""
    if table is None:
        yield batch
        return
    for start in range(0, batch.num_rows, TAKE_ROWS):
        yield _take_blobs(batch.slice(start, TAKE_ROWS), blobs, table)


def _publish_local(meta: dict, attempt: str, part_dir: str) -> dict:
    """Record `meta` in the attempt folder and rename it to the partition's folder --
    atomic, first finisher wins; a later attempt deletes its copy and reports the
    winner's record."""
    with open(os.path.join(attempt, PART_META), "w", encoding="utf-8") as f:
        json.dump(meta, f)
    try:
        os.rename(attempt, part_dir)  # atomic; fails if another attempt won
    except OSError:
        shutil.rmtree(attempt, ignore_errors=True)
        with open(os.path.join(part_dir, PART_META), encoding="utf-8") as f:
            return json.load(f)
    return meta
