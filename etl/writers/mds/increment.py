"""An incremental export's plan: what changed since the export in place, and what to
write and keep (:func:`plan_increment`).

Every partition of an incremental export keeps its rows' ids and fingerprints
(:data:`PART_IDS`); the next export diffs its rows against them. The diff runs in Spark
(a join with the ids the partitions keep) or, for rows the driver holds, here on Arrow
tables (:func:`plan_increment_local`): the same counts, the same partitions rewritten,
the same decision (:func:`_plan`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl.writers.mds.checksum import PART_IDS
from etl.writers.remote import S3Store, is_remote

__all__ = ["IncrementPlan", "plan_increment", "plan_increment_local", "ids_location",
           "exported_of", "part_members", "plan_changes", "REWRITE_SHARE", "MAX_PARTS_FACTOR"]

# An incremental export rewrites the whole export instead when it would write more than
# this share of its rows, or when it would be made of more than this many times the
# configured number of partitions (every night adds one: the rewrite compacts them).
REWRITE_SHARE = 0.5
MAX_PARTS_FACTOR = 4
_MAX_PART_ID = 99_999  # part-NNNNN


@dataclass
class IncrementPlan:
    """What an incremental export writes and keeps (:func:`plan_increment`)."""

    rows: Any  # the rows to write (a DataFrame, or an Arrow table from the local diff)
    kept: list[dict]  # the `parts` records of partitions kept as they are
    new_parts: int  # partitions to write the rows into
    offset: int  # the first new partition's id
    added: int
    departed: int
    changed: int
    rewritten: list[int]  # ids of partitions that lost or changed a row
    to_write: int
    incremental: bool  # False: a full rewrite is cheaper or due
    reason: str
    planned_from: str = "diff"  # "diff" (every row) or "changes" (:func:`plan_changes`)

    def summary(self) -> dict:
        return {
            "mode": "incremental" if self.incremental else "rewrite", "reason": self.reason,
            "planned_from": self.planned_from,
            "added": self.added, "departed": self.departed, "changed": self.changed,
            "rewritten_parts": self.rewritten, "written_samples":
            self.to_write if self.incremental else None,
            "kept_parts": [p["partition"] for p in self.kept] if self.incremental else [],
        }


def _ids_rel(record: dict) -> str:
    """A partition's :data:`PART_IDS`, relative to the export (``prefix`` on S3, ``dir``
    locally)."""
    return f"{record.get('prefix') or record['dir']}/{PART_IDS}"


def ids_location(out_dir: str, record: dict) -> str:
    """Where a partition's :data:`PART_IDS` is."""
    return f"{out_dir.rstrip('/')}/{_ids_rel(record)}"


def plan_increment(rows: DataFrame, current: dict, out_dir: str, partitions: int
                   ) -> IncrementPlan | None:
    """Diff `rows` (with ``_fp``) against the partitions of the export in place (their
    :data:`PART_IDS`), and decide what to write. None when the export in place keeps
    no ids (written before incremental exports, or with `incremental` off).

    A row that joined the selection goes to a new partition; a partition that lost a
    row (removed, taken down, now a duplicate) or holds a row whose fingerprint changed
    is written again, as a new partition, from the current rows; every other partition
    is kept. MDS shards are immutable and a reader takes the whole shard, so a
    partition is the smallest unit that can be replaced without rewriting others."""
    parts = current.get("parts")
    if not parts:
        return None
    old = _exported_ids(rows.sparkSession, out_dir, parts)
    counts, rewritten = _diff_counts(rows, old)
    plan = _plan(counts, rewritten, current, partitions)
    if plan.incremental and plan.to_write:
        plan.rows = (rows.join(old.select("sample_id", "_part"), "sample_id", "left")
                     .where(F.col("_part").isNull()
                            | F.col("_part").isin(plan.rewritten))
                     .drop("_part"))
    else:
        plan.rows = rows
    return plan


