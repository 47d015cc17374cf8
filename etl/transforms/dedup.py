"""Duplicate clusters: exact (same ``image_sha256``) and near (64-bit dHashes at most
``threshold`` bits apart), annotated on every row, nothing deleted.

The steps, each a DataFrame -> DataFrame function (no I/O; the job reads and writes):

1. :func:`hash_pairs` -- near-duplicate search without an all-pairs join. Every
   distinct hash is cut into ``bands`` blocks; each combination of ``bands - threshold``
   blocks is one LSH key (the hash with the other blocks masked out). Two hashes at most
   ``threshold`` bits apart differ in at most ``threshold`` blocks, so they agree on at
   least one key (pigeonhole): recall is exact, and every candidate pair is verified by
   its true Hamming distance (``bit_count(a ^ b)``), so precision is exact too. With
   ``bands = threshold + 1`` this is classic banding. Only buckets that hold a *new*
   hash are expanded, and only pairs with a new side are kept: a nightly run compares
   new rows with everything, never old rows with old rows again.
2. :func:`connected_components` -- min-label propagation with pointer jumping, in Spark.
3. :func:`plan_dedup` -- the rules of :mod:`etl.transforms.dedup_rules` in Spark, one
   step per rule: which rows are new (R1), the near pairs (R2), the graph of new rows,
   known clusters and hashes and its components (R3), the rows to reassign (R4), the
   canonical member, cluster id and kind of each (R5-R7), and only the rows whose
   assignment changed (R8), plus the ids that left the table.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from etl.config import DedupConfig
from etl.transforms.dedup_rules import (
    ASSIGNMENT_COLUMNS,
    COMPARED,
    HASH,
    KNOWN_CLUSTER,
    NEW_ROW,
    ROW_COLUMNS,
    lsh_masks,
    order_terms,
)

__all__ = [
    "ROW_COLUMNS",
    "ASSIGNMENT_COLUMNS",
    "lsh_masks",
    "hash_pairs",
    "connected_components",
    "canonical_order",
    "DedupPlan",
    "plan_dedup",
]

log = logging.getLogger(__name__)


def hash_pairs(hashes: DataFrame, threshold: int, bands: int, *, all_new: bool) -> DataFrame:
    """Verified near pairs among distinct hashes.

    `hashes` has one row per distinct ``dhash`` and a boolean ``is_new``. Returns
    ``(a, b, distance)`` with ``a < b``, ``0 < distance <= threshold`` and at least one
    of them new. `all_new` (a first or full run) skips restricting buckets to new keys.
    """
    masks = lsh_masks(threshold, bands)
    keyed = hashes.select(
        "dhash",
        "is_new",
        F.posexplode(
            F.array(*[F.col("dhash").bitwiseAND(F.lit(m).cast("long")) for m in masks])
        ).alias("key_id", "key"),
    )
    if not all_new:
        new_keys = keyed.where("is_new").select("key_id", "key").distinct()
        keyed = keyed.join(new_keys, ["key_id", "key"], "left_semi")
    buckets = (
        keyed.groupBy("key_id", "key")
        .agg(F.array_sort(F.collect_list(F.struct("dhash", "is_new"))).alias("m"))
        .where(F.size("m") > 1)
    )
    # Every pair (m[i], m[j]), i < j, of a bucket sorted by hash.
    pairs = buckets.select(
        F.explode(
            F.expr(
                "flatten(transform(sequence(0, size(m) - 2), i -> "
                "transform(slice(m, i + 2, size(m) - i - 1), "
                "y -> named_struct('x', m[i], 'y', y))))"
            )
        ).alias("p")
    )
    distance = F.bit_count(F.col("p.x.dhash").bitwiseXOR(F.col("p.y.dhash")))
    return (
        pairs.where(F.col("p.x.is_new") | F.col("p.y.is_new"))
        .select(
            F.col("p.x.dhash").alias("a"),
            F.col("p.y.dhash").alias("b"),
            distance.cast("int").alias("distance"),
        )
        .where(F.col("distance") <= threshold)
        .distinct()
    )


def connected_components(edges: DataFrame, max_iterations: int) -> tuple[DataFrame, int]:
    """``(node, label)`` for every node of the undirected graph `edges` (``src``, ``dst``):
    label = the smallest node of its component. Min-label propagation plus pointer
    jumping (a node also takes its label's label), so chains collapse in about
    log2(length) rounds. Each round is checkpointed; stops when no label changes."""
    both = (
        edges.select("src", "dst")
        .unionByName(edges.select(F.col("dst").alias("src"), F.col("src").alias("dst")))
        .where(F.col("src") != F.col("dst"))
        .distinct()
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    labels = (
        both.groupBy(F.col("src").alias("node"))
        .agg(F.least(F.min("dst"), F.first("src")).alias("label"))
        .localCheckpoint(eager=True)
    )
    rounds = 0
    while True:
        rounds += 1
        if rounds > max_iterations:
            both.unpersist()
            raise RuntimeError(
                f"connected components did not converge in {max_iterations} rounds "
                "(dedup.max_iterations)"
            )
        offered = (
            both.join(labels.withColumnsRenamed({"node": "dst", "label": "offer"}), "dst")
            .groupBy(F.col("src").alias("node"))
            .agg(F.min("offer").alias("offer"))
        )
        step = labels.join(offered, "node").select(
            "node", F.least("label", "offer").alias("label")
        )
        jumped = (
            step.alias("s")
            .join(step.alias("t"), F.col("s.label") == F.col("t.node"))
            .select(F.col("s.node"), F.least("s.label", "t.label").alias("label"))
            .localCheckpoint(eager=True)
        )
        changed = (
            jumped.join(labels.withColumnRenamed("label", "old"), "node")
            .where(F.col("label") != F.col("old"))
            .count()
        )
        labels = jumped
        if changed == 0:
            break
    both.unpersist()
    return labels, rounds


def canonical_order(policy: tuple[str, ...], source_priority: tuple[str, ...]) -> list[Column]:
    """R5's sort order inside a cluster, as Spark columns; the first row is canonical."""
    order: list[Column] = []
    for term in order_terms(policy, source_priority):
        if term.kind == "product":
            a, b = term.columns
            order.append((F.col(a).cast("long") * F.col(b)).desc())
        elif term.kind == "rank":
            rank = F.lit(len(term.ranking))
            for i, name in reversed(list(enumerate(term.ranking))):
                rank = F.when(F.col(term.columns[0]) == name, F.lit(i)).otherwise(rank)
            order.append(rank.asc())
        else:
            order.append(F.col(term.columns[0]).asc())
    return order


@dataclass
class DedupPlan:
    """What a dedup run changes. `changes` and `removed` are checkpointed DataFrames."""

    changes: DataFrame  # ASSIGNMENT_COLUMNS: rows that are new or whose assignment changed
    removed: DataFrame  # sample_id: rows dedup knew that the curated table no longer has
    new_rows: int
    pairs: int
    rounds: int


def _node(prefix: str, col: str) -> Column:
    return F.concat(F.lit(prefix), F.col(col).cast("string"))


_MARKED = (*ROW_COLUMNS, "_new", "_old_cid")


def _mark_new(current: DataFrame, prior: DataFrame | None, *, full: bool) -> DataFrame:
    """R1: the curated rows with ``_new`` and, for known rows, ``_old_cid``."""
    cur = current.select(*ROW_COLUMNS)
    if prior is None or full:
        return cur.withColumns({"_new": F.lit(True), "_old_cid": F.lit(None).cast("string")})
    p = prior.select(
        "sample_id",
        F.col("image_sha256").alias("_p_sha"),
        F.col("dhash").alias("_p_dhash"),
        F.col("dup_cluster_id").alias("_p_cid"),
    )
    same = (F.col("_p_sha") == F.col("image_sha256")) & (F.col("_p_dhash") == F.col("dhash"))
    return (
        cur.join(p, "sample_id", "left")
        .withColumn("_new", ~F.coalesce(same, F.lit(False)))
        .withColumn("_old_cid", F.when(~F.col("_new"), F.col("_p_cid")))
        .select(*_MARKED)
    )


def _near_pairs(rows: DataFrame, cfg: DedupConfig, *, all_new: bool
                ) -> tuple[DataFrame, DataFrame]:
    """R2: the verified near pairs ``(a, b, distance)`` (checkpointed) and the hashes
    that matter to R3: a side of a pair, or a new row's hash that other rows share."""
    hashes = rows.groupBy("dhash").agg(
        F.count(F.lit(1)).alias("n"), F.max("_new").alias("is_new")
    ).persist(StorageLevel.MEMORY_AND_DISK)
    pairs = hash_pairs(hashes.select("dhash", "is_new"), cfg.threshold, cfg.bands,
                       all_new=all_new).localCheckpoint(eager=True)
    relevant = (
        pairs.select(F.col("a").alias("dhash"))
        .union(pairs.select(F.col("b").alias("dhash")))
        .union(hashes.where("is_new AND n > 1").select("dhash"))
        .distinct()
    )
    hashes.unpersist()
    return pairs, relevant


def _components(rows: DataFrame, pairs: DataFrame, relevant: DataFrame,
                max_iterations: int) -> tuple[DataFrame, int]:
    """R3: ``(node, label)`` of the graph's nodes, and the rounds it took."""
    row_node = F.when(F.col("_new"), _node(NEW_ROW, "sample_id")).otherwise(
        _node(KNOWN_CLUSTER, "_old_cid"))
    edges = (
        rows.join(relevant, "dhash", "left_semi")
        .select(row_node.alias("src"), _node(HASH, "dhash").alias("dst"))
        .union(pairs.select(_node(HASH, "a").alias("src"), _node(HASH, "b").alias("dst")))
        .distinct()
    )
    return connected_components(edges, max_iterations)


def _members(rows: DataFrame, labels: DataFrame, prior: DataFrame | None, *,
             full: bool) -> DataFrame:
    """R4: the rows to reassign, each with its component ``_comp`` (checkpointed)."""
    label = labels.select(F.col("node").alias("_n"), F.col("label").alias("_comp"))
    new, kept = rows.where("_new"), rows.where(~F.col("_new"))
    in_graph_new = new.join(label, _node(NEW_ROW, "sample_id") == F.col("_n"), "left").select(
        *_MARKED, F.coalesce("_comp", _node(NEW_ROW, "sample_id")).alias("_comp"))
    touched_kept = kept.join(label, _node(KNOWN_CLUSTER, "_old_cid") == F.col("_n")).select(
        *_MARKED, "_comp")
    members = in_graph_new.unionByName(touched_kept)
    if prior is not None and not full:
        # Clusters that lost members (rows gone from the table, or whose image changed)
        # are re-evaluated as they stand.
        departed = prior.select("sample_id", "dup_cluster_id").join(
            kept.select("sample_id"), "sample_id", "left_anti")
        shrunk = departed.select(F.col("dup_cluster_id").alias("_old_cid")).distinct()
        members = members.unionByName(
            kept.join(shrunk, "_old_cid", "left_semi")
            .join(touched_kept.select("sample_id"), "sample_id", "left_anti")
            .select(*_MARKED, _node(KNOWN_CLUSTER, "_old_cid").alias("_comp")))
    return members.localCheckpoint(eager=True)


def _cluster_ids(members: DataFrame, canon: DataFrame, kept: DataFrame) -> DataFrame:
    """R6: ``(_comp, _canon_sha, dup_cluster_id)`` of every component."""
    old_ids = (
        members.where(F.col("_old_cid").isNotNull())
        .groupBy("_comp", "_old_cid")
        .agg(F.count(F.lit(1)).alias("_n"))
        .groupBy("_comp")
        .agg(F.min(F.struct((-F.col("_n")).alias("k"), F.col("_old_cid").alias("id")))["id"]
             .alias("_kept_id"))
    )
    member_ids = members.groupBy("_comp").agg(
        F.sort_array(F.collect_list("sample_id")).alias("_ids"))
    ids_in_use = kept.select(F.col("_old_cid").alias("_canon_id")).distinct().withColumn(
        "_in_use", F.lit(True))
    named_by_members = F.substring(F.sha2(F.concat_ws(",", "_ids"), 256), 1, 32)
    return (
        canon.join(old_ids, "_comp", "left")
        .join(member_ids, "_comp")
        .join(ids_in_use, "_canon_id", "left")
        .select("_comp", "_canon_sha", F.coalesce(
            "_kept_id", F.when(F.col("_in_use"), named_by_members).otherwise(
                F.col("_canon_id"))).alias("dup_cluster_id"))
    )


def _assign(members: DataFrame, kept: DataFrame, cfg: DedupConfig, run_id: str) -> DataFrame:
    """R5-R7: every member's assignment (ASSIGNMENT_COLUMNS)."""
    by_comp = Window.partitionBy("_comp")
    ranked = members.withColumn(
        "_rank",
        F.row_number().over(by_comp.orderBy(*canonical_order(cfg.policy, cfg.source_priority))),
    ).withColumn("cluster_size", F.count(F.lit(1)).over(by_comp))
    canon = ranked.where("_rank = 1").select(
        "_comp", F.col("sample_id").alias("_canon_id"),
        F.col("image_sha256").alias("_canon_sha"))
    kind = (F.when(F.col("cluster_size") == 1, "unique")
            .when(F.col("_rank") == 1, "canonical")
            .when(F.col("image_sha256") == F.col("_canon_sha"), "exact")
            .otherwise("near"))
    return ranked.join(_cluster_ids(members, canon, kept), "_comp").select(
        "sample_id", "source", "image_sha256", "dhash", "dup_cluster_id",
        (F.col("_rank") == 1).alias("is_canonical"), kind.alias("dup_kind"),
        F.col("cluster_size").cast("long"), F.lit(run_id).alias("run_id"),
    )


def _changed(assigned: DataFrame, prior: DataFrame | None) -> DataFrame:
    """R8: the assignments that differ from the previous ones (all on a first run)."""
    if prior is None:
        return assigned.select(*ASSIGNMENT_COLUMNS)
    old = prior.select("sample_id", *[F.col(c).alias(f"_p_{c}") for c in COMPARED])
    differs = F.lit(False)
    for c in COMPARED:
        differs = differs | ~F.col(c).eqNullSafe(F.col(f"_p_{c}"))
    return assigned.join(old, "sample_id", "left").where(differs).select(*ASSIGNMENT_COLUMNS)


def plan_dedup(
    current: DataFrame,
    prior: DataFrame | None,
    cfg: DedupConfig,
    run_id: str,
    *,
    full: bool = False,
) -> DedupPlan:
    """Cluster assignments for the curated rows `current` (ROW_COLUMNS), given the
    previous assignments `prior` (ASSIGNMENT_COLUMNS; None on a first run), by the rules
    of :mod:`etl.transforms.dedup_rules`.

    Incremental (default): rows whose id, image hash and dHash are already in `prior`
    keep their cluster; each such cluster is one node of the graph, so old pairs are
    never searched again. `full`: every row is treated as new (a changed threshold or
    band count); `prior` then only decides which rows changed.
    """
    rows = _mark_new(current, prior, full=full).localCheckpoint(eager=True)
    new_rows = rows.where("_new").count()
    pairs, relevant = _near_pairs(rows, cfg, all_new=prior is None or full)
    n_pairs = pairs.count()
    labels, rounds = _components(rows, pairs, relevant, cfg.max_iterations)
    members = _members(rows, labels, prior, full=full)
    assigned = _assign(members, rows.where(~F.col("_new")), cfg, run_id)
    changes = _changed(assigned, prior).localCheckpoint(eager=True)
    if prior is None:
        removed = changes.sparkSession.createDataFrame([], "sample_id string")
    else:
        removed = prior.select("sample_id").join(current.select("sample_id"), "sample_id",
                                                 "left_anti")
    removed = removed.localCheckpoint(eager=True)
    pairs.unpersist()
    return DedupPlan(changes, removed, new_rows, n_pairs, rounds)
