"""prepare_image on real files built in the test."""

from __future__ import annotations

import io

from conftest import jpeg_bytes, png_bytes
from PIL import Image

from udfs.images import prepare_image

LIMITS = dict(max_bytes=1 << 20, max_pixels=10_000_000)


def _decode(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def test_png_becomes_rgb_jpeg_with_same_size():
    out = prepare_image(png_bytes((40, 30)), **LIMITS)
    assert out.status == "ok" and out.reason is None
    im = _decode(out.image)
    assert im.format == "JPEG" and im.mode == "RGB" and im.size == (40, 30)
    assert (out.width, out.height, out.original_width, out.original_height) == (40, 30, 40, 30)
    assert out.original_format == "PNG"
    assert out.original_bytes == len(png_bytes((40, 30)))


def test_quality_changes_bytes():
    noisy = Image.effect_noise((128, 128), 64).convert("RGB")
    buf = io.BytesIO()
    noisy.save(buf, format="PNG")
    low = prepare_image(buf.getvalue(), quality=30, **LIMITS)
    high = prepare_image(buf.getvalue(), quality=92, **LIMITS)
    assert len(low.image) < len(high.image)


def test_exif_rotation_swaps_dimensions():
    im = Image.new("RGB", (80, 20), (0, 0, 255))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display
    buf = io.BytesIO()
    im.save(buf, format="JPEG", exif=exif)
    out = prepare_image(buf.getvalue(), **LIMITS)
    assert (out.original_width, out.original_height) == (80, 20)
    assert (out.width, out.height) == (20, 80)


def test_rgba_is_composited_on_white():
    out = prepare_image(png_bytes((10, 10), mode="RGBA", color=(255, 0, 0, 0)), **LIMITS)
    r, g, b = _decode(out.image).getpixel((5, 5))
    assert min(r, g, b) > 245  # fully transparent -> white, not black


def test_grayscale_and_16bit():
    gray = prepare_image(png_bytes((12, 12), mode="L", color=128), **LIMITS)
    assert _decode(gray.image).mode == "RGB"
    im16 = Image.new("I;16", (8, 8), 65535)
    buf = io.BytesIO()
    im16.save(buf, format="PNG")
    out = prepare_image(buf.getvalue(), **LIMITS)
    assert out.status == "ok"
    assert min(_decode(out.image).getpixel((4, 4))) > 245


def test_bad_inputs_are_rejected_with_reasons():
    good = jpeg_bytes((64, 64))
    cases = {
        b"": "empty",
        b"hello, not an image": "undecodable",
        good[: len(good) // 2]: "truncated",
    }
    for data, reason in cases.items():
        out = prepare_image(data, **LIMITS)
        assert (out.status, out.reason) == ("rejected", reason), data[:10]
        assert out.image is None
    assert prepare_image(None, **LIMITS).reason == "empty"


def test_byte_cap_and_pixel_cap():
    data = jpeg_bytes((100, 100))
    assert prepare_image(data, max_bytes=10, max_pixels=10**9).reason == "too_large_bytes"
    out = prepare_image(data, max_bytes=1 << 20, max_pixels=100 * 100 - 1)
    assert (out.reason, out.original_width, out.original_height) == ("too_many_pixels", 100, 100)
