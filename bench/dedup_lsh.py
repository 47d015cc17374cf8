"""Near-duplicate search at scale: banded LSH + verification + connected components.

Synthetic 64-bit hashes with planted clusters: random base hashes, and copies of some
of them with 1..threshold random bits flipped. The ground truth (every pair of distinct
hashes in a planted cluster within the threshold) is computed here with numpy,
independently of lakeshard; lakeshard's `hash_pairs` (a first/full run: all rows new)
and `connected_components` run in local Spark. Prints recall, precision and seconds
per size, and how time grows with size (linear = the size ratio).

    .venv/bin/python bench/dedup_lsh.py                       # 1M and 4M rows
    .venv/bin/python bench/dedup_lsh.py --sizes 100000        # a quick look
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def synth(rows: int, copies: float, threshold: int, seed: int):
    """`rows` signed 64-bit hashes (a `copies` fraction are planted near copies) and the
    set of true pairs (a < b, distinct values, Hamming <= threshold) in planted clusters."""
    rng = np.random.default_rng(seed)
    n_copies = int(rows * copies)
    top = np.iinfo(np.uint64).max
    base = rng.integers(0, top, size=rows - n_copies, dtype=np.uint64, endpoint=True)
    centers = rng.integers(0, len(base), size=n_copies)
    flips = rng.integers(1, threshold + 1, size=n_copies)
    masks = np.zeros(n_copies, dtype=np.uint64)
    for i, k in enumerate(flips):
        for b in rng.choice(64, size=k, replace=False):
            masks[i] |= np.uint64(1) << np.uint64(b)
    planted = base[centers] ^ masks
    values = np.concatenate([base, planted]).view(np.int64)

    def signed(u) -> int:
        return int(np.uint64(u).view(np.int64))

    members: dict[int, set[int]] = {}
    for c, v in zip(centers, planted, strict=True):
        members.setdefault(int(c), {signed(base[c])}).add(signed(v))
    truth = set()
    for group in members.values():
        g = sorted(group)
        for i, a in enumerate(g):
            for b in g[i + 1:]:
                if bin((a ^ b) & (2**64 - 1)).count("1") <= threshold:
                    truth.add((a, b))
    return values, truth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 4_000_000])
    ap.add_argument("--threshold", type=int, default=4)
    ap.add_argument("--bands", type=int, default=6)
    ap.add_argument("--copies", type=float, default=0.02, help="fraction of planted copies")
    ap.add_argument("--partitions", type=int, default=16, help="spark.sql.shuffle.partitions")
    ap.add_argument("--memory", default="10g", help="spark.driver.memory (8M rows ran with 12g)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from pyspark.sql import functions as F

    from etl.config import parse_config
    from etl.session import get_spark
    from etl.transforms.dedup import connected_components, hash_pairs, lsh_masks

    work = tempfile.mkdtemp(prefix="dedup-bench-")
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    repo = Path(__file__).resolve().parents[1]
    cfg = parse_config({
        "storage": {"root": work},
        "spark": {"master": "local[*]", "jars_dir": str(repo / ".jars"), "conf": {
            "spark.driver.memory": args.memory, "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": str(args.partitions)}},
        "sources": [{"name": "bench", "kind": "image_folder", "path": work}],
    })
    spark = get_spark(cfg)
    spark.sparkContext.setLogLevel("ERROR")
    keys = len(lsh_masks(args.threshold, args.bands))
    print(f"threshold {args.threshold}, {args.bands} bands -> {keys} LSH keys per hash; "
          f"{args.copies:.0%} planted copies; {os.cpu_count()} cores")
    header = (f"{'rows':>10} {'true pairs':>10} {'found':>8} {'recall':>7} {'precision':>9} "
              f"{'pairs s':>8} {'cc s':>6} {'total s':>8} {'rows/s':>8}")
    print(header + "\n" + "-" * len(header))
    results = []
    for rows in args.sizes:
        values, truth = synth(rows, args.copies, args.threshold, args.seed)
        path = os.path.join(work, f"hashes-{rows}.parquet")
        pq.write_table(pa.table({"dhash": np.unique(values)}), path, row_group_size=1 << 20)
        hashes = spark.read.parquet(path).withColumn("is_new", F.lit(True))

        t0 = time.perf_counter()
        pairs = hash_pairs(hashes, args.threshold, args.bands, all_new=True).localCheckpoint()
        found = {(r.a, r.b) for r in pairs.collect()}
        t1 = time.perf_counter()
        edges = pairs.select(F.col("a").cast("string").alias("src"),
                             F.col("b").cast("string").alias("dst"))
        labels, rounds = connected_components(edges, max_iterations=40)
        components = labels.select("label").distinct().count()
        t2 = time.perf_counter()

        verified = sum(bin((a ^ b) & (2**64 - 1)).count("1") <= args.threshold for a, b in found)
        recall = len(found & truth) / len(truth)
        precision = verified / len(found) if found else 1.0
        results.append((rows, t2 - t0))
        print(f"{rows:>10} {len(truth):>10} {len(found):>8} {recall:>7.4f} {precision:>9.4f} "
              f"{t1 - t0:>8.1f} {t2 - t1:>6.1f} {t2 - t0:>8.1f} {rows / (t2 - t0):>8.0f}"
              f"   ({components} clusters, {rounds} cc rounds,"
              f" {len(found - truth)} found pairs outside planted clusters)")
    for (r0, s0), (r1, s1) in zip(results, results[1:], strict=False):
        print(f"growth {r0} -> {r1} rows: time x{s1 / s0:.2f} for rows x{r1 / r0:.2f} "
              f"(linear = x{r1 / r0:.2f})")
    spark.stop()


if __name__ == "__main__":
    main()
