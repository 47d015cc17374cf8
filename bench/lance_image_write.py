"""Benchmark: writing image bytes to Lance with its default encoding of binary values
and with ``lance-encoding:compression=none`` (what lakeshard's writer sets on binary
columns, :func:`etl.writers.lance.stored_uncompressed`).

N rows shaped like curated's (an id, a caption, a JPEG) are written as one fragment,
each way once per round, alternating; the CPU time of the write (all of pylance's
threads: ``time.process_time``), its wall time, the data file's size and the CPU time
of reading the images back (as an export does) are printed, best of ROUNDS. The JPEGs
are `bench/ingest_vs_img2dataset.py`'s photos (crops of the photos bundled with
scikit-image, 0.3-0.8 MP) re-encoded at q92.
Run:

    .venv/bin/python bench/lance_image_write.py [--n 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import lance
import pyarrow as pa
from lance.fragment import write_fragments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ingest_vs_img2dataset import make_photos  # noqa: E402

from etl.writers.lance import stored_uncompressed  # noqa: E402


def _jpegs(n: int, work: Path) -> list[bytes]:
    """The ingest bench's photos (0.3-0.8 MP), re-encoded as JPEG q92 as curate stores
    them."""
    from PIL import Image

    make_photos(work / "photos", n, (0.3, 0.8), seed=0)
    out = []
    for path in sorted((work / "photos").iterdir()):
        buf = io.BytesIO()
        Image.open(path).convert("RGB").save(buf, format="JPEG", quality=92)
        out.append(buf.getvalue())
    return out


def _write(table: pa.Table, schema: pa.Schema, where: Path
           ) -> tuple[float, float, int, float]:
    """CPU and wall seconds of the write, bytes on disk, CPU seconds of reading the
    images back."""
    shutil.rmtree(where, ignore_errors=True)
    table = pa.Table.from_arrays(table.columns, schema=schema)
    c0, w0 = time.process_time(), time.perf_counter()
    fragments = write_fragments(table, str(where), schema=schema)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    ds = lance.LanceDataset.commit(str(where), lance.LanceOperation.Overwrite(schema, fragments))
    size = sum(f.stat().st_size for f in (where / "data").rglob("*.lance"))
    c0 = time.process_time()
    assert ds.to_table(columns=["image"]).column("image").equals(table.column("image"))
    return cpu, wall, size, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lance-write-bench-"))
    images = _jpegs(args.n, work)
    table = pa.table({
        "sample_id": pa.array([f"{i:016x}" for i in range(args.n)]),
        "caption": pa.array([f"a photograph, crop number {i}" for i in range(args.n)]),
        "image": pa.array(images, pa.binary()),
    })
    sides = {"default": table.schema, "compression=none": stored_uncompressed(table.schema)}
    print(f"{args.n} JPEGs, {sum(map(len, images)) / 1e6:.0f} MB; pylance {lance.__version__}; "
          f"{os.cpu_count()} cores; best of {args.rounds}")
    best: dict[str, tuple[float, float, int, float]] = {}
    try:
        for _ in range(args.rounds):
            for name, schema in sides.items():
                got = _write(table, schema, work / "t.lance")
                if name not in best:
                    best[name] = got
                best[name] = (*min(best[name][:2], got[:2]), got[2], min(best[name][3], got[3]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'encoding':<18} {'write cpu s':>11} {'wall s':>7} {'MB on disk':>11} "
          f"{'read cpu s':>11}")
    for name, (cpu, wall, size, read) in best.items():
        print(f"{name:<18} {cpu:11.2f} {wall:7.2f} {size / 1e6:11.1f} {read:11.2f}")
    print("default / none (CPU): %.2f" % (best["default"][0] / best["compression=none"][0]))


if __name__ == "__main__":
    main()
