"""Benchmark: the image-preparation stage in local Spark vs a bare multiprocess loop.

Every side decodes and re-encodes the same images as JPEG q92 with the same libraries
(libjpeg-turbo under simplejpeg and Pillow) on the same number of cores, in one run:

* bare   -- multiprocessing.Pool(cores) over the image bytes: a colour JPEG decoded by
            simplejpeg into a buffer Pillow wraps (as lakeshard decodes it), anything
            else opened and converted to RGB by Pillow; saved as JPEG q92 by Pillow.
            Nothing else: the libjpeg-turbo ceiling on this machine.
* stage  -- lakeshard's prepare stage: parquet of image bytes -> Spark -> the batch
            function curate's tasks run (fetch -- nothing to fetch here --, decode,
            orientation, colour, JPEG, sha256 of source and JPEG, dHash, flags), the
            accepted rows handed to a row sink in the task, as curate's tasks write
            theirs to Lance (this sink keeps none: the JPEGs stay in the worker) ->
            Spark's noop sink for the rows' outcomes.
* jvm    -- the same without the row sink: the JPEGs go back to the JVM (as curate's
            did before its tasks wrote the rows), at the threads curate gives its
            tasks by default (prepare.threads null: the cores over the tasks).
* loop   -- lakeshard's prepare_image in the same Pool, to separate the cost of the
            extra per-image work from the cost of Spark.

Spark reads the images from parquet with its own split sizing (about the total bytes /
cores per task) and lakeshard's session defaults (Arrow batches cut at 64 rows or 16
MiB, so a batch of large images stays small). The stage is timed with
`prepare.threads` 1 and 2 (two images of a batch at a time, since Pillow releases the
GIL); curate's default (null) gives each task the cores over the tasks: 1 where the
tasks fill the cores, as here. Every side runs once per round, alternating, best of ROUNDS kept:
drift on a noisy machine hits all sides alike. Inputs are realistic: photos bundled
with scikit-image resized to 0.3-12 MP (the `large` set, 60 images) or 0.2-0.8 MP (the
`small` set, 400 images: web-sized, where per-image overhead shows), mostly JPEG (q90),
some PNG and WebP. Run:

    .venv/bin/python bench/prepare_throughput.py [--sets large small] [--images N]
                                                 [--cores 2] [--threads 1 2]
    .venv/bin/python bench/prepare_throughput.py --sets small --profile   # per piece
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

import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg",
          "hubble_deep_field.jpg", "retina.jpg", "motorcycle_left.png"]
MEGAPIXELS = [0.3, 0.5, 1, 2, 4, 8, 12]
# Web-sized images (LAION-style URL lists are mostly well under 1 MP): per-image overhead,
# not decoding, is what this set shows.
SMALL_MEGAPIXELS = [0.2, 0.3, 0.4, 0.5, 0.6, 0.8]
SETS = {"large": (MEGAPIXELS, 60), "small": (SMALL_MEGAPIXELS, 400)}  # sizes, default n
ROUNDS = 3  # best of, alternating sides: this machine is noisy


def make_images(n: int, megapixels: list[float] = MEGAPIXELS) -> list[bytes]:
    from PIL import Image

    out = []
    for i in range(n):
        name = PHOTOS[i % len(PHOTOS)]
        src = Image.open(io.BytesIO(resources.files("skimage").joinpath("data", name).read_bytes()))
        src = src.convert("RGB")
        mp = megapixels[(i * 3) % len(megapixels)]
        scale = (mp * 1e6 / (src.width * src.height)) ** 0.5
        im = src.resize((int(src.width * scale), int(src.height * scale)), Image.Resampling.BICUBIC)
        fmt = "PNG" if i % 10 == 3 else "WEBP" if i % 10 == 7 else "JPEG"
        buf = io.BytesIO()
        im.save(buf, format=fmt, **({"quality": 90} if fmt != "PNG" else {}))
        out.append(buf.getvalue())
    return out


def decode(data: bytes):
    """The fastest decode to 8-bit RGB pixels here, lakeshard's own: libjpeg-turbo
    (simplejpeg) straight into Pillow's layout for a colour JPEG, Pillow otherwise."""
    from PIL import Image

    from udfs.images import _decoded

    im = _decoded(Image.open(io.BytesIO(data)), data)
    return im if im.mode == "RGBX" else im.convert("RGB")


def bare(data: bytes) -> int:
    im = decode(data)
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=92)
    return im.width * im.height


def full(data: bytes) -> int:
    from etl.config import PrepareConfig
    from udfs.images import prepare_image

    out = prepare_image(data, PrepareConfig())
    assert out.status == "ok", out.detail
    return out.width * out.height


