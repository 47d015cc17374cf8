"""JPEG re-encoding audit: PSNR/SSIM per generation on a real photo."""

from __future__ import annotations

import io
from importlib import resources

import numpy as np
from PIL import Image

from udfs.jpeg_quality import audit_image, summarise


def _photo_bytes() -> bytes:
    return resources.files("skimage").joinpath("data", "coffee.png").read_bytes()


def test_generation_one_psnr_matches_an_independent_computation():
    data = _photo_bytes()
    audit = audit_image(data, quality=92, generations=3, subsampling="4:2:0")
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64)
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").save(buf, format="JPEG", quality=92)
    dec = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"), dtype=np.float64)
    expected = 10 * np.log10(255.0**2 / np.mean((ref - dec) ** 2))
    g1 = audit.generations[0]
    assert abs(g1.psnr - expected) < 1e-6 and g1.jpeg_bytes == len(buf.getvalue())
    assert (audit.width, audit.height) == (600, 400)


def test_q92_is_close_and_png_costs_more_bytes():
    audits = [audit_image(_photo_bytes(), quality=92, generations=4, subsampling="4:2:0")]
    rows = summarise(audits)
    assert [r["generation"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["psnr_mean"] > 35 and rows[0]["ssim_mean"] > 0.95
    assert rows[-1]["psnr_mean"] <= rows[0]["psnr_mean"] + 1e-9  # never improves
    assert rows[0]["png_over_jpeg"] > 2
    low = summarise([audit_image(_photo_bytes(), quality=40, generations=1, subsampling="4:2:0")])
    assert low[0]["psnr_mean"] < rows[0]["psnr_mean"]
