"""The rows a nightly dedup increment touches, found from Lance's fragment metadata and
a filtered read of the dedup table, for the driver's plan
(:func:`etl.transforms.dedup_local.plan_local`).

Three steps, each a function:

1. :func:`fragment_changes` -- what changed in the curated table since the version dedup
   covers: fragments appended (read alone), deletion files that grew, fragments a purge
   or compaction rewrote (their rows before, against the fragments that replaced them:
   moved rows are not new);
2. :func:`stored_rows` -- the dedup table's rows the plan needs: stored hashes sharing an
   LSH key with a new hash, the previous rows of changed and deleted ids, rows whose
   cluster is named after one of those ids, then every member of their clusters (a
   filtered scan of narrow columns against broadcast keys, no shuffle of the table);
3. :func:`curated_rows` -- those stored rows' ordering columns from the curated table
   (pylance in the driver up to a row bound, else one Spark job).

:func:`touched_rows` chains them, or answers None (plan over the whole table in Spark)
when the increment is larger than the bound it is given, or the dedup table does not
describe the version it says it covers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl.config import DedupConfig
from etl.transforms.dedup import ASSIGNMENT_COLUMNS, ROW_COLUMNS, lsh_masks
from etl.writers.lance import lance_reader

__all__ = [
    "deleted_rows",
    "row_layout",
    "same_rows",
    "FragmentChanges",
    "fragment_changes",
    "stored_rows",
    "curated_rows",
    "TouchedRows",
    "touched_rows",
]

log = logging.getLogger(__name__)

_IDENTITY = ("sample_id", "image_sha256", "dhash")


def deleted_rows(fragment) -> int:
    """Rows a Lance fragment's deletion file marks deleted (0 without one)."""
    d = fragment.metadata.deletion_file
    return d.num_deleted_rows if d is not None else 0


def row_layout(ds) -> set[tuple[int, int, int]]:
    """Which rows a Lance version holds, as its fragments' (id, physical rows, deleted
    rows): appends and deletes change it, new or rewritten columns do not."""
    return {(f.fragment_id, f.metadata.physical_rows, deleted_rows(f))
            for f in ds.get_fragments()}


def same_rows(path: str, covered: int, version: int) -> bool:
    """Whether two versions of the Lance table at `path` hold the same rows (only
    columns were added or rewritten in between), from the fragments' metadata; False
    when the older version was cleaned up."""
    import lance

    try:
        return row_layout(lance.dataset(path, version=covered)) == row_layout(
            lance.dataset(path, version=version))
    except (ValueError, OSError):
        return False


@dataclass(frozen=True)
class FragmentChanges:
    """The curated rows that changed between two versions."""

    dataset: object  # the Lance dataset at the newer version
    added: list[dict]  # ROW_COLUMNS of rows new to dedup (new ids, or a changed image)
    deleted: set[str]  # ids gone from the table


def fragment_changes(path: str, covered: int, version: int,
                     limit: int) -> FragmentChanges | None:
    """What changed from curated version `covered` to `version`, from the fragments;
    None when the fragments touched hold more than `limit` rows or the covered version
    was cleaned up."""
    import lance

    try:
        old = {f.fragment_id: f for f in lance.dataset(path, version=covered).get_fragments()}
    except (ValueError, OSError):
        return None
    now = lance.dataset(path, version=version)
    new = {f.fragment_id: f for f in now.get_fragments()}
    if any(i in new and old[i].metadata.physical_rows != new[i].metadata.physical_rows
           for i in old):
        return None  # a fragment changed its rows in place: not something Lance does
    gone = [i for i in old if i not in new]  # rewritten (purged, compacted) or dropped
    appended = [i for i in new if i not in old]  # appended, or the rewrites' output
    shrunk = [i for i in old if i in new and deleted_rows(new[i]) != deleted_rows(old[i])]
    touched = (sum(old[i].count_rows() for i in gone)
               + sum(new[i].count_rows() for i in appended)
               + sum(deleted_rows(new[i]) - deleted_rows(old[i]) for i in shrunk))
    if touched > limit:
        return None
    # Rows that left their fragment (deleted, or moved by a rewrite), as they were...
    left: dict[str, tuple] = {}
    for i in gone:
        left.update(_identities(old[i].to_table(columns=list(_IDENTITY)).to_pylist()))
    for i in shrunk:
        still = set(new[i].to_table(columns=["sample_id"]).column(0).to_pylist())
        left.update(_identities(r for r in old[i].to_table(columns=list(_IDENTITY))
                                .to_pylist() if r["sample_id"] not in still))
    # ...and rows in new fragments: new, changed, or moved unchanged (not new to dedup).
    arrived = [r for i in appended
               for r in new[i].to_table(columns=list(ROW_COLUMNS)).to_pylist()]
    added = [r for r in arrived if left.get(r["sample_id"]) != (r["image_sha256"], r["dhash"])]
    return FragmentChanges(now, added, set(left) - {r["sample_id"] for r in arrived})


def _identities(rows: Iterable[dict]) -> dict[str, tuple]:
    return {r["sample_id"]: (r["image_sha256"], r["dhash"]) for r in rows}


def _semi(table: DataFrame, spark: SparkSession, column: str, values: list) -> DataFrame:
    wanted = spark.createDataFrame([(v,) for v in values], f"{column} string")
    return table.join(F.broadcast(wanted), column, "left_semi")


