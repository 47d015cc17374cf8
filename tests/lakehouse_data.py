"""A small curated table with known content, written through the Lance data source.

Shared by the lakehouse, SQL-recipe and notebook tests: 24 rows in 3 sources, real
JPEGs of known sizes, a few flagged rows, one row without a caption. Expectations in
the tests are computed from ROWS here, not from the code under test.
"""

from __future__ import annotations

from datetime import datetime

from conftest import jpeg_bytes

CAPTIONS = [
    "a red bicycle leaning against a brick wall",
    "a bowl of tomato soup on a wooden table",
    "a snowy mountain peak at dawn",
    "a cat asleep on a grey sofa",
    "a sailboat on a calm blue lake",
    "a plate of sushi with chopsticks",
    "a child flying a kite on the beach",
    "an old steam locomotive in a station",
    "a field of sunflowers under a clear sky",
    "a laptop and a cup of coffee on a desk",
    "a dog catching a frisbee in a park",
    "a lighthouse on a rocky coast at sunset",
]
SIZES = [(64, 64), (128, 96), (96, 128), (160, 90), (72, 72), (200, 100), (48, 32), (120, 40)]
SOURCES = ["photos", "alt_text", "crawl"]


def _row(i: int) -> dict:
    w, h = SIZES[i % len(SIZES)]
    source = SOURCES[i % 3]
    if w < 64 or h < 64:
        keep, reason = False, "too_small"
    elif max(w, h) / min(w, h) > 2.5:
        keep, reason = False, "extreme_aspect"
    else:
        keep, reason = True, None
    caption = None if i == 23 else f"{CAPTIONS[i % len(CAPTIONS)]}" + (
        "" if i < len(CAPTIONS) else f", photo {i}"
    )
    img = jpeg_bytes((w, h), color=((i * 37) % 256, (i * 91) % 256, (i * 53) % 256))
    return {
        "sample_id": f"{i:032x}",
        "source": source,
        "source_key": f"k{i}",
        "source_uri": f"file:///data/{source}/{i}.jpg",
        "caption_original": caption,
        "license": "CC-BY-4.0",
        "metadata_json": None,
        "image": img,
        "width": w,
        "height": h,
        "original_width": w,
        "original_height": h,
        "original_format": "JPEG",
        "original_size_bytes": len(img),
        "image_size_bytes": len(img),
        "image_sha256": "0" * 64,
        "dhash": i,
        "aspect_ratio": round(w / h, 6),
        "flags": [],
        "keep": keep,
        "filter_reason": reason,
        "run_id": "run-1",
        "ingested_at": datetime(2026, 1, 1, 12, 0, 0),
    }


ROWS = [_row(i) for i in range(24)]


def write_curated(spark, path: str, rows: list[dict] | None = None, parts: int = 3) -> None:
    """Write `rows` (default ROWS) as a curated Lance table of `parts` fragments."""
    from etl.schema import CURATED_COLUMNS, CURATED_SCHEMA

    rows = ROWS if rows is None else rows
    df = spark.createDataFrame([tuple(r[c] for c in CURATED_COLUMNS) for r in rows],
                               CURATED_SCHEMA)
    df.repartition(parts).write.format("lance").mode("overwrite").save(path)