def plan_increment_local(rows: pa.Table, current: dict, out_dir: str, partitions: int
                         ) -> IncrementPlan | None:
    """:func:`plan_increment` for rows the driver holds (an Arrow table with ``_fp``):
    the ids the partitions keep are read here (pyarrow; boto3 on S3), the diff is Arrow
    compute, and the plan's rows are an Arrow table. No Spark job."""
    parts = current.get("parts")
    if not parts:
        return None
    old = _exported_ids_local(out_dir, parts)
    # Spark may hand strings over as large_string (arrow.useLargeVarTypes): compare as str.
    ids = pa.table({"sample_id": rows["sample_id"].cast(pa.string()), "_fp": rows["_fp"]})
    diff = ids.join(old, "sample_id", join_type="full outer")
    fp, old_fp, part = diff["_fp"], diff["_old_fp"], diff["_part"]
    added = pc.is_null(old_fp)
    departed = pc.and_(pc.invert(added), pc.is_null(fp))
    changed = pc.and_kleene(pc.and_(pc.invert(added), pc.invert(departed)),
                            pc.not_equal(fp, old_fp))
    counts = {"added": pc.sum(added).as_py() or 0,
              "departed": pc.sum(departed).as_py() or 0,
              "changed": pc.sum(changed).as_py() or 0}
    lost = pc.or_(departed, changed)
    rewritten = set(pc.unique(pc.filter(part, lost)).to_pylist())
    plan = _plan(counts, rewritten, current, partitions)
    if plan.incremental and plan.to_write:
        part_of = ids.select(["sample_id"]).join(old.select(["sample_id", "_part"]),
                                                 "sample_id", join_type="left outer")
        write_ids = pc.filter(part_of["sample_id"], pc.or_kleene(
            pc.is_null(part_of["_part"]),
            pc.is_in(part_of["_part"], value_set=pa.array(plan.rewritten, pa.int32()))))
        plan.rows = rows.filter(pc.is_in(ids["sample_id"], value_set=write_ids))
    else:
        plan.rows = rows
    return plan


def exported_of(out_dir: str, current: dict, ids: set[str]) -> pa.Table:
    """``sample_id, _old_fp, _part`` of those of `ids` the export in place holds: its
    partitions' :data:`PART_IDS` read on the driver, filtered to `ids` as they are read
    (the id column is scanned, only the matching rows are kept). Nothing is read for
    no ids."""
    old = _exported_ids_local(out_dir, current["parts"], ids) if ids else None
    return old if old is not None else _IDS_SCHEMA.empty_table()


def part_members(out_dir: str, current: dict, parts: list[int]) -> list[str]:
    """Every id partitions `parts` of the export in place hold."""
    records = [p for p in current["parts"] if p["partition"] in set(parts)]
    return _exported_ids_local(out_dir, records)["sample_id"].to_pylist() if records else []


def plan_changes(fingerprints: pa.Table, old: pa.Table, departed: set[str], current: dict,
                 partitions: int) -> IncrementPlan:
    """:func:`plan_increment` from what changed instead of a diff of every row:
    `fingerprints` (``sample_id, _fp``) are the rows that changed and are in the
    selection now, `departed` the ids that left it, `old` what the export in place holds
    of both (:func:`exported_of`). The same counts, partitions and decision as the diff
    of every row would give, as nothing else differs; `rows` is left to the caller."""
    fp = dict(zip(fingerprints["sample_id"].to_pylist(), fingerprints["_fp"].to_pylist(),
                  strict=True))
    held = {i: (f, p) for i, f, p in zip(old["sample_id"].to_pylist(),
                                          old["_old_fp"].to_pylist(),
                                          old["_part"].to_pylist(), strict=True)}
    gone = {i for i in departed if i in held and i not in fp}
    changed = {i for i in fp if i in held and held[i][0] != fp[i]}
    counts = {"added": sum(1 for i in fp if i not in held), "departed": len(gone),
              "changed": len(changed)}
    plan = _plan(counts, {held[i][1] for i in gone | changed}, current, partitions)
    plan.planned_from = "changes"
    return plan


