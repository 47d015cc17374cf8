"""Benchmark: lakeshard's MDS exporter vs Mosaic's `dataframe_to_mds`, one run.

Same cached DataFrame of JPEG rows (caption, ids, sizes), same partitions, same
`size_limit`, same compression, same 2-core local Spark. Each side timed best of
ROUNDS. lakeshard passes the JPEG bytes through (`jpeg` column); Mosaic's converter
gets the binary column as `bytes` (its `jpeg` would decode and re-encode). Run:

    .venv/bin/python bench/export_throughput.py [--rows 1500] [--compression none|zstd]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ROUNDS = 2
PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "hubble_deep_field.jpg",
          "retina.jpg", "motorcycle_left.png"]


def make_rows(n: int) -> list[tuple]:
    from PIL import Image

    jpegs = []
    for i, name in enumerate(PHOTOS):
        im = Image.open(io.BytesIO(resources.files("skimage").joinpath("data", name).read_bytes()))
        im = im.convert("RGB").resize((768 + 64 * i, 576 + 32 * i))
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=92)
        jpegs.append((buf.getvalue(), im.width, im.height))
    return [
        (jpegs[i % len(jpegs)][0], f"a caption for sample {i} " * 8, f"{i:08d}", f"src{i % 5}",
         jpegs[i % len(jpegs)][1], jpegs[i % len(jpegs)][2], 2 * jpegs[i % len(jpegs)][1],
         2 * jpegs[i % len(jpegs)][2])
        for i in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1500)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--compression", default="none")
    args = parser.parse_args()
    compression = None if args.compression == "none" else args.compression

    from streaming.base.converters import dataframe_to_mds

    from etl.config import parse_config
    from etl.session import get_spark
    from etl.writers.mds import export_mds

    work = tempfile.mkdtemp()
    cfg = parse_config({
        "storage": {"root": work},
        "spark": {"master": "local[2]", "jars_dir": str(REPO / ".jars"),
                  "conf": {"spark.ui.enabled": "false"}},
        "sources": [{"name": "b", "kind": "image_folder", "path": work}],
    })
    spark = get_spark(cfg)
    spark.sparkContext.setLogLevel("ERROR")
    schema = ("image binary, caption string, sample_id string, source string, width int, "
              "height int, original_width int, original_height int")
    rows = make_rows(args.rows)
    mb = sum(len(r[0]) for r in rows) / 1e6
    df = spark.createDataFrame(rows, schema).repartition(args.partitions, "sample_id").cache()
    df.count()
    size_limit = 128 << 20

    def ours() -> None:
        out = os.path.join(work, "ours")
        shutil.rmtree(out, ignore_errors=True)
        export_mds(df, out, partitions=args.partitions, size_limit=size_limit,
                   compression=compression, hashes=())

    def theirs() -> None:
        out = os.path.join(work, "theirs")
        shutil.rmtree(out, ignore_errors=True)
        columns = {"image": "bytes", "caption": "str", "sample_id": "str", "source": "str",
                   "width": "int32", "height": "int32", "original_width": "int32",
                   "original_height": "int32"}
        dataframe_to_mds(df, merge_index=True, mds_kwargs={
            "out": out, "columns": columns, "size_limit": size_limit, "compression": compression})

    times = {}
    for name, fn in (("lakeshard export_mds", ours), ("streaming dataframe_to_mds", theirs)):
        best = float("inf")
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        times[name] = best
    spark.stop()
    shutil.rmtree(work, ignore_errors=True)
    print(f"{args.rows} rows, {mb:.0f} MB of JPEG, {args.partitions} partitions, "
          f"compression={compression}, size_limit=128 MiB, local[2], best of {ROUNDS}")
    print(f"{'':<28}{'rows/s':>10}{'MB/s':>8}")
    for name, t in times.items():
        print(f"{name:<28}{args.rows / t:>10.0f}{mb / t:>8.1f}")
    ratio = times["streaming dataframe_to_mds"] / times["lakeshard export_mds"]
    print(f"throughput ratio lakeshard/dataframe_to_mds = {ratio:.2f} (target >= 2)")


if __name__ == "__main__":
    main()
