"""Benchmark: the image-preparation stage in local Spark vs a bare multiprocess loop.

Both sides decode and re-encode the same images as JPEG q92 with the same library
(Pillow's libjpeg-turbo) on the same number of cores, in one run:

* bare   -- multiprocessing.Pool(cores) over the image bytes: open, convert to RGB,
            save JPEG q92. Nothing else: the libjpeg-turbo ceiling on this machine.
* stage  -- lakeshard's prepare stage: parquet of image bytes -> Spark -> the pandas
            UDF (decode, orientation, colour, JPEG, sha256, dHash, flags) -> noop sink.
* loop   -- lakeshard's prepare_image in the same Pool, to separate the cost of the
            extra per-image work from the cost of Spark.

Spark reads the images from parquet in ~16 MB splits (a few tasks per core): with tiny
splits the per-task cost of a Python UDF task dominates (measured: an identity UDF over
the same 90 MB took 7.7 s in 44 tasks and 1.6 s in 4). Each side is timed best of
ROUNDS. Inputs are realistic: photos bundled with scikit-image resized to 0.3-12 MP, mostly
JPEG (q90), some PNG and WebP. Run:

    .venv/bin/python bench/prepare_throughput.py [--images 60] [--cores 2]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from importlib import resources
from multiprocessing import Pool
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg",
          "hubble_deep_field.jpg", "retina.jpg", "motorcycle_left.png"]
MEGAPIXELS = [0.3, 0.5, 1, 2, 4, 8, 12]
ROUNDS = 2  # best of: this machine is noisy


def make_images(n: int) -> list[bytes]:
    from PIL import Image

    out = []
    for i in range(n):
        name = PHOTOS[i % len(PHOTOS)]
        src = Image.open(io.BytesIO(resources.files("skimage").joinpath("data", name).read_bytes()))
        src = src.convert("RGB")
        mp = MEGAPIXELS[(i * 3) % len(MEGAPIXELS)]
        scale = (mp * 1e6 / (src.width * src.height)) ** 0.5
        im = src.resize((int(src.width * scale), int(src.height * scale)), Image.Resampling.BICUBIC)
        fmt = "PNG" if i % 10 == 3 else "WEBP" if i % 10 == 7 else "JPEG"
        buf = io.BytesIO()
        im.save(buf, format=fmt, **({"quality": 90} if fmt != "PNG" else {}))
        out.append(buf.getvalue())
    return out


def bare(data: bytes) -> int:
    from PIL import Image

    im = Image.open(io.BytesIO(data)).convert("RGB")
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=92)
    return im.width * im.height


def full(data: bytes) -> int:
    from udfs.images import PrepareOptions, prepare_image

    out = prepare_image(data, PrepareOptions())
    assert out.status == "ok", out.detail
    return out.width * out.height


def timed_pool(fn, images, cores) -> tuple[float, int]:
    with Pool(cores) as pool:
        pool.map(fn, images[:cores])  # warm the workers
        best = float("inf")
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            pixels = sum(pool.map(fn, images, chunksize=1))
            best = min(best, time.perf_counter() - t0)
        return best, pixels


def timed_stage(images, cores, workdir) -> float:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    from etl.config import parse_config
    from etl.schema import INGEST_SCHEMA
    from etl.session import get_spark
    from etl.transforms.prepare import prepare_images
    from udfs.images import PrepareOptions

    path = os.path.join(workdir, "images.parquet")
    table = pa.table({"k": [str(i) for i in range(len(images))], "b": images})
    pq.write_table(table, path, row_group_size=4)
    cfg = parse_config({
        "storage": {"root": workdir},
        "spark": {"master": f"local[{cores}]", "jars_dir": str(REPO / ".jars"),
                  "conf": {"spark.ui.enabled": "false",
                           "spark.sql.files.maxPartitionBytes": str(16 << 20)}},
        "sources": [{"name": "b", "kind": "image_folder", "path": workdir}],
    })
    spark = get_spark(cfg)
    spark.sparkContext.setLogLevel("ERROR")
    df = spark.read.parquet(path).select(
        F.col("k").alias("sample_id"), F.lit("b").alias("source"), F.col("k").alias("source_key"),
        F.lit(None).cast("string").alias("source_uri"),
        F.lit(None).cast("string").alias("caption_original"),
        F.lit(None).cast("string").alias("license"),
        F.lit(None).cast("string").alias("metadata_json"),
        F.col("b").alias("image_bytes"), F.lit("ok").alias("read_status"),
        F.lit(None).cast("string").alias("read_reason"),
    ).select(*INGEST_SCHEMA.fieldNames())
    prepared = prepare_images(df, PrepareOptions()).select("prepared.image", "status")
    prepared.limit(cores).write.format("noop").mode("overwrite").save()  # warm workers
    elapsed = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        prepared.write.format("noop").mode("overwrite").save()
        elapsed = min(elapsed, time.perf_counter() - t0)
    print(f"  stage partitions: {prepared.rdd.getNumPartitions()}")
    spark.stop()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=60)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    images = make_images(args.images)
    mb = sum(map(len, images)) / 1e6
    print(f"{len(images)} images, {mb:.1f} MB encoded, cores={args.cores}")
    t_bare, pixels = timed_pool(bare, images, args.cores)
    t_full, _ = timed_pool(full, images, args.cores)
    with tempfile.TemporaryDirectory() as workdir:
        t_stage = timed_stage(images, args.cores, workdir)
    mp = pixels / 1e6
    n = len(images)
    print(f"{'':<34}{'images/s':>10}{'MP/s/core':>11}{'vs bare':>9}")
    for label, t in (("bare Pool: decode + JPEG q92", t_bare),
                     ("Pool: lakeshard prepare_image", t_full),
                     ("Spark prepare stage (pandas UDF)", t_stage)):
        print(f"{label:<34}{n / t:>10.2f}{mp / t / args.cores:>11.2f}{t_bare / t:>9.2f}")
    print(f"ratio stage/bare = {t_bare / t_stage:.2f} (target >= 0.8)")


if __name__ == "__main__":
    main()
