"""The dedup rules (:mod:`etl.transforms.dedup_rules`) in the driver, for a small set
of rows: what a nightly increment touches.

An increment of a few thousand rows touches a few thousand more (near neighbours of
the new hashes, the clusters they join or leave). Planning them with Spark costs tens
of small jobs whatever their size; here it is a loop in the driver, one step per rule
as in :func:`etl.transforms.dedup.plan_dedup` (incremental mode), and
``tests/test_dedup_local.py`` checks that both give the same changes on the same
tables. The caller chooses the rows (:mod:`etl.lakehouse.dedup_increment`): every row
the plan could reassign or needs to see must be in `current` and `prior`.

:func:`update_stats` carries the per-source counts and the cluster count forward from
the rows that changed, instead of counting the whole table again.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from etl.config import DedupConfig
from etl.transforms.dedup_rules import (
    COMPARED,
    HASH,
    KNOWN_CLUSTER,
    NEW_ROW,
    lsh_masks,
    members_name,
    order_terms,
)

__all__ = ["LocalPlan", "plan_local", "update_stats", "size_histogram", "canonical_key"]

Row = Mapping[str, Any]
_MASK64 = (1 << 64) - 1


@dataclass
class LocalPlan:
    changes: list[dict]  # ASSIGNMENT_COLUMNS: rows that are new or whose assignment changed
    removed: list[str]  # sample ids dedup knew that `current` no longer has
    new_rows: int
    pairs: int


def _distance(a: int, b: int) -> int:
    return ((a ^ b) & _MASK64).bit_count()


def canonical_key(policy: Sequence[str], source_priority: Sequence[str]):
    """R5's sort order as a Python sort key, equal to
    :func:`etl.transforms.dedup.canonical_order` (Spark's null placement: descending
    puts nulls last, ascending first)."""

    def product(row: Row, a: str, b: str) -> tuple:
        if row[a] is None or row[b] is None:
            return (1, 0)
        return (0, -int(row[a]) * int(row[b]))

    def value(v) -> tuple:
        return (0, 0) if v is None else (1, v)

    def part(term, row: Row):
        if term.kind == "product":
            return product(row, *term.columns)
        if term.kind == "rank":
            rank = {name: i for i, name in enumerate(term.ranking)}
            return rank.get(row[term.columns[0]], len(term.ranking))
        return value(row[term.columns[0]])

    terms = order_terms(policy, source_priority)

    def key(row: Row) -> tuple:
        return tuple(part(term, row) for term in terms)

    return key


class _Components:
    """Union-find; each component is labelled by its smallest node (as Spark's
    min-label propagation labels it)."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)  # the root is the smallest node

    def labels(self) -> dict[str, str]:
        return {x: self.find(x) for x in self.parent}


def _mark_new(current: Iterable[Row], prior_by_id: Mapping[str, Row]) -> list[dict]:
    """R1: the curated rows with ``_new`` and, for known rows, ``_old_cid``."""
    rows = []
    for r in current:
        p = prior_by_id.get(r["sample_id"])
        same = (p is not None and None not in (p["image_sha256"], p["dhash"],
                                               r["image_sha256"], r["dhash"])
                and p["image_sha256"] == r["image_sha256"] and p["dhash"] == r["dhash"])
        rows.append({**r, "_new": not same, "_old_cid": p["dup_cluster_id"] if same else None})
    return rows


def _near_pairs(rows: list[dict], cfg: DedupConfig) -> tuple[set[tuple[int, int]], set[int]]:
    """R2: the verified near pairs and the hashes that matter to R3."""
    count: Counter[int] = Counter()
    is_new: dict[int, bool] = {}
    for r in rows:
        if r["dhash"] is not None:
            count[r["dhash"]] += 1
            is_new[r["dhash"]] = is_new.get(r["dhash"], False) or r["_new"]
    new_hashes = sorted(h for h, n in is_new.items() if n)
    pairs = set()
    for mask in lsh_masks(cfg.threshold, cfg.bands):
        buckets: dict[int, list[int]] = defaultdict(list)
        for h in is_new:
            buckets[h & mask].append(h)
        for a in new_hashes:
            for b in buckets[a & mask]:
                if a != b and _distance(a, b) <= cfg.threshold:
                    pairs.add((min(a, b), max(a, b)))
    relevant = {h for pair in pairs for h in pair}
    return pairs, relevant | {h for h in new_hashes if count[h] > 1}


def _node(r: Row) -> str:
    return f"{NEW_ROW}{r['sample_id']}" if r["_new"] else f"{KNOWN_CLUSTER}{r['_old_cid']}"


def _components(rows: list[dict], pairs: set[tuple[int, int]],
                relevant: set[int]) -> dict[str, str]:
    """R3: the label of every node of the graph."""
    graph = _Components()
    for r in rows:
        if r["dhash"] in relevant:
            graph.union(_node(r), f"{HASH}{r['dhash']}")
    for a, b in pairs:
        graph.union(f"{HASH}{a}", f"{HASH}{b}")
    return graph.labels()


def _members(rows: list[dict], labels: Mapping[str, str],
             prior_by_id: Mapping[str, Row]) -> list[dict]:
    """R4: the rows to reassign, each with its component ``_comp``."""
    members = [{**r, "_comp": labels.get(_node(r), _node(r))} for r in rows if r["_new"]]
    kept = [r for r in rows if not r["_new"]]
    touched = set()
    for r in kept:
        if _node(r) in labels:
            members.append({**r, "_comp": labels[_node(r)]})
            touched.add(r["sample_id"])
    kept_ids = {r["sample_id"] for r in kept}
    shrunk = {p["dup_cluster_id"] for p in prior_by_id.values() if p["sample_id"] not in kept_ids}
    members += [{**r, "_comp": _node(r)} for r in kept
                if r["_old_cid"] in shrunk and r["sample_id"] not in touched]
    return members


