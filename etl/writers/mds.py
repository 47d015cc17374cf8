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

Two things make it fast:

* **Image bytes skip Spark.** With a :class:`BlobSource`, the DataFrame carries only
  small columns plus each row's Lance row address; the shuffle that spreads and orders
  rows moves those, and each task takes the image bytes straight from the Lance table
  (pinned version) for one Arrow batch at a time -- the bytes never go through the JVM.
* **Samples are encoded a batch at a time** from the Arrow buffers (:func:`encode_batch`),
  not row by row through Python objects; the result is byte-for-byte what
  ``MDSWriter.encode_sample`` produces.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from etl.faults import fault_point

__all__ = [
    "BlobSource",
    "encode_batch",
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

_FIXED_NUMPY = {
    "int8": "<i1", "int16": "<i2", "int32": "<i4", "int64": "<i8",
    "uint8": "<u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8",
    "float16": "<f2", "float32": "<f4", "float64": "<f8",
}


def _var_chunks(arr: pa.Array) -> tuple[list, list[int]]:
    """Zero-copy views of each value of a string/binary array, and their lengths."""
    import numpy as np

    if pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type):
        otype, width = np.int64, 8
    else:
        otype, width = np.int32, 4
    bufs = arr.buffers()
    offs = np.frombuffer(bufs[1], dtype=otype, count=len(arr) + 1, offset=arr.offset * width)
    data = memoryview(bufs[2]) if bufs[2] is not None else memoryview(b"")
    o = offs.tolist()
    return [data[o[i]:o[i + 1]] for i in range(len(arr))], np.diff(offs).tolist()


def encode_batch(batch: pa.RecordBatch, columns: Mapping[str, str]) -> list[bytes]:
    """MDS sample bytes for every row of `batch` (columns in `columns` order), equal to
    ``MDSWriter.encode_sample``; `jpeg` columns take stored JPEG bytes as they are."""
    import numpy as np
    from streaming.base.format.mds.encodings import get_mds_encoded_size, mds_encode

    n = batch.num_rows
    per_column, var_lengths = [], []
    for name in sorted(columns):  # MDSWriter orders columns by name
        enc = columns[name]
        arr = batch.column(batch.schema.get_field_index(name))
        if arr.null_count:
            raise ValueError(f"column {name!r}: null values cannot be written to MDS")
        size = get_mds_encoded_size(enc)
        is_var = size is None
        binary = (
            pa.types.is_binary(arr.type) or pa.types.is_string(arr.type)
            or pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type)
        )
        if binary and (enc in ("str", "bytes", "jpeg") or enc.startswith("ndarray:")):
            # ndarray: raw array bytes (stored latents); a fixed-shape ndarray's encoding is
            # exactly its values' bytes, so only the size needs checking.
            chunks, lengths = _var_chunks(arr)
            if enc == "jpeg" and any(bytes(c[:2]) != b"\xff\xd8" for c in chunks):
                raise ValueError(f"column {name!r}: bytes are not a JPEG")
            if size is not None and any(n != size for n in lengths):
                raise ValueError(f"column {name!r}: values are not {size} bytes ({enc})")
        elif enc in _FIXED_NUMPY:
            raw = np.asarray(arr.to_numpy(zero_copy_only=False)).astype(_FIXED_NUMPY[enc])
            k, buf = raw.itemsize, raw.tobytes()
            chunks, lengths = [buf[i * k:(i + 1) * k] for i in range(n)], None
        else:  # any other MDS encoding: the stock per-value encoder
            chunks = [mds_encode(enc, v) for v in arr.to_pylist()]
            lengths = [len(c) for c in chunks]
        per_column.append(chunks)
        if is_var:
            var_lengths.append(lengths)
    heads = (
        np.array(var_lengths, dtype="<u4").T if var_lengths else np.zeros((n, 0), "<u4")
    )
    return [
        b"".join([heads[i].tobytes(), *(col[i] for col in per_column)]) for i in range(n)
    ]


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


