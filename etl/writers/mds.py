"""Partition-wise MDS export (Mosaic Streaming).

Each Spark task streams its partition's Arrow batches through an ``MDSWriter`` into a
directory scoped to its task attempt (``_attempts/part-00003-t17``, by task attempt
id). Only attempts that succeeded report back to the driver; the driver renames those
to ``part-00003``, merges their ``index.json`` files into one root index, and swaps the
finished export into place in one rename, so a reader never sees a half-written export
and a retried or speculative attempt never leaves shards in the result.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame

__all__ = ["MDS_COLUMNS", "ExportResult", "export_mds", "merge_partition_indexes"]

# Sample layout training loaders expect; `image` holds the stored JPEG bytes unchanged.
MDS_COLUMNS: dict[str, str] = {
    "image": "jpeg",
    "caption": "str",
    "sample_id": "str",
    "source": "str",
    "width": "int32",
    "height": "int32",
    "original_width": "int32",
    "original_height": "int32",
}

_RESULT_SCHEMA = "partition int, attempt string, samples long"


@dataclass(frozen=True)
class ExportResult:
    path: str
    samples: int
    shards: int
    bytes: int


def _passthrough_writer_cls():
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
                self.column_names, self.column_encodings, self.column_sizes, strict=False
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
            import numpy as np

            return np.array(sizes, np.uint32).tobytes() + b"".join(data)

    return PassThroughJpegMDSWriter


def _write_partitions(staging: str, columns: dict, size_limit: int, compression, hashes):
    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        pid = ctx.partitionId()
        attempt = f"part-{pid:05d}-t{ctx.taskAttemptId()}"
        out = os.path.join(staging, "_attempts", attempt)
        shutil.rmtree(out, ignore_errors=True)
        writer_cls = _passthrough_writer_cls()
        samples = 0
        with writer_cls(
            out=out,
            columns=columns,
            compression=compression,
            hashes=list(hashes),
            size_limit=size_limit,
        ) as writer:
            for batch in batches:  # one Arrow batch at a time: never a whole partition
                for row in batch.to_pylist():
                    writer.write(row)
                    samples += 1
        yield pa.RecordBatch.from_pylist(
            [{"partition": pid, "attempt": attempt, "samples": samples}],
            schema=pa.schema(
                [("partition", pa.int32()), ("attempt", pa.string()), ("samples", pa.int64())]
            ),
        )

    return write


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
    work_id: str,
) -> ExportResult:
    """Write `rows` (columns of :data:`MDS_COLUMNS`) as an MDS export at `out_dir`.

    Rows are hash-partitioned by `sample_id` and sorted within partitions, so the same
    rows always give the same shards. `out_dir` is replaced atomically at the end.
    """
    missing = [c for c in MDS_COLUMNS if c not in rows.columns]
    if missing:
        raise ValueError(f"export rows lack column(s) {missing}")
    parent = os.path.dirname(os.path.abspath(out_dir))
    name = os.path.basename(out_dir.rstrip("/"))
    staging = os.path.join(parent, f".{name}.staging-{work_id}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(os.path.join(staging, "_attempts"), exist_ok=True)

    ordered = (
        rows.select(*MDS_COLUMNS)
        .repartition(partitions, "sample_id")
        .sortWithinPartitions("sample_id")
    )
    sc = rows.sparkSession.sparkContext
    sc.setJobDescription(f"lakeshard export: write MDS {name}")
    try:
        results = ordered.mapInArrow(
            _write_partitions(staging, MDS_COLUMNS, size_limit, compression, hashes),
            _RESULT_SCHEMA,
        ).collect()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # nothing of a failed export remains
        raise
    finally:
        sc.setJobDescription(None)

    parts = []
    for r in sorted(results, key=lambda r: r["partition"]):
        part = f"part-{r['partition']:05d}"
        os.replace(os.path.join(staging, "_attempts", r["attempt"]), os.path.join(staging, part))
        parts.append(part)
    shutil.rmtree(os.path.join(staging, "_attempts"))  # failed attempts' leftovers
    index = merge_partition_indexes(staging, parts)
    with open(os.path.join(staging, "index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, sort_keys=True)

    samples = sum(s["samples"] for s in index["shards"])
    reported = sum(r["samples"] for r in results)
    if samples != reported:
        raise RuntimeError(f"MDS index has {samples} samples but tasks wrote {reported}")

    # Swap into place: the previous export (if any) disappears only once this is whole.
    trash = os.path.join(parent, f".{name}.old-{work_id}")
    if os.path.exists(out_dir):
        os.replace(out_dir, trash)
    os.replace(staging, out_dir)
    shutil.rmtree(trash, ignore_errors=True)
    nbytes = sum((s.get("zip_data") or s["raw_data"])["bytes"] for s in index["shards"])
    return ExportResult(path=out_dir, samples=samples, shards=len(index["shards"]), bytes=nbytes)
