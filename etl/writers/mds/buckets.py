"""Aspect-ratio buckets for exports: the bucket set, assignment, resize-to-bucket, and
the router that sends a task's rows to one MDS writer per bucket.

Training at several aspect ratios (SDXL-style "multi-aspect" training) batches images
of one bucket together, so each batch has one shape. A bucket set is defined by a base
resolution (a bucket holds about ``base_resolution**2`` pixels), a patch size (both
sides are multiples of it: the model's downsampling factor times its patch size) and the
range of aspect ratios (width / height) to cover::

    for w in patch, 2*patch, ...:
        h = floor(base**2 / w / patch) * patch       # largest multiple with w*h <= base**2
        if w >= h: keep (w, h) and its mirror (h, w) if min_aspect <= ratio <= max_aspect

A sample goes to the bucket whose aspect ratio is closest in log space (so 2:1 and 1:2
are equally far from 1:1); images outside the range go to the extreme buckets. With
``resize``, the exported image is scaled to cover the bucket (Lanczos) and centre-cropped
to exactly its size, then re-encoded as JPEG; otherwise the stored JPEG passes through
and the training loader resizes.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import numpy as np
import pyarrow as pa

from etl.config import BucketSpec
from etl.writers.mds.checksum import combine_digests
from etl.writers.mds.codec import encode_batch

__all__ = [
    "spec_settings",
    "bucket_set",
    "assign_buckets",
    "bucket_name",
    "resize_to_bucket",
    "BucketRouter",
]


def spec_settings(spec: BucketSpec) -> dict[str, Any]:
    """The spec's settings as they enter an export's key and manifest.

    Listed field by field (not ``dataclasses.asdict``) so the dict, and with it the key
    of an unchanged export, does not depend on how the config class is implemented."""
    return {
        "base_resolution": spec.base_resolution,
        "patch_size": spec.patch_size,
        "min_aspect": spec.min_aspect,
        "max_aspect": spec.max_aspect,
        "resize": spec.resize,
    }


def bucket_set(spec: BucketSpec) -> list[tuple[int, int]]:
    """(width, height) of every bucket, ordered by aspect ratio."""
    area, p = spec.base_resolution**2, spec.patch_size
    out = set()
    w = p
    while w <= area // p:
        h = (area // w) // p * p
        if h >= p and w >= h:  # landscape and square; portrait buckets are their mirrors
            for bw, bh in ((w, h), (h, w)):
                if spec.min_aspect <= bw / bh <= spec.max_aspect:
                    out.add((bw, bh))
        w += p
    if not out:
        raise ValueError(f"bucket set {spec} is empty: widen the aspect range or lower patch")
    # Per aspect ratio keep the largest area (several w can round to the same ratio).
    best: dict[float, tuple[int, int]] = {}
    for w, h in out:
        r = round(w / h, 6)
        if r not in best or w * h > best[r][0] * best[r][1]:
            best[r] = (w, h)
    return sorted(best.values(), key=lambda wh: wh[0] / wh[1])


def bucket_name(wh: tuple[int, int]) -> str:
    """A bucket's folder name (and StreamingDataset split): ``<W>x<H>``."""
    return f"{wh[0]}x{wh[1]}"


def assign_buckets(
    widths: np.ndarray, heights: np.ndarray, buckets: list[tuple[int, int]]
) -> np.ndarray:
    """Index into `buckets` of the closest aspect ratio (log space) for each image."""
    logs = np.log(np.array([w / h for w, h in buckets]))
    ratios = np.log(np.asarray(widths, np.float64) / np.asarray(heights, np.float64))
    # Buckets are sorted by ratio: searchsorted, then the nearer of the two neighbours.
    idx = np.clip(np.searchsorted(logs, ratios), 1, len(logs) - 1) if len(logs) > 1 else None
    if idx is None:
        return np.zeros(len(ratios), dtype=np.int64)
    left = np.abs(ratios - logs[idx - 1])
    right = np.abs(ratios - logs[idx])
    return np.where(left <= right, idx - 1, idx)


def resize_to_bucket(data: bytes, wh: tuple[int, int], quality: int = 92) -> bytes:
    """Scale a JPEG to cover `wh` (Lanczos), centre-crop to exactly `wh`, re-encode."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im = im.convert("RGB")
        bw, bh = wh
        scale = max(bw / im.width, bh / im.height)
        size = (max(bw, math.ceil(im.width * scale)), max(bh, math.ceil(im.height * scale)))
        im = im.resize(size, Image.Resampling.LANCZOS)
        left, top = (size[0] - bw) // 2, (size[1] - bh) // 2
        im = im.crop((left, top, left + bw, top + bh))
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=quality)
        return buf.getvalue()


def _resize_rows(rows: pa.RecordBatch, wh: tuple[int, int], quality: int) -> pa.RecordBatch:
    """`rows` with each image resized to bucket `wh`, and `width`/`height` set to it."""
    out = rows
    i = out.schema.get_field_index("image")
    images = [resize_to_bucket(b, wh, quality) for b in out.column(i).to_pylist()]
    out = out.set_column(i, out.schema.field(i), pa.array(images, out.schema.field(i).type))
    for name, value in (("width", wh[0]), ("height", wh[1])):
        j = out.schema.get_field_index(name)
        col = pa.array([value] * out.num_rows, out.schema.field(j).type)
        out = out.set_column(j, out.schema.field(j), col)
    return out


class BucketRouter:
    """Routes a batch's rows to per-bucket writers (or one writer without buckets),
    keeping the rows' order inside each bucket and the writers' cached bytes bounded.

    `make_writer(local, sub)` opens the writer of sub-folder `sub` (a bucket's name, or
    "" without buckets) writing under `local`; the router closes them all on `close`."""

    def __init__(
        self,
        attempt: str,
        make_writer: Callable[[str, str], Any],
        size_limit: int,
        buckets: BucketSpec | None,
        quality: int,
    ) -> None:
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
        return "" if self.dims is None else bucket_name(self.dims[b])

    def _writer(self, b: int):
        if b not in self.writers:
            local = os.path.join(self.attempt, self.sub(b)) if self.sub(b) else self.attempt
            self.writers[b] = self.stack.enter_context(self.make_writer(local, self.sub(b)))
        return self.writers[b]

    def indexes(self) -> dict[str, dict]:
        """Each written sub-folder's index.json (call after `close`)."""
        return {self.sub(b): w.index() for b, w in self.writers.items()}

    def checksum(self) -> str:
        """The partition's checksum over all its writers' files (call after `close`)."""
        return combine_digests({
            "/".join(p for p in (self.sub(b), rel) if p): d
            for b, w in self.writers.items() for rel, d in w.digests().items()
        })

    def write(self, batch: pa.RecordBatch, columns: Mapping[str, str]) -> None:
        if self.dims is None:
            writer = self._writer(0)
            for data in encode_batch(batch, columns):
                writer.write_encoded(data)
            return
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
            max(self.writers.values(), key=lambda w: w.new_shard_size).flush_cached()

    def close(self) -> None:
        self.stack.close()
        os.makedirs(self.attempt, exist_ok=True)  # a bucketed partition with no rows