def _passthrough_writer_cls():
    import numpy as np
    from streaming import MDSWriter
    from streaming.base.format.mds.encodings import mds_encode

    class PassThroughJpegMDSWriter(MDSWriter):
        file_digests: dict[str, str]

        def __init__(self, *args, **kwargs):
            self.file_digests = {}
            super().__init__(*args, **kwargs)

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
                elif encoding.startswith("ndarray:") and isinstance(value, (bytes, bytearray)):
                    # Raw array bytes (e.g. stored latents): a fixed-shape ndarray's encoding
                    # is exactly its values' bytes; the size check below guards the shape.
                    datum = bytes(value)
                else:
                    datum = mds_encode(encoding, value)
                if size is None:
                    sizes.append(len(datum))
                elif size != len(datum):
                    raise ValueError(f"column {key!r}: {len(datum)} bytes, expected {size}")
                data.append(datum)
            return np.array(sizes, np.uint32).tobytes() + b"".join(data)

        def _process_file(self, raw_data, raw_basename, zip_basename):
            # Hash the stored file before it is uploaded (and, remotely, deleted).
            infos = super()._process_file(raw_data, raw_basename, zip_basename)
            if zip_basename is None:
                self.file_digests[raw_basename] = hashlib.sha256(raw_data).hexdigest()
            else:
                with open(os.path.join(self.local, zip_basename), "rb") as f:
                    self.file_digests[zip_basename] = hashlib.sha256(f.read()).hexdigest()
            return infos

        def flush_shard(self) -> None:
            """The stock flush joins the cached samples into one shard in memory twice
            over, writes it, and (for our checksum) the file was read back to hash it.
            Uncompressed and without MDS hashes, the same bytes go straight from the
            cached samples to the file, hashed on the way: no shard-sized copy at all.
            """
            if self.compression or self.hashes:  # both need the whole shard in memory
                return super().flush_shard()
            basename, _ = self._name_next_shard()
            samples = self.new_samples
            offsets = np.array([0] + [len(x) for x in samples]).cumsum().astype(np.uint32)
            offsets += 4 + offsets.nbytes + len(self.config_data)  # as encode_joint_shard
            header = np.uint32(len(samples)).tobytes() + offsets.tobytes() + self.config_data
            digest = hashlib.sha256(header)
            with open(os.path.join(self.local, basename), "wb") as f:
                f.write(header)
                for x in samples:  # large buffers bypass the file's buffer: no copy
                    digest.update(x)
                    f.write(x)
            self.file_digests[basename] = digest.hexdigest()
            raw_info = {"basename": basename, "bytes": int(offsets[-1]), "hashes": {}}
            self.shards.append({"samples": len(samples), "raw_data": raw_info,
                                "zip_data": None, **self.get_config()})
            future = self.executor.submit(self.cloud_writer.upload_file, basename)
            future.add_done_callback(self.exception_callback)

        def index(self) -> dict:
            """The index.json this writer writes (call after `finish`)."""
            return {"version": 2, "shards": self.shards}

        def digests(self) -> dict[str, str]:
            index = json.dumps(self.index(), sort_keys=True).encode()
            return {**self.file_digests, "index.json": hashlib.sha256(index).hexdigest()}

        def write_encoded(self, data: bytes) -> None:
            """`write` for a sample already encoded by :func:`encode_batch`."""
            if self.event.is_set():
                self.cancel_future_jobs()
                raise RuntimeError("an MDS upload thread failed; see the earlier traceback")
            size = len(data) + self.extra_bytes_per_sample
            if self.size_limit and self.size_limit < self.new_shard_size + size:
                self.flush_shard()
                self._reset_cache()
            self.new_samples.append(data)
            self.new_shard_size += size

    return PassThroughJpegMDSWriter


def combine_digests(digests: Mapping[str, str]) -> str:
    """A partition's checksum from its files' sha256 digests (relative path -> hex)."""
    lines = "".join(f"{rel}\0{digests[rel]}\n" for rel in sorted(digests))
    return hashlib.sha256(lines.encode()).hexdigest()


