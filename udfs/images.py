"""Image preparation: robust decode, orientation, RGB, JPEG re-encode.

:func:`prepare_image` is plain Python on one image and never raises for bad data: a
corrupt, empty, oversized or bomb-sized input returns a result with ``status`` set to
``"rejected"`` and a ``reason`` from :data:`REJECT_REASONS`. :func:`prepare_udf` wraps
it as a vectorised pandas UDF over Arrow batches.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import asdict, dataclass

import pandas as pd
from pyspark.sql import types as T
from pyspark.sql.functions import pandas_udf

__all__ = [
    "PREPARED_TYPE",
    "REJECT_REASONS",
    "PreparedImage",
    "prepare_image",
    "prepare_udf",
]

REJECT_REASONS = ("empty", "too_large_bytes", "too_many_pixels", "truncated", "undecodable")

PREPARED_TYPE = T.StructType(
    [
        T.StructField("image", T.BinaryType(), True),
        T.StructField("width", T.IntegerType(), True),
        T.StructField("height", T.IntegerType(), True),
        T.StructField("original_width", T.IntegerType(), True),
        T.StructField("original_height", T.IntegerType(), True),
        T.StructField("original_format", T.StringType(), True),
        T.StructField("original_bytes", T.LongType(), True),
        T.StructField("status", T.StringType(), False),
        T.StructField("reason", T.StringType(), True),
        T.StructField("detail", T.StringType(), True),
    ]
)


@dataclass(frozen=True)
class PreparedImage:
    image: bytes | None
    width: int | None
    height: int | None
    original_width: int | None
    original_height: int | None
    original_format: str | None
    original_bytes: int | None
    status: str
    reason: str | None = None
    detail: str | None = None


def _rejected(reason: str, detail: str, nbytes: int | None, **kw) -> PreparedImage:
    base = dict(
        image=None, width=None, height=None, original_width=None, original_height=None,
        original_format=None,
    )
    base.update(kw)
    return PreparedImage(
        **base, original_bytes=nbytes, status="rejected", reason=reason, detail=detail[:500]
    )


def prepare_image(
    data: bytes | None, *, quality: int = 92, max_bytes: int, max_pixels: int
) -> PreparedImage:
    """Decode `data`, apply EXIF orientation, flatten to 8-bit RGB, encode as JPEG."""
    from PIL import Image, ImageOps

    if data is None or len(data) == 0:
        return _rejected("empty", "zero-byte or missing image", 0 if data is not None else None)
    nbytes = len(data)
    if nbytes > max_bytes:
        return _rejected("too_large_bytes", f"{nbytes} bytes > cap {max_bytes}", nbytes)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            fmt = im.format
            w, h = im.size  # from the header: nothing decoded yet
            if w * h > max_pixels:
                return _rejected(
                    "too_many_pixels", f"{w}x{h} > cap {max_pixels} px", nbytes,
                    original_width=w, original_height=h, original_format=fmt,
                )
            im.seek(0)
            im.load()
            im = ImageOps.exif_transpose(im)
            rgb = _to_rgb(im)
            out = io.BytesIO()
            rgb.save(out, format="JPEG", quality=quality)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        return _rejected("too_many_pixels", str(exc), nbytes)
    except Image.UnidentifiedImageError:
        return _rejected(
            "undecodable", f"not a recognised image format (starts {data[:8].hex()})", nbytes
        )
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        reason = "truncated" if "truncated" in str(exc).lower() else "undecodable"
        return _rejected(reason, f"{type(exc).__name__}: {exc}", nbytes)
    return PreparedImage(
        image=out.getvalue(),
        width=rgb.width,
        height=rgb.height,
        original_width=w,
        original_height=h,
        original_format=fmt,
        original_bytes=nbytes,
        status="ok",
    )


def _to_rgb(im):
    """8-bit RGB; transparency is composited on white."""
    from PIL import Image

    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        import numpy as np

        arr = np.asarray(im, dtype=np.uint32)
        im = Image.fromarray((arr >> 8).clip(0, 255).astype("uint8"), mode="L")
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA"):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


def prepare_udf(*, quality: int, max_bytes: int, max_pixels: int):
    """A pandas UDF: binary image column -> struct of :data:`PREPARED_TYPE`."""

    @pandas_udf(PREPARED_TYPE)
    def prepare(images: pd.Series) -> pd.DataFrame:
        rows = [
            asdict(
                prepare_image(
                    None if b is None else bytes(b),
                    quality=quality, max_bytes=max_bytes, max_pixels=max_pixels,
                )
            )
            for b in images
        ]
        frame = pd.DataFrame(rows, columns=PREPARED_TYPE.fieldNames())
        for col in ("width", "height", "original_width", "original_height", "original_bytes"):
            frame[col] = frame[col].astype("Int64")
        return frame

    return prepare
