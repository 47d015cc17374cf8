"""Exports from the curated Lance table: image bytes taken from Lance by row address,
aspect-ratio buckets (pass-through and resized), read back with StreamingDataset."""

from __future__ import annotations

import io
import json
import math

import lance
import pyarrow as pa
from conftest import jpeg_bytes, make_config
from PIL import Image

from etl import tables
from etl.config import BucketSpec
from etl.jobs.export import export
from etl.writers.mds.buckets import assign_buckets, bucket_set

SIZES = [(64, 64), (128, 64), (64, 128), (300, 100), (100, 100), (90, 60), (60, 200), (400, 90)]


def _curated(cfg) -> dict[str, dict]:
    rows = []
    for i, (w, h) in enumerate(SIZES * 2):
        rows.append(
            {
                "sample_id": f"id{i:02d}",
                "source": f"s{i % 3}",
                "image": jpeg_bytes((w, h), color=(20 * i % 255, 100, 50)),
                "caption_original": f"caption {i}",
                "width": w,
                "height": h,
                "original_width": w,
                "original_height": h,
                "keep": i != 3,
            }
        )
    lance.write_dataset(
        pa.Table.from_pylist(rows), tables.layout(cfg).curated, max_rows_per_file=5
    )
    return {r["sample_id"]: r for r in rows}


def _nearest(w: int, h: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """Brute force: the bucket with the closest log aspect ratio (first on ties)."""
    return min(buckets, key=lambda b: (abs(math.log(w / h) - math.log(b[0] / b[1])), b[0] / b[1]))


def _read(path: str, split: str | None = None) -> list[dict]:
    from mds_read import read_mds

    return read_mds(path, split=split)


def test_bucket_set_is_symmetric_on_the_patch_grid_and_assignment_is_nearest():
    spec = BucketSpec(base_resolution=256, patch_size=32, min_aspect=0.25, max_aspect=4.0)
    buckets = bucket_set(spec)
    assert (256, 256) in buckets
    for w, h in buckets:
        assert w % 32 == 0 and h % 32 == 0 and w * h <= 256 * 256
        assert (h, w) in buckets and 0.25 <= w / h <= 4.0
    widths = [1, 7, 100, 333, 1000, 4096, 50]
    heights = [1, 3, 100, 1000, 10, 100, 51]
    got = [buckets[i] for i in assign_buckets(widths, heights, buckets)]
    assert got == [_nearest(w, h, buckets) for w, h in zip(widths, heights, strict=True)]


def test_export_takes_images_from_lance_and_routes_rows_into_buckets(spark, tmp_path):
    spec = {"base_resolution": 128, "patch_size": 32, "min_aspect": 0.25, "max_aspect": 4.0}
    cfg = make_config(
        tmp_path,
        exports={
            "plain": {"partitions": 3},
            "bucketed": {"partitions": 2, "buckets": spec},
            "resized": {"partitions": 2, "buckets": {**spec, "resize": True}},
        },
    )
    rows = _curated(cfg)
    kept = {k: r for k, r in rows.items() if r["keep"]}

    plain = export(spark, cfg, "plain")
    got = _read(plain.path)
    assert sorted(s["sample_id"] for s in got) == sorted(kept)
    for s in got:  # the stored JPEG passed through: same pixels as decoding it directly
        r = kept[s["sample_id"]]
        stored = Image.open(io.BytesIO(r["image"]))
        assert s["image"].tobytes() == stored.tobytes()
        assert s["caption"] == r["caption_original"]

    buckets = bucket_set(BucketSpec(**spec))
    expected: dict[str, set[str]] = {}
    for k, r in kept.items():
        w, h = _nearest(r["width"], r["height"], buckets)
        expected.setdefault(f"{w}x{h}", set()).add(k)

    out = export(spark, cfg, "bucketed")
    manifest = json.load(open(f"{out.path}/manifest.json"))
    assert manifest["bucket_samples"] == {b: len(ids) for b, ids in expected.items()}
    assert out.samples == len(kept)
    for name, ids in expected.items():
        samples = _read(out.path, split=name)
        assert {s["sample_id"] for s in samples} == ids
        for s in samples:  # pass-through: original sizes
            r = kept[s["sample_id"]]
            assert s["image"].size == (r["width"], r["height"]) == (s["width"], s["height"])

    from etl.jobs.verify_export import verify_export

    report = verify_export(out.path, loader_workers=0)
    assert report.ok, report.problems
    assert report.samples == report.images_decoded == len(kept)

    resized = export(spark, cfg, "resized")
    for name, ids in expected.items():
        bw, bh = map(int, name.split("x"))
        samples = _read(resized.path, split=name)
        assert {s["sample_id"] for s in samples} == ids
        for s in samples:
            assert s["image"].size == (bw, bh) == (s["width"], s["height"])
            r = kept[s["sample_id"]]
            assert (s["original_width"], s["original_height"]) == (r["width"], r["height"])
