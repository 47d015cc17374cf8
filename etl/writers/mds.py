"""Partition-wise, resumable MDS export (Mosaic Streaming).

Rows are hash-partitioned by ``sample_id`` into a fixed number of partitions and
ordered inside each by a seeded hash, so a given table version, predicate and seed
always give the same partitions in the same order (and every shard mixes sources).

Each Spark task streams its partition's Arrow batches through an ``MDSWriter`` into a
directory scoped to its task attempt (``_attempts/part-00003-t17``, by task attempt
id), then renames it to ``part-00003`` -- first finisher wins, a retried or speculative
attempt that finishes second deletes its copy. Everything happens in a staging folder
named by the export's settings (:func:`export_key`), so an interrupted export, run
again with the same settings, skips every partition that already has its
``part-NNNNN`` folder. The driver then merges the partitions' ``index.json`` files into
one root index, writes ``manifest.json`` (settings, counts, checksum) and swaps the
staging folder into place in one rename: a reader never sees a half-written export.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from etl.faults import fault_point

__all__ = [
    "FIXED_COLUMNS",
    "ExportResult",
    "mds_encoding",
    "export_key",
    "export_mds",
    "merge_partition_indexes",
    "part_checksum",
    "PART_META",
]

# Columns every export has; `image` holds the stored JPEG bytes unchanged.
FIXED_COLUMNS: dict[str, str] = {
    "image": "jpeg",
    "sample_id": "str",
    "source": "str",
    "width": "int32",
    "height": "int32",
    "original_width": "int32",
    "original_height": "int32",
}

_ENCODINGS = {
    T.StringType: "str",
    T.IntegerType: "int32",
    T.LongType: "int64",
    T.ShortType: "int16",
    T.FloatType: "float32",
    T.DoubleType: "float64",
}
PART_META = "_part.json"
_RESULT_DDL = "partition int, samples long, checksum string, resumed boolean"


@dataclass(frozen=True)
class ExportResult:
    path: str
    samples: int
    shards: int
    bytes: int
    checksum: str
    resumed_partitions: int = 0


def mds_encoding(dtype: T.DataType, column: str) -> str:
    """The MDS encoding for a Spark column type; a clear error for unsupported ones."""
    for spark_type, encoding in _ENCODINGS.items():
        if isinstance(dtype, spark_type):
            return encoding
    raise ValueError(
        f"column {column!r} has type {dtype.simpleString()}, which has no MDS encoding here "
        f"(supported: {', '.join(sorted(t.typeName() for t in _ENCODINGS))})"
    )


def export_key(settings: dict[str, Any]) -> str:
    """A short, stable id of everything that determines an export's bytes."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _passthrough_writer_cls():
    import numpy as np
    from streaming import MDSWriter
    from streaming.base.format.mds.encodings import mds_encode

    class PassThroughJpegMDSWriter(MDSWriter):
        """MDSWriter whose `jpeg` columns take already-encoded JPEG bytes as they are.

        The stock `jpeg` encoding takes a PIL image and re-encodes it (lossy, slow);
        the curated table already stores JPEG bytes, and `jpeg` decoding on the read
        side is just ``Image.open`` of those bytes.
        """

        def encode_sample(self, sample: dict[str, Any]) -> bytes:
            sizes, data = [], []
            for key, encoding, size in zip(
                self.column_names, self.column_encodings, self.column_sizes, strict=True
            ):
                value = sample[key]
                if encoding == "jpeg" and isinstance(value, (bytes, bytearray)):
                    if not value.startswith(b"\xff\xd8"):
                        raise ValueError(f"column {key!r}: bytes are not a JPEG")
                    datum = bytes(value)
                else:
                    datum = mds_encode(encoding, value)
                if size is None:
                    sizes.append(len(datum))
                elif size != len(datum):
                    raise ValueError(f"column {key!r}: {len(datum)} bytes, expected {size}")
                data.append(datum)
            return np.array(sizes, np.uint32).tobytes() + b"".join(data)

    return PassThroughJpegMDSWriter


