"""The bronze layer as DataFrame transforms: what a listing holds that the manifest does
not (new, changed, retried), which copy of a repeated key is kept, which records left
their source, which records a takedown names, and the manifest rows a run records. The
curate and forget jobs read and write; these functions only decide.

A record is *unchanged* when its ``sample_id`` is in the manifest with the same
fingerprint (file size + mtime for folders and tars; null for tables, which are keyed)
and its last outcome was not a transient failure (timeout, connection, DNS, 429, 5xx)
or an internal error (lakeshard's own code failed on it), which the next run
retries. A tar shard whose every manifest record carries the shard's
current fingerprint is not even opened; nor is a table file whose size and mtime are
those curate remembered beside the manifest (:mod:`etl.lakehouse.curate_state`). A
record *removed* from its source is new again if it comes back; a record taken down
stays known (and refused if it changes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import partial

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from etl.runtime.local import per_batch, projected
from etl.schema import MANIFEST_SCHEMA, REMOVED
from udfs.fetch import TRANSIENT_STATUSES
from udfs.outcomes import INTERNAL_ERROR

__all__ = [
    "CONTAINER_FAILURES",
    "RETRIED_REASONS",
    "TAKEN_DOWN",
    "unchanged_containers",
    "retried",
    "is_retry",
    "retry_column",
    "known_fingerprint",
    "mark_unchanged",
    "mark_duplicate_keys",
    "manifest_rows",
    "live",
    "removed_records",
    "takedown_identifiers",
    "taken_down_ids",
    "taken_down_records",
    "refuse_taken_down",
    "refuse_prepared",
    "match_takedowns",
    "matched_identifiers",
]

# Read failures of a whole file or shard (or part of one): its records were not listed,
# which says nothing about whether they are still there.
CONTAINER_FAILURES = ("unreadable_file", "unreadable_row_group", "broken_tar")
# The reason of a record refused, or removed, because of a takedown.
TAKEN_DOWN = "taken_down"


def live(manifest: DataFrame) -> DataFrame:
    """Manifest rows of records still there (accepted or rejected, not removed)."""
    return manifest.where(F.col("status") != REMOVED)


def _source_removed() -> Column:
    return (F.col("status") == REMOVED) & (F.col("reason") == "source_removed")


def unchanged_containers(listed: Mapping[str, str], known: Sequence[Mapping]
                         ) -> tuple[frozenset[str], int]:
    """Containers (tar shards) a run can skip whole, and the records they hold.

    `listed`: container URI -> its fingerprint now. `known`: the manifest's
    ``(source_uri, fingerprint, count)`` groups for the source (records removed from
    their source left out). A container is skipped only if every manifest record of
    it has the current fingerprint."""
    same = [k for k in known if listed.get(k["source_uri"]) == k["fingerprint"]]
    stale = {k["source_uri"] for k in known if listed.get(k["source_uri"]) != k["fingerprint"]}
    skip = frozenset(k["source_uri"] for k in same) - stale
    return skip, sum(k["count"] for k in same if k["source_uri"] in skip)


RETRIED_REASONS = (*TRANSIENT_STATUSES, INTERNAL_ERROR)  # rejects the next run tries again


def _is_retry(manifest_status: Column, reason: Column) -> Column:
    retried = reason.isin(*RETRIED_REASONS)
    return (manifest_status == "rejected") & retried | reason.startswith("http_5")


def retry_column() -> Column:
    """A manifest row's record is retried by the next run (:func:`_is_retry`)."""
    return _is_retry(F.col("status"), F.col("reason"))


def is_retry(status: str | None, reason: str | None) -> bool:
    """:func:`_is_retry` for one manifest row on the driver: its record is retried."""
    return (status == "rejected" and reason in RETRIED_REASONS) or \
        (reason is not None and reason.startswith("http_5"))


def retried(reason: str | None) -> bool:
    """Whether a record that failed for `reason` is tried again by the next run (the
    rule of :func:`_is_retry`, for a reason collected on the driver)."""
    return reason is not None and (reason in RETRIED_REASONS or reason.startswith("http_5"))


