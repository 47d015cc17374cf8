"""Image preparation: safe decode, orientation, colour, JPEG re-encode, hashes, flags.

:func:`prepare_image` is plain Python on one image and never raises for bad data: an
empty, oversized, bomb-sized, truncated or non-image input returns ``status =
"rejected"`` and a ``reason`` from :data:`REJECT_REASONS`. A decodable image is always
``"ok"``; light quality filters (too small, extreme aspect ratio) only set ``keep =
False`` and a ``filter_reason`` -- nothing is deleted for a quality opinion.

Bad data and our own failures are kept apart. An exception is a data failure only when
Pillow raised it reading the bytes (one of :data:`PILLOW_DATA_ERRORS`, raised inside
Pillow's code). Anything else -- an exception raised in this module, numpy, a broken library
upgrade -- propagates out of :func:`prepare_image`; the batch loop turns it into
``status = "error"``, ``reason = "internal_error"`` with the exception's type, message
and where it was raised in ``detail``. Internal errors are counted apart from rejects
and count against the stage's failure budget (``run.budgets``); the next run retries
those records.

:func:`prepare_many` runs it over a batch on the ``prepare.threads`` pool and
:func:`prepared_columns` lays the results out as the fields of :data:`PREPARED_TYPE`
(:func:`prepared_frame`: as a pandas frame); :func:`prepare_udf` wraps them as a
vectorised pandas UDF over Arrow batches (curate fetches and prepares in one Arrow
batch function instead: :mod:`udfs.ingest`).
"""

from __future__ import annotations

import hashlib
import io
import os
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pandas as pd
from pyspark.sql import types as T
from pyspark.sql.functions import pandas_udf

from udfs.arrow_types import nullable_type
from udfs.faults import raise_point
from udfs.outcomes import INTERNAL_ERROR, internal_detail

if TYPE_CHECKING:
    from etl.config import PrepareConfig

__all__ = [
    "PREPARED_TYPE",
    "STATUSES",
    "INTERNAL_ERROR",
    "PILLOW_DATA_ERRORS",
    "raised_by_pillow",
    "REJECT_REASONS",
    "FILTER_REASONS",
    "FLAGS",
    "PreparedImage",
    "prepare_image",
    "dhash64",
    "prepare_many",
    "prepared_columns",
    "prepared_frame",
    "prepare_udf",
]

# ok: prepared. rejected: the data is unusable (a reason from REJECT_REASONS).
# error: lakeshard's own code (or a library under it) failed on this row: INTERNAL_ERROR.
STATUSES = ("ok", "rejected", "error")
REJECT_REASONS = ("empty", "too_large_bytes", "too_many_pixels", "truncated", "undecodable")
# What Pillow raises for bytes it cannot read -- data failures when Pillow raised them.
PILLOW_DATA_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError)
FILTER_REASONS = ("too_small", "extreme_aspect")
# What a flag in `flags` means:
#   has_alpha     transparency composited on white      multi_frame  animation/pages: frame 0
#   exif_rotated  EXIF orientation applied               icc_converted  ICC profile -> sRGB
#   resized       downscaled to max_side (Lanczos)       passthrough  original JPEG bytes kept
#   high_bit_depth 16-bit input reduced to 8 bits        icc_failed   profile unusable, ignored
FLAGS = (
    "has_alpha", "multi_frame", "exif_rotated", "icc_converted", "icc_failed", "resized",
    "passthrough", "high_bit_depth",
)

PREPARED_TYPE = T.StructType(
    [
        T.StructField("image", T.BinaryType(), True),
        T.StructField("width", T.IntegerType(), True),
        T.StructField("height", T.IntegerType(), True),
        T.StructField("original_width", T.IntegerType(), True),
        T.StructField("original_height", T.IntegerType(), True),
        T.StructField("original_format", T.StringType(), True),
        T.StructField("original_size_bytes", T.LongType(), True),
        T.StructField("image_sha256", T.StringType(), True),
        T.StructField("dhash", T.LongType(), True),
        T.StructField("aspect_ratio", T.DoubleType(), True),
        T.StructField("flags", T.ArrayType(T.StringType(), False), True),
        T.StructField("keep", T.BooleanType(), True),
        T.StructField("filter_reason", T.StringType(), True),
        T.StructField("status", T.StringType(), False),
        T.StructField("reason", T.StringType(), True),
        T.StructField("detail", T.StringType(), True),
    ]
)