def part_checksum(part_dir: str) -> str:
    """sha256 over the partition's index and shard files, in name order."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(part_dir)):
        if name == PART_META:
            continue
        digest.update(name.encode() + b"\0")
        with open(os.path.join(part_dir, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _write_partitions(staging: str, columns: dict, size_limit: int, compression, hashes):
    result_schema = pa.schema(
        [("partition", pa.int32()), ("samples", pa.int64()), ("checksum", pa.string()),
         ("resumed", pa.bool_())]
    )

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        pid = TaskContext.get().partitionId()
        part_dir = os.path.join(staging, f"part-{pid:05d}")
        meta_path = os.path.join(part_dir, PART_META)
        if os.path.exists(meta_path):  # finished by an earlier, interrupted run
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
            yield pa.RecordBatch.from_pylist([{**meta, "resumed": True}], schema=result_schema)
            return
        attempt = os.path.join(
            staging, "_attempts", f"part-{pid:05d}-t{TaskContext.get().taskAttemptId()}"
        )
        shutil.rmtree(attempt, ignore_errors=True)
        samples = 0
        with _passthrough_writer_cls()(
            out=attempt, columns=columns, compression=compression, hashes=list(hashes),
            size_limit=size_limit,
        ) as writer:
            for batch in batches:  # one Arrow batch at a time: never a whole partition
                for row in batch.to_pylist():
                    writer.write(row)
                    samples += 1
        meta = {"partition": pid, "samples": samples, "checksum": part_checksum(attempt)}
        with open(os.path.join(attempt, PART_META), "w", encoding="utf-8") as f:
            json.dump(meta, f)
        try:
            os.rename(attempt, part_dir)  # atomic; fails if another attempt won
        except OSError:
            shutil.rmtree(attempt, ignore_errors=True)
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        fault_point(f"export:part-{pid:05d}")
        yield pa.RecordBatch.from_pylist([{**meta, "resumed": False}], schema=result_schema)

    return write, result_schema


def _read_manifest(out_dir: str) -> dict | None:
    try:
        with open(os.path.join(out_dir, "manifest.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _result(out_dir: str, manifest: dict, resumed: int) -> ExportResult:
    return ExportResult(
        path=out_dir, samples=manifest["samples"], shards=manifest["shards"],
        bytes=manifest["bytes"], checksum=manifest["checksum"], resumed_partitions=resumed,
    )


def merge_partition_indexes(export_dir: str, parts: list[str]) -> dict:
    """Root index over the shards of `parts` (sub-directories of `export_dir`)."""
    shards = []
    for part in sorted(parts):
        with open(os.path.join(export_dir, part, "index.json"), encoding="utf-8") as f:
            index = json.load(f)
        for shard in index["shards"]:
            shard = json.loads(json.dumps(shard))  # deep copy
            for key in ("raw_data", "zip_data"):
                if shard.get(key):
                    shard[key]["basename"] = f"{part}/{shard[key]['basename']}"
            shards.append(shard)
    return {"version": 2, "shards": shards}


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
) -> ExportResult:
    """Write `rows` as an MDS export at `out_dir`: every column of `rows`, encoded by
    its Spark type (`image` as pass-through JPEG). `manifest` adds the caller's
    lineage (table, version, predicate) to ``manifest.json``; together with the
    writer settings it names the staging folder, so an interrupted export resumes."""
    if "sample_id" not in rows.columns or "image" not in rows.columns:
        raise ValueError("export rows need `image` and `sample_id` columns")
    columns = {
        f.name: "jpeg" if f.name == "image" else mds_encoding(f.dataType, f.name)
        for f in rows.schema.fields
    }
    settings = {
        **(manifest or {}), "columns": columns, "partitions": partitions,
        "size_limit": size_limit, "compression": compression, "hashes": list(hashes),
        "seed": seed,
    }
    key = export_key(settings)
    current = _read_manifest(out_dir)
    if current is not None and current.get("export_key") == key:
        return _result(out_dir, current, resumed=partitions)  # already exported: no work
    parent = os.path.dirname(os.path.abspath(out_dir))
    name = os.path.basename(out_dir.rstrip("/"))
    staging = os.path.join(parent, f".{name}.staging-{key}")
    os.makedirs(os.path.join(staging, "_attempts"), exist_ok=True)

    ordered = (
        rows.repartition(partitions, "sample_id")
        .sortWithinPartitions(F.xxhash64("sample_id", F.lit(seed)), "sample_id")
    )
    write, result_schema = _write_partitions(staging, columns, size_limit, compression, hashes)
    sc = rows.sparkSession.sparkContext
    sc.setJobDescription(f"lakeshard export: write MDS {name}")
    try:
        results = sorted(
            ordered.mapInArrow(write, _RESULT_DDL).collect(), key=lambda r: r["partition"]
        )
    finally:
        sc.setJobDescription(None)
    reported = [r["partition"] for r in results]
    if reported != list(range(partitions)):
        raise RuntimeError(f"export {name}: tasks reported partitions {reported}")

    parts = [f"part-{r['partition']:05d}" for r in results]
    shutil.rmtree(os.path.join(staging, "_attempts"), ignore_errors=True)
    index = merge_partition_indexes(staging, parts)
    samples = sum(s["samples"] for s in index["shards"])
    if samples != sum(r["samples"] for r in results):
        raise RuntimeError(f"MDS index has {samples} samples, tasks reported otherwise")
    checksum = hashlib.sha256("".join(r["checksum"] for r in results).encode()).hexdigest()
    nbytes = sum((s.get("zip_data") or s["raw_data"])["bytes"] for s in index["shards"])
    with open(os.path.join(staging, "index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, sort_keys=True)
    with open(os.path.join(staging, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(
            {**settings, "export_key": key, "samples": samples, "shards": len(index["shards"]),
             "bytes": nbytes, "checksum": checksum,
             "part_checksums": [r["checksum"] for r in results]},
            f, indent=2, sort_keys=True,
        )

    fault_point("export:staged")
    # Swap into place: the previous export (if any) disappears only once this is whole.
    trash = os.path.join(parent, f".{name}.old-{key}")
    shutil.rmtree(trash, ignore_errors=True)
    if os.path.exists(out_dir):
        os.replace(out_dir, trash)
    os.replace(staging, out_dir)
    shutil.rmtree(trash, ignore_errors=True)
    return ExportResult(
        path=out_dir, samples=samples, shards=len(index["shards"]), bytes=nbytes,
        checksum=checksum, resumed_partitions=sum(1 for r in results if r["resumed"]),
    )
