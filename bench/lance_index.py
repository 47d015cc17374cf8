"""Selective filters on the curated table's metadata with and without scalar indexes.

Builds a synthetic curated-shaped table (metadata only, no image bytes: the filter
path never reads them) of --rows rows, runs each query without indexes, creates the
pipeline's indexes (etl.lakehouse.indexes.ensure_scalar_indexes, the config's defaults
for the columns present) and runs the same queries again: best of --repeat, one run,
side by side. Prints rows matched, milliseconds, bytes read (Lance IO stats) and the
speed-up.

    .venv/bin/python bench/lance_index.py --rows 1000000
"""

from __future__ import annotations

import argparse
import tempfile
import time

import lance
import numpy as np
import pyarrow as pa

from etl.config import LakehouseConfig
from etl.lakehouse.indexes import ensure_scalar_indexes, uses_index

QUERIES = {
    "one rare source": "source = 'src_042'",
    "rare source, flagged": "source = 'src_042' AND NOT keep",
    "flagged too_small": "filter_reason = 'too_small'",
    "width range": "width BETWEEN 4000 AND 4010",
}


def build(path: str, rows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    # 200 sources with a long-tailed size distribution (like real crawls).
    weights = 1 / np.arange(1, 201) ** 1.1
    source = rng.choice(200, size=rows, p=weights / weights.sum())
    width = rng.integers(64, 4097, size=rows, dtype=np.int32)
    height = rng.integers(64, 4097, size=rows, dtype=np.int32)
    keep = rng.random(rows) > 0.02
    reasons = np.where(keep, None, np.where(rng.random(rows) < 0.5, "too_small",
                                            "extreme_aspect"))
    table = pa.table({
        "sample_id": pa.array([f"{i:032x}" for i in range(rows)]),
        "source": pa.array([f"src_{s:03d}" for s in source]),
        "width": width,
        "height": height,
        "keep": keep,
        "filter_reason": pa.array(reasons.tolist(), pa.string()),
        "caption_original": pa.array([f"caption number {i}" for i in range(rows)]),
    })
    lance.write_dataset(table, path, max_rows_per_file=256 * 1024, mode="overwrite")


def timed(path: str, predicate: str, repeat: int) -> tuple[int, float, int]:
    best, n, read = float("inf"), 0, 0
    for _ in range(repeat):
        ds = lance.dataset(path)
        ds.io_stats_incremental()
        t = time.perf_counter()
        n = ds.to_table(filter=predicate, columns=["sample_id", "width"]).num_rows
        best = min(best, time.perf_counter() - t)
        read = ds.io_stats_incremental().read_bytes
    return n, best * 1000, read


def layout(tmp: str, rows: int = 4000, image_kb: int = 64) -> None:
    """Image bytes inline (one table) vs a separate image table: what a metadata scan
    reads, and what fetching 100 random images costs."""
    rng = np.random.default_rng(1)
    ids = pa.array([f"{i:032x}" for i in range(rows)])
    meta = {"sample_id": ids, "source": pa.array([f"src_{i % 20:03d}" for i in range(rows)]),
            "width": rng.integers(64, 4097, size=rows, dtype=np.int32)}
    images = pa.array([rng.bytes(image_kb * 1024) for _ in range(rows)], pa.binary())
    lance.write_dataset(pa.table({**meta, "image": images}), f"{tmp}/inline.lance")
    lance.write_dataset(pa.table(meta), f"{tmp}/meta.lance")
    lance.write_dataset(pa.table({"sample_id": ids, "image": images}), f"{tmp}/images.lance")
    take = sorted(rng.choice(rows, 100, replace=False).tolist())
    print(f"\nimage layout: {rows} rows x {image_kb} KiB images")
    for name, scan_path in (("inline", "inline"), ("separate", "meta")):
        ds = lance.dataset(f"{tmp}/{scan_path}.lance")
        ds.io_stats_incremental()
        t = time.perf_counter()
        ds.to_table(columns=["source", "width"], filter="width > 2000")
        ms = (time.perf_counter() - t) * 1000
        mb = ds.io_stats_incremental().read_bytes / 1e6
        img = lance.dataset(f"{tmp}/{'inline' if name == 'inline' else 'images'}.lance")
        t = time.perf_counter()
        img.take(take, columns=["image"])
        take_ms = (time.perf_counter() - t) * 1000
        print(f"  {name:<9} metadata scan {ms:7.1f} ms {mb:7.2f} MB read; "
              f"take 100 images {take_ms:6.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/curated.lance"
        t = time.perf_counter()
        build(path, args.rows)
        print(f"table: {args.rows:,} rows in {time.perf_counter() - t:.1f} s")
        before = {name: timed(path, q, args.repeat) for name, q in QUERIES.items()}
        t = time.perf_counter()
        res = ensure_scalar_indexes(path, LakehouseConfig().scalar_indexes)
        print(f"indexes {', '.join(res.created)} built in {time.perf_counter() - t:.1f} s")
        after = {name: timed(path, q, args.repeat) for name, q in QUERIES.items()}
        print(f"\n{'query':<24}{'rows':>8}{'scan ms':>10}{'index ms':>10}{'scan MB':>9}"
              f"{'index MB':>10}{'speed-up':>10}  index used")
        for name, q in QUERIES.items():
            (n0, ms0, b0), (n1, ms1, b1) = before[name], after[name]
            assert n0 == n1, f"{name}: {n0} rows without index, {n1} with"
            print(f"{name:<24}{n0:>8}{ms0:>10.1f}{ms1:>10.1f}{b0 / 1e6:>9.1f}{b1 / 1e6:>10.1f}"
                  f"{ms0 / ms1:>9.1f}x  {uses_index(path, q)}")
        layout(tmp)


if __name__ == "__main__":
    main()