def stored_rows(spark: SparkSession, table, cfg: DedupConfig,
                added: list[dict], ids: set[str]) -> dict[str, dict]:
    """The assignments (by id) a plan of `added` rows and changed or deleted `ids`
    needs from the dedup `table` (ASSIGNMENT_COLUMNS): near neighbours of the new
    hashes (an LSH key in common), the previous rows of `ids`, rows whose cluster is
    named after one of them; then every member of their clusters. `table`: the table
    in Spark, or read on the driver as an Arrow table (:func:`_stored_local`, no Spark
    job)."""
    masks = lsh_masks(cfg.threshold, cfg.bands)
    keys = sorted({(k, r["dhash"] & m) for r in added if r["dhash"] is not None
                   for k, m in enumerate(masks)})
    if not isinstance(table, DataFrame):  # read on the driver
        return _stored_local(table, masks, set(keys), ids)
    found = table.limit(0)
    if keys:
        keyed = table.select(
            "*", F.posexplode(F.array(*[F.col("dhash").bitwiseAND(F.lit(m).cast("long"))
                                        for m in masks])).alias("_key_id", "_key"))
        wanted = spark.createDataFrame(keys, "_key_id int, _key long")
        found = keyed.join(F.broadcast(wanted), ["_key_id", "_key"], "left_semi").select(
            *ASSIGNMENT_COLUMNS)
    if ids:
        found = found.unionByName(_semi(table, spark, "sample_id", sorted(ids)))
        found = found.unionByName(table.join(
            F.broadcast(spark.createDataFrame([(i,) for i in sorted(ids)],
                                              "dup_cluster_id string")),
            "dup_cluster_id", "left_semi"))
    first = found.dropDuplicates(["sample_id"]).collect()
    prior = {r["sample_id"]: r.asDict() for r in first}
    clusters = sorted({r["dup_cluster_id"] for r in first})
    if clusters:
        for r in _semi(table, spark, "dup_cluster_id", clusters).collect():
            prior.setdefault(r["sample_id"], r.asDict())
    return prior


def _signed(v: int) -> int:
    """A 64-bit pattern as the signed long Delta stores it."""
    return (v + 2**63) % 2**64 - 2**63


def _stored_local(table, masks: list[int], keys: set[tuple[int, int]],
                  ids: set[str]) -> dict[str, dict]:
    """:func:`stored_rows` over the table read on the driver (an Arrow table), in
    vectorised compute: the same three matches (an LSH key of a new hash, an id, a
    cluster named after an id), then their clusters' members."""
    import pyarrow as pa
    import pyarrow.compute as pc

    wanted = pa.array(sorted(ids), pa.string())
    hit = pc.or_(pc.is_in(table["sample_id"], wanted), pc.is_in(table["dup_cluster_id"], wanted))
    for k, m in enumerate(masks):
        band = pa.array(sorted({_signed(key) for kk, key in keys if kk == k}), pa.int64())
        if len(band):
            hit = pc.or_(hit, pc.is_in(pc.bit_wise_and(table["dhash"], pa.scalar(
                _signed(m), pa.int64())), band))
    first = table.filter(hit)
    clusters = pc.unique(first["dup_cluster_id"])
    members = table.filter(pc.and_(pc.is_in(table["dup_cluster_id"], clusters),
                                   pc.invert(hit)))
    return {r["sample_id"]: r for r in first.to_pylist() + members.to_pylist()}


def curated_rows(spark: SparkSession, path: str, now, version: int, ids: list[str],
                 scan_rows: int) -> list[dict]:
    """ROW_COLUMNS of the curated rows `ids` at `version` (`now`: that Lance dataset):
    read by pylance in this process while the table holds at most `scan_rows` rows (the
    narrow columns, filtered by id: no Spark job), else by one Spark job."""
    import pyarrow as pa

    if not ids:
        return []
    columns = list(ROW_COLUMNS)
    schema = pa.schema([now.schema.field(c) for c in columns])
    if now.count_rows() <= scan_rows:
        import pyarrow.compute as pc

        return now.to_table(columns=columns, filter=pc.field("sample_id").isin(ids)) \
            .cast(schema).to_pylist()
    rows = (lance_reader(spark).option("version", str(version))
            .option("columns", ",".join(columns)).load(path))
    return _semi(rows, spark, "sample_id", ids).select(*columns).toArrow().cast(schema) \
        .to_pylist()


@dataclass(frozen=True)
class TouchedRows:
    """What the driver's plan takes: every row it could reassign or needs to see."""

    current: list[dict]  # ROW_COLUMNS: the new rows and the stored rows still there
    prior: dict[str, dict]  # ASSIGNMENT_COLUMNS by id: the stored rows involved


def touched_rows(spark: SparkSession, path: str, table, cfg: DedupConfig, *,
                 covered: int, version: int, limit: int,
                 scan_rows: int) -> TouchedRows | None:
    """The rows an increment from curated version `covered` to `version` touches, or
    None when they are more than `limit` (fragments touched) or 4x `limit` (stored rows
    involved), or the dedup `table` names rows the curated table lacks that no delete
    removed (it does not describe the version it says it covers)."""
    changes = fragment_changes(path, covered, version, limit)
    if changes is None:
        return None
    added_ids = {r["sample_id"] for r in changes.added}
    prior = stored_rows(spark, table, cfg, changes.added, added_ids | changes.deleted)
    if len(prior) > 4 * limit:
        return None
    stored = sorted(set(prior) - changes.deleted - added_ids)
    current = changes.added + curated_rows(spark, path, changes.dataset, version, stored,
                                           scan_rows)
    if len(current) != len(changes.added) + len(stored):
        log.info("dedup: the stored rows do not match curated version %d: planning in Spark",
                 covered)
        return None
    return TouchedRows(current, prior)
