"""The bronze layer as DataFrame transforms: what a listing holds that the manifest does
not (new, changed, retried), which copy of a repeated key is kept, and the manifest rows
a run records. The curate job reads and writes; these functions only decide.

A record is *unchanged* when its ``sample_id`` is in the manifest with the same
fingerprint (file size + mtime for folders and tars; null for tables, which are keyed)
and its last outcome was not a transient failure (timeout, connection, DNS, 429, 5xx)
or an internal error (lakeshard's own code failed on it), which the next run
retries. A tar shard whose every manifest record carries the shard's
current fingerprint is not even opened.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from etl.schema import MANIFEST_SCHEMA
from udfs.fetch import TRANSIENT_STATUSES
from udfs.outcomes import INTERNAL_ERROR

__all__ = [
    "unchanged_containers",
    "known_fingerprint",
    "mark_unchanged",
    "mark_duplicate_keys",
    "manifest_rows",
]


def unchanged_containers(listed: Mapping[str, str], known: Sequence[Mapping]
                         ) -> tuple[frozenset[str], int]:
    """Containers (tar shards) a run can skip whole, and the records they hold.

    `listed`: container URI -> its fingerprint now. `known`: the manifest's
    ``(source_uri, fingerprint, count)`` groups for the source. A container is skipped
    only if every manifest record of it has the current fingerprint."""
    same = [k for k in known if listed.get(k["source_uri"]) == k["fingerprint"]]
    stale = {k["source_uri"] for k in known if listed.get(k["source_uri"]) != k["fingerprint"]}
    skip = frozenset(k["source_uri"] for k in same) - stale
    return skip, sum(k["count"] for k in same if k["source_uri"] in skip)


def _is_retry(manifest_status: Column, reason: Column) -> Column:
    retried = reason.isin(*TRANSIENT_STATUSES, INTERNAL_ERROR)
    return (manifest_status == "rejected") & retried | reason.startswith("http_5")


def known_fingerprint() -> Column:
    """A manifest row's fingerprint as the skip decision sees it: null for a record the
    next run retries, so a container (tar shard) holding one is opened again."""
    return (F.when(_is_retry(F.col("status"), F.col("reason")), F.lit(None))
            .otherwise(F.col("fingerprint")).alias("fingerprint"))


def mark_unchanged(listed: DataFrame, manifest: DataFrame | None) -> DataFrame:
    """Add ``occurrence`` (1 = the copy kept of a repeated key; readable copies first)
    and ``unchanged`` (already in the manifest, same fingerprint, not to be retried)."""
    order = Window.partitionBy("sample_id").orderBy(
        (F.col("read_status") != "ok"), "source_uri", "image_ref", "image_offset",
        "fingerprint",
    )
    out = listed.withColumn("occurrence", F.row_number().over(order))
    if manifest is None:
        return out.withColumn("unchanged", F.lit(False))
    known = manifest.select(
        "sample_id",
        F.col("fingerprint").alias("_known_fp"),
        F.lit(True).alias("_known"),
        _is_retry(F.col("status"), F.col("reason")).alias("_retry"),
    )
    unchanged = (
        F.coalesce(F.col("_known"), F.lit(False))
        & F.col("fingerprint").eqNullSafe(F.col("_known_fp"))
        & ~F.coalesce(F.col("_retry"), F.lit(False))
    )
    return (
        out.join(known, "sample_id", "left")
        .withColumn("unchanged", unchanged)
        .drop("_known_fp", "_known", "_retry")
    )


def mark_duplicate_keys(df: DataFrame) -> DataFrame:
    """Every readable copy of a key but the first is rejected as ``duplicate_key``."""
    dup = (F.col("occurrence") > 1) & (F.col("read_status") == "ok")
    return df.withColumns({
        "read_status": F.when(dup, F.lit("rejected")).otherwise(F.col("read_status")),
        "read_reason": F.when(dup, F.lit("duplicate_key")).otherwise(F.col("read_reason")),
    })


def manifest_rows(prepared: DataFrame, *, run_id: str, ingested_at: datetime) -> DataFrame:
    """The manifest's row for each record processed now (the first copy of a key):
    accepted, or rejected with the stage and reason."""
    ok = F.col("status") == "ok"
    return (
        prepared.where(F.col("occurrence") == 1)
        .withColumns({
            "status": F.when(ok, F.lit("accepted")).otherwise(F.lit("rejected")),
            "stage": F.when(~ok, F.col("stage")),
            "reason": F.when(~ok, F.coalesce("reason", F.lit("unknown"))),
            "run_id": F.lit(run_id),
            "ingested_at": F.lit(ingested_at),
        })
        .select(*MANIFEST_SCHEMA.fieldNames())
    )
