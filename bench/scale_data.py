"""The scale bench's records: N small distinct JPEGs with planted exact and near copies,
written as parquet files of a `table` source, deterministic from a seed, streamed to disk.

Record `i` (key ``r{i:09d}``) is one of three kinds, decided by ``plan(seed, i)`` alone:

* **plain**: its own picture -- an 8x9 grid of grey levels whose horizontal neighbours
  differ by at least ``_GAP`` (so its 64-bit dHash is one fair coin per pair and stable
  under re-encoding), scaled up bilinearly to 160x120, tinted per channel, with a little
  noise. Two plain records are unrelated: their dHashes are ~32 bits apart, far beyond
  dedup's threshold (4), so they never cluster by accident.
* **exact copy** of an earlier plain record: the very same JPEG bytes.
* **near copy** of an earlier plain record: its picture resized to 152x114 and encoded at
  quality 70 -- the "resized and recompressed photo" docs/dedup.md says sits 0-4 bits away.

A copy always names a plain original (its root), so every planted cluster is one
original and its copies. Pictures are regenerated from ``(seed, i)`` when a copy needs
its original: nothing but the current batch is ever held in memory, whatever N is.
Row groups are made by a process pool and written in order, file by file.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Plan", "plan", "picture", "record_bytes", "write_files",
           "key_of", "dhash_distance", "FILE_PATTERN"]

WIDTH, HEIGHT = 160, 120
NEAR_SIZE = (152, 114)
QUALITY, NEAR_QUALITY = 90, 70
_GAP = 24  # least grey-level step between horizontal neighbours of the grid
_ROW_GROUP = 1000
FILE_PATTERN = "part-{:05d}.parquet"


@dataclass(frozen=True)
class Plan:
    """What record `index` is: ``plain``, or an ``exact``/``near`` copy of `original`."""

    index: int
    kind: str
    original: int | None = None


def key_of(index: int) -> str:
    return f"r{index:09d}"


def plan(seed: int, index: int, copy_rate: float, old_below: int | None = None,
         old_rate: float | None = None) -> Plan:
    """Record `index`'s kind. A copy (rate `copy_rate`, half exact, half near) names a
    plain record before it -- before `old_below` if given (the +1 % file's copies of old
    records, which were drawn at `old_rate`). The first 10 records are plain, so early
    copies have originals."""
    if index < 10:
        return Plan(index, "plain")
    rng = np.random.default_rng([seed, index, 1])
    u = rng.random()
    if u >= copy_rate:
        return Plan(index, "plain")
    kind = "exact" if u < copy_rate / 2 else "near"
    limit = index if old_below is None else min(index, old_below)
    original = int(rng.integers(0, limit))
    rate = copy_rate if old_rate is None else old_rate
    while plan(seed, original, rate).kind != "plain":  # a copy's root is plain
        original = int(rng.integers(0, limit))
    return Plan(index, kind, original)


def picture(seed: int, index: int) -> np.ndarray:
    """Plain record `index`'s pixels: HEIGHT x WIDTH x 3 uint8."""
    from PIL import Image

    rng = np.random.default_rng([seed, index, 0])
    grid = rng.integers(0, 256, size=(8, 9)).astype(np.int16)
    for _ in range(12):  # redraw neighbours closer than _GAP (a few rounds settle it)
        close = np.abs(np.diff(grid, axis=1)) < _GAP
        if not close.any():
            break
        grid[:, 1:][close] = rng.integers(0, 256, size=int(close.sum()))
    grey = Image.fromarray(grid.clip(0, 255).astype(np.uint8), "L").resize(
        (WIDTH, HEIGHT), Image.Resampling.BILINEAR)
    base = np.asarray(grey, dtype=np.float32)[..., None]
    gain = rng.uniform(0.7, 1.0, size=3).astype(np.float32)
    offset = rng.uniform(0, 50, size=3).astype(np.float32)
    noise = rng.normal(0, 3, size=(HEIGHT, WIDTH, 3)).astype(np.float32)
    return np.clip(base * gain + offset + noise, 0, 255).astype(np.uint8)


