"""etl.transforms.export on a few rows: the MDS column mapping, the identity column that
joins a row's fingerprint, and the order-free fingerprint of a set of ids (checked
against xxhash64 computed here with the `xxhash` package). Leaving out duplicates and
shaping captions: test_bronze_accounting.py."""

from __future__ import annotations

import random

import pytest
import xxhash

from etl.config import ExportConfig
from etl.errors import ConfigError
from etl.transforms.export import (
    export_columns,
    export_rows,
    ids_fingerprint,
)

TABLE = ["_rowaddr", "image", "sample_id", "source", "width", "height", "original_width",
         "original_height", "caption_original", "caption_v1", "aesthetic", "image_sha256"]


def test_export_columns_map_fixed_caption_and_extra_columns():
    exp = ExportConfig(name="t", captions={"caption": "caption_original", "v1": "caption_v1"},
                       columns=("aesthetic",))
    assert export_columns(exp, TABLE) == {
        "image": "image", "sample_id": "sample_id", "source": "source", "width": "width",
        "height": "height", "original_width": "original_width",
        "original_height": "original_height", "caption": "caption_original",
        "v1": "caption_v1", "aesthetic": "aesthetic"}
    with pytest.raises(ConfigError, match=r"exports\.t\.captions: 'source' clashes with "
                                          r"the column 'source'"):
        export_columns(ExportConfig(name="t", captions={"source": "caption_v1"}), TABLE)
    with pytest.raises(ConfigError, match=r"exports\.t: column 'caption_v2' \(for 'v2'\) is "
                                          r"not in the curated table"):
        export_columns(ExportConfig(name="t", captions={"v2": "caption_v2"}), TABLE)


def test_export_rows_carry_the_identity_column_and_cast_sizes_to_int32(spark):
    curated = spark.createDataFrame(
        [(7, "a", "s", 64, 48, 80, 60, None, "h-a")],
        "_rowaddr long, sample_id string, source string, width long, height long, "
        "original_width long, original_height long, caption_original string, "
        "image_sha256 string")
    mapping = export_columns(ExportConfig(name="t"), [*curated.columns, "image"])
    rows = export_rows(curated, mapping, captions={"caption"}, fetched={"image"},
                       duplicates=None, row_address="_rowaddr", identity="image_sha256")
    assert rows.columns == ["_rowaddr", "_identity", "sample_id", "source", "width", "height",
                            "original_width", "original_height", "caption"]
    types = {f.name: f.dataType.simpleString() for f in rows.schema}
    assert [types[c] for c in ("width", "height", "original_width", "original_height")] == [
        "int"] * 4
    assert tuple(rows.first()) == (7, "h-a", "a", "s", 64, 48, 80, 60, "")


def _xxhash64_signed(value: str) -> int:
    """Spark's xxhash64 of a string: XXH64 of its UTF-8 bytes, seed 42, as a signed long."""
    h = xxhash.xxh64_intdigest(value.encode(), seed=42)
    return h - (1 << 64) if h >= 1 << 63 else h


def test_ids_fingerprint_is_the_xor_of_the_ids_hashes_in_any_order(spark):
    ids = ["a", "b", "ü-3"]
    expected = 0
    for sid in ids:
        expected ^= _xxhash64_signed(sid)
    frame = spark.createDataFrame([(s,) for s in ids], "sample_id string")
    assert ids_fingerprint(frame) == expected
    shuffled = spark.createDataFrame([(s,) for s in reversed(ids)], "sample_id string")
    assert ids_fingerprint(shuffled.repartition(3)) == expected
    assert ids_fingerprint(spark.createDataFrame([], "sample_id string")) == 0
    fewer = spark.createDataFrame([("a",), ("b",)], "sample_id string")
    assert ids_fingerprint(fewer) == _xxhash64_signed("a") ^ _xxhash64_signed("b") != expected


def test_the_drivers_fingerprint_of_ids_is_sparks_bit_for_bit(spark):
    """An export's key holds the fingerprint of the ids it leaves out: computed on the
    driver for ids it holds, by Spark otherwise -- the same number either way, or the
    path taken would change the key (and rewrite an export for nothing)."""
    rng = random.Random(7)
    alphabet = "abcdef0123456789-_/ üßé字😀"
    for n in (0, 1, 2, 3, 200):
        ids = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
               for _ in range(n)]
        frame = spark.createDataFrame([(s,) for s in ids], "sample_id string")
        assert ids_fingerprint(ids) == ids_fingerprint(frame), ids
    hashes = [_xxhash64_signed(s) for s in ("a", "ü-3")]
    assert ids_fingerprint(["a", "ü-3"]) == hashes[0] ^ hashes[1]
    assert min(ids_fingerprint([f"id{i}"]) for i in range(64)) < 0  # a signed long
