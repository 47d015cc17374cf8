"""An exception in lakeshard's own code is `internal_error`, not bad data: a bug in
fetching a reference or a sidecar is the record's internal_error (counted apart,
retried), and a feature that cannot be computed says why it is null while a bug of
ours raises. (How internal errors are counted: test_transform_accounting.py; how they
fail a stage on its budget: test_budgets.py.)"""

from __future__ import annotations

import json

import pytest
from support import png_bytes


def test_a_fetch_bug_is_internal_error_not_a_bad_reference(tmp_path, monkeypatch):
    from udfs import fetch

    path = tmp_path / "a.png"
    path.write_bytes(png_bytes())
    assert fetch.fetch_ref(str(path)).status == "ok"

    def broken(path, opts, rng, rules):
        return {}["no such key"]  # a bug in the fetch code itself

    monkeypatch.setattr(fetch, "_local", broken)
    res = fetch.fetch_ref(str(path))
    assert res.status == "internal_error" and res.data is None
    assert res.detail.startswith("KeyError: 'no such key' (at test_internal_errors.py:")
    assert "in fetch_ref" in res.detail


def test_a_fetch_bug_reading_a_sidecar_is_internal_error_not_a_bad_sidecar(tmp_path,
                                                                          monkeypatch):
    """image_folder reads `.txt`/`.json` sidecars through fetch_ref: a bug there is the
    record's internal_error (counted apart, retried), not `invalid_sidecar`."""
    from etl.sources.image_folder import _sidecar_parser
    from udfs import fetch

    (tmp_path / "a.txt").write_text("a cat on a mat\n")
    (tmp_path / "a.json").write_text(json.dumps({"license": "cc-by"}))
    parse = _sidecar_parser({"caption": "caption", "license": "license"},
                            max_caption_chars=65536, follow_symlinks=False)
    out = parse(str(tmp_path / "a.txt"), str(tmp_path / "a.json"))
    assert (out["read_status"], out["read_reason"], out["caption_original"],
            out["license"]) == ("ok", None, "a cat on a mat", "cc-by")

    def broken(path, opts, rng, rules):
        raise TypeError("a bug in the fetch code")

    monkeypatch.setattr(fetch, "_local", broken)
    out = parse(str(tmp_path / "a.txt"), str(tmp_path / "a.json"))
    assert (out["read_status"], out["read_reason"]) == ("rejected", "internal_error")
    assert json.loads(out["metadata_json"])["detail"].startswith(
        "TypeError: a bug in the fetch code (at test_internal_errors.py:")
    out = parse(str(tmp_path / "a.txt"), None)  # the caption file alone
    assert out["read_reason"] == "internal_error"


def test_luma_mean_says_why_it_is_null_and_a_bug_fails(monkeypatch):
    from PIL import ImageStat

    from udfs.features import luma_mean

    value, error = luma_mean(png_bytes((40, 30), color=(100, 100, 100)))
    assert error is None and 99 <= value <= 101
    assert luma_mean(b"") == (None, "empty: no image bytes")
    value, error = luma_mean(b"these bytes are not an image")
    assert value is None and error.startswith("undecodable: UnidentifiedImageError")

    def broken(*a, **k):
        raise ValueError("a bug of ours, not the image's")

    monkeypatch.setattr(ImageStat, "Stat", broken)
    with pytest.raises(ValueError, match="a bug of ours"):
        luma_mean(png_bytes())
