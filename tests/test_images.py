"""prepare_image on real files of every kind, built inside the test."""

from __future__ import annotations

import io
import resource
import struct
import time
import zlib

import numpy as np
import pandas as pd
import pytest
from conftest import jpeg_bytes, png_bytes
from PIL import Image, ImageCms

from etl.config import PrepareConfig
from udfs.images import dhash64, prepare_image

OPTS = PrepareConfig(max_image_bytes=1 << 22, max_pixels=10_000_000, min_side=8)


def _decode(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _photo(size=(96, 64)) -> Image.Image:
    """A smooth gradient with structure: a stand-in photo that survives JPEG."""
    w, h = size
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :].repeat(h, 0)
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None].repeat(w, 1)
    rgb = np.stack([x, y, (x + y) / 2], axis=-1).astype(np.uint8)
    return Image.fromarray(rgb, "RGB")


def _ok(data, opts=OPTS):
    out = prepare_image(data, opts)
    assert out.status == "ok", (out.reason, out.detail)
    im = _decode(out.image)
    assert im.format == "JPEG" and im.mode == "RGB"
    assert im.size == (out.width, out.height)
    return out, im


def test_png_becomes_rgb_jpeg_with_same_size_and_hashes():
    data = png_bytes((40, 30))
    out, im = _ok(data)
    assert (out.width, out.height, out.original_width, out.original_height) == (40, 30, 40, 30)
    assert out.original_format == "PNG" and out.original_size_bytes == len(data)
    import hashlib

    assert out.image_sha256 == hashlib.sha256(out.image).hexdigest()
    assert out.aspect_ratio == pytest.approx(40 / 30)
    assert out.keep is True and out.filter_reason is None and out.flags == []


@pytest.mark.parametrize("fmt, kw", [
    ("JPEG", {"quality": 90}), ("JPEG", {"quality": 90, "progressive": True}),
    ("PNG", {}), ("WEBP", {"quality": 90}), ("GIF", {}), ("BMP", {}), ("TIFF", {}),
])
def test_every_common_format_decodes(fmt, kw):
    src = _photo()
    out, im = _ok(_save(src, fmt, **kw))
    assert out.original_format == fmt and im.size == src.size
    if fmt != "GIF":  # GIF is palettised: colours differ by design
        diff = np.abs(np.asarray(im, np.int16) - np.asarray(src, np.int16)).mean()
        assert diff < 6, diff


def test_quality_and_subsampling_are_applied():
    noisy = _save(Image.effect_noise((128, 128), 64).convert("RGB"), "PNG")
    low = prepare_image(noisy, PrepareConfig(jpeg_quality=30, min_side=8))
    high = prepare_image(noisy, PrepareConfig(jpeg_quality=92, min_side=8))
    full = prepare_image(
        noisy, PrepareConfig(jpeg_quality=92, chroma_subsampling="4:4:4", min_side=8)
    )
    assert len(low.image) < len(high.image) < len(full.image)


def test_exif_rotation_swaps_dimensions():
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated 90 degrees clockwise
    data = _save(Image.new("RGB", (80, 20), (0, 0, 255)), "JPEG", exif=exif)
    out, _ = _ok(data)
    assert (out.width, out.height) == (20, 80)
    assert (out.original_width, out.original_height) == (20, 80)  # displayed, too
    assert "exif_rotated" in out.flags


def test_cmyk_jpeg_keeps_its_colours():
    red_cmyk = Image.new("CMYK", (32, 32), (0, 255, 255, 0))  # pure red in CMYK
    out, im = _ok(_save(red_cmyk, "JPEG", quality=95))
    r, g, b = im.getpixel((16, 16))
    assert r > 200 and g < 60 and b < 60, (r, g, b)


def test_palette_png_with_transparency_is_composited_on_white():
    pal = Image.new("P", (16, 16), 0)
    pal.putpalette([255, 0, 0] + [0, 0, 0] * 255)
    pal.putpixel((0, 0), 1)
    data = _save(pal, "PNG", transparency=0)  # index 0 (red) is transparent
    out, im = _ok(data)
    assert min(im.getpixel((8, 8))) > 245 and "has_alpha" in out.flags


def test_rgba_and_la_are_composited_on_white_and_flagged():
    for mode, color in (("RGBA", (255, 0, 0, 0)), ("LA", (0, 0))):
        out, im = _ok(png_bytes((10, 10), mode=mode, color=color))
        assert min(im.getpixel((5, 5))) > 245 and "has_alpha" in out.flags
    opaque, _ = _ok(png_bytes((10, 10), mode="RGBA", color=(1, 2, 3, 255)))
    assert "has_alpha" not in opaque.flags


def test_16bit_and_grayscale_become_8bit_rgb():
    arr = np.full((8, 8), 65535, dtype=np.uint16)
    arr[0, 0] = 0
    out, im = _ok(_save(Image.fromarray(arr), "PNG"))
    assert min(im.getpixel((4, 4))) > 245 and "high_bit_depth" in out.flags
    _, gray = _ok(png_bytes((12, 12), mode="L", color=128))
    assert abs(gray.getpixel((6, 6))[0] - 128) < 4