def known_fingerprint() -> Column:
    """A manifest row's fingerprint as the skip decision sees it: null for a record the
    next run retries, so a container (tar shard) holding one is opened again."""
    return (F.when(_is_retry(F.col("status"), F.col("reason")), F.lit(None))
            .otherwise(F.col("fingerprint")).alias("fingerprint"))


def mark_unchanged(listed: DataFrame, manifest: DataFrame | None) -> DataFrame:
    """Add ``occurrence`` (1 = the copy kept of a repeated key; readable copies first)
    and ``unchanged`` (already in the manifest, same fingerprint, not to be retried).
    A record that had left its source and is listed again is new."""
    order = Window.partitionBy("sample_id").orderBy(
        (F.col("read_status") != "ok"), "source_uri", "image_ref", "image_offset",
        "fingerprint",
    )
    out = listed.withColumn("occurrence", F.row_number().over(order))
    if manifest is None:
        return out.withColumn("unchanged", F.lit(False))
    known = manifest.where(~_source_removed()).select(
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


def manifest_rows(prepared: DataFrame | pa.Table, *, run_id: str, ingested_at: datetime
                  ) -> DataFrame | pa.Table:
    """The manifest's row for each record processed now (the first copy of a key):
    accepted, or rejected with the stage and reason. One rule (:func:`_manifest_batch`),
    run on prepared rows this process holds (an Arrow table, as ``toArrow`` gives them)
    or in Spark's tasks (:func:`~etl.runtime.local.per_batch`)."""
    # As Spark stores F.lit(ingested_at): a naive datetime is this process's local time.
    rule = partial(_manifest_batch, run_id=run_id,
                   at=T.TimestampType().toInternal(ingested_at))
    return per_batch(prepared, rule, MANIFEST_SCHEMA,
                     [*MANIFEST_SCHEMA.fieldNames(), "occurrence"])


def _manifest_batch(prepared: pa.Table, *, run_id: str, at: int) -> pa.Table:
    """:func:`manifest_rows` of one Arrow batch; `at`: the run's timestamp, in
    microseconds since the epoch."""
    first = prepared.filter(pc.equal(prepared.column("occurrence"), 1))
    n = first.num_rows
    ok = pc.equal(first.column("status"), "ok")
    rejected = pc.invert(ok)  # null where the status is: no stage, no reason (as Spark)
    none = pa.scalar(None, pa.string())
    computed = {
        "status": pc.if_else(pc.fill_null(ok, False), "accepted", "rejected"),
        "stage": pc.if_else(rejected, first.column("stage"), none),
        "reason": pc.if_else(rejected, pc.coalesce(first.column("reason"), "unknown"), none),
        "run_id": pa.array([run_id] * n, pa.string()),
        "ingested_at": pa.array([at] * n, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        "removed_at": pa.nulls(n, pa.timestamp("us", tz="UTC")),
    }
    if "original_sha256" not in first.column_names:
        computed["original_sha256"] = pa.nulls(n, pa.string())
    return projected(first, MANIFEST_SCHEMA, computed)


def removed_records(manifest: DataFrame, listed: DataFrame, *, sources: Sequence[str],
                    skipped: Mapping[str, frozenset[str]] | None = None,
                    candidates: DataFrame | None = None) -> DataFrame:
    """Records of `sources` that the manifest holds (accepted or rejected) and the
    listing no longer has: ``sample_id, source, status`` (the status they had).

    `skipped`: per source, containers not opened this run (their records are still
    there). `candidates`: ``sample_id`` s a source's change history says were deleted;
    when given, only they are checked (against the listing, so a key deleted and
    written again, or still held by another copy, stays)."""
    rows = live(manifest).where(F.col("source").isin(*sources) if sources else F.lit(False))
    pairs = [(s, uri) for s, uris in sorted((skipped or {}).items()) if s in sources
             for uri in sorted(uris)]
    if pairs:
        kept = manifest.sparkSession.createDataFrame(pairs, "source string, source_uri string")
        rows = rows.join(F.broadcast(kept), ["source", "source_uri"], "left_anti")
    if candidates is not None:
        rows = rows.join(candidates.select("sample_id").distinct(), "sample_id", "left_semi")
    still = listed.select("sample_id").distinct()
    return rows.join(still, "sample_id", "left_anti").select("sample_id", "source", "status")


# --------------------------------------------------------------------------- takedowns


def takedown_identifiers(takedowns: DataFrame) -> DataFrame:
    """Everything a takedown table refuses, as ``kind, value, request_id`` with kind one
    of ``sample_id``, ``url``, ``image_sha256`` (a key is its sample id; every matched
    record's id counts), one row per (kind, value)."""
    named = takedowns.where(F.col("kind") != "key").select("kind", "value", "request_id")
    ids = takedowns.where(F.col("sample_id").isNotNull()).select(
        F.lit("sample_id").alias("kind"), F.col("sample_id").alias("value"), "request_id"
    )
    return (
        named.unionByName(ids)
        .groupBy("kind", "value")
        .agg(F.min("request_id").alias("request_id"))
    )


def taken_down_ids(takedowns: DataFrame) -> DataFrame:
    """``sample_id`` of every record the takedown rows name, once each."""
    return (takedown_identifiers(takedowns).where(F.col("kind") == "sample_id")
            .select(F.col("value").alias("sample_id")))


def taken_down_records(manifest: DataFrame, takedowns: DataFrame) -> DataFrame:
    """Manifest records the takedown rows name that are not yet removed as taken down,
    as the rows :func:`etl.lakehouse.maintenance.remove_records` takes: ``sample_id,
    source, status, reason``."""
    named = manifest.join(taken_down_ids(takedowns), "sample_id", "left_semi").where(
        (F.col("status") != REMOVED) | (F.col("reason") != TAKEN_DOWN))
    return named.select("sample_id", "source", "status", F.lit(TAKEN_DOWN).alias("reason"))


def _original_sha256(manifest: DataFrame) -> Column:
    """The source bytes' hash (null in a manifest written before lakeshard kept it)."""
    if "original_sha256" in manifest.columns:
        return F.col("original_sha256")
    return F.lit(None).cast("string").alias("original_sha256")


def _addressed_url() -> Column:
    """A record's own image URI (a URL, a file): its image_ref unless the image is a
    byte range of a container (a tar member), which a URL cannot name alone."""
    return F.when(F.col("image_offset").isNull(), F.col("image_ref"))



def _refusal(df: DataFrame, identifiers: DataFrame, checks: Mapping[str, Column]
             ) -> DataFrame:
    """`df` with ``_td``: "request R: kind" of the first takedown a row matches."""
    out = df.withColumn("_td", F.lit(None).cast("string"))
    for kind, column in checks.items():
        ids = (
            identifiers.where(F.col("kind") == kind)
            .select(F.col("value").alias("_tv"), F.col("request_id").alias("_tr"))
        )
        out = (
            out.withColumn("_tk", column)
            .join(F.broadcast(ids), F.col("_tk") == F.col("_tv"), "left")
            .withColumn("_td", F.coalesce("_td", F.when(
                F.col("_tr").isNotNull(),
                F.format_string("takedown %s: same %s", "_tr", F.lit(kind.replace("_", " "))),
            )))
            .drop("_tk", "_tv", "_tr")
        )
    return out


def refuse_taken_down(df: DataFrame, identifiers: DataFrame, *, by_hash: bool = False
                      ) -> DataFrame:
    """Readable rows a takedown names become ``rejected`` / ``taken_down`` (``read_status``,
    ``read_reason``; ``takedown_detail`` says which request and how).

    Before fetching: by ``sample_id`` (the key) and by the image's own URL, so nothing
    taken down is fetched again. With `by_hash`, after fetching: by the sha256 of the
    source's bytes (``original_sha256``) -- the same file under another name or URL.
    Curate fetches and prepares in one step, so such a row was prepared too: no longer
    readable, it ends at stage ingest and its ``prepared`` struct is dropped
    (:func:`etl.transforms.prepare.prepared_outcomes`), as if it had never been."""
    checks = ({"image_sha256": F.col("original_sha256")} if by_hash else
              {"sample_id": F.col("sample_id"), "url": _addressed_url()})
    marked = _refusal(df, identifiers, checks)
    hit = F.col("_td").isNotNull() & (F.col("read_status") == "ok")
    detail = F.col("takedown_detail") if "takedown_detail" in df.columns else F.lit(None)
    return marked.withColumns({
        "read_status": F.when(hit, F.lit("rejected")).otherwise(F.col("read_status")),
        "read_reason": F.when(hit, F.lit(TAKEN_DOWN)).otherwise(F.col("read_reason")),
        "takedown_detail": F.when(hit, F.col("_td")).otherwise(detail).cast("string"),
    }).drop("_td")


def refuse_prepared(prepared: DataFrame, identifiers: DataFrame) -> DataFrame:
    """Prepared rows whose stored JPEG's ``image_sha256`` a takedown names become
    rejected (stage ``prepare``, reason ``taken_down``): the same picture re-encoded."""
    marked = _refusal(prepared, identifiers, {"image_sha256": F.col("prepared.image_sha256")})
    hit = F.col("_td").isNotNull() & (F.col("status") == "ok")
    return marked.withColumns({
        "status": F.when(hit, F.lit("rejected")).otherwise(F.col("status")),
        "stage": F.when(hit, F.lit("prepare")).otherwise(F.col("stage")),
        "reason": F.when(hit, F.lit(TAKEN_DOWN)).otherwise(F.col("reason")),
        "detail": F.when(hit, F.col("_td")).otherwise(F.col("detail")),
    }).drop("_td")


def match_takedowns(given: DataFrame, manifest: DataFrame | None,
                    curated: DataFrame | None) -> DataFrame:
    """The records a request's identifiers name: ``request_id, sample_id, source``.

    `given`: ``request_id, kind, value`` (kind ``sample_id``, ``url`` or
    ``image_sha256``). A sample id matches the manifest and the curated table; a URL the
    image's own URI in the manifest; an image hash the source bytes' hash in the
    manifest and the stored JPEG's hash in the curated table. Every manifest status
    counts: a record already removed from its source is still named (and cleared)."""
    spark = given.sparkSession
    out = spark.createDataFrame([], "request_id string, sample_id string, source string")

    def of(kind: str) -> DataFrame:
        return given.where(F.col("kind") == kind).select("request_id", "value")

    if manifest is not None:
        m = manifest.select("sample_id", "source", _addressed_url().alias("_url"),
                            _original_sha256(manifest))
        for kind, col in (("sample_id", "sample_id"), ("url", "_url"),
                          ("image_sha256", "original_sha256")):
            hits = m.join(F.broadcast(of(kind)), F.col(col) == F.col("value"))
            out = out.unionByName(hits.select("request_id", "sample_id", "source"))
    if curated is not None:
        c = curated.select("sample_id", "source", "image_sha256")
        for kind, col in (("sample_id", "sample_id"), ("image_sha256", "image_sha256")):
            hits = c.join(F.broadcast(of(kind)), F.col(col) == F.col("value"))
            out = out.unionByName(hits.select("request_id", "sample_id", "source"))
    return out.distinct()


def matched_identifiers(matches: DataFrame, manifest: DataFrame | None,
                        curated: DataFrame | None) -> DataFrame:
    """Every identifier of each matched record (``request_id, kind, value, sample_id,
    source``): its sample id, its own URL, the hash of its source bytes and of its stored
    JPEG -- what later runs refuse, so a copy under another name stays out."""
    rec = matches.select("request_id", "sample_id", "source")
    out = rec.select("request_id", F.lit("sample_id").alias("kind"),
                     F.col("sample_id").alias("value"), "sample_id", "source")
    if manifest is not None:
        m = manifest.select("sample_id", _addressed_url().alias("_url"),
                            _original_sha256(manifest))
        joined = rec.join(m, "sample_id")
        for kind, col in (("url", "_url"), ("image_sha256", "original_sha256")):
            out = out.unionByName(joined.where(F.col(col).isNotNull()).select(
                "request_id", F.lit(kind).alias("kind"), F.col(col).alias("value"),
                "sample_id", "source"))
    if curated is not None:
        joined = rec.join(curated.select("sample_id", "image_sha256"), "sample_id")
        out = out.unionByName(joined.select(
            "request_id", F.lit("image_sha256").alias("kind"),
            F.col("image_sha256").alias("value"), "sample_id", "source"))
    return out.distinct()
