"""Per-image feature UDFs (executor side), used by :mod:`etl.lakehouse.features`.

A feature that reads image bytes returns a value *and* a reason: bytes Pillow cannot
read give a null value with why in the reason (``empty``, ``undecodable: …``), kept as
``<feature>_error`` next to the value. An exception that is not Pillow failing on the
bytes is a bug and fails the task, with its traceback, instead of becoming a null.
"""

from __future__ import annotations

import io

import pandas as pd
from pyspark.sql.functions import pandas_udf
from pyspark.sql.types import DoubleType, StringType, StructField, StructType

from udfs.images import PILLOW_DATA_ERRORS, raised_by_pillow

__all__ = ["VALUE_WITH_REASON", "luma_mean", "luma_mean_udf"]

# A feature value, or null and why.
VALUE_WITH_REASON = StructType([
    StructField("value", DoubleType(), True),
    StructField("error", StringType(), True),
])


def luma_mean(data: bytes | None) -> tuple[float | None, str | None]:
    """Mean luma (0-255) of an image from a <=64 px draft decode, or (None, why).

    Curated images are JPEGs, so JPEG draft mode decodes them at 1/8 scale for free."""
    if data is None or len(data) == 0:
        return None, "empty: no image bytes"
    from PIL import Image, ImageStat

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.draft("L", (64, 64))
            gray = img.convert("L")
            gray.thumbnail((64, 64))
            return round(float(ImageStat.Stat(gray).mean[0]), 4), None
    except PILLOW_DATA_ERRORS as exc:
        if not raised_by_pillow(exc):
            raise  # our bug, not unreadable bytes: fail the task
        return None, f"undecodable: {type(exc).__name__}: {exc}"[:500]


@pandas_udf(VALUE_WITH_REASON)
def luma_mean_udf(images: pd.Series) -> pd.DataFrame:
    out = [luma_mean(None if b is None else bytes(b)) for b in images]
    return pd.DataFrame(out, columns=["value", "error"]).astype({"value": "float64"})
