"""How one MDS export is written: :class:`ExportSettings`, the one argument of
:func:`etl.writers.mds.export_mds` besides the rows and the folder.

Frozen, so the settings an export's key was computed from are the settings it was
written with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from etl.config import BucketSpec
from etl.writers.mds.buckets import bucket_name, bucket_set, spec_settings
from etl.writers.mds.task import BlobSource

__all__ = ["ExportSettings"]


@dataclass(frozen=True)
class ExportSettings:
    """The writer's settings (what shapes the files), what the caller says of the
    export, and how the rows reach the writer."""

    partitions: int  # hash partitions of sample_id, one Spark task (and folder) each
    size_limit: int  # bytes per shard before the writer starts the next
    compression: str | None  # streaming's shard compression ("zstd"), None: none
    hashes: tuple[str, ...] = ()  # streaming's shard hashes ("xxh64")
    seed: int = 0  # the order of rows inside a partition (a seeded hash of sample_id)
    # The caller's description of the export (table, predicate), in manifest.json.
    manifest: Mapping[str, Any] = field(default_factory=dict)
    # What changes with the table's content (its version, what was left out): with the
    # writer settings, the export key, which names the staging folder (an interrupted
    # export resumes) and tells an export already in place.
    lineage: Mapping[str, Any] = field(default_factory=dict)
    # Columns the writing tasks take from a Lance table by row address (image bytes
    # never go through the JVM); None: every column is in the rows.
    blobs: BlobSource | None = None
    # Aspect-ratio buckets: rows routed into one sub-folder per bucket (``<out>/<W>x<H>/``,
    # each with its own ``index.json``; read one with ``StreamingDataset(local=<out>,
    # split="<W>x<H>")``), resized to the bucket at `jpeg_quality` if the spec says so.
    buckets: BucketSpec | None = None
    jpeg_quality: int = 92
    # Encodings of some columns instead of the one their Spark type gives (binary
    # columns of raw array bytes as fixed-shape ``ndarray:<dtype>:<shape>``).
    encodings: Mapping[str, str] = field(default_factory=dict)
    # Every partition keeps its rows' ids and fingerprints (a hash of the row's written
    # columns and of the `identity` column, e.g. the image's sha256, which is not
    # written); when only the lineage changed since the export in place, the rows are
    # diffed against those, the partitions that still hold exactly their rows are kept,
    # and only rows that joined, plus the rows of partitions that lost or changed a
    # row, are written, as new partitions (:func:`etl.writers.mds.plan_increment`).
    incremental: bool = False
    identity: str | None = None
    # The rows are a few the driver holds (local data): collected once, the increment
    # planned on the driver and, up to DRIVER_WRITE_ROWS rows to write, the partitions
    # written there too -- spread and ordered as Spark would (same partitions, same
    # order, same bytes); no Python worker starts.
    held: bool = False

    def writer_settings(self, columns: Mapping[str, str]) -> dict[str, Any]:
        """The caller's description plus every writer setting that shapes the files:
        what the export key is computed from (with the lineage) and ``manifest.json``
        records."""
        base = {
            **self.manifest, "columns": dict(columns), "partitions": self.partitions,
            "size_limit": self.size_limit, "compression": self.compression,
            "hashes": list(self.hashes), "seed": self.seed,
        }
        if self.buckets is not None:
            base["buckets"] = spec_settings(self.buckets)
            base["bucket_names"] = [bucket_name(wh) for wh in bucket_set(self.buckets)]
            if self.buckets.resize:
                base["jpeg_quality"] = self.jpeg_quality
        return base
