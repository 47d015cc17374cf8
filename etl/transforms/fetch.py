"""Records that reference their image (a URL, a file, a tar member) get its bytes."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from etl.config import FetchConfig
from udfs.fetch import fetch_udf

__all__ = ["fetch_images"]


def fetch_images(df: DataFrame, opts: FetchConfig) -> DataFrame:
    """Fill `image_bytes` from `image_ref` for readable rows that reference their image;
    a failed fetch makes the row `rejected` with the fetch status as reason (`http_404`,
    `timeout`, `too_large`, `dns`, `missing_file`, …) and `fetch_detail` set."""
    need = (F.col("read_status") == "ok") & F.col("image_bytes").isNull() & \
        F.col("image_ref").isNotNull()
    fetched = df.withColumn(
        "_fetch",
        F.when(need, fetch_udf(opts)(F.when(need, F.col("image_ref")), "image_offset",
                                     "image_length")),
    )
    failed = need & (F.col("_fetch.status") != "ok")
    return fetched.withColumns({
        "image_bytes": F.when(need, F.col("_fetch.bytes")).otherwise(F.col("image_bytes")),
        "read_status": F.when(failed, F.lit("rejected")).otherwise(F.col("read_status")),
        "read_reason": F.when(failed, F.col("_fetch.status")).otherwise(F.col("read_reason")),
        "fetch_failed": F.coalesce(failed, F.lit(False)),
        "fetch_detail": F.col("_fetch.detail"),
    }).drop("_fetch")
