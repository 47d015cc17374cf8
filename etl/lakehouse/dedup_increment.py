"""The rows a nightly dedup increment touches, found from Lance's fragment metadata and
a filtered read of the dedup table, for the driver's plan
(:func:`etl.transforms.dedup_local.plan_local`).

Three steps, each a function:

1. :func:`fragment_changes` -- what changed in the curated table since the version dedup
   covers: fragments appended (read alone), deletion files that grew, fragments a purge
   or compaction rewrote (their rows before, against the fragments that replaced them:
   moved rows are not new);
2. :func:`stored_lookup` -- the dedup table's rows the plan needs: stored hashes within
   ``threshold`` bits of a new hash (found through an LSH key in common, then measured),
   the previous rows of changed and deleted ids, rows whose cluster is named after one of
   those ids, then every member of their clusters. The new rows' keys and ids are pushed
   into the table's read (a pyarrow dataset filter over delta-rs's files in the driver;
   broadcast keys in Spark), so the rows read follow the new rows' keys: a stored hash
   that only shares a key (one in ~2^21 per key with the default 4/6, i.e. a number that
   grows with the table) is dropped before the curated table is asked for its
   ordering columns or the plan sees it;
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
from typing import TYPE_CHECKING

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl.config import DedupConfig
from etl.transforms.dedup import ASSIGNMENT_COLUMNS, ROW_COLUMNS, lsh_masks
from etl.writers.lance import lance_reader

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "scan_rows",
    "deleted_rows",
    "row_layout",
    "same_rows",
    "FragmentChanges",
    "fragment_changes",
    "StoredRows",
    "stored_lookup",
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


@dataclass(frozen=True)
class StoredRows:
    """What :func:`stored_lookup` found in the dedup table."""

    rows: dict[str, dict]  # ASSIGNMENT_COLUMNS by id: the stored rows the plan needs
    read: int  # stored rows the lookup took out of the table (Spark: those sharing a
    # key, before the distance check; the driver: those within it)


def _key_buckets(added: list[dict], cfg: DedupConfig) -> dict[tuple[int, int], list[int]]:
    """(band, key) -> the new hashes with that LSH key: what a stored hash must share
    to be a candidate, and whom it is then measured against."""
    buckets: dict[tuple[int, int], list[int]] = {}
    for k, m in enumerate(lsh_masks(cfg.threshold, cfg.bands)):
        for r in added:
            if r["dhash"] is not None:
                buckets.setdefault((k, r["dhash"] & m), []).append(r["dhash"])
    return buckets


def stored_lookup(spark: SparkSession, table, cfg: DedupConfig,
                  added: list[dict], ids: set[str]) -> StoredRows:
    """The assignments (by id) a plan of `added` rows and changed or deleted `ids`
    needs from the dedup `table` (ASSIGNMENT_COLUMNS): near neighbours of the new
    hashes (an LSH key in common, then within ``threshold`` bits of one), the previous
    rows of `ids`, rows whose cluster is named after one of them; then every member of
    their clusters. The table is read through filters on those keys and ids, so what it
    hands over follows the new rows, not the stored ones. `table`: the table in Spark,
    or a pyarrow dataset (or Arrow table) the driver scans (:func:`_stored_local`, no
    Spark job)."""
    masks, threshold = lsh_masks(cfg.threshold, cfg.bands), cfg.threshold
    if not isinstance(table, DataFrame):  # scanned by the driver
        return _stored_local(table, masks, added, ids, threshold)
    buckets = _key_buckets(added, cfg)
    found = table.limit(0).select(*ASSIGNMENT_COLUMNS, F.lit(True).alias("_near"))
    if buckets:
        keyed = table.select(
            "*", F.posexplode(F.array(*[F.col("dhash").bitwiseAND(F.lit(m).cast("long"))
                                        for m in masks])).alias("_key_id", "_key"))
        wanted = spark.createDataFrame([(k, key, h) for (k, key), hs in sorted(buckets.items())
                                        for h in hs], "_key_id int, _key long, _new long")
        distance = F.bit_count(F.col("dhash").bitwiseXOR(F.col("_new")))
        found = keyed.join(F.broadcast(wanted), ["_key_id", "_key"]).select(
            *ASSIGNMENT_COLUMNS, (distance <= threshold).alias("_near"))
    if ids:
        named = F.broadcast(spark.createDataFrame([(i,) for i in sorted(ids)], "_id string"))
        found = found.unionByName(
            table.join(named, (F.col("sample_id") == F.col("_id"))
                       | (F.col("dup_cluster_id") == F.col("_id")), "left_semi")
            .select(*ASSIGNMENT_COLUMNS, F.lit(True).alias("_near")))
    candidates = found.groupBy(*ASSIGNMENT_COLUMNS).agg(F.max("_near").alias("_near")).collect()
    first = [r for r in candidates if r["_near"]]
    prior = {r["sample_id"]: {c: r[c] for c in ASSIGNMENT_COLUMNS} for r in first}
    clusters = sorted({r["dup_cluster_id"] for r in first
                       if r["cluster_size"] > 1 or r["sample_id"] in ids})
    members = _semi(table, spark, "dup_cluster_id", clusters).collect() if clusters else []
    for r in members:
        prior.setdefault(r["sample_id"], r.asDict())
    return StoredRows(prior, len(candidates) + len(members))


def stored_rows(spark: SparkSession, table, cfg: DedupConfig,
                added: list[dict], ids: set[str]) -> dict[str, dict]:
    """:func:`stored_lookup`'s rows."""
    return stored_lookup(spark, table, cfg, added, ids).rows


