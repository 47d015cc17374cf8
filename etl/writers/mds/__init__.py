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
:mod:`.writer` (the ``MDSWriter`` subclass), :mod:`.buckets` (aspect-ratio buckets and
the per-bucket router), :mod:`.task` (the per-task writer), :mod:`.commit` (the
driver-side commit), :mod:`.checksum` (partition checksums), and here the Spark glue.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import MapType

from etl.config import BucketSpec
from etl.writers.mds.buckets import bucket_name, bucket_set, spec_settings
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
from etl.writers.mds.task import RESULT_DDL, TAKE_ROWS, BlobSource, partition_writer

__all__ = [
    "BlobSource",
    "encode_batch",
    "ExportResult",
    "mds_encoding",
    "export_key",
    "export_mds",
    "plan_increment",
    "IncrementPlan",
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


def export_mds(
    rows: DataFrame,
    out_dir: str,
    *,
    partitions: int,
    size_limit: int,
    compression: str | None,
    hashes: tuple[str, ...],
    seed: int = 0,
    manifest: dict[str, Any] | None = None,
    lineage: dict[str, Any] | None = None,
    blobs: BlobSource | None = None,
    buckets: BucketSpec | None = None,
    jpeg_quality: int = 92,
    encodings: dict[str, str] | None = None,
    incremental: bool = False,
    identity: str | None = None,
) -> ExportResult:
    """Write `rows` as an MDS export at `out_dir`: every column of `rows`, encoded by
    its Spark type (`image` as pass-through JPEG). `manifest` adds the caller's
    description of the export (table, predicate) to ``manifest.json``, `lineage` what
    changes with the table's content (its version, what was left out); together with
    the writer settings they name the staging folder, so an interrupted export resumes.

    With `buckets` (:class:`etl.config.BucketSpec`), rows are routed by aspect ratio
    into one sub-folder per bucket (``<out>/<W>x<H>/``, each with its own
    ``index.json``; read one with ``StreamingDataset(local=<out>, split="<W>x<H>")``),
    resized to the bucket at `jpeg_quality` if the spec says so.

    `encodings` overrides the encoding of some columns (binary columns of raw array
    bytes as fixed-shape ``ndarray:<dtype>:<shape>``).

    `incremental`: every partition keeps its rows' ids and fingerprints (a hash of
    the row's written columns and of the `identity` column, e.g. the image's sha256,
    which is not written); when only the lineage changed since the export in place,
    the rows are diffed against those, the partitions that still hold exactly their
    rows are kept, and only rows that joined, plus the rows of partitions that lost or
    changed a row, are written, as new partitions (:func:`plan_increment`)."""
    _check_rows(rows, blobs, buckets)
    columns = _mds_columns(rows, blobs, encodings or {}, identity)
    base = _writer_settings(
        manifest, columns, partitions=partitions, size_limit=size_limit,
        compression=compression, hashes=hashes, seed=seed, buckets=buckets,
        jpeg_quality=jpeg_quality,
    )
    settings = {**base, **(lineage or {})}
    key = export_key(settings)
    commit = open_commit(out_dir, key)
    current = commit.read_manifest()
    if current is not None and current.get("export_key") == key:  # already exported
        commit.drop_leftovers()
        return ExportResult.from_manifest(out_dir, current, resumed=partitions, unchanged=True)
    commit.prepare()

    name = out_dir.rstrip("/").rsplit("/", 1)[-1]
    if incremental:
        settings["base_key"] = export_key(base)
        rows = rows.withColumn("_fp", row_fingerprint(rows, exclude=("_rowaddr",)))
    if identity is not None:
        rows = rows.drop(identity)
    plan = None
    if incremental and current is not None and current.get("base_key") == settings["base_key"]:
        with _job(rows, f"diff {name} with the export in place"):
            plan = plan_increment(rows, current, out_dir, partitions)
    if plan is not None:
        settings["increment"] = plan.summary()
    todo = _WriteSet.of(rows, partitions, plan)
    write = partition_writer(
        staging=commit.staging, remote=commit.remote, key=key, columns=columns,
        size_limit=size_limit, compression=compression, hashes=hashes, blobs=blobs,
        buckets=buckets, quality=jpeg_quality, part_offset=todo.offset, keep_ids=incremental,
    )
    results = _write_partitions(todo, write, seed=seed, small_rows=blobs is not None,
                                name=name)
    final = commit.commit(results, settings, bucketed=buckets is not None, kept=todo.kept)
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


def _mds_columns(rows: DataFrame, blobs: BlobSource | None, encodings: dict[str, str],
                identity: str | None) -> dict[str, str]:
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


def _writer_settings(manifest: dict[str, Any] | None, columns: dict[str, str], *,
                    partitions: int, size_limit: int, compression: str | None,
                    hashes: tuple[str, ...], seed: int, buckets: BucketSpec | None,
                    jpeg_quality: int) -> dict[str, Any]:
    """The caller's description plus every writer setting that shapes the files: what
    the export key is computed from (with the lineage) and ``manifest.json`` records."""
    base = {
        **(manifest or {}), "columns": columns, "partitions": partitions,
        "size_limit": size_limit, "compression": compression, "hashes": list(hashes),
        "seed": seed,
    }
    if buckets is not None:
        base["buckets"] = spec_settings(buckets)
        base["bucket_names"] = [bucket_name(wh) for wh in bucket_set(buckets)]
        if buckets.resize:
            base["jpeg_quality"] = jpeg_quality
    return base


@contextmanager
def _job(rows: DataFrame, step: str) -> Iterator[None]:
    """Spark jobs started inside are labelled ``lakeshard export: <step>``."""
    sc = rows.sparkSession.sparkContext
    sc.setJobDescription(f"lakeshard export: {step}")
    try:
        yield
    finally:
        sc.setJobDescription(None)


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
        settings["spark.sql.execution.arrow.maxRecordsPerBatch"] = str(rows)
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

    rows: DataFrame
    parts: int
    offset: int = 0
    kept: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, rows: DataFrame, partitions: int, plan: IncrementPlan | None) -> _WriteSet:
        if plan is None or not plan.incremental:
            return cls(rows, partitions)
        return cls(plan.rows, plan.new_parts, plan.offset, plan.kept)