# The side that sends the JPEGs back to the JVM, and the columns the other sides hand to
# their sink (a few of the curated table's; the JPEG among them).
JVM = "jvm"
STORED = pa.schema([("sample_id", pa.string()), ("image", pa.binary()),
                    ("image_sha256", pa.string()), ("dhash", pa.int64()),
                    ("width", pa.int32()), ("height", pa.int32())])


def discard(batches) -> list[str]:
    """The bench's row sink: reads every accepted row the task hands it (which runs the
    task's fetch + prepare) and keeps none; returns their count."""
    return [str(sum(b.num_rows for b in batches))]


class Sides:
    """The three sides, set up once; `time(label)` runs one side over all images."""

    def __init__(self, images, cores, workdir, threads_list):
        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyspark.sql import functions as F

        from etl.config import PrepareConfig, parse_config
        from etl.schema import INGEST_SCHEMA
        from etl.session import get_spark
        from etl.transforms.prepare import fetch_and_prepare, prepared_outcomes
        from etl.transforms.prepare_task import RowSink

        self.images = images
        self.pool = Pool(cores)
        self.pool.map(bare, images[:cores])  # warm the workers
        self.pool.map(full, images[:cores])
        path = os.path.join(workdir, "images.parquet")
        table = pa.table({"k": [str(i) for i in range(len(images))], "b": images})
        pq.write_table(table, path, row_group_size=4)
        # Spark's own split sizing (about total bytes / cores per task) and lakeshard's
        # session defaults (Arrow batches of at most 64 rows / 16 MiB).
        cfg = parse_config({
            "storage": {"root": workdir},
            "spark": {"master": f"local[{cores}]", "jars_dir": str(REPO / ".jars"),
                      "conf": {"spark.ui.enabled": "false",
                               "spark.ui.showConsoleProgress": "false"}},
            "sources": [{"name": "b", "kind": "image_folder", "path": workdir}],
        })
        self.spark = get_spark(cfg)
        self.spark.sparkContext.setLogLevel("ERROR")
        df = self.spark.read.parquet(path).select(
            F.col("k").alias("sample_id"), F.lit("b").alias("source"),
            F.col("k").alias("source_key"), F.lit(None).cast("string").alias("source_uri"),
            F.lit(None).cast("string").alias("caption_original"),
            F.lit(None).cast("string").alias("license"),
            F.lit(None).cast("string").alias("metadata_json"),
            F.col("b").alias("image_bytes"), F.lit("ok").alias("read_status"),
            F.lit(None).cast("string").alias("read_reason"),
        ).select(*INGEST_SCHEMA.fieldNames(),
                 *[F.lit(None).cast(t).alias(c) for c, t in (
                     ("image_ref", "string"), ("image_offset", "long"),
                     ("image_length", "long"))])
        self.stages = {}
        sink = RowSink(discard, STORED, "bench", 0)
        self.partitions = df.rdd.getNumPartitions()
        warm = table.column("k").to_pylist()[:: max(1, len(images) // (2 * cores))]
        # What curate's tasks get with prepare.threads null, for this many tasks.
        self.default = PrepareConfig().task_threads(cores, self.partitions)
        for side in [*threads_list, JVM]:
            # What curate runs: one Python function per task that fetches (nothing here:
            # the bytes are in the rows), prepares, hashes the source bytes and hands the
            # accepted rows to the task's sink (curate's writes a Lance fragment; this one
            # drops them), the JPEGs staying in the worker. JVM: the same function
            # without a sink, its JPEGs sent back to the JVM (as curate did before).
            threads = self.default if side == JVM else side

            def stage(rows, threads=threads, side=side):
                return prepared_outcomes(fetch_and_prepare(
                    rows, cfg.fetch, cfg.sources, PrepareConfig(threads=threads),
                    sink=None if side == JVM else sink)).select("prepared.image", "status")

            # Warm: the workers start and run the function on a few rows, every task's
            # output read to its end (a `limit` would stop reading it, and Spark would
            # drop those workers: the first timed round would start new ones).
            stage(df.where(F.col("sample_id").isin(warm))).write.format("noop").mode(
                "overwrite").save()
            self.stages[side] = stage(df)

    def time(self, side) -> float:
        t0 = time.perf_counter()
        if side == "bare":
            self.pool.map(bare, self.images, chunksize=1)
        elif side == "loop":
            self.pool.map(full, self.images, chunksize=1)
        else:
            self.stages[side].write.format("noop").mode("overwrite").save()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.close()
        self.spark.stop()


def run_set(name: str, args) -> None:
    from PIL import Image

    megapixels, default_n = SETS[name]
    images = make_images(args.images or default_n, megapixels)
    mb = sum(map(len, images)) / 1e6
    pixels = sum(w * h for w, h in (Image.open(io.BytesIO(b)).size for b in images))
    with tempfile.TemporaryDirectory() as workdir:
        sides = Sides(images, args.cores, workdir, args.threads)
        order = ["bare", "loop", *args.threads, JVM]
        best = {side: float("inf") for side in order}
        for _ in range(args.rounds):  # alternating, so drift hits every side alike
            for side in order:
                best[side] = min(best[side], sides.time(side))
        partitions, default = sides.partitions, sides.default
        sides.close()
    print(f"\n{name} set: {len(images)} images ({min(megapixels)}-{max(megapixels)} MP), "
          f"{mb:.1f} MB encoded, {pixels / 1e6:.0f} MP, cores={args.cores}, {partitions} "
          f"Spark tasks, best of {args.rounds} alternating")
    mp = pixels / 1e6
    n = len(images)
    t_bare = best["bare"]
    labels = {"bare": "bare Pool: decode + JPEG q92", "loop": "Pool: lakeshard prepare_image"}
    print(f"{'':<42}{'images/s':>10}{'MP/s/core':>11}{'vs bare':>9}")
    for side in order:
        label = labels.get(side) or (
            f"Spark stage, JPEGs to the JVM, threads={default}"
            if side == JVM else f"Spark prepare stage, threads={side}")
        t = best[side]
        print(f"{label:<42}{n / t:>10.2f}{mp / t / args.cores:>11.2f}{t_bare / t:>9.2f}")
    if default in best:
        print(f"ratio stage/bare = {t_bare / best[default]:.2f} at curate's default "
              f"(prepare.threads null: {default} per task here; {name} set); load "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def profile_set(name: str, args) -> None:
    """CPU time per image of each piece of the per-image path, one process, no Spark:
    what prepare_image adds to the bare decode + encode."""
    import hashlib

    import pyarrow as pa
    from PIL import Image

    from etl.config import FetchConfig, PrepareConfig
    from udfs.fetch import OWN_REFS
    from udfs.images import dhash64, prepare_image
    from udfs.ingest import fetch_prepare_batches

    megapixels, default_n = SETS[name]
    images = make_images(args.images or default_n, megapixels)
    decoded = [decode(b) for b in images]
    encoded = [prepare_image(b, PrepareConfig()).image for b in images]
    opts = PrepareConfig(threads=1)

    def pillow_decode(data: bytes) -> None:  # the decode before 0280eb4
        im = Image.open(io.BytesIO(data))
        im.load()
        if im.mode != "RGB":
            im.convert("RGB")

    n = len(images)  # curate's batch function's arguments: every row carries its bytes
    batch = (pa.array([True] * n), pa.array(["bench"] * n), pa.nulls(n, pa.string()),
             pa.nulls(n, pa.int64()), pa.nulls(n, pa.int64()), pa.array(images, pa.binary()))
    pieces = {
        # Each decoded image dropped at once, as the stage drops it.
        "decode": lambda: [decode(b).size for b in images],
        "  Pillow's decode of every image, for comparison":
            lambda: [pillow_decode(b) for b in images],
        "bare decode + JPEG q92": lambda: [bare(b) for b in images],
        "prepare_image": lambda: [prepare_image(b, opts) for b in images],
        "  of which dHash": lambda: [dhash64(im) for im in decoded],
        "  of which sha256 of the JPEG": lambda: [hashlib.sha256(e).hexdigest()
                                                 for e in encoded],
        "curate's batch function (threads=1)": lambda: list(fetch_prepare_batches(
            iter([batch]), FetchConfig(), {"bench": OWN_REFS}, opts)),
    }
    print(f"\n{name} set: {len(images)} images, CPU ms per image (best of {args.rounds}; "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    for label, fn in pieces.items():
        best = float("inf")
        for _ in range(args.rounds):
            t0 = time.process_time()
            fn()
            best = min(best, time.process_time() - t0)
        print(f"  {label:<40}{best / len(images) * 1e3:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sets", nargs="+", choices=sorted(SETS), default=["large"],
                        help="image sets to time, one after the other")
    parser.add_argument("--images", type=int, default=None,
                        help="images per set (default: 60 large, 400 small)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="prepare.threads values to time the stage with (curate's "
                        "default: the cores over the tasks, 1 here)")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--profile", action="store_true",
                        help="CPU ms per image of each piece of prepare_image, no Spark")
    args = parser.parse_args()
    for name in args.sets:
        (profile_set if args.profile else run_set)(name, args)


if __name__ == "__main__":
    main()