def _cluster_id(group: list[dict], in_use: set[str]) -> str:
    """R6, for one component sorted by R5."""
    old_ids = Counter(m["_old_cid"] for m in group if m["_old_cid"] is not None)
    if old_ids:
        return min(old_ids.items(), key=lambda kv: (-kv[1], kv[0]))[0]
    if group[0]["sample_id"] in in_use:
        return members_name([m["sample_id"] for m in group])
    return group[0]["sample_id"]


def _kind(rank: int, size: int, row: Row, canon: Row) -> str:
    """R7."""
    if size == 1:
        return "unique"
    if rank == 1:
        return "canonical"
    if row["image_sha256"] is not None and row["image_sha256"] == canon["image_sha256"]:
        return "exact"
    return "near"


def _assign(members: list[dict], in_use: set[str], cfg: DedupConfig,
            run_id: str) -> list[dict]:
    """R5-R7: every member's assignment (ASSIGNMENT_COLUMNS)."""
    key = canonical_key(cfg.policy, cfg.source_priority)
    by_comp: dict[str, list[dict]] = defaultdict(list)
    for m in members:
        by_comp[m["_comp"]].append(m)
    out = []
    for group in by_comp.values():
        group.sort(key=key)
        cluster_id, size = _cluster_id(group, in_use), len(group)
        out += [{"sample_id": m["sample_id"], "source": m["source"],
                 "image_sha256": m["image_sha256"], "dhash": m["dhash"],
                 "dup_cluster_id": cluster_id, "is_canonical": rank == 1,
                 "dup_kind": _kind(rank, size, m, group[0]), "cluster_size": size,
                 "run_id": run_id}
                for rank, m in enumerate(group, start=1)]
    return out


def plan_local(current: Iterable[Row], prior: Iterable[Row], cfg: DedupConfig,
               run_id: str) -> LocalPlan:
    """Incremental cluster assignments for `current` (ROW_COLUMNS) given the previous
    assignments `prior` (ASSIGNMENT_COLUMNS), as ``plan_dedup(current, prior, cfg,
    run_id)`` computes them (not a full run)."""
    prior_by_id = {r["sample_id"]: r for r in prior}
    rows = _mark_new(current, prior_by_id)
    pairs, relevant = _near_pairs(rows, cfg)
    labels = _components(rows, pairs, relevant)
    members = _members(rows, labels, prior_by_id)
    in_use = {r["_old_cid"] for r in rows if not r["_new"]}
    changes = [row for row in _assign(members, in_use, cfg, run_id)  # R8
               if (p := prior_by_id.get(row["sample_id"])) is None
               or any(p[c] != row[c] for c in COMPARED)]
    changes.sort(key=lambda r: r["sample_id"])
    current_ids = {r["sample_id"] for r in rows}
    removed = sorted(sid for sid in prior_by_id if sid not in current_ids)
    return LocalPlan(changes, removed, sum(r["_new"] for r in rows), len(pairs))


def update_stats(stats: Mapping[str, Any], changes: Iterable[Row], removed: Iterable[str],
                 prior: Mapping[str, Row]) -> dict:
    """The dedup table's stats (``{"by": {source: {kind: rows}}, "clusters": n, "sizes":
    {size: clusters}}``: rows per source and kind, clusters of 2+ rows and how many of
    each size) after `changes` and `removed`, from the stats before and the previous
    assignments (`prior`, by sample id) of those rows.

    A cluster whose membership changes has every remaining member among the changes
    (each one's size or cluster id changes), so a cluster id that only the previous
    assignments name is gone, and one the changes name has the size they give it."""
    by: dict[str, Counter] = {s: Counter(k) for s, k in stats["by"].items()}
    sizes = Counter({int(k): n for k, n in stats["sizes"].items()})
    before: dict[str, int] = {}
    after: dict[str, int] = {}
    for r in changes:
        p = prior.get(r["sample_id"])
        if p is not None:
            by.setdefault(p["source"], Counter())[p["dup_kind"]] -= 1
            if p["cluster_size"] > 1:
                before[p["dup_cluster_id"]] = p["cluster_size"]
        by.setdefault(r["source"], Counter())[r["dup_kind"]] += 1
        after[r["dup_cluster_id"]] = r["cluster_size"]
    for sid in removed:
        p = prior[sid]
        by.setdefault(p["source"], Counter())[p["dup_kind"]] -= 1
        if p["cluster_size"] > 1:
            before[p["dup_cluster_id"]] = p["cluster_size"]
    sizes.subtract(before.values())
    sizes.update(size for size in after.values() if size > 1)
    out = {s: {k: n for k, n in sorted(kinds.items()) if n} for s, kinds in sorted(by.items())}
    return {"by": {s: kinds for s, kinds in out.items() if kinds},
            "clusters": sum(sizes.values()), "sizes": size_histogram(sizes)}


def size_histogram(sizes: Mapping[int, int]) -> dict[str, int]:
    """Clusters per size (sizes 2+), as JSON keeps it: string keys, no zero counts."""
    return {str(k): int(n) for k, n in sorted(sizes.items()) if n}
