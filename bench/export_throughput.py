"""Benchmark: lakeshard's MDS export vs Mosaic's `dataframe_to_mds`, same table, one run.

Both sides export the same curated-style Lance table (JPEG bytes, caption, ids, sizes)
written once at the start: lakeshard through its real export path (`etl.jobs.export`:
small columns + row addresses through Spark, image bytes taken from Lance inside each
task, batch-encoded samples); Mosaic's converter through the obvious route, a Spark
DataFrame read from the same table (`format("lance")`) handed to `dataframe_to_mds`
with the same partitions, `size_limit` and compression. Mosaic's converter gets the
image column as `bytes` (its `jpeg` encoding would decode and re-encode).

Peak memory: every 20 ms the benchmark reads the resident memory of Spark's Python
workers (the processes that run the writers) and reports the largest single worker.

Each side runs ROUNDS times, alternating, best time kept. Run:

    .venv/bin/python bench/export_throughput.py [--rows 6000] [--compression none|zstd]
        [--size-limit-mb 16]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ROUNDS = 3
PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "hubble_deep_field.jpg",
          "retina.jpg", "motorcycle_left.png"]


def make_rows(n: int) -> list[dict]:
    from PIL import Image

    jpegs = []
    for i, name in enumerate(PHOTOS):
        im = Image.open(io.BytesIO(resources.files("skimage").joinpath("data", name).read_bytes()))
        im = im.convert("RGB").resize((768 + 64 * i, 576 + 32 * i))
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=92)
        jpegs.append((buf.getvalue(), im.width, im.height))
    rows = []
    for i in range(n):
        data, w, h = jpegs[i % len(jpegs)]
        rows.append({
            "sample_id": f"{i:08d}", "source": f"src{i % 5}", "image": data,
            "caption_original": f"a caption for sample {i} " * 8, "width": w, "height": h,
            "original_width": 2 * w, "original_height": 2 * h, "keep": i % 10 != 0,
        })
    return rows


class PeakRSS:
    """Samples the RSS of Spark's Python worker processes (pyspark daemons): the peak
    of any one worker, and each worker's growth over its first sample in this window
    (for a warm, reused worker: what the export itself allocated, imports excluded)."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self.peak_total = 0
        self.peak_one = 0
        self.first: dict[int, int] = {}
        self.growth = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _workers(self):
        me = self._psutil.Process()
        for p in me.children(recursive=True):
            try:
                if p.name().startswith("python"):  # not the JVM
                    yield p.pid, p.memory_info().rss
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                continue

    def _run(self) -> None:
        while not self._stop.is_set():
            samples = list(self._workers())
            for pid, rss in samples:
                self.growth = max(self.growth, rss - self.first.setdefault(pid, rss))
            sizes = [rss for _, rss in samples]
            if sizes:
                self.peak_total = max(self.peak_total, sum(sizes))
                self.peak_one = max(self.peak_one, max(sizes))
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--compression", default="none")
    parser.add_argument("--size-limit-mb", type=int, default=16)
    args = parser.parse_args()
    compression = None if args.compression == "none" else args.compression
    size_limit = args.size_limit_mb << 20

    import lance
    import pyarrow as pa
    from streaming.base.converters import dataframe_to_mds

    from etl import tables
    from etl.config import parse_config
    from etl.jobs.export import export
    from etl.session import get_spark

    work = tempfile.mkdtemp()
    cfg = parse_config({
        "storage": {"root": work},
        "spark": {"master": "local[2]", "jars_dir": str(REPO / ".jars"),
                  "conf": {"spark.ui.enabled": "false"}},
        "sources": [{"name": "b", "kind": "image_folder", "path": work}],
        "exports": {"bench": {"partitions": args.partitions, "size_limit": size_limit,
                              "compression": compression, "where": None}},
    })
    spark = get_spark(cfg)
    spark.sparkContext.setLogLevel("ERROR")
    rows = make_rows(args.rows)
    table_path = tables.layout(cfg).curated
    lance.write_dataset(pa.Table.from_pylist(rows), table_path, max_rows_per_file=512)
    mb = sum(len(r["image"]) for r in rows) / 1e6

    def ours() -> None:
        shutil.rmtree(tables.layout(cfg).export_dir("bench"), ignore_errors=True)
        export(spark, cfg, "bench")

    def theirs() -> None:
        out = os.path.join(work, "theirs")
        shutil.rmtree(out, ignore_errors=True)
        df = (
            spark.read.format("lance").load(table_path)
            .selectExpr("image", "caption_original as caption", "sample_id", "source",
                        "cast(width as int) as width", "cast(height as int) as height",
                        "cast(original_width as int) as original_width",
                        "cast(original_height as int) as original_height")
            .repartition(args.partitions)
        )
        columns = {"image": "bytes", "caption": "str", "sample_id": "str", "source": "str",
                   "width": "int32", "height": "int32", "original_width": "int32",
                   "original_height": "int32"}
        dataframe_to_mds(df, merge_index=True, mds_kwargs={
            "out": out, "columns": columns, "size_limit": size_limit,
            "compression": compression})

    sides = {"lakeshard export": ours, "streaming dataframe_to_mds": theirs}
    times = {name: float("inf") for name in sides}
    peaks = {name: (0, 0) for name in sides}
    growth = {name: 0 for name in sides}
    for _ in range(ROUNDS):
        for name, fn in sides.items():
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - t0
            times[name] = min(times[name], elapsed)
            peaks[name] = (max(peaks[name][0], mem.peak_total), max(peaks[name][1], mem.peak_one))
            growth[name] = mem.growth  # the last round's: workers warm, imports done
    spark.stop()
    shutil.rmtree(work, ignore_errors=True)
    print(f"{args.rows} rows, {mb:.0f} MB of JPEG in a Lance table, {args.partitions} "
          f"partitions, compression={compression}, size_limit={args.size_limit_mb} MiB, "
          f"local[2], best of {ROUNDS} (alternating)")
    print(f"{'':<28}{'rows/s':>9}{'MB/s':>8}{'peak RSS, one worker':>22}"
          f"{'growth of a warm worker':>25}")
    for name, t in times.items():
        total, one = peaks[name]
        print(f"{name:<28}{args.rows / t:>9.0f}{mb / t:>8.1f}{one / 2**20:>18.0f} MiB"
              f"{growth[name] / 2**20:>21.0f} MiB")
    ratio = times["streaming dataframe_to_mds"] / times["lakeshard export"]
    print(f"throughput ratio lakeshard/dataframe_to_mds = {ratio:.2f} (target >= 2)")


if __name__ == "__main__":
    main()
