"""Scalar indexes on the columns analysts filter by.

Lance answers a filter such as ``source = 'laion' AND NOT keep`` from a BITMAP/BTREE
index (``ScalarIndexQuery`` in the plan) instead of scanning the columns. An index
covers the fragments that existed when it was built: after an append,
:func:`ensure_scalar_indexes` extends each index to the new fragments
(``optimize_indices``) rather than rebuilding it; after an overwrite (a new table with
no indexes) it builds them again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["IndexResult", "ensure_scalar_indexes", "index_name", "indexed_columns", "uses_index"]

log = logging.getLogger(__name__)

# Lance's describe_indices() type names -> the create_scalar_index names.
_TYPE_URLS = {
    "BitmapIndexDetails": "BITMAP",
    "BTreeIndexDetails": "BTREE",
    "ZoneMapIndexDetails": "ZONEMAP",
    "BloomFilterIndexDetails": "BLOOMFILTER",
    "LabelListIndexDetails": "LABEL_LIST",
}


@dataclass(frozen=True)
class IndexResult:
    version: int  # the table version after indexing
    created: tuple[str, ...]  # columns indexed from scratch
    extended: tuple[str, ...]  # columns whose index was extended to new fragments
    skipped: tuple[str, ...]  # configured columns the table does not have (yet)


def index_name(column: str) -> str:
    return f"{column}_idx"


def indexed_columns(path: str) -> dict[str, str]:
    """Column -> index type of the single-column scalar indexes on the table."""
    import lance

    out = {}
    for desc in lance.dataset(path).describe_indices():
        kind = desc.type_url.rsplit(".", 1)[-1]
        if kind in _TYPE_URLS and len(desc.field_names) == 1:
            out[desc.field_names[0]] = _TYPE_URLS[kind]
    return out


def ensure_scalar_indexes(path: str, wanted: Mapping[str, str]) -> IndexResult:
    """Create the configured indexes the table lacks, extend the rest to new fragments.

    An index whose type differs from the configured one is rebuilt with the new type."""
    import lance

    ds = lance.dataset(path)
    if ds.count_rows() == 0:
        return IndexResult(ds.version, (), (), tuple(wanted))
    have = indexed_columns(path)
    columns = set(ds.schema.names)
    created, extended, skipped = [], [], []
    for column, kind in wanted.items():
        if column not in columns:
            skipped.append(column)
            continue
        if have.get(column) == kind:
            extended.append(column)
            continue
        ds.create_scalar_index(column, kind, name=index_name(column), replace=True)
        ds = lance.dataset(path)
        created.append(column)
    if extended and _has_unindexed_fragments(ds, extended):
        ds.optimize.optimize_indices(index_names=[index_name(c) for c in extended])
    else:
        extended = []
    if skipped:
        log.info("scalar indexes: %s not in %s (yet); skipped", ", ".join(skipped), path)
    return IndexResult(lance.dataset(path).version, tuple(created), tuple(extended),
                       tuple(skipped))


def _has_unindexed_fragments(ds, columns: list[str]) -> bool:
    fragments = {f.fragment_id for f in ds.get_fragments()}
    for idx in ds.list_indices():
        if idx["fields"] and idx["fields"][0] in columns:
            if not fragments <= set(idx["fragment_ids"]):
                return True
    return False


def uses_index(path: str, predicate: str, version: int | None = None) -> bool:
    """Whether Lance answers `predicate` from a scalar index (its plan has
    ``ScalarIndexQuery``) rather than by scanning the filtered columns."""
    import lance

    plan = lance.dataset(path, version=version).scanner(
        filter=predicate, columns=["sample_id"]
    ).explain_plan()
    return "ScalarIndexQuery" in plan