@dataclass(frozen=True)
class PreparedImage:
    status: str
    image: bytes | None = None
    width: int | None = None
    height: int | None = None
    original_width: int | None = None
    original_height: int | None = None
    original_format: str | None = None
    original_size_bytes: int | None = None
    image_sha256: str | None = None
    dhash: int | None = None
    aspect_ratio: float | None = None
    flags: list[str] = field(default_factory=list)
    keep: bool | None = None
    filter_reason: str | None = None
    reason: str | None = None
    detail: str | None = None


def _rejected(reason: str, detail: str, nbytes: int | None, **kw) -> PreparedImage:
    return PreparedImage(
        status="rejected", reason=reason, detail=detail[:500], original_size_bytes=nbytes, **kw
    )


def _pillow_dir() -> str:
    import PIL

    return os.path.dirname(PIL.__file__) + os.sep


def _raised_in(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of `exc`'s traceback: where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    return frames[-1] if frames else None


def raised_by_pillow(exc: BaseException) -> bool:
    """Whether `exc` was raised inside Pillow: with a type of :data:`PILLOW_DATA_ERRORS`,
    Pillow failing to read the bytes -- a data failure, not a bug of ours."""
    where = _raised_in(exc)
    return where is not None and where.filename.startswith(_pillow_dir())


def _internal_error(exc: BaseException, nbytes: int | None) -> PreparedImage:
    """An unexpected exception: its type, message and where it was raised."""
    return PreparedImage(status="error", reason=INTERNAL_ERROR, detail=internal_detail(exc),
                         original_size_bytes=nbytes)


def dhash64(im) -> int:
    """64-bit difference hash (signed, for Spark's LongType): 9x8 grey thumbnail, one bit
    per horizontal neighbour pair. Near-duplicates differ in a few bits."""
    import numpy as np
    from PIL import Image

    small = im.convert("L").resize((9, 8), Image.Resampling.BILINEAR, reducing_gap=2.0)
    px = np.asarray(small, dtype=np.int16)
    bits = (px[:, 1:] > px[:, :-1]).flatten()
    value = int("".join("1" if b else "0" for b in bits), 2)
    return value - (1 << 64) if value >= (1 << 63) else value


def _decoded(im, data: bytes):
    """`im` (opened from `data`, no pixel read yet) with its pixels decoded.

    A colour JPEG is decoded by libjpeg-turbo through simplejpeg, straight into RGBX --
    Pillow's own layout for RGB, which Pillow wraps without a copy. The pixels are the
    ones Pillow's decoder gives (the same library, DCT and upsampling), the header and
    metadata are still Pillow's (`info`: orientation, ICC profile, the comment a JPEG
    save keeps), and the decode takes ~10-15 % less CPU on a web-sized photo (simplejpeg
    hands libjpeg-turbo the whole stream, which writes RGBX rows in place; Pillow feeds
    the stream in chunks and unpacks every row into its layout). Anything else, and a
    JPEG simplejpeg does not decode cleanly (its strict mode fails on any libjpeg
    warning: a truncated or corrupt stream), is decoded by Pillow, whose verdict on bad
    data stays the one recorded."""
    from PIL import Image

    if im.format == "JPEG" and im.mode == "RGB":
        import simplejpeg

        try:
            pixels = simplejpeg.decode_jpeg(data, colorspace="RGBX")
        except ValueError:
            pixels = None  # Pillow decodes it, or says why it cannot
        if pixels is not None and pixels.shape[1::-1] == im.size:
            out = Image.frombuffer("RGBX", im.size, pixels, "raw", "RGBX", 0, 1)
            out.info = dict(im.info)
            return out
    im.load()
    return im


def _filters(w: int, h: int, opts: PrepareConfig) -> tuple[bool, str | None]:
    if min(w, h) < opts.min_side:
        return False, "too_small"
    if max(w, h) / min(w, h) > opts.max_aspect_ratio:
        return False, "extreme_aspect"
    return True, None


def _to_srgb(im, flags: list[str]):
    """Convert an embedded ICC profile to sRGB; leave sRGB and profile-less images."""
    icc = im.info.get("icc_profile")
    if not icc or im.mode not in ("RGB", "RGBX", "RGBA", "CMYK", "L", "LA"):
        return im
    from PIL import ImageCms

    try:
        src = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        if "srgb" in (ImageCms.getProfileDescription(src) or "").lower():
            return im
        out_mode = "RGBA" if im.mode in ("RGBA", "LA") else "RGB"
        base = (im.convert("RGBA") if im.mode == "LA" else im.convert("RGB") if im.mode == "RGBX"
                else im)
        converted = ImageCms.profileToProfile(
            base, src, ImageCms.createProfile("sRGB"), outputMode=out_mode
        )
        flags.append("icc_converted")
        return converted
    except (ImageCms.PyCMSError, OSError, ValueError, TypeError) as exc:
        if not raised_by_pillow(exc):
            raise  # our own bug, not an unusable profile
        flags.append("icc_failed")
        return im


def _to_rgb(im, flags: list[str]):
    """8-bit RGB (or RGBX, the decoder's buffer: the same pixels, as Pillow lays RGB out
    in memory); transparency is composited on white."""
    from PIL import Image

    raise_point("prepare:convert")
    if im.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        import numpy as np

        arr = np.asarray(im, dtype=np.float64)
        if im.mode != "F":
            flags.append("high_bit_depth")
            arr = arr / (65535.0 if arr.max() > 255 else 255.0) * 255.0
        im = Image.fromarray(arr.clip(0, 255).astype("uint8"), mode="L")
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = im.convert("RGBA")
        if rgba.getextrema()[3][0] < 255:  # any pixel not fully opaque
            flags.append("has_alpha")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im if im.mode in ("RGB", "RGBX") else im.convert("RGB")


def _can_pass_through(im, data: bytes, opts: PrepareConfig) -> bool:
    if not (opts.passthrough_jpeg and im.format == "JPEG" and im.mode == "RGB"):
        return False
    if im.info.get("progressive") or im.info.get("progression"):
        return False
    if im.getexif().get(0x0112, 1) != 1 or im.info.get("icc_profile"):
        return False
    if opts.max_side and max(im.size) > opts.max_side:
        return False
    return data[:2] == b"\xff\xd8"


def _quiet_bomb_warnings() -> None:
    """Pillow warns (once per call site) about images above ~89 MP. Our own cap,
    `max_pixels`, is checked from the header before any decode, and Pillow still raises
    its DecompressionBombError above twice its limit; the warning adds nothing. Set
    once per process: `warnings.catch_warnings` is not thread-safe, and images are
    prepared on several threads (:func:`_prepare_batch`)."""
    global _BOMB_WARNINGS_QUIET
    if not _BOMB_WARNINGS_QUIET:
        from PIL import Image

        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
        _BOMB_WARNINGS_QUIET = True


_BOMB_WARNINGS_QUIET = False


def prepare_image(data: bytes | None, opts: PrepareConfig) -> PreparedImage:
    """Decode `data` safely and return the JPEG the curated table stores, with hashes,
    flags and the light-filter verdict; never raises for bad image data. An exception
    that is not Pillow failing on the bytes propagates: it is not the data's fault."""
    from PIL import Image, ImageOps

    _quiet_bomb_warnings()
    if data is None or len(data) == 0:
        return _rejected("empty", "zero-byte or missing image", 0 if data is not None else None)
    nbytes = len(data)
    if nbytes > opts.max_image_bytes:
        return _rejected("too_large_bytes", f"{nbytes} bytes > cap {opts.max_image_bytes}", nbytes)
    flags: list[str] = []
    try:
        im = Image.open(io.BytesIO(data))
        fmt = im.format
        ow, oh = im.size  # from the header: no pixel is decoded yet
        if ow * oh > opts.max_pixels:
            return _rejected(
                "too_many_pixels", f"{ow}x{oh} > cap {opts.max_pixels} px", nbytes,
                original_width=ow, original_height=oh, original_format=fmt,
            )
        if getattr(im, "n_frames", 1) > 1:
            flags.append("multi_frame")
            im.seek(0)
        if _can_pass_through(im, data, opts):
            # Decode at 1/8 scale: checks the whole stream (a truncated file still
            # fails) and gives the hash, without a full-size decode or re-encode.
            im.draft("RGB", (max(1, ow // 8), max(1, oh // 8)))
            im.load()
            flags.append("passthrough")
            return _ok(data, ow, oh, ow, oh, fmt, nbytes, dhash64(im), flags, opts)
        if opts.max_side and fmt == "JPEG" and max(ow, oh) > 2 * opts.max_side:
            # DCT-domain downscale while decoding: far cheaper than a full decode.
            scale = opts.max_side / max(ow, oh)
            im.draft(im.mode, (int(ow * scale) + 1, int(oh * scale) + 1))
            im.load()
        else:
            im = _decoded(im, data)
        orientation = im.getexif().get(0x0112, 1)
        if orientation != 1:
            im = ImageOps.exif_transpose(im)
            flags.append("exif_rotated")
            if orientation in (5, 6, 7, 8):  # transposed: report displayed dimensions
                ow, oh = oh, ow
        rgb = _to_rgb(_to_srgb(im, flags), flags)
        if opts.max_side and max(rgb.size) > opts.max_side:
            scale = opts.max_side / max(rgb.size)
            size = (max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale)))
            rgb = rgb.resize(size, Image.Resampling.LANCZOS)
            flags.append("resized")
        out = io.BytesIO()
        rgb.save(out, format="JPEG", quality=opts.jpeg_quality, subsampling=opts.chroma_subsampling)
        encoded = out.getvalue()
    except Image.DecompressionBombError as exc:
        return _rejected("too_many_pixels", str(exc), nbytes)
    except Image.UnidentifiedImageError:
        return _rejected(
            "undecodable", f"not a recognised image format (starts {data[:8].hex()})", nbytes
        )
    except PILLOW_DATA_ERRORS as exc:
        if not raised_by_pillow(exc):
            raise
        reason = "truncated" if "truncated" in str(exc).lower() else "undecodable"
        return _rejected(reason, f"{type(exc).__name__}: {exc}", nbytes)
    return _ok(encoded, rgb.width, rgb.height, ow, oh, fmt, nbytes, dhash64(rgb), flags, opts)


def _ok(encoded, w, h, ow, oh, fmt, nbytes, dhash, flags, opts) -> PreparedImage:
    keep, why = _filters(w, h, opts)
    return PreparedImage(
        status="ok",
        image=encoded,
        width=w,
        height=h,
        original_width=ow,
        original_height=oh,
        original_format=fmt,
        original_size_bytes=nbytes,
        image_sha256=hashlib.sha256(encoded).hexdigest(),
        dhash=dhash,
        aspect_ratio=round(w / h, 6),
        flags=flags,
        keep=keep,
        filter_reason=why,
    )


def _prepare_one(b, opts: PrepareConfig) -> PreparedImage:
    data = None if b is None else bytes(b)
    try:
        return prepare_image(data, opts)
    except Exception as exc:  # noqa: BLE001 -- counted and budgeted, never "bad data"
        return _internal_error(exc, None if data is None else len(data))


_POOLS: dict[int, object] = {}


def _pool(threads: int):
    """One thread pool per size per Python worker (workers are reused across tasks)."""
    from concurrent.futures import ThreadPoolExecutor

    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="lakeshard-prepare")
    return _POOLS[threads]


_INT_COLUMNS = frozenset(("width", "height", "original_width", "original_height",
                          "original_size_bytes", "dhash"))


def prepare_many(images: Sequence, opts: PrepareConfig) -> list[PreparedImage]:
    """:func:`prepare_image` on each of `images` (bytes, or None), on this worker's
    ``opts.threads`` pool (null: 1); an unexpected exception is that row's
    ``internal_error``."""
    threads = opts.threads or 1
    if threads > 1 and len(images) > 1:
        return list(_pool(threads).map(lambda b: _prepare_one(b, opts), images))
    return [_prepare_one(b, opts) for b in images]


def prepared_columns(rows: Sequence[PreparedImage | None]) -> dict[str, list]:
    """The values of :data:`PREPARED_TYPE`'s fields, field by field, one per result (None
    for a row that was not prepared) -- from the results' attributes, with no per-row
    dict (``dataclasses.asdict`` deep-copies every field of every row)."""
    return {name: [None if r is None else getattr(r, name) for r in rows]
            for name in PREPARED_TYPE.fieldNames()}


def prepared_frame(rows: Sequence[PreparedImage | None]) -> pd.DataFrame:
    """The columns of :data:`PREPARED_TYPE` as a pandas frame (the pandas UDF's
    result), one row per result (all null for None: a row that was not prepared)."""
    columns = {name: pd.array(values, dtype="Int64") if name in _INT_COLUMNS
               else pd.Series(values)
               for name, values in prepared_columns(rows).items()}
    return pd.DataFrame(columns, index=pd.RangeIndex(len(rows)))


def _prepare_batch(images: pd.Series, opts: PrepareConfig) -> pd.DataFrame:
    return prepared_frame(prepare_many(list(images), opts))


def prepare_udf(opts: PrepareConfig):
    """A pandas UDF: binary image column -> struct of :data:`PREPARED_TYPE`."""

    @pandas_udf(nullable_type(PREPARED_TYPE))  # Spark 4.0: udfs/arrow_types.py
    def prepare(images: pd.Series) -> pd.DataFrame:
        return _prepare_batch(images, opts)

    return prepare
