"""Dedup's rule set: what makes rows duplicates, which row of a cluster is canonical,
how a cluster is named, and how a change to the curated table invalidates clusters.

Two planners implement these rules and must give the same table on the same data:
:func:`etl.transforms.dedup.plan_dedup` (Spark, over the whole table: first, full and
large runs) and :func:`etl.transforms.dedup_local.plan_local` (the driver, over the rows
a nightly increment touches). A third answer comes from metadata alone
(:class:`etl.lakehouse.dedup_table.DedupTable`): when the curated rows are those the
table covers and its settings are the recorded ones, the table is already what either
planner would write. ``tests/test_dedup_local.py`` checks each pair on the same data.
The constants and helpers below are the parts of the rules both planners share.

**R1 -- known and new rows.** A curated row is *known* when the previous assignments
hold its ``sample_id`` with the same ``image_sha256`` and ``dhash`` (a null never
matches); it keeps its cluster (``_old_cid``). Every other row is *new*: a new id, or a
known id whose image changed (it leaves its old cluster). A full run (no previous
assignments, or settings other than the recorded ones) treats every row as new.

**R2 -- duplicate pairs.** Rows with the same ``dhash`` are duplicates (the same bytes
give the same dHash: exact copies are among them). Two distinct dHashes are a *near
pair* when ``bit_count(a ^ b) <= threshold``, with at least one of them the hash of a new
row. Candidates come from :func:`lsh_masks` (every pair within the threshold shares a
key: exact recall) and each is verified by its true distance (exact precision).

**R3 -- the graph.** Nodes: each new row (``s:<sample_id>``), each known cluster touched
(``c:<cluster id>``: its members move together, old pairs are never searched again), and
each hash that matters (``h:<dhash>``: a side of a near pair, or a new row's hash that
another row shares). Edges: row or cluster -- its hash, for hashes that matter; hash --
hash, for near pairs. Clusters are the connected components.

**R4 -- what is reassigned.** New rows; known rows whose cluster is in the graph; known
rows of a cluster that lost a member (a row gone from the table, or whose image changed),
which is re-evaluated as it stands (size, canonical member, kinds) and not split even if
the row that left bridged it. Ids the previous assignments hold and the table does not
are *removed*.

**R5 -- the canonical member**: the first row of the cluster in :func:`order_terms`
order: ``dedup.policy`` criteria in turn (``resolution``: original pixels, then stored
pixels, most first, unknown last; ``source_priority``: the listed order, unlisted
sources after; ``earliest``: ``ingested_at``, unknown first), then ``sample_id``.

**R6 -- the cluster id.** A cluster holding known rows keeps the id most of them carry
(ties: the smallest id). A cluster of new rows only is named after its canonical
member's ``sample_id`` -- unless that id still names another cluster (the row left it
when its image changed): then :func:`members_name` of its members.

**R7 -- the kind** of a row: ``unique`` (cluster of one), ``canonical`` (the first),
``exact`` (same ``image_sha256`` as the canonical member), else ``near``.

**R8 -- what is written.** A reassigned row is written when any of :data:`COMPARED`
differs from its previous assignment (or it had none); every written row carries the
run's ``run_id``.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ROW_COLUMNS",
    "ASSIGNMENT_COLUMNS",
    "COMPARED",
    "lsh_masks",
    "OrderTerm",
    "order_terms",
    "members_name",
    "NEW_ROW",
    "KNOWN_CLUSTER",
    "HASH",
]

# The curated columns dedup reads (no image bytes).
ROW_COLUMNS = (
    "sample_id", "source", "image_sha256", "dhash", "width", "height",
    "original_width", "original_height", "ingested_at",
)
# What dedup records per row (etl.schema.DEDUP_SCHEMA, in order).
ASSIGNMENT_COLUMNS = (
    "sample_id", "source", "image_sha256", "dhash", "dup_cluster_id", "is_canonical",
    "dup_kind", "cluster_size", "run_id",
)
# R8: a reassigned row is written when one of these differs from its previous row.
COMPARED = ("image_sha256", "dhash", "dup_cluster_id", "is_canonical", "dup_kind",
            "cluster_size")
# R3: the prefixes of the graph's nodes.
NEW_ROW, KNOWN_CLUSTER, HASH = "s:", "c:", "h:"


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= (1 << 63) else value


def lsh_masks(threshold: int, bands: int) -> list[int]:
    """R2: one 64-bit mask (signed, like ``dhash``) per combination of
    ``bands - threshold`` of the ``bands`` contiguous blocks of the hash."""
    if not 0 <= threshold < bands <= 64:
        raise ValueError(f"need 0 <= threshold < bands <= 64, got {threshold}, {bands}")
    bounds = [round(i * 64 / bands) for i in range(bands + 1)]
    blocks = [((1 << (hi - lo)) - 1) << lo for lo, hi in itertools.pairwise(bounds)]
    masks = []
    for combo in itertools.combinations(range(bands), bands - threshold):
        mask = 0
        for i in combo:
            mask |= blocks[i]
        masks.append(_signed(mask))
    return masks


@dataclass(frozen=True)
class OrderTerm:
    """One sort key of R5. `kind`: ``product`` (of two columns, most first, unknown
    last), ``rank`` (the column's position in `ranking`, unlisted after) or ``value``
    (the column, smallest first, unknown first)."""

    kind: str
    columns: tuple[str, ...]
    ranking: tuple[str, ...] = ()


def order_terms(policy: Sequence[str], source_priority: Sequence[str]) -> list[OrderTerm]:
    """R5: the sort order inside a cluster (the first row is canonical), ending with
    ``sample_id`` so that the choice never depends on row order."""
    terms: list[OrderTerm] = []
    for criterion in policy:
        if criterion == "resolution":
            terms += [OrderTerm("product", ("original_width", "original_height")),
                      OrderTerm("product", ("width", "height"))]
        elif criterion == "source_priority":
            terms.append(OrderTerm("rank", ("source",), tuple(source_priority)))
        elif criterion == "earliest":
            terms.append(OrderTerm("value", ("ingested_at",)))
        else:
            raise ValueError(f"unknown dedup policy criterion {criterion!r}")
    return [*terms, OrderTerm("value", ("sample_id",))]


def members_name(sample_ids: Sequence[str]) -> str:
    """R6: the id of a new cluster whose canonical id names another cluster: the first
    32 hex digits of the sha256 of its members' sorted ids, comma-separated (Spark:
    ``substring(sha2(concat_ws(',', sort_array(ids)), 256), 1, 32)``)."""
    return hashlib.sha256(",".join(sorted(sample_ids)).encode()).hexdigest()[:32]