def scan_rows(table, columns: list[str], keep) -> list[dict]:
    """The rows of `table` (a pyarrow dataset or Arrow table) for which `keep(batch)` (a
    boolean mask) holds, batch by batch: only those rows are materialised."""
    out: list[dict] = []
    for batch in _batches(table, columns):
        out.extend(batch.filter(keep(batch)).to_pylist())
    return out


def _batches(table, columns: list[str]):
    """`table`'s `columns` (a pyarrow dataset or Arrow table), batch by batch, string
    views as plain strings."""
    import pyarrow as pa

    batches = (table.select(columns).to_batches() if isinstance(table, pa.Table)
               else table.to_batches(columns=columns))
    for batch in batches:
        if batch.num_rows:
            yield _plain(batch)


def _plain(batch):
    """`batch` with string views (delta-rs's datasets hand them out) as plain strings,
    which the ids and keys compared with them are."""
    import pyarrow as pa

    if not any(pa.types.is_string_view(t) or pa.types.is_large_string(t)
               for t in batch.schema.types):
        return batch
    return pa.RecordBatch.from_arrays(
        [c.cast(pa.string()) if pa.types.is_string_view(c.type)
         or pa.types.is_large_string(c.type) else c for c in batch.columns],
        names=batch.schema.names)


# Pairs (stored hash, new hash) measured at once: a batch whose rows share keys with
# many new hashes (blank or placeholder images, one hash each) is measured in slices.
_PAIRS = 1 << 20


def _bit_count(x: np.ndarray) -> np.ndarray:
    """Set bits of each uint64 of `x` (numpy 2's ``bitwise_count``; on an older numpy,
    a runtime's own, by byte)."""
    import numpy as np

    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x)
    byte_bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(axis=1)
    return byte_bits[x.view(np.uint8).reshape(-1, 8)].sum(axis=1)