def _jpeg(pixels: np.ndarray, quality: int, size: tuple[int, int] | None = None) -> bytes:
    from PIL import Image

    img = Image.fromarray(pixels)
    if size is not None:
        img = img.resize(size, Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def record_bytes(seed: int, p: Plan) -> bytes:
    """The JPEG record `p` holds."""
    if p.kind == "plain":
        return _jpeg(picture(seed, p.index), QUALITY)
    pixels = picture(seed, p.original)
    if p.kind == "exact":
        return _jpeg(pixels, QUALITY)
    return _jpeg(pixels, NEAR_QUALITY, NEAR_SIZE)


def dhash_distance(a: bytes, b: bytes) -> int:
    """Bits between two JPEGs' dHashes, as lakeshard computes them (udfs.images.dhash64)."""
    from PIL import Image

    from udfs.images import dhash64

    ha, hb = (dhash64(Image.open(io.BytesIO(x))) & (2**64 - 1) for x in (a, b))
    return (ha ^ hb).bit_count()


def _batch(seed: int, lo: int, hi: int, copy_rate: float, old_below: int | None,
           old_rate: float | None) -> tuple[list[Plan], list[bytes], int]:
    """Records [lo, hi): their plans, JPEGs, and the largest dHash distance of a near
    copy from its original."""
    plans = [plan(seed, i, copy_rate, old_below, old_rate) for i in range(lo, hi)]
    images = [record_bytes(seed, p) for p in plans]
    worst = max((dhash_distance(data, record_bytes(seed, Plan(p.original, "plain")))
                 for p, data in zip(plans, images, strict=True) if p.kind == "near"),
                default=0)
    return plans, images, worst


def _write(path: str, batches: Iterator[tuple[list[Plan], list[bytes], int]]) -> dict:
    """One parquet file from `batches` (a row group each), written beside and renamed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("key", pa.string()), ("image", pa.binary()), ("caption", pa.string())])
    copies: dict[str, list[list[int]]] = {"exact": [], "near": []}
    rows = worst = 0
    with pq.ParquetWriter(path + ".tmp", schema) as writer:
        for plans, images, batch_worst in batches:
            worst, rows = max(worst, batch_worst), rows + len(plans)
            for p in plans:
                if p.kind != "plain":
                    copies[p.kind].append([p.index, p.original])
            writer.write_table(pa.table({
                "key": [key_of(p.index) for p in plans], "image": images,
                "caption": [f"scale bench record {p.index}, a {p.kind} picture"
                            for p in plans]}, schema=schema))
    os.replace(path + ".tmp", path)
    return {"path": path, "rows": rows, "copies": copies, "worst_near_bits": worst}


def write_files(folder: Path, seed: int, start: int, stop: int, file_rows: int,
                first_file: int, copy_rate: float, old_below: int | None = None,
                old_rate: float | None = None, workers: int | None = None) -> list[dict]:
    """Records [start, stop) as parquet files of `file_rows` rows, numbered from
    `first_file`. Row groups of ``_ROW_GROUP`` records are made by a pool of `workers`
    processes (default: one per core) and written in order by this one, so memory holds
    a few row groups whatever N is. Returns per file its path, rows, planted copies
    (``{"exact": [[copy, original], …], "near": …}``) and the largest dHash distance of
    a near copy from its original."""
    folder.mkdir(parents=True, exist_ok=True)
    workers = max(1, workers or os.cpu_count() or 1)
    pool = ProcessPoolExecutor(workers) if workers > 1 else None
    out = []
    try:
        for n, lo in enumerate(range(start, stop, file_rows)):
            hi = min(stop, lo + file_rows)
            args = [(seed, a, min(hi, a + _ROW_GROUP), copy_rate, old_below, old_rate)
                    for a in range(lo, hi, _ROW_GROUP)]
            batches = (pool.map(_batch, *zip(*args, strict=True)) if pool
                       else (_batch(*a) for a in args))
            out.append(_write(str(folder / FILE_PATTERN.format(first_file + n)), batches))
    finally:
        if pool:
            pool.shutdown()
    return out
