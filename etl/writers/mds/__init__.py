"""Partition-wise, resumable MDS export (Mosaic Streaming).

Rows are hash-partitioned by ``sample_id`` into a fixed number of partitions and
ordered inside each by a seeded hash, so a given table version, predicate and seed
always give the same partitions in the same order (and every shard mixes sources).

Each Spark task streams its partition's Arrow batches through an ``MDSWriter`` into a
folder scoped to its task attempt (:mod:`.task`); the driver then commits what the
tasks reported (:mod:`.commit`): it merges the partitions' ``index.json`` files into
one root index, writes ``manifest.json`` (settings, counts, checksum) and makes the
export appear whole -- by one rename locally, by writing the manifest last on S3.
Everything is keyed by the export's settings (:func:`export_key`), so an interrupted
export, run again with the same settings, skips every partition already finished, and
an export whose manifest has the same key is not written at all.

Two things make it fast:

* **Image bytes skip Spark.** With a :class:`BlobSource`, the DataFrame carries only
  small columns plus each row's Lance row address; the shuffle that spreads and orders
  rows moves those, and each task takes the image bytes straight from the Lance table
  (pinned version) for one Arrow batch at a time -- the bytes never go through the JVM.
* **Samples are encoded a batch at a time** from the Arrow buffers (:func:`encode_batch`),
  not row by row through Python objects; the result is byte-for-byte what
  ``MDSWriter.encode_sample`` produces.

The package follows streaming's own split: :mod:`.codec` (sample encoding),
:mod:`.writer` (the MDS shard writer: the stock format, without importing torch),
:mod:`.buckets` (aspect-ratio buckets and the per-bucket router), :mod:`.task` (the
per-task writer), :mod:`.commit` (the driver-side commit), :mod:`.checksum` (partition
checksums), and here the Spark glue.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import MapType

from etl.config import BucketSpec
from etl.config.bounds import DRIVER_WRITE_ROWS
from etl.runtime.local import local_arrow
from etl.writers.mds.checksum import (
    NOT_CHECKSUMMED,
    PART_IDS,
    PART_META,
    combine_digests,
    part_checksum,
)
from etl.writers.mds.codec import encode_batch, mds_encoding
from etl.writers.mds.commit import (
    ExportResult,
    export_key,
    merge_partition_indexes,
    open_commit,
)
from etl.writers.mds.increment import (
    IncrementPlan,
    exported_of,
    ids_location,
    part_members,
    plan_changes,
    plan_increment,
    plan_increment_local,
)
from etl.writers.mds.settings import ExportSettings
from etl.writers.mds.task import (
    RESULT_DDL,
    TAKE_ROWS,
    BlobSource,
    partition_writer,
    warm_writer,
    write_here,
)

__all__ = [
    "BlobSource",
    "encode_batch",
    "ExportResult",
    "mds_encoding",
    "export_key",
    "export_mds",
    "ExportSettings",
    "DRIVER_WRITE_ROWS",
    "warm_for",
    "plan_increment",
    "plan_changes",
    "exported_of",
    "part_members",
    "IncrementPlan",
    "ids_location",
    "row_fingerprint",
    "read_manifest",
    "merge_partition_indexes",
    "part_checksum",
    "PART_META",
    "PART_IDS",
    "NOT_CHECKSUMMED",
    "combine_digests",
]


def read_manifest(out_dir: str) -> dict | None:
    """The manifest of the export at `out_dir` (local or ``s3://``), None if there is
    no whole export there."""
    return open_commit(out_dir, key="").read_manifest()


def warm_for(out_dir: str, rows: int) -> None:
    """`rows` rows the driver holds are about to be exported to `out_dir` (`held`): when
    the driver will likely write them -- few enough, or an increment of the export in
    place -- start importing the MDS writer now (:func:`warm_writer`), while the
    caller's Spark jobs run."""
    if rows <= DRIVER_WRITE_ROWS or read_manifest(out_dir) is not None:
        warm_writer()


def export_mds(rows: DataFrame, out_dir: str, settings: ExportSettings,
               planned: IncrementPlan | None = None) -> ExportResult | None:
    """Write `rows` as an MDS export at `out_dir` with `settings`: every column of
    `rows`, encoded by its Spark type (`image` as pass-through JPEG). The writer
    settings and the lineage make the export key, which names the staging folder (an
    interrupted export resumes) and tells an export in place that is already this one.
    An incremental export writes only what changed (:func:`plan_increment`); rows the
    driver holds (`settings.held`) are planned, and up to :data:`DRIVER_WRITE_ROWS`
    written, here (:func:`etl.writers.mds.task.write_here`). `planned`: an increment
    planned from what changed (:func:`plan_changes`), whose `rows` are these rows, all
    of them to write; None (write nothing) when the export in place is not the one it
    was planned on (other writer settings)."""
    s = settings
    _check_rows(rows, s.blobs, s.buckets)
    columns = _mds_columns(rows, s.blobs, s.encodings, s.identity)
    base = s.writer_settings(columns)
    key_settings = {**base, **s.lineage}
    key = export_key(key_settings)
    commit = open_commit(out_dir, key)
    current = commit.read_manifest()
    if current is not None and current.get("export_key") == key:  # already exported
        commit.drop_leftovers()
        return ExportResult.from_manifest(out_dir, current, resumed=s.partitions,
                                          unchanged=True)
    commit.prepare()

    name = out_dir.rstrip("/").rsplit("/", 1)[-1]
    if s.incremental:
        key_settings["base_key"] = export_key(base)
        rows = rows.withColumn("_fp", row_fingerprint(rows, exclude=("_rowaddr",)))
    if s.identity is not None:
        rows = rows.drop(s.identity)
    local = _collect(rows, s.seed, name) if s.held else None
    plan = None
    if planned is not None:
        if current is None or current.get("base_key") != key_settings["base_key"]:
            return None
        plan = planned
        plan.rows = rows if local is None else local
    elif (s.incremental and current is not None
            and current.get("base_key") == key_settings["base_key"]):
        with _job(rows, f"diff {name} with the export in place"):
            plan = (plan_increment(rows, current, out_dir, s.partitions) if local is None
                    else plan_increment_local(local, current, out_dir, s.partitions))
    if plan is not None:
        key_settings["increment"] = plan.summary()
    todo = _WriteSet.of(rows if local is None else local, s.partitions, plan)
    write = partition_writer(
        staging=commit.staging, remote=commit.remote, key=key, columns=columns,
        size_limit=s.size_limit, compression=s.compression, hashes=s.hashes,
        blobs=s.blobs, buckets=s.buckets, quality=s.jpeg_quality, part_offset=todo.offset,
        keep_ids=s.incremental,
    )
    here = isinstance(todo.rows, pa.Table) and todo.rows.num_rows <= DRIVER_WRITE_ROWS
    if isinstance(todo.rows, pa.Table) and not here:  # too many for the driver to write
        todo = todo.as_frame(rows)
    results = _write_partitions(todo, write, seed=s.seed, small_rows=s.blobs is not None,
                                name=name, spark=rows.sparkSession, here=here)
    final = commit.commit(results, key_settings, bucketed=s.buckets is not None,
                          kept=todo.kept)
    resumed = sum(1 for r in results if r["resumed"])
    return ExportResult.from_manifest(out_dir, final, resumed=resumed, kept=len(todo.kept))


def _check_rows(rows: DataFrame, blobs: BlobSource | None, buckets: BucketSpec | None
                ) -> None:
    """The columns an export needs, checked on the driver before any work."""
    fetched = dict(blobs.columns) if blobs else {}
    if "sample_id" not in rows.columns or "image" not in [*rows.columns, *fetched]:
        raise ValueError("export rows need `image` and `sample_id` columns")
    if fetched and "_rowaddr" not in rows.columns:
        raise ValueError("a BlobSource needs the rows' `_rowaddr` (read option row_address)")
    if buckets is not None and not {"width", "height"} <= set(rows.columns):
        raise ValueError("aspect-ratio buckets need `width` and `height` columns")


def _mds_columns(rows: DataFrame, blobs: BlobSource | None,
                 encodings: Mapping[str, str], identity: str | None) -> dict[str, str]:
    """The MDS column -> encoding map: every column of `rows` but the internal ones, by
    its Spark type unless `encodings` names it, then the columns `blobs` fetches
    (`image` is always pass-through JPEG)."""
    internal = {"_rowaddr", identity}
    columns = {
        f.name: "jpeg" if f.name == "image"
        else encodings.get(f.name) or mds_encoding(f.dataType, f.name)
        for f in rows.schema.fields
        if f.name not in internal
    }
    for name in (blobs.columns if blobs else {}):
        columns[name] = "jpeg" if name == "image" else encodings.get(name, "bytes")
    return columns


@contextmanager
def _job(rows: DataFrame, step: str) -> Iterator[None]:
    """Spark jobs started inside are labelled ``lakeshard export: <step>``."""
    sc = rows.sparkSession.sparkContext
    sc.setJobDescription(f"lakeshard export: {step}")
    try:
        yield
    finally:
        sc.setJobDescription(None)


_BATCH_ROWS = "spark.sql.execution.arrow.maxRecordsPerBatch"


@contextmanager
def _write_conf(spark: SparkSession, rows: int | None) -> Iterator[None]:
    """Inside: Spark's Arrow batch size set to `rows` (unchanged with None), and adaptive
    execution neither coalescing nor locally reading shuffles: a join on sample_id
    upstream (the rows left out) whose shuffle also serves the repartition by sample_id
    (Spark drops the repartition as redundant) would otherwise be coalesced or read one
    partition per map task, and the writer would get fewer partitions than asked for.
    All put back after."""
    settings = {"spark.sql.adaptive.coalescePartitions.enabled": "false",
                "spark.sql.adaptive.localShuffleReader.enabled": "false"}
    if rows is not None:
        settings[_BATCH_ROWS] = str(rows)
    before = {k: spark.conf.get(k, None) for k in settings}
    for k, v in settings.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


@dataclass(frozen=True)
class _WriteSet:
    """What an export writes: `rows` into `parts` partitions numbered from `offset`,
    next to the `kept` partitions of the export in place (an incremental export)."""

    rows: DataFrame | pa.Table  # an Arrow table: rows the driver holds (_collect)
    parts: int
    offset: int = 0
    kept: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, rows: DataFrame | pa.Table, partitions: int, plan: IncrementPlan | None
           ) -> _WriteSet:
        if plan is None or not plan.incremental:
            return cls(rows, partitions)
        return cls(plan.rows, plan.new_parts, plan.offset, plan.kept)

    def as_frame(self, like: DataFrame) -> _WriteSet:
        """Held rows handed back to Spark (local data, `like`'s schema)."""
        table = self.rows.drop_columns([_PART_HASH, _ORDER])
        frame = like.sparkSession.createDataFrame(table, schema=like.schema)
        return _WriteSet(frame, self.parts, self.offset, self.kept)


