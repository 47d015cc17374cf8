"""Aspect-ratio buckets for exports: the bucket set, assignment, and resize-to-bucket.

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
from dataclasses import dataclass

import numpy as np

__all__ = ["BucketSpec", "bucket_set", "assign_buckets", "bucket_name", "resize_to_bucket"]


@dataclass(frozen=True)
class BucketSpec:
    base_resolution: int = 512
    patch_size: int = 64
    min_aspect: float = 0.25
    max_aspect: float = 4.0
    # Resize (cover + centre crop, Lanczos) to the bucket's size at export time.
    resize: bool = False


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