def _write_partitions(todo: _WriteSet, write, *, seed: int, small_rows: bool, name: str
                      ) -> list[dict]:
    """Spread and order the rows, run `write` (:func:`partition_writer`) on every
    partition and return the tasks' reports in partition order, checked to be exactly
    the partitions asked for. With `small_rows` (blobs are taken by the tasks), Arrow
    batches are large: the task takes the blobs in slices."""
    results: list[dict] = []
    if todo.parts:
        ordered = (
            todo.rows.repartition(todo.parts, "sample_id")
            .sortWithinPartitions(F.xxhash64("sample_id", F.lit(seed)), "sample_id")
        )
        spark = todo.rows.sparkSession
        with _job(todo.rows, f"write MDS {name}"), \
                _write_conf(spark, TAKE_ROWS * 8 if small_rows else None):
            results = sorted(
                (r.asDict() for r in ordered.mapInArrow(write, RESULT_DDL).collect()),
                key=lambda r: r["partition"],
            )
    reported = [r["partition"] for r in results]
    if reported != list(range(todo.offset, todo.offset + todo.parts)):
        raise RuntimeError(f"export {name}: tasks reported partitions {reported}")
    return results


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


# An incremental export rewrites the whole export instead when it would write more than
# this share of its rows, or when it would be made of more than this many times the
# configured number of partitions (every night adds one: the rewrite compacts them).
REWRITE_SHARE = 0.5
MAX_PARTS_FACTOR = 4
_MAX_PART_ID = 99_999  # part-NNNNN


@dataclass
class IncrementPlan:
    """What an incremental export writes and keeps (:func:`plan_increment`)."""

    rows: DataFrame  # the rows to write: joined, plus those of rewritten partitions
    kept: list[dict]  # the `parts` records of partitions kept as they are
    new_parts: int  # partitions to write the rows into
    offset: int  # the first new partition's id
    added: int
    departed: int
    changed: int
    rewritten: list[int]  # ids of partitions that lost or changed a row
    to_write: int
    incremental: bool  # False: a full rewrite is cheaper or due
    reason: str

    def summary(self) -> dict:
        return {
            "mode": "incremental" if self.incremental else "rewrite", "reason": self.reason,
            "added": self.added, "departed": self.departed, "changed": self.changed,
            "rewritten_parts": self.rewritten, "written_samples":
            self.to_write if self.incremental else None,
            "kept_parts": [p["partition"] for p in self.kept] if self.incremental else [],
        }


def ids_location(out_dir: str, record: dict) -> str:
    """Where a partition's :data:`PART_IDS` is (``prefix`` on S3, ``dir`` locally)."""
    where = record.get("prefix") or record["dir"]
    return f"{out_dir.rstrip('/')}/{where}/{PART_IDS}"


