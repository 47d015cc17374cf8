"""What every source adapter's rows pass through (etl.sources.finish_ingest): a sample id
that is a stable hash of (source, key), computed here independently, and the source's
default license where a record has none."""

from __future__ import annotations

import hashlib

from etl.config import SourceConfig
from etl.schema import SAMPLE_ID_SEPARATOR
from etl.sources import finish_ingest


def _expected_id(source: str, key: str) -> str:
    return hashlib.sha256(f"{source}{SAMPLE_ID_SEPARATOR}{key}".encode()).hexdigest()[:32]


def test_finish_ingest_adds_stable_sample_id_and_default_license(spark):
    raw = spark.createDataFrame(
        [("a.jpg", "u", "cap", None, None, b"x", "ok", None),
         ("b.jpg", "u", None, "CC-BY", None, b"y", "ok", None)],
        "source_key string, source_uri string, caption_original string, license string, "
        "metadata_json string, image_bytes binary, read_status string, read_reason string",
    )
    src = SourceConfig(name="web", kind="image_folder", path="/x", license="CC0")
    out = {r.source_key: r for r in finish_ingest(raw, src).collect()}
    assert out["a.jpg"].sample_id == _expected_id("web", "a.jpg")
    assert out["b.jpg"].sample_id == _expected_id("web", "b.jpg")
    assert out["a.jpg"].license == "CC0" and out["b.jpg"].license == "CC-BY"
    assert out["a.jpg"].source == "web"
    # Same key, other source: other id.
    assert _expected_id("web2", "a.jpg") != out["a.jpg"].sample_id
