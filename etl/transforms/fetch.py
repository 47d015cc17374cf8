"""Records that reference their image (a URL, a file, a tar member) get its bytes."""

from __future__ import annotations

from collections.abc import Iterable

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from etl.config import FetchConfig, SourceConfig
from udfs.fetch import fetch_udf, rules_for

__all__ = ["fetch_images", "needs_fetch", "fetch_outcome"]


def needs_fetch() -> Column:
    """A readable row that references its image and does not carry its bytes."""
    return (F.col("read_status") == "ok") & F.col("image_bytes").isNull() & \
        F.col("image_ref").isNotNull()


def fetch_outcome(need: Column, status: Column, detail: Column) -> dict[str, Column]:
    """What a fetch's `status` and `detail` make of a row that `need` ed it: a failed
    fetch is ``rejected`` with the status as reason, ``fetch_failed`` and
    ``fetch_detail`` set."""
    failed = need & (status != "ok")
    return {
        "read_status": F.when(failed, F.lit("rejected")).otherwise(F.col("read_status")),
        "read_reason": F.when(failed, status).otherwise(F.col("read_reason")),
        "fetch_failed": F.coalesce(failed, F.lit(False)),
        "fetch_detail": F.when(need, detail),
    }


def fetch_images(df: DataFrame, opts: FetchConfig, sources: Iterable[SourceConfig]
                 ) -> DataFrame:
    """Fill `image_bytes` from `image_ref` for readable rows that reference their image,
    each under the rules of its `source` (one of `sources`: what its URLs may name,
    opt-out, rate). A failed fetch makes the row `rejected` with the fetch status as
    reason (`http_404`, `timeout`, `blocked_address`, `bad_scheme`, `opted_out`, ...)
    and `fetch_detail` set. (Curate fetches and prepares in one step instead:
    :func:`etl.transforms.prepare.fetch_and_prepare`.)"""
    rules = {s.name: rules_for(s) for s in sources}
    need = needs_fetch()
    fetched = df.withColumn(
        "_fetch",
        F.when(need, fetch_udf(opts, rules)(
            "source", F.when(need, F.col("image_ref")), "image_offset", "image_length")),
    )
    return fetched.withColumns({
        "image_bytes": F.when(need, F.col("_fetch.bytes")).otherwise(F.col("image_bytes")),
        **fetch_outcome(need, F.col("_fetch.status"), F.col("_fetch.detail")),
    }).drop("_fetch")
