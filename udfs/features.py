"""Per-image feature UDFs (executor side), used by :mod:`etl.lakehouse.features`."""

from __future__ import annotations

import io

import pandas as pd
from pyspark.sql.functions import pandas_udf
from pyspark.sql.types import DoubleType

__all__ = ["luma_mean", "luma_mean_udf"]


def luma_mean(data: bytes | None) -> float | None:
    """Mean luma (0-255) of an image, from a <=64 px draft decode; None if unreadable.

    Curated images are JPEGs, so JPEG draft mode decodes them at 1/8 scale for free."""
    if not data:
        return None
    from PIL import Image, ImageStat

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.draft("L", (64, 64))
            gray = img.convert("L")
            gray.thumbnail((64, 64))
            return round(float(ImageStat.Stat(gray).mean[0]), 4)
    except Exception:  # noqa: BLE001 -- one unreadable image is a null, not a failed task
        return None


@pandas_udf(DoubleType())
def luma_mean_udf(images: pd.Series) -> pd.Series:
    return images.map(luma_mean).astype("float64")
