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

from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from etl.config import BucketSpec
from etl.writers.mds.buckets import bucket_name, bucket_set, spec_settings
from etl.writers.mds.checksum import PART_META, combine_digests, part_checksum
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
    "read_manifest",
    "merge_partition_indexes",
    "part_checksum",
    "PART_META",
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
    blobs: BlobSource | None = None,
    buckets: BucketSpec | None = None,
    jpeg_quality: int = 92,
    encodings: dict[str, str] | None = None,
) -> ExportResult:
    """Write `rows` as an MDS export at `out_dir`: every column of `rows`, encoded by
    its Spark type (`image` as pass-through JPEG). `manifest` adds the caller's
    lineage (table, version, predicate) to ``manifest.json``; together with the
    writer settings it names the staging folder, so an interrupted export resumes.

    With `buckets` (:class:`etl.config.BucketSpec`), rows are routed by aspect ratio
    into one sub-folder per bucket (``<out>/<W>x<H>/``, each with its own
    ``index.json``; read one with ``StreamingDataset(local=<out>, split="<W>x<H>")``),
    resized to the bucket at `jpeg_quality` if the spec says so.

    `encodings` overrides the encoding of some columns (binary columns of raw array
    bytes as fixed-shape ``ndarray:<dtype>:<shape>``)."""
    fetched = dict(blobs.columns) if blobs else {}
    if "sample_id" not in rows.columns or "image" not in [*rows.columns, *fetched]:
        raise ValueError("export rows need `image` and `sample_id` columns")
    if fetched and "_rowaddr" not in rows.columns:
        raise ValueError("a BlobSource needs the rows' `_rowaddr` (read option row_address)")
    if buckets is not None and not {"width", "height"} <= set(rows.columns):
        raise ValueError("aspect-ratio buckets need `width` and `height` columns")
    encodings = encodings or {}
    columns = {
        f.name: "jpeg" if f.name == "image"
        else encodings.get(f.name) or mds_encoding(f.dataType, f.name)
        for f in rows.schema.fields
        if f.name != "_rowaddr"
    }
    for name in fetched:
        columns[name] = "jpeg" if name == "image" else encodings.get(name, "bytes")
    settings = {
        **(manifest or {}), "columns": columns, "partitions": partitions,
        "size_limit": size_limit, "compression": compression, "hashes": list(hashes),
        "seed": seed,
    }
    if buckets is not None:
        settings["buckets"] = spec_settings(buckets)
        settings["bucket_names"] = [bucket_name(wh) for wh in bucket_set(buckets)]
        if buckets.resize:
            settings["jpeg_quality"] = jpeg_quality
    key = export_key(settings)
    commit = open_commit(out_dir, key)
    current = commit.read_manifest()
    if current is not None and current.get("export_key") == key:  # already exported
        commit.drop_leftovers()
        return ExportResult.from_manifest(out_dir, current, resumed=partitions)
    commit.prepare()

    ordered = (
        rows.repartition(partitions, "sample_id")
        .sortWithinPartitions(F.xxhash64("sample_id", F.lit(seed)), "sample_id")
    )
    write = partition_writer(
        staging=commit.staging, remote=commit.remote, key=key, columns=columns,
        size_limit=size_limit, compression=compression, hashes=hashes, blobs=blobs,
        buckets=buckets, quality=jpeg_quality,
    )
    name = out_dir.rstrip("/").rsplit("/", 1)[-1]
    spark = rows.sparkSession
    sc = spark.sparkContext
    sc.setJobDescription(f"lakeshard export: write MDS {name}")
    batch_key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = spark.conf.get(batch_key, None)
    if blobs is not None:  # rows are small: big Arrow batches, blobs taken in slices
        spark.conf.set(batch_key, str(TAKE_ROWS * 8))
    try:
        results = sorted(
            (r.asDict() for r in ordered.mapInArrow(write, RESULT_DDL).collect()),
            key=lambda r: r["partition"],
        )
    finally:
        sc.setJobDescription(None)
        if before is None:
            spark.conf.unset(batch_key)
        else:
            spark.conf.set(batch_key, before)
    reported = [r["partition"] for r in results]
    if reported != list(range(partitions)):
        raise RuntimeError(f"export {name}: tasks reported partitions {reported}")

    final = commit.commit(results, settings, bucketed=buckets is not None)
    resumed = sum(1 for r in results if r["resumed"])
    return ExportResult.from_manifest(out_dir, final, resumed=resumed)