def plan_increment(rows: DataFrame, current: dict, out_dir: str, partitions: int
                   ) -> IncrementPlan | None:
    """Diff `rows` (with ``_fp``) against the partitions of the export in place (their
    :data:`PART_IDS`), and decide what to write. None when the export in place keeps
    no ids (written before incremental exports, or with `incremental` off).

    A row that joined the selection goes to a new partition; a partition that lost a
    row (removed, taken down, now a duplicate) or holds a row whose fingerprint changed
    is written again, as a new partition, from the current rows; every other partition
    is kept. MDS shards are immutable and a reader takes the whole shard, so a
    partition is the smallest unit that can be replaced without rewriting others."""
    parts = current.get("parts")
    if not parts:
        return None
    old = _exported_ids(rows.sparkSession, out_dir, parts)
    counts, rewritten = _diff_counts(rows, old)
    by_id = {p["partition"]: p for p in parts}
    unknown = rewritten - set(by_id)
    if unknown or None in rewritten:
        raise RuntimeError(f"export ids name partitions {sorted(unknown)} the manifest lacks")
    kept = [p for p in parts if p["partition"] not in rewritten]
    total = current["samples"] + counts["added"] - counts["departed"]
    to_write = counts["added"] + sum(by_id[i]["samples"] for i in rewritten) - counts["departed"]
    per_part = max(1, -(-max(total, 1) // partitions))
    new_parts = -(-to_write // per_part) if to_write else 0
    offset = max(by_id) + 1
    reason = _rewrite_reason(to_write, total, parts_after=len(kept) + new_parts,
                             next_id=offset + new_parts, partitions=partitions)
    incremental = reason == _ONLY_CHANGES
    write = rows
    if incremental and to_write:
        write = (rows.join(old.select("sample_id", "_part"), "sample_id", "left")
                 .where(F.col("_part").isNull() | F.col("_part").isin(sorted(rewritten)))
                 .drop("_part"))
    return IncrementPlan(
        rows=write, kept=kept, new_parts=new_parts, offset=offset, added=counts["added"],
        departed=counts["departed"], changed=counts["changed"], rewritten=sorted(rewritten),
        to_write=to_write, incremental=incremental, reason=reason,
    )


def _exported_ids(spark: SparkSession, out_dir: str, parts: list[dict]) -> DataFrame:
    """``sample_id, _old_fp, _part``: every row the export in place holds, with its
    fingerprint and partition id (from the path of the partition's :data:`PART_IDS`)."""
    return (
        spark.read.schema("sample_id string, _fp long")
        .parquet(*[ids_location(out_dir, p) for p in parts])
        .select("sample_id", F.col("_fp").alias("_old_fp"),
                F.regexp_extract(F.input_file_name(), r"part-(\d{5})(-t\d+)?/[^/]*$", 1)
                .cast("int").alias("_part"))
    )


def _diff_counts(rows: DataFrame, old: DataFrame) -> tuple[dict[str, int], set[int]]:
    """How many rows were added, departed and changed since the export in place
    (:func:`_exported_ids`), and the partitions that lost or changed a row."""
    diff = (
        rows.select("sample_id", "_fp").join(old, "sample_id", "full_outer")
        .select(
            "sample_id", "_part",
            F.when(F.col("_old_fp").isNull(), "added")
            .when(F.col("_fp").isNull(), "departed")
            .when(F.col("_fp") != F.col("_old_fp"), "changed")
            .alias("_change"))
        .where(F.col("_change").isNotNull())
    )
    counts = {"added": 0, "departed": 0, "changed": 0}
    rewritten: set[int] = set()
    for r in diff.groupBy("_change", "_part").count().collect():
        counts[r["_change"]] += r["count"]
        if r["_change"] != "added":
            rewritten.add(r["_part"])
    return counts, rewritten


_ONLY_CHANGES = "only what changed"


def _rewrite_reason(to_write: int, total: int, *, parts_after: int, next_id: int,
                    partitions: int) -> str:
    """Why the whole export is written again instead (:data:`REWRITE_SHARE`,
    :data:`MAX_PARTS_FACTOR`, ids exhausted), or :data:`_ONLY_CHANGES`."""
    if to_write > REWRITE_SHARE * total:
        return f"{to_write} of {total} rows to write (> {REWRITE_SHARE:.0%})"
    if parts_after > MAX_PARTS_FACTOR * partitions:
        return (f"{parts_after} partitions (> {MAX_PARTS_FACTOR} x "
                f"{partitions}): rewritten to compact them")
    if next_id > _MAX_PART_ID:
        return "partition ids exhausted"
    return _ONLY_CHANGES