# The columns _collect adds: Spark's hash partitioning of sample_id (Murmur3, as
# `repartition(n, "sample_id")` computes it) and the seeded order within a partition.
_PART_HASH, _ORDER = "_part_hash", "_order"


def _order_key(seed: int) -> Column:
    return F.xxhash64("sample_id", F.lit(seed))


def _collect(rows: DataFrame, seed: int, name: str) -> pa.Table:
    """Rows the driver holds, collected once, with what spreads and orders them."""
    with _job(rows, f"collect {name}'s rows on the driver"):
        return local_arrow(rows.select("*", F.hash("sample_id").alias(_PART_HASH),
                                       _order_key(seed).alias(_ORDER)))


def _write_partitions(todo: _WriteSet, write, *, seed: int, small_rows: bool, name: str,
                      spark: SparkSession, here: bool = False) -> list[dict]:
    """Spread and order the rows, run `write` (:func:`partition_writer`) on every
    partition and return the tasks' reports in partition order, checked to be exactly
    the partitions asked for. With `small_rows` (blobs are taken by the tasks), Arrow
    batches are large: the task takes the blobs in slices. `here`: held rows (an Arrow
    table), spread, ordered and written by this process (:func:`_spread_here`)."""
    results: list[dict] = []
    batch_rows = TAKE_ROWS * 8 if small_rows else None
    if todo.parts and here:
        batch_rows = batch_rows or int(spark.conf.get(_BATCH_ROWS, "10000"))
        results = sorted(write_here(write, _spread_here(todo, batch_rows)),
                         key=lambda r: r["partition"])
    elif todo.parts:
        ordered = (
            todo.rows.repartition(todo.parts, "sample_id")
            .sortWithinPartitions(_order_key(seed), "sample_id")
        )
        with _job(todo.rows, f"write MDS {name}"), _write_conf(spark, batch_rows):
            results = sorted(
                (r.asDict() for r in ordered.mapInArrow(write, RESULT_DDL).collect()),
                key=lambda r: r["partition"],
            )
    reported = [r["partition"] for r in results]
    if reported != list(range(todo.offset, todo.offset + todo.parts)):
        raise RuntimeError(f"export {name}: tasks reported partitions {reported}")
    return results