def _plan(counts: dict[str, int], rewritten: set, current: dict, partitions: int
          ) -> IncrementPlan:
    """The plan from the diff's counts and the partitions that lost or changed a row;
    its `rows` are set by the caller."""
    parts = current["parts"]
    by_id = {p["partition"]: p for p in parts}
    unknown = rewritten - set(by_id)
    if unknown or None in rewritten:
        raise RuntimeError(f"export ids name partitions {sorted(unknown, key=str)} "
                           "the manifest lacks")
    kept = [p for p in parts if p["partition"] not in rewritten]
    total = current["samples"] + counts["added"] - counts["departed"]
    to_write = counts["added"] + sum(by_id[i]["samples"] for i in rewritten) - counts["departed"]
    per_part = max(1, -(-max(total, 1) // partitions))
    new_parts = -(-to_write // per_part) if to_write else 0
    offset = max(by_id) + 1
    reason = _rewrite_reason(to_write, total, parts_after=len(kept) + new_parts,
                             next_id=offset + new_parts, partitions=partitions)
    return IncrementPlan(
        rows=None, kept=kept, new_parts=new_parts, offset=offset, added=counts["added"],
        departed=counts["departed"], changed=counts["changed"], rewritten=sorted(rewritten),
        to_write=to_write, incremental=reason == _ONLY_CHANGES, reason=reason,
    )


def _exported_ids(spark: SparkSession, out_dir: str, parts: list[dict]) -> DataFrame:
    """``sample_id, _old_fp, _part``: every row the export in place holds, with its
    fingerprint and partition id (from the path of the partition's :data:`PART_IDS`)."""
    return (
        spark.read.schema("sample_id string, _fp long")
        .parquet(*[ids_location(out_dir, p) for p in parts])
        .select("sample_id", F.col("_fp").alias("_old_fp"),
                F.regexp_extract(F.input_file_name(), r"part-(\d{5})(-t\d+)?/[^/]*$", 1)
                .cast("int").alias("_part"))
    )


_IDS_SCHEMA = pa.schema([("sample_id", pa.string()), ("_old_fp", pa.int64()),
                         ("_part", pa.int32())])


def _exported_ids_local(out_dir: str, parts: list[dict],
                        only: set[str] | None = None) -> pa.Table:
    """:func:`_exported_ids` read on the driver: each partition's :data:`PART_IDS`,
    with the partition id its manifest record names (`only`: just those ids)."""
    import pyarrow.parquet as pq

    store = S3Store(out_dir) if is_remote(out_dir) else None
    wanted = None if only is None else pa.array(sorted(only), pa.string())
    tables = []
    for p in parts:
        if store is not None:
            data = store.get_bytes(_ids_rel(p))
            if data is None:
                raise FileNotFoundError(f"{ids_location(out_dir, p)}: the ids of an "
                                        "exported partition")
            ids = pq.read_table(io.BytesIO(data), columns=["sample_id", "_fp"])
        else:
            ids = pq.read_table(ids_location(out_dir, p), columns=["sample_id", "_fp"])
        sample_ids = ids["sample_id"].cast(pa.string())
        if wanted is not None:
            ids = ids.filter(pc.is_in(sample_ids, value_set=wanted))
            sample_ids = ids["sample_id"].cast(pa.string())
        tables.append(pa.table({
            "sample_id": sample_ids,
            "_old_fp": ids["_fp"].cast(pa.int64()),
            "_part": pa.array([p["partition"]] * ids.num_rows, pa.int32())}))
    return pa.concat_tables(tables) if tables else _IDS_SCHEMA.empty_table()


def _diff_counts(rows: DataFrame, old: DataFrame) -> tuple[dict[str, int], set[int]]:
    """How many rows were added, departed and changed since the export in place
    (:func:`_exported_ids`), and the partitions that lost or changed a row."""
    diff = (
        rows.select("sample_id", "_fp").join(old, "sample_id", "full_outer")
        .select(
            "sample_id", "_part",
            F.when(F.col("_old_fp").isNull(), "added")
            .when(F.col("_fp").isNull(), "departed")
            .when(F.col("_fp") != F.col("_old_fp"), "changed")
            .alias("_change"))
        .where(F.col("_change").isNotNull())
    )
    counts = {"added": 0, "departed": 0, "changed": 0}
    rewritten: set[int] = set()
    for r in diff.groupBy("_change", "_part").count().collect():
        counts[r["_change"]] += r["count"]
        if r["_change"] != "added":
            rewritten.add(r["_part"])
    return counts, rewritten


_ONLY_CHANGES = "only what changed"


def _rewrite_reason(to_write: int, total: int, *, parts_after: int, next_id: int,
                    partitions: int) -> str:
    """Why the whole export is written again instead (:data:`REWRITE_SHARE`,
    :data:`MAX_PARTS_FACTOR`, ids exhausted), or :data:`_ONLY_CHANGES`."""
    if to_write > REWRITE_SHARE * total:
        return f"{to_write} of {total} rows to write (> {REWRITE_SHARE:.0%})"
    if parts_after > MAX_PARTS_FACTOR * partitions:
        return (f"{parts_after} partitions (> {MAX_PARTS_FACTOR} x "
                f"{partitions}): rewritten to compact them")
    if next_id > _MAX_PART_ID:
        return "partition ids exhausted"
    return _ONLY_CHANGES