def test_animated_gif_and_multipage_tiff_give_the_first_frame():
    frames = [Image.new("RGB", (20, 20), c) for c in ((255, 0, 0), (0, 0, 255))]
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    tif = io.BytesIO()
    frames[0].save(tif, format="TIFF", save_all=True, append_images=frames[1:])
    for data in (gif.getvalue(), tif.getvalue()):
        out, im = _ok(data)
        r, _, b = im.getpixel((10, 10))
        assert r > 200 and b < 60 and "multi_frame" in out.flags


def test_srgb_profile_is_left_and_a_broken_profile_is_flagged():
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))
    srgb_data = _save(_photo(), "JPEG", icc_profile=srgb.tobytes())
    out, _ = _ok(srgb_data)
    assert "icc_converted" not in out.flags and "icc_failed" not in out.flags
    broken = _save(_photo(), "JPEG", icc_profile=b"not a real icc profile")
    out, _ = _ok(broken)
    assert "icc_failed" in out.flags


def _bomb_png(w: int, h: int) -> bytes:
    """A tiny PNG whose header declares w x h pixels (the data is a few bytes)."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def test_decompression_bomb_is_rejected_from_the_header_fast_and_small():
    data = _bomb_png(30000, 30000)
    assert len(data) < 200
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    for opts in (OPTS, PrepareConfig(max_pixels=10**12)):  # our cap, then PIL's own guard
        out = prepare_image(data, opts)
        assert (out.status, out.reason) == ("rejected", "too_many_pixels")
    assert time.perf_counter() - t0 < 1.0
    grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grew_kib < 50 * 1024  # 30000x30000 RGB would be 2.5 GiB


def test_bad_inputs_are_rejected_with_reasons():
    good = jpeg_bytes((64, 64))
    cases = {
        b"": "empty",
        b"hello, I am a text file named .png": "undecodable",
        good[: len(good) // 2]: "truncated",
        _bomb_png(64, 64): "truncated",  # declared 64x64, data for far fewer pixels
    }
    for data, reason in cases.items():
        out = prepare_image(data, OPTS)
        assert (out.status, out.reason) == ("rejected", reason), (data[:10], out.detail)
        assert out.image is None
    assert prepare_image(None, OPTS).reason == "empty"
    assert prepare_image(good, PrepareConfig(max_image_bytes=10)).reason == "too_large_bytes"


def test_light_filters_flag_but_keep():
    small, _ = _ok(png_bytes((40, 30)), PrepareConfig(min_side=64))
    assert (small.keep, small.filter_reason) == (False, "too_small")
    wide, _ = _ok(png_bytes((600, 100)), PrepareConfig(min_side=64, max_aspect_ratio=5.0))
    assert (wide.keep, wide.filter_reason) == (False, "extreme_aspect")
    fine, _ = _ok(png_bytes((400, 100)), PrepareConfig(min_side=64, max_aspect_ratio=5.0))
    assert fine.keep is True


def test_max_side_resizes_with_lanczos_keeping_aspect():
    for data in (_save(_photo((800, 400)), "JPEG", quality=90), _save(_photo((800, 400)), "PNG")):
        out, im = _ok(data, PrepareConfig(max_side=200, min_side=8))
        assert im.size == (200, 100) and "resized" in out.flags
        assert (out.original_width, out.original_height) == (800, 400)


def test_passthrough_keeps_baseline_jpeg_bytes_and_not_others():
    opts = PrepareConfig(passthrough_jpeg=True, min_side=8)
    baseline = _save(_photo(), "JPEG", quality=85)
    out, _ = _ok(baseline, opts)
    assert out.image == baseline and "passthrough" in out.flags
    progressive = _save(_photo(), "JPEG", quality=85, progressive=True)
    out, _ = _ok(progressive, opts)
    assert out.image != progressive and "passthrough" not in out.flags
    half = baseline[: len(baseline) // 2]
    assert prepare_image(half, opts).reason == "truncated"


def test_dhash_is_stable_under_reencode_and_differs_for_other_images():
    a = _photo((128, 96))
    b = Image.fromarray(np.asarray(a)[:, ::-1].copy())  # mirrored
    h1 = dhash64(a)
    h2 = dhash64(_decode(_save(a, "JPEG", quality=70)))
    h3 = dhash64(b)
    assert bin((h1 ^ h2) & (2**64 - 1)).count("1") <= 4
    assert bin((h1 ^ h3) & (2**64 - 1)).count("1") > 16
    assert -(2**63) <= h1 < 2**63


def test_a_batch_prepared_on_threads_equals_one_image_at_a_time():
    from udfs.images import _prepare_batch

    good = [_save(_photo((64 + 8 * i, 48 + 4 * i)), "PNG") for i in range(12)]
    batch = [*good[:5], b"", b"not an image", *good[5:], None, jpeg_bytes((64, 64))[:300]]
    series = pd.Series(batch, dtype=object)
    serial = _prepare_batch(series, PrepareConfig(min_side=8, threads=1))
    threaded = _prepare_batch(series, PrepareConfig(min_side=8, threads=4))
    pd.testing.assert_frame_equal(serial, threaded)
    # Row order is the input's: sizes and reasons line up with what was passed.
    expected = [prepare_image(b, PrepareConfig(min_side=8)) for b in batch]
    assert threaded["status"].tolist() == [e.status for e in expected]
    assert threaded["image_sha256"].tolist() == [e.image_sha256 for e in expected]
    assert threaded["reason"].tolist()[5:7] == ["empty", "undecodable"]


def test_a_batch_with_rejects_keeps_every_dhash_exact():
    """A batch holding rejected rows (no dHash) keeps the others' 64-bit dHashes to the
    bit: a float column would round them (to multiples of 512 near 2**61), and the same
    picture in two batches would then miss its exact duplicate."""
    from skimage import data

    from udfs.images import _prepare_batch

    photos = [_save(Image.fromarray(getattr(data, n)()), "JPEG")
              for n in ("rocket", "astronaut", "coffee", "chelsea")]
    batch = pd.Series([photos[0], b"", *photos[1:], None], dtype=object)
    got = _prepare_batch(batch, PrepareConfig(min_side=8, threads=1))["dhash"].tolist()
    want = [prepare_image(b, PrepareConfig(min_side=8)).dhash for b in batch]
    assert [None if pd.isna(g) else int(g) for g in got] == want
    assert all(w is None or -(2**63) <= w < 2**63 for w in want)
    assert any(w is not None and abs(w) > 2**53 for w in want)  # beyond float precision


def _colour_jpegs() -> dict[str, tuple[bytes, PrepareConfig]]:
    """Colour JPEGs of the kinds the web serves, with the options to prepare them."""
    from skimage import data

    photo = Image.fromarray(data.coffee()).resize((300, 200))
    exif = Image.Exif()
    exif[0x0112] = 6
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    # The same primaries under a name without "sRGB": converted through LittleCMS.
    renamed = srgb.replace("sRGB".encode("utf-16-be"), "wRGB".encode("utf-16-be"))
    plain = PrepareConfig(min_side=8)
    return {
        "baseline 4:2:0": (_save(photo, "JPEG", quality=90), plain),
        "4:4:4": (_save(photo, "JPEG", quality=90, subsampling="4:4:4"), plain),
        "progressive": (_save(photo, "JPEG", quality=80, progressive=True), plain),
        "with a comment": (_save(photo, "JPEG", comment=b"kept by the re-encode"), plain),
        "exif rotated": (_save(photo, "JPEG", exif=exif), plain),
        "srgb profile": (_save(photo, "JPEG", icc_profile=srgb), plain),
        "other profile": (_save(photo, "JPEG", icc_profile=renamed), plain),
        "resized": (_save(photo, "JPEG"), PrepareConfig(min_side=8, max_side=256)),
    }


def test_colour_jpegs_decoded_by_simplejpeg_prepare_exactly_as_by_pillow(monkeypatch):
    """A colour JPEG is decoded by simplejpeg, into a buffer Pillow wraps: the stored
    JPEG, its hashes, size and flags are the ones Pillow's own decoder gives, whatever
    the JPEG carries (orientation, profiles, a comment) or the options ask (resize)."""
    import simplejpeg

    decode = simplejpeg.decode_jpeg
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return decode(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise ValueError("refused by the test: Pillow decodes")

    cases = _colour_jpegs()
    monkeypatch.setattr(simplejpeg, "decode_jpeg", counted)
    fast = {name: prepare_image(data, opts) for name, (data, opts) in cases.items()}
    assert len(calls) == len(cases)  # every one of them took the simplejpeg decode
    monkeypatch.setattr(simplejpeg, "decode_jpeg", refuse)
    for name, (data, opts) in cases.items():
        by_pillow = prepare_image(data, opts)
        assert by_pillow.status == "ok", name
        assert fast[name] == by_pillow, name
    # The options and the metadata did their work on the simplejpeg path too.
    assert "exif_rotated" in fast["exif rotated"].flags
    assert "icc_converted" in fast["other profile"].flags
    assert "icc_converted" not in fast["srgb profile"].flags
    assert (fast["resized"].width, "resized" in fast["resized"].flags) == (256, True)
    assert _decode(fast["with a comment"].image).info["comment"] == b"kept by the re-encode"


def test_a_jpeg_simplejpeg_refuses_gets_pillows_verdict():
    """simplejpeg's strict mode fails on any libjpeg warning; Pillow then decodes, so a
    truncated JPEG is still `truncated` and one with stray bytes between its segments
    (a warning Pillow lets pass) is still prepared."""
    import simplejpeg

    data = _save(_photo((96, 64)), "JPEG", quality=90)
    with pytest.raises(ValueError):
        simplejpeg.decode_jpeg(data[: len(data) // 2])
    assert prepare_image(data[: len(data) // 2], OPTS).reason == "truncated"
    sos = data.index(b"\xff\xda")
    stray = data[:sos] + b"\x00\x00\x00" + data[sos:]  # "extraneous bytes before marker"
    with pytest.raises(ValueError):
        simplejpeg.decode_jpeg(stray)
    out, _ = _ok(stray)
    assert out.image == prepare_image(data, OPTS).image