def _spread_here(todo: _WriteSet, batch_rows: int) -> list[list[pa.RecordBatch]]:
    """Held rows as Spark's write spreads and orders them: partition i holds the rows
    whose Murmur3 hash of sample_id is i modulo the partitions (Spark's ``pmod``),
    ordered by the seeded hash, then sample_id; in batches of the size the tasks get."""
    table = todo.rows
    part = np.mod(table[_PART_HASH].to_numpy(zero_copy_only=False).astype(np.int64),
                  todo.parts)
    ordered = (table.append_column("_part", pa.array(part))
               .sort_by([("_part", "ascending"), (_ORDER, "ascending"),
                         ("sample_id", "ascending")])
               .drop_columns(["_part", _PART_HASH, _ORDER]).combine_chunks())
    ends = np.cumsum(np.bincount(part, minlength=todo.parts))
    return [ordered.slice(end - n, n).to_batches(max_chunksize=batch_rows)
            for end, n in zip(ends, np.diff(ends, prepend=0), strict=True)]


def row_fingerprint(rows: DataFrame, exclude: tuple[str, ...] = ()) -> Column:
    """A 64-bit hash of each row's columns (by name, in name order; maps as JSON, which
    Spark does not hash): equal fingerprints, equal written sample."""
    cols = []
    for f in sorted(rows.schema.fields, key=lambda f: f.name):
        if f.name in exclude:
            continue
        col = F.col(f.name)
        cols.append(F.to_json(col) if isinstance(f.dataType, MapType) else col)
    return F.xxhash64(F.lit("lakeshard-export-row"), *cols)