class _NearHashes:
    """The new hashes (each once), per LSH mask grouped by their key under it, to tell
    which stored hashes lie within ``threshold`` bits of one of them (R2), batch by
    batch: a stored hash's keys are looked up in a hash set of the new keys (Arrow's
    ``index_in``), and only a hash sharing one, not yet found near, is measured (numpy,
    at most :data:`_PAIRS` pairs at a time), against the new hashes with that key.
    Every pair within the threshold shares a key: exact recall and precision."""

    def __init__(self, added: list[dict], masks: list[int], threshold: int):
        import numpy as np
        import pyarrow as pa

        hashes = np.unique(np.array([r["dhash"] for r in added if r["dhash"] is not None],
                                    np.int64))
        self.threshold = threshold
        self.bands = []
        for m in masks:
            keys = hashes & np.int64(m)
            order = np.argsort(keys, kind="stable")
            unique, starts, counts = np.unique(keys[order], return_index=True,
                                               return_counts=True)
            self.bands.append((np.int64(m), pa.array(unique, pa.int64()), starts, counts,
                               hashes[order]))

    def near(self, dhash) -> np.ndarray:
        """Which of `dhash` (an Arrow int64 array; nulls are near nothing) lie within
        the threshold of a new hash."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        valid = pc.is_valid(dhash).to_numpy(zero_copy_only=False)
        values = pc.fill_null(dhash, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        out = np.zeros(len(values), bool)
        for mask, unique, starts, counts, hashes in self.bands:
            if not len(unique):
                continue
            found = pc.index_in(pa.array(values & mask, pa.int64()), value_set=unique)
            shares = pc.is_valid(found)
            rows = np.flatnonzero(shares.to_numpy(zero_copy_only=False))
            at = found.filter(shares).to_numpy().astype(np.int64)
            todo = ~out[rows]  # a row found near already needs no other measure
            rows, at = rows[todo], at[todo]
            step = max(1, _PAIRS // int(counts.max()))  # rows whose pairs fit
            for lo in range(0, len(rows), step):
                self._measure(values, rows[lo:lo + step], at[lo:lo + step], starts, counts,
                              hashes, out)
        return out & valid

    def _measure(self, values, rows, at, starts, counts, hashes, out) -> None:
        """Mark in `out` the `rows` within the threshold of a new hash with their key
        (`at`: its place among the band's keys)."""
        import numpy as np

        if not len(rows):
            return
        per = counts[at]
        row = np.repeat(rows, per)
        first = np.repeat(starts[at] - (np.cumsum(per) - per), per)
        other = hashes[first + np.arange(len(row))]
        bits = _bit_count((values[row] ^ other).view(np.uint64))
        out[row[bits <= self.threshold]] = True


def _stored_local(table, masks: list[int], added: list[dict], ids: set[str],
                  threshold: int) -> StoredRows:
    """:func:`stored_lookup` on the driver, over the table's files (a pyarrow dataset,
    e.g. delta-rs's; or an Arrow table) read batch by batch: the rows within the
    threshold of a new hash (:class:`_NearHashes`), with an id, or in a cluster named
    after an id are kept, and then the members of their clusters of two or more are
    taken from the rows of clusters of two or more that the same pass kept (one read of
    the table). Only the matching rows become Python rows."""
    import pyarrow as pa
    import pyarrow.compute as pc

    wanted = pa.array(sorted(ids), pa.string())
    hashes = _NearHashes(added, masks, threshold)
    columns = list(ASSIGNMENT_COLUMNS)
    first: list[dict] = []
    clustered: list[pa.RecordBatch] = []  # rows of clusters of two or more
    for batch in _batches(table, columns):
        hit = pc.or_(pc.or_(pc.is_in(batch["sample_id"], wanted),
                            pc.is_in(batch["dup_cluster_id"], wanted)),
                     pa.array(hashes.near(batch["dhash"]), pa.bool_()))
        first.extend(batch.filter(hit).to_pylist())
        clustered.append(batch.filter(pc.greater(batch["cluster_size"], 1)))
    prior = {r["sample_id"]: r for r in first}
    # A cluster of one is its row alone (in `first` already when an id names it): the
    # members of larger clusters are among the rows kept above.
    clusters = pa.array(sorted({r["dup_cluster_id"] for r in first
                                if r["cluster_size"] > 1 or r["sample_id"] in ids}),
                        pa.string())
    members = []
    if len(clusters) and clustered:
        kept = pa.Table.from_batches(clustered)
        members = kept.filter(pc.is_in(kept["dup_cluster_id"], clusters)).to_pylist()
    for r in members:
        prior.setdefault(r["sample_id"], r)
    return StoredRows(prior, len(first) + len(members))


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
    stored_read: int = 0  # rows the filtered reads took out of the dedup table


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
    stored = stored_lookup(spark, table, cfg, changes.added, added_ids | changes.deleted)
    prior = stored.rows
    if len(prior) > 4 * limit:
        return None
    kept = sorted(set(prior) - changes.deleted - added_ids)
    current = changes.added + curated_rows(spark, path, changes.dataset, version, kept,
                                           scan_rows)
    if len(current) != len(changes.added) + len(kept):
        log.info("dedup: the stored rows do not match curated version %d: planning in Spark",
                 covered)
        return None
    return TouchedRows(current, prior, stored.read)
