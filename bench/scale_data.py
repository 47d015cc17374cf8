"""The scale bench's records: N small distinct JPEGs with planted exact and near copies,
written as parquet files of a `table` source, deterministic from a seed, streamed to disk.

Record `i` (key ``r{i:09d}``) is one of three kinds, decided by ``plan(seed, i)`` alone:

* **plain**: its own picture, built for a chosen dHash. Its 64-bit dHash
  (:func:`design_hash`) is a codeword of the BCH(63, 30) code -- minimum distance 13 --
  for a bijective mix of ``(seed, i)``, plus one free bit. The picture is an 8x9 grid of
  grey levels scaled up bilinearly to 160x120, tinted per channel, with a little noise;
  the grid is solved so that the dHash's own 9x8 thumbnail of it (whose bilinear filter
  mixes each cell with its neighbours: a random grid's thumbnail keeps ~0 steps between
  many neighbours, and a resized copy then flips those bits) steps up or down by 16-40
  grey levels as the codeword's bits say. Every plain JPEG's dHash is checked to be its
  design at generation (redrawn otherwise), so two plain records are at least 13 bits
  apart at any N up to 2^30 -- far beyond dedup's threshold (4) -- and no two records
  of different originals (copies included) are within it.
* **exact copy** of an earlier plain record: the very same JPEG bytes.
* **near copy** of an earlier plain record: its picture resized to 152x114 and encoded at
  quality 70 -- the "resized and recompressed photo" docs/dedup.md says sits 0-4 bits
  away. Its distance from the original is measured at generation; past the threshold
  the next, gentler variant of ``NEAR_VARIANTS`` is taken (and none within it is an
  error), so every planted near copy is within the threshold.

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
from functools import lru_cache
from pathlib import Path

import numpy as np

from etl.config.curation import DedupConfig

__all__ = ["Plan", "plan", "picture", "record_bytes", "near_copy", "write_files",
           "key_of", "design_hash", "bch_codeword", "dhash_of", "dhash_distance",
           "FILE_PATTERN", "NEAR_VARIANTS", "THRESHOLD", "MAX_RECORDS", "VERSION"]

WIDTH, HEIGHT = 160, 120
QUALITY = 90
# Near copies, the first within THRESHOLD of the original's dHash taken: resized and
# recompressed, then gentler (the last only recompressed, never the exact copy's bytes).
NEAR_VARIANTS = (((152, 114), 70), ((156, 117), 80), ((WIDTH, HEIGHT), 80))
THRESHOLD = DedupConfig().threshold  # dedup's default (etl/config/curation.py)
_STEPS = (16.0, 40.0)  # grey-level steps between the thumbnail's horizontal neighbours
_ATTEMPTS = 20  # redraws of a plain picture whose dHash is not its design (rare)
_ROW_GROUP = 1000
FILE_PATTERN = "part-{:05d}.parquet"
_BITS = 30  # BCH(63, 30): messages of 30 bits, codewords of 63, minimum distance 13
MAX_RECORDS = 1 << _BITS
VERSION = 2  # 2: pictures of designed dHashes (1: random grids), kept with --files
_MASK = MAX_RECORDS - 1


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


@lru_cache(maxsize=1)
def _bch_generator() -> int:
    """BCH(63, 30)'s generator polynomial over GF(2) (bit k: the coefficient of x^k): the
    product of the minimal polynomials of a^1, a^3, ..., a^11 in GF(64) (a: a root of
    x^6 + x + 1), so a^1..a^12 are roots of every codeword: designed distance 13."""
    exp = [1] * 126
    for i in range(1, 126):
        exp[i] = exp[i - 1] << 1
        if exp[i] & 64:
            exp[i] ^= 0b1000011
    log = {exp[i]: i for i in range(63)}
    poly = [1]  # coefficients in GF(64), lowest degree first
    roots = sorted({(i << j) % 63 for i in (1, 3, 5, 7, 9, 11) for j in range(6)})
    for r in roots:  # poly *= (x + a^r)
        out = [0] * (len(poly) + 1)
        for k, c in enumerate(poly):
            out[k + 1] ^= c
            out[k] ^= exp[log[c] + r] if c else 0
        poly = out
    if any(c > 1 for c in poly) or len(poly) != 64 - _BITS:
        raise AssertionError("BCH(63, 30) generator: not a binary polynomial of degree 33")
    return sum(c << k for k, c in enumerate(poly))


def bch_codeword(message: int) -> int:
    """The 63-bit codeword message(x) * g(x) of a 30-bit `message` (carry-less product)."""
    g, out = _bch_generator(), 0
    for k in range(_BITS):
        if message >> k & 1:
            out ^= g << k
    return out


def design_hash(seed: int, index: int) -> int:
    """Plain record `index`'s dHash (unsigned 64 bits): the BCH codeword of a bijective
    mix of `index` with `seed` (so any two records' codewords differ, in >= 13 bits,
    and look random enough for dedup's LSH keys), shifted up by one free bit."""
    if not 0 <= index < MAX_RECORDS:
        raise ValueError(f"record {index}: the generator designs at most {MAX_RECORDS} hashes")
    x = index ^ ((seed * 0x9E3779B1 + 0x7F4A7C15) & _MASK)
    for mult in (0x2545F491, 0x1B873593):  # odd multipliers and xorshifts: a bijection
        x = (x * mult) & _MASK
        x ^= x >> 15
    return bch_codeword(x) << 1 | (x * 0x5851F42D >> 29) & 1


def _float_image(values: np.ndarray, size: tuple[int, int], **kw) -> np.ndarray:
    from PIL import Image

    img = Image.fromarray(values.astype(np.float32), "F")
    return np.asarray(img.resize(size, Image.Resampling.BILINEAR, **kw), dtype=np.float64)


@lru_cache(maxsize=1)
def _thumbnail_inverse() -> np.ndarray:
    """The inverse of the linear map grid (8x9) -> the dHash's 9x8 thumbnail of the grid
    scaled up to the picture (udfs.images.dhash64's resize, on float pixels): a grid
    solved through it gives the thumbnail we choose."""
    cols = []
    for k in range(72):
        basis = np.zeros(72)
        basis[k] = 100.0
        up = _float_image(basis.reshape(8, 9), (WIDTH, HEIGHT))
        cols.append(_float_image(up, (9, 8), reducing_gap=2.0).ravel() / 100.0)
    return np.linalg.inv(np.stack(cols, axis=1))


def _render(rng: np.random.Generator, bits: np.ndarray) -> np.ndarray:
    """Pixels whose dHash thumbnail steps up (bit 1) or down by `_STEPS` grey levels."""
    steps = rng.uniform(*_STEPS, size=(8, 8)) * np.where(bits, 1.0, -1.0)
    thumb = np.concatenate([np.zeros((8, 1)), np.cumsum(steps, axis=1)], axis=1)
    thumb += rng.uniform(-20, 20, size=(8, 1))
    grid = (_thumbnail_inverse() @ thumb.ravel()).reshape(8, 9)
    span = grid.max() - grid.min()
    if span > 220:  # fit in the grey range (tint and noise added); the signs stay
        grid *= 220 / span
    grid += 10 - grid.min() + rng.uniform(0, 1) * (220 - (grid.max() - grid.min()))
    base = _float_image(grid, (WIDTH, HEIGHT)).astype(np.float32)[..., None]
    gain = rng.uniform(0.7, 1.0, size=3).astype(np.float32)
    offset = rng.uniform(0, 20, size=3).astype(np.float32)
    pixels = rng.standard_normal(size=(HEIGHT, WIDTH, 3), dtype=np.float32)  # float32:
    pixels *= 3  # the noise, then the tinted picture, in place (the generator's hot path)
    pixels += base * gain
    pixels += offset
    return np.clip(pixels, 0, 255, out=pixels).astype(np.uint8)


def _plain(seed: int, index: int) -> tuple[np.ndarray, bytes]:
    """Plain record `index`'s pixels and JPEG, whose dHash is checked to be its design."""
    target = design_hash(seed, index)
    bits = np.array([target >> (63 - k) & 1 for k in range(64)], dtype=bool).reshape(8, 8)
    rng = np.random.default_rng([seed, index, 0])
    for _ in range(_ATTEMPTS):
        pixels = _render(rng, bits)
        data = _jpeg(pixels, QUALITY)
        if dhash_of(data) == target:
            return pixels, data
    raise RuntimeError(f"record {index}: no picture of its designed dHash in {_ATTEMPTS} draws")


def picture(seed: int, index: int) -> np.ndarray:
    """Plain record `index`'s pixels: HEIGHT x WIDTH x 3 uint8."""
    return _plain(seed, index)[0]


def _jpeg(pixels: np.ndarray, quality: int, size: tuple[int, int] | None = None) -> bytes:
    from PIL import Image

    img = Image.fromarray(pixels)
    if size is not None and size != img.size:
        img = img.resize(size, Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def near_copy(seed: int, original: int) -> tuple[bytes, int]:
    """A near copy of plain record `original` and its dHash distance from it: the first
    of ``NEAR_VARIANTS`` within ``THRESHOLD`` bits."""
    pixels, target = picture(seed, original), design_hash(seed, original)
    for size, quality in NEAR_VARIANTS:
        data = _jpeg(pixels, quality, size)
        bits = (dhash_of(data) ^ target).bit_count()
        if bits <= THRESHOLD:
            return data, bits
    raise RuntimeError(f"no near copy of record {original} within {THRESHOLD} dHash bits")


def record_bytes(seed: int, p: Plan) -> bytes:
    """The JPEG record `p` holds."""
    if p.kind == "near":
        return near_copy(seed, p.original)[0]
    return _plain(seed, p.index if p.kind == "plain" else p.original)[1]


def dhash_of(data: bytes) -> int:
    """A JPEG's dHash, unsigned, as lakeshard computes it (udfs.images.dhash64)."""
    from PIL import Image

    from udfs.images import dhash64

    return dhash64(Image.open(io.BytesIO(data))) & (2**64 - 1)


def dhash_distance(a: bytes, b: bytes) -> int:
    """Bits between two JPEGs' dHashes."""
    return (dhash_of(a) ^ dhash_of(b)).bit_count()


def _batch(seed: int, lo: int, hi: int, copy_rate: float, old_below: int | None,
           old_rate: float | None) -> tuple[list[Plan], list[bytes], int]:
    """Records [lo, hi): their plans, JPEGs, and the largest dHash distance of a near
    copy from its original."""
    plans = [plan(seed, i, copy_rate, old_below, old_rate) for i in range(lo, hi)]
    images, worst = [], 0
    for p in plans:
        if p.kind == "near":
            data, bits = near_copy(seed, p.original)
            worst = max(worst, bits)
        else:
            data = record_bytes(seed, p)
        images.append(data)
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
    if stop > MAX_RECORDS:
        raise ValueError(f"at most {MAX_RECORDS} records: the plain records' designed "
                         "dHashes are BCH(63, 30) codewords")
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