def part_checksum(part_dir: str) -> str:
    """Checksum of a partition folder's index and shard files (all levels): equal to
    what the writing task computed as it wrote them (:func:`combine_digests`)."""
    digests = {}
    for dirpath, _, files in os.walk(part_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), part_dir)
            if rel == PART_META:
                continue
            digest = hashlib.sha256()
            with open(os.path.join(part_dir, rel), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            digests[rel] = digest.hexdigest()
    return combine_digests(digests)


class _BucketRouter:
    """Routes a batch's rows to per-bucket writers (or one writer without buckets),
    keeping the rows' order inside each bucket and the writers' cached bytes bounded."""

    def __init__(self, attempt: str, make_writer, size_limit: int, buckets, quality: int):
        from contextlib import ExitStack

        from etl.buckets import bucket_set

        self.attempt = attempt
        self.make_writer = make_writer
        self.size_limit = size_limit
        self.spec = buckets
        self.dims = bucket_set(buckets) if buckets else None
        self.quality = quality
        self.stack = ExitStack()
        self.writers: dict[int, Any] = {}
        if self.dims is None:
            self._writer(0)  # one index.json even for an empty partition

    def sub(self, b: int) -> str:
        from etl.buckets import bucket_name

        return "" if self.dims is None else bucket_name(self.dims[b])

    def _writer(self, b: int):
        if b not in self.writers:
            local = os.path.join(self.attempt, self.sub(b)) if self.sub(b) else self.attempt
            self.writers[b] = self.stack.enter_context(self.make_writer(local, self.sub(b)))
        return self.writers[b]

    def indexes(self) -> dict[str, dict]:
        return {self.sub(b): w.index() for b, w in self.writers.items()}

    def checksum(self) -> str:
        return combine_digests({
            "/".join(p for p in (self.sub(b), rel) if p): d
            for b, w in self.writers.items() for rel, d in w.digests().items()
        })

    def write(self, batch: pa.RecordBatch, columns: dict) -> None:
        import numpy as np

        if self.dims is None:
            writer = self._writer(0)
            for data in encode_batch(batch, columns):
                writer.write_encoded(data)
            return
        from etl.buckets import assign_buckets

        widths = batch.column(batch.schema.get_field_index("width")).to_numpy()
        heights = batch.column(batch.schema.get_field_index("height")).to_numpy()
        idx = assign_buckets(widths, heights, self.dims)
        for b in np.unique(idx).tolist():
            rows = batch.take(pa.array(np.flatnonzero(idx == b)))
            if self.spec.resize:
                rows = _resize_rows(rows, self.dims[b], self.quality)
            writer = self._writer(b)
            for data in encode_batch(rows, columns):
                writer.write_encoded(data)
        # Each bucket's writer caches up to a shard; keep the sum near 2x size_limit.
        while sum(w.new_shard_size for w in self.writers.values()) > 2 * self.size_limit:
            biggest = max(self.writers.values(), key=lambda w: w.new_shard_size)
            biggest.flush_shard()
            biggest._reset_cache()

    def close(self) -> None:
        self.stack.close()
        os.makedirs(self.attempt, exist_ok=True)  # a bucketed partition with no rows


def _resize_rows(rows: pa.RecordBatch, wh: tuple[int, int], quality: int) -> pa.RecordBatch:
    from etl.buckets import resize_to_bucket

    out = rows
    i = out.schema.get_field_index("image")
    images = [resize_to_bucket(b, wh, quality) for b in out.column(i).to_pylist()]
    out = out.set_column(i, out.schema.field(i), pa.array(images, out.schema.field(i).type))
    for name, value in (("width", wh[0]), ("height", wh[1])):
        j = out.schema.get_field_index(name)
        col = pa.array([value] * out.num_rows, out.schema.field(j).type)
        out = out.set_column(j, out.schema.field(j), col)
    return out


_RESULT_FIELDS = [
    ("partition", pa.int32()), ("samples", pa.int64()), ("checksum", pa.string()),
    ("resumed", pa.bool_()), ("dir", pa.string()), ("indexes", pa.string()),
]
_RESULT_DDL = ("partition int, samples long, checksum string, resumed boolean, dir string, "
               "indexes string")


def _marker(key: str, pid: int) -> str:
    return f"_lakeshard/{key}/done/part-{pid:05d}.json"


def _write_partitions(
    staging: str, columns: dict, size_limit: int, compression, hashes,
    blobs: BlobSource | None = None, buckets=None, quality: int = 92,
    remote: str | None = None, key: str = "",
):
    """The per-task function. Locally, `staging` is the staging folder; with `remote`
    (an ``s3://`` export folder), shards go to ``<remote>/[<bucket>/]<key>/<attempt>/``
    through a local scratch folder that MDSWriter empties as it uploads."""
    result_schema = pa.schema(_RESULT_FIELDS)

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import tempfile

        from pyspark import TaskContext

        from etl.writers.remote import S3Store

        ctx = TaskContext.get()
        pid = ctx.partitionId()
        store = S3Store(remote) if remote else None
        part_dir = os.path.join(staging, f"part-{pid:05d}")
        meta_path = os.path.join(part_dir, PART_META)
        done = store.get_json(_marker(key, pid)) if store else (
            json.load(open(meta_path, encoding="utf-8")) if os.path.exists(meta_path) else None
        )
        if done is not None:  # finished by an earlier, interrupted run
            yield pa.RecordBatch.from_pylist([{**done, "resumed": True}], schema=result_schema)
            return
        attempt_name = f"part-{pid:05d}-t{ctx.taskAttemptId()}"
        if store:
            attempt = tempfile.mkdtemp(prefix=f"lakeshard-{attempt_name}-")
        else:
            attempt = os.path.join(staging, "_attempts", attempt_name)
            shutil.rmtree(attempt, ignore_errors=True)
        table = None
        if blobs is not None:
            import lance

            table = lance.dataset(blobs.path, version=blobs.version)
        cls = _passthrough_writer_cls()
        from udfs.worker import settle_imports

        settle_imports()  # streaming imports torch: keep the daemon's per-task GC cheap

        def make_writer(local: str, sub: str):
            out = local
            if store:
                out = (local, store.url(sub, key, attempt_name))
            return cls(out=out, columns=columns, compression=compression, hashes=list(hashes),
                       size_limit=size_limit, exist_ok=True)

        samples = 0
        router = _BucketRouter(attempt, make_writer, size_limit, buckets, quality)
        try:
            for batch in batches:  # one Arrow batch at a time: never a whole partition
                if table is None:
                    router.write(batch, columns)
                    samples += batch.num_rows
                    continue
                # Batches of small columns are large (TAKE_BATCH_ROWS x 8 per Spark
                # batch); blobs are taken TAKE_ROWS rows at a time to bound memory.
                for start in range(0, batch.num_rows, TAKE_ROWS):
                    part = _take_blobs(batch.slice(start, TAKE_ROWS), blobs, table)
                    router.write(part, columns)
                    samples += part.num_rows
        finally:
            router.close()
        meta = {"partition": pid, "samples": samples, "checksum": router.checksum(),
                "dir": attempt_name if store else f"part-{pid:05d}",
                "indexes": json.dumps(router.indexes(), sort_keys=True)}
        if store:
            store.put_json(_marker(key, pid), meta)  # last: the partition is done
            shutil.rmtree(attempt, ignore_errors=True)
        else:
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


def _merge_bucket_indexes(staging: str, parts: list[str]) -> dict[str, dict]:
    """Move ``part-N/<bucket>`` to ``<bucket>/part-N`` and index each bucket.

    Idempotent, so a run that died half-way through it finishes it: a bucket folder
    already moved is left where it is (a rewritten partition replaces it)."""
    buckets: set[str] = set()
    for part in parts:
        for sub in os.listdir(os.path.join(staging, part)):
            src = os.path.join(staging, part, sub)
            if not os.path.isdir(src):
                continue
            dst = os.path.join(staging, sub, part)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.rmtree(dst, ignore_errors=True)
            os.replace(src, dst)
    for sub in os.listdir(staging):
        if os.path.isdir(os.path.join(staging, sub)) and not sub.startswith(("part-", "_")):
            buckets.add(sub)
    return {
        b: merge_partition_indexes(
            os.path.join(staging, b),
            [p for p in parts if os.path.isdir(os.path.join(staging, b, p))],
        )
        for b in sorted(buckets)
    }


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
    buckets=None,
    jpeg_quality: int = 92,
    encodings: dict[str, str] | None = None,
) -> ExportResult:
    """Write `rows` as an MDS export at `out_dir`: every column of `rows`, encoded by
    its Spark type (`image` as pass-through JPEG). `manifest` adds the caller's
    lineage (table, version, predicate) to ``manifest.json``; together with the
    writer settings it names the staging folder, so an interrupted export resumes.

    With `buckets` (:class:`etl.buckets.BucketSpec`), rows are routed by aspect ratio
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
        from dataclasses import asdict

        from etl.buckets import bucket_name, bucket_set

        settings["buckets"] = asdict(buckets)
        settings["bucket_names"] = [bucket_name(wh) for wh in bucket_set(buckets)]
        if buckets.resize:
            settings["jpeg_quality"] = jpeg_quality
    key = export_key(settings)
    from etl.writers.remote import S3Store, is_remote

    remote = out_dir.rstrip("/") if is_remote(out_dir) else None
    store = S3Store(remote) if remote else None
    current = store.get_json("manifest.json") if store else _read_manifest(out_dir)
    if current is not None and current.get("export_key") == key:
        return _result(out_dir, current, resumed=partitions)  # already exported: no work
    name = out_dir.rstrip("/").rsplit("/", 1)[-1]
    if store:
        staging = ""
    else:
        parent = os.path.dirname(os.path.abspath(out_dir))
        staging = os.path.join(parent, f".{name}.staging-{key}")
        os.makedirs(os.path.join(staging, "_attempts"), exist_ok=True)

    ordered = (
        rows.repartition(partitions, "sample_id")
        .sortWithinPartitions(F.xxhash64("sample_id", F.lit(seed)), "sample_id")
    )
    write, result_schema = _write_partitions(
        staging, columns, size_limit, compression, hashes, blobs, buckets, jpeg_quality,
        remote, key,
    )
    spark = rows.sparkSession
    sc = spark.sparkContext
    sc.setJobDescription(f"lakeshard export: write MDS {name}")
    batch_key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = spark.conf.get(batch_key, None)
    if blobs is not None:  # rows are small: big Arrow batches, blobs taken in slices
        spark.conf.set(batch_key, str(TAKE_ROWS * 8))
    try:
        results = sorted(
            ordered.mapInArrow(write, _RESULT_DDL).collect(), key=lambda r: r["partition"]
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

    if store:
        return _finish_remote(store, key, results, settings, buckets is not None, out_dir)
    parts = [f"part-{r['partition']:05d}" for r in results]
    shutil.rmtree(os.path.join(staging, "_attempts"), ignore_errors=True)
    if buckets is None:
        indexes = {"": merge_partition_indexes(staging, parts)}
    else:
        indexes = _merge_bucket_indexes(staging, parts)
    shards = [s for index in indexes.values() for s in index["shards"]]
    samples = sum(s["samples"] for s in shards)
    if samples != sum(r["samples"] for r in results):
        raise RuntimeError(f"MDS index has {samples} samples, tasks reported otherwise")
    for sub, index in indexes.items():
        with open(os.path.join(staging, sub, "index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, sort_keys=True)
    final = _manifest(settings, key, results, indexes, buckets is not None)
    with open(os.path.join(staging, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(final, f, indent=2, sort_keys=True)

    fault_point("export:staged")
    # Swap into place: the previous export (if any) disappears only once this is whole.
    trash = os.path.join(parent, f".{name}.old-{key}")
    shutil.rmtree(trash, ignore_errors=True)
    if os.path.exists(out_dir):
        os.replace(out_dir, trash)
    os.replace(staging, out_dir)
    shutil.rmtree(trash, ignore_errors=True)
    return _result(out_dir, final, resumed=sum(1 for r in results if r["resumed"]))


def _manifest(settings: dict, key: str, results: list, indexes: dict, bucketed: bool) -> dict:
    shards = [s for index in indexes.values() for s in index["shards"]]
    extra = {}
    if bucketed:
        extra["bucket_samples"] = {
            sub: sum(s["samples"] for s in index["shards"]) for sub, index in indexes.items()
        }
    return {
        **settings, **extra, "export_key": key,
        "samples": sum(s["samples"] for s in shards), "shards": len(shards),
        "bytes": sum((s.get("zip_data") or s["raw_data"])["bytes"] for s in shards),
        "checksum": hashlib.sha256("".join(r["checksum"] for r in results).encode()).hexdigest(),
        "part_checksums": [r["checksum"] for r in results],
    }


def _finish_remote(store, key: str, results: list, settings: dict, bucketed: bool,
                   out_dir: str) -> ExportResult:
    """Object stores have no rename: each task's shards stay where its attempt wrote
    them (``[<bucket>/]<key>/<attempt>/``); the root indexes list only the attempts that
    finished (one per partition, from their done-markers), are written last, and then
    everything else under the export -- failed attempts, an older export -- is deleted."""
    indexes: dict[str, dict] = {}
    keep: set[str] = set()
    for r in results:
        for sub, index in json.loads(r["indexes"]).items():
            prefix = "/".join(p for p in (key, r["dir"]) if p)
            keep.add("/".join(p for p in (sub, prefix) if p) + "/")
            merged = indexes.setdefault(sub, {"version": 2, "shards": []})
            for shard in index["shards"]:
                shard = json.loads(json.dumps(shard))
                for k in ("raw_data", "zip_data"):
                    if shard.get(k):
                        shard[k]["basename"] = f"{prefix}/{shard[k]['basename']}"
                merged["shards"].append(shard)
    if not bucketed:
        indexes.setdefault("", {"version": 2, "shards": []})
    samples = sum(s["samples"] for index in indexes.values() for s in index["shards"])
    if samples != sum(r["samples"] for r in results):
        raise RuntimeError(f"MDS index has {samples} samples, tasks reported otherwise")
    for sub, index in sorted(indexes.items()):
        store.put_json(f"{sub}/index.json" if sub else "index.json", index)
    final = _manifest(settings, key, results, indexes, bucketed)
    store.put_json("manifest.json", final)
    tops = {"manifest.json", "index.json"} | {f"{sub}/index.json" for sub in indexes}
    stale = [
        k for k in store.list()
        if k not in tops
        and not k.startswith(f"_lakeshard/{key}/")
        and not any(k.startswith(p) for p in keep)
    ]
    store.delete(stale)
    return _result(out_dir, final, resumed=sum(1 for r in results if r["resumed"]))
