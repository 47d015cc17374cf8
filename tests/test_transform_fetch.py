"""etl.transforms.fetch on a few rows with local files (no server): only readable rows
that reference their image and have no bytes are fetched; byte ranges are honoured; a
failed fetch makes the row rejected with the fetch status as its reason. Fetching over
HTTP and each source's rules: test_fetch.py and test_fetch_policy.py."""

from __future__ import annotations

from etl.config import FetchConfig, SourceConfig
from etl.transforms.fetch import fetch_images

COLUMNS = ("k string, source string, image_bytes binary, image_ref string, "
           "image_offset long, image_length long, read_status string, read_reason string")


def test_fetch_fills_bytes_only_where_a_readable_row_references_them(spark, tmp_path):
    blob = tmp_path / "shard.bin"
    blob.write_bytes(bytes(range(100)))
    ref, missing = str(blob), str(tmp_path / "nope.jpg")
    df = spark.createDataFrame([
        ("whole", "f", None, ref, None, None, "ok", None),
        ("range", "f", None, ref, 10, 5, "ok", None),
        ("short", "f", None, ref, 98, 5, "ok", None),
        ("missing", "f", None, missing, None, None, "ok", None),
        ("embedded", "f", b"own bytes", missing, None, None, "ok", None),
        ("unread", "f", None, ref, None, None, "rejected", "unreadable_file"),
        ("no_ref", "f", None, None, None, None, "ok", None),
    ], COLUMNS)
    source = SourceConfig(name="f", kind="image_folder", path=str(tmp_path))
    out = fetch_images(df, FetchConfig(retries=0), [source])
    assert out.columns == [*df.columns, "fetch_failed", "fetch_detail"]
    got = {r.k: (r.image_bytes, r.read_status, r.read_reason, r.fetch_failed, r.fetch_detail)
           for r in out.collect()}
    assert got == {
        "whole": (bytes(range(100)), "ok", None, False, None),
        "range": (bytes(range(10, 15)), "ok", None, False, None),
        "short": (None, "rejected", "truncated", True, "read 2 of 5 bytes"),
        "missing": (None, "rejected", "missing_file", True, "no such file"),
        # Bytes already there, an earlier failure, no reference: not fetched at all.
        "embedded": (b"own bytes", "ok", None, False, None),
        "unread": (None, "rejected", "unreadable_file", False, None),
        "no_ref": (None, "ok", None, False, None),
    }
