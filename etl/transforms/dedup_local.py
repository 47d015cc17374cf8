"""The dedup plan of :func:`etl.transforms.dedup.plan_dedup`, in the driver, for a
small set of rows: what a nightly increment touches.

An increment of a few thousand rows touches a few thousand more (near neighbours of
the new hashes, the clusters they join or leave). Planning them with Spark costs tens
of small jobs whatever their size; here it is a loop in the driver. The rules are
those of ``plan_dedup`` (incremental mode), rule for rule -- which rows are new, the
verified near pairs, the graph of new rows, known clusters and hashes, its components,
the canonical member, which cluster id survives, the kinds -- and
``tests/test_dedup_local.py`` checks that both give the same changes on the same
tables. The caller chooses the rows (:mod:`etl.jobs.dedup`): every row the plan could
reassign or needs to see must be in `current` and `prior`.

:func:`update_stats` carries the per-source counts and the cluster count forward from
the rows that changed, instead of counting the whole table again.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from etl.config import DedupConfig
from etl.transforms.dedup import lsh_masks

__all__ = ["LocalPlan", "plan_local", "update_stats", "size_histogram", "canonical_key"]

Row = Mapping[str, Any]
_MASK64 = (1 << 64) - 1
_COMPARED = ("image_sha256", "dhash", "dup_cluster_id", "is_canonical", "dup_kind",
             "cluster_size")


@dataclass
class LocalPlan:
    changes: list[dict]  # ASSIGNMENT_COLUMNS: rows that are new or whose assignment changed
    removed: list[str]  # sample ids dedup knew that `current` no longer has
    new_rows: int
    pairs: int


def _distance(a: int, b: int) -> int:
    return ((a ^ b) & _MASK64).bit_count()


def canonical_key(policy: Sequence[str], source_priority: Sequence[str]):
    """A sort key equal to :func:`etl.transforms.dedup.canonical_order` (Spark's null
    placement: descending puts nulls last, ascending first; ``sample_id`` last)."""
    rank = {name: i for i, name in enumerate(source_priority)}

    def desc(v):
        return (1, 0) if v is None else (0, -v)

    def asc(v):
        return (0, 0) if v is None else (1, v)

    def product(a, b):
        return None if a is None or b is None else int(a) * int(b)

    def key(row: Row) -> tuple:
        out: list = []
        for criterion in policy:
            if criterion == "resolution":
                out += [desc(product(row["original_width"], row["original_height"])),
                        desc(product(row["width"], row["height"]))]
            elif criterion == "source_priority":
                out.append(rank.get(row["source"], len(source_priority)))
            elif criterion == "earliest":
                out.append(asc(row["ingested_at"]))
            else:
                raise ValueError(f"unknown dedup policy criterion {criterion!r}")
        return (*out, row["sample_id"])

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


def plan_local(current: Iterable[Row], prior: Iterable[Row], cfg: DedupConfig,
               run_id: str) -> LocalPlan:
    """Incremental cluster assignments for `current` (ROW_COLUMNS) given the previous
    assignments `prior` (ASSIGNMENT_COLUMNS), as ``plan_dedup(current, prior, cfg,
    run_id)`` computes them (not a full run)."""
    prior_by_id = {r["sample_id"]: r for r in prior}
    rows = []
    for r in current:
        p = prior_by_id.get(r["sample_id"])
        same = (p is not None and None not in (p["image_sha256"], p["dhash"],
                                               r["image_sha256"], r["dhash"])
                and p["image_sha256"] == r["image_sha256"] and p["dhash"] == r["dhash"])
        rows.append({**r, "_new": not same, "_old_cid": p["dup_cluster_id"] if same else None})
    new_rows = sum(r["_new"] for r in rows)

    count: Counter[int] = Counter()
    is_new: dict[int, bool] = {}
    for r in rows:
        if r["dhash"] is not None:
            count[r["dhash"]] += 1
            is_new[r["dhash"]] = is_new.get(r["dhash"], False) or r["_new"]
    new_hashes = sorted(h for h, n in is_new.items() if n)
    pairs = set()
    # The same LSH keys as Spark's hash_pairs (exact recall: two hashes within the
    # threshold share a key), each candidate verified by its true distance.
    for mask in lsh_masks(cfg.threshold, cfg.bands):
        buckets: dict[int, list[int]] = defaultdict(list)
        for h in is_new:
            buckets[h & mask].append(h)
        for a in new_hashes:
            for b in buckets[a & mask]:
                if a != b and _distance(a, b) <= cfg.threshold:
                    pairs.add((min(a, b), max(a, b)))
    relevant = {h for pair in pairs for h in pair}
    relevant |= {h for h in new_hashes if count[h] > 1}

    def node(r: Row) -> str:
        return f"s:{r['sample_id']}" if r["_new"] else f"c:{r['_old_cid']}"

    graph = _Components()
    for r in rows:
        if r["dhash"] in relevant:
            graph.union(node(r), f"h:{r['dhash']}")
    for a, b in pairs:
        graph.union(f"h:{a}", f"h:{b}")
    labels = graph.labels()

    members: list[dict] = []
    kept = [r for r in rows if not r["_new"]]
    for r in rows:
        if r["_new"]:
            members.append({**r, "_comp": labels.get(node(r), node(r))})
    touched = set()
    for r in kept:
        if node(r) in labels:
            members.append({**r, "_comp": labels[node(r)]})
            touched.add(r["sample_id"])
    kept_ids = {r["sample_id"] for r in kept}
    shrunk = {p["dup_cluster_id"] for p in prior_by_id.values() if p["sample_id"] not in kept_ids}
    for r in kept:
        if r["_old_cid"] in shrunk and r["sample_id"] not in touched:
            members.append({**r, "_comp": f"c:{r['_old_cid']}"})
    current_ids = {r["sample_id"] for r in rows}
    removed = sorted(sid for sid in prior_by_id if sid not in current_ids)

    in_use = {r["_old_cid"] for r in kept}
    key = canonical_key(cfg.policy, cfg.source_priority)
    by_comp: dict[str, list[dict]] = defaultdict(list)
    for m in members:
        by_comp[m["_comp"]].append(m)
    changes = []
    for group in by_comp.values():
        group.sort(key=key)
        canon = group[0]
        old_ids = Counter(m["_old_cid"] for m in group if m["_old_cid"] is not None)
        if old_ids:
            cluster_id = min(old_ids.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        elif canon["sample_id"] in in_use:
            # A new cluster whose canonical id still names another cluster (its row left
            # that cluster when its image changed): name it by its members.
            ids = ",".join(sorted(m["sample_id"] for m in group))
            cluster_id = hashlib.sha256(ids.encode()).hexdigest()[:32]
        else:
            cluster_id = canon["sample_id"]
        size = len(group)
        for rank, m in enumerate(group, start=1):
            if size == 1:
                kind = "unique"
            elif rank == 1:
                kind = "canonical"
            elif m["image_sha256"] is not None and m["image_sha256"] == canon["image_sha256"]:
                kind = "exact"
            else:
                kind = "near"
            row = {"sample_id": m["sample_id"], "source": m["source"],
                   "image_sha256": m["image_sha256"], "dhash": m["dhash"],
                   "dup_cluster_id": cluster_id, "is_canonical": rank == 1,
                   "dup_kind": kind, "cluster_size": size, "run_id": run_id}
            p = prior_by_id.get(m["sample_id"])
            if p is None or any(p[c] != row[c] for c in _COMPARED):
                changes.append(row)
    changes.sort(key=lambda r: r["sample_id"])
    return LocalPlan(changes, removed, new_rows, len(pairs))


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
