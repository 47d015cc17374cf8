"""`curated_meta`: the curated Lance table's columns, without image bytes and vectors, as
a Delta table -- what Databricks SQL, Athena, stock Trino and every other engine that
reads Delta but not Lance query (``catalog.publish_curated_meta``; docs/sql.md).

Each row also carries its duplicate cluster and role from the `dedup` Delta table
(``dup_cluster_id``, ``is_canonical``, ``dup_kind``, ``cluster_size``; null before dedup
ran), so an analyst filters canonical rows without a join.

Lance stays the table that builds and exports; this one follows it. :func:`sync` runs
after every stage or command that may have moved the Lance version (the runner calls it,
:mod:`etl.pipeline.runner`), and writes only what changed, at the grain of a Lance
fragment: each row carries ``lance_fragment``, the fragment it lives in, and a memo
(derived state, :mod:`etl.lakehouse.derived`, keyed by the meta table's Delta version)
holds the Lance version mirrored and a signature of each fragment (its data files and
deletion file). A fragment whose signature changed (rows deleted, a column written, a
compaction) has its rows replaced in one Delta commit (an overwrite with a predicate on
``lance_fragment``); a fragment that left is removed in the same commit; an unchanged
one is not read. The memo also holds the dedup table's version: the rows in data files
dedup added since are the samples whose role may have changed, and the fragments holding
them (a Lance scan by ``sample_id``) are rewritten too. Without a usable memo (first
run, a meta table written by anyone else, new columns) the table is rebuilt in full.
Removals and takedowns delete Lance rows, which changes their fragments' deletion files:
their rows leave curated_meta in the same run.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from etl import tables
from etl.config import Config
from etl.lakehouse.derived import DerivedState
from etl.schema import DEDUP_SCHEMA, arrow_schema
from etl.storage import delta_rs_storage, delta_rs_table, lance_exists, object_url

__all__ = ["FRAGMENT_COLUMN", "DEDUP_COLUMNS", "MetaSync", "mirrored_columns", "sync"]

log = logging.getLogger(__name__)

# The Lance fragment a row lives in: how the table is kept in step, not curated data.
FRAGMENT_COLUMN = "lance_fragment"
_KIND = "curated_meta"
# A row's duplicate cluster and role, from the dedup table.
DEDUP_COLUMNS = ("dup_cluster_id", "is_canonical", "dup_kind", "cluster_size")
# More samples than this whose dedup row changed: rebuild rather than look each up.
_DEDUP_LOOKUP = 50_000


@dataclass(frozen=True)
class MetaSync:
    """What one sync did."""

    lance_version: int
    delta_version: int | None
    mode: str  # "unchanged", "incremental" or "full"
    fragments: int  # fragments read (rows rewritten) or removed
    rows: int  # rows written


def _vector_or_bytes(t: pa.DataType) -> bool:
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or \
            pa.types.is_fixed_size_binary(t) or pa.types.is_fixed_size_list(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        v = t.value_type
        return pa.types.is_floating(v) or pa.types.is_integer(v) or _vector_or_bytes(v)
    return False


def mirrored_columns(schema: pa.Schema) -> list[str]:
    """The curated columns curated_meta holds: all but image bytes and vectors (binary,
    fixed-size lists, numeric lists)."""
    return [f.name for f in schema if not _vector_or_bytes(f.type)]


def _signature(fragment) -> str:
    meta = fragment.metadata.to_json()
    return hashlib.sha1(json.dumps(meta, sort_keys=True, default=str).encode()).hexdigest()


def _dedup_schema() -> pa.Schema:
    full = arrow_schema(DEDUP_SCHEMA)
    return pa.schema([full.field("sample_id"),
                      *(full.field(c).with_nullable(True) for c in DEDUP_COLUMNS)])


def _dedup_rows(dedup, ids: pa.Array | None) -> pa.Table:
    """(sample_id, the dedup columns) of `ids` (None: every row) from the dedup table
    (a delta-rs table, or None before dedup ran)."""
    schema = _dedup_schema()
    if dedup is None:
        return schema.empty_table()
    data = dedup.to_pyarrow_dataset()
    where = None if ids is None else pc.field("sample_id").isin(ids)
    return data.to_table(columns=schema.names, filter=where).cast(schema)


def _rows(fragments: list, columns: list[str], schema: pa.Schema, dedup) -> pa.Table:
    """The live rows of `fragments`, with their duplicate cluster and role and their
    fragment id."""
    parts = []
    for frag in fragments:
        t = frag.to_table(columns=columns)
        parts.append(t.append_column(
            FRAGMENT_COLUMN, pa.array([frag.fragment_id] * t.num_rows, pa.int32())))
    fields = [schema.field(c) for c in columns] + [pa.field(FRAGMENT_COLUMN, pa.int32())]
    rows = pa.concat_tables(parts) if parts else pa.schema(fields).empty_table()
    ids = rows.column("sample_id")
    roles = _dedup_rows(dedup, None if rows.num_rows > _DEDUP_LOOKUP
                        else pc.unique(ids))
    # Each row's dedup row (null where it has none): a lookup, not a join (Arrow's hash
    # join refuses list columns such as `flags`).
    aligned = roles.take(pc.index_in(ids, value_set=roles.column("sample_id")))
    out = rows.drop_columns([FRAGMENT_COLUMN])
    for name in DEDUP_COLUMNS:
        out = out.append_column(roles.schema.field(name), aligned.column(name))
    return out.append_column(rows.schema.field(FRAGMENT_COLUMN), rows.column(FRAGMENT_COLUMN))


def _data_files(table) -> set[str]:
    """The data files of a delta-rs table at its version (paths under the table)."""
    return set(pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist())


def _dedup_changed(dedup, since: int | None) -> pa.Array | None:
    """Sample ids in the dedup table's data files added after version `since` (a
    superset of the rows whose role changed); None: cannot tell, rebuild."""
    from deltalake import DeltaTable

    empty = pa.array([], pa.string())
    if dedup is None or since == dedup.version():
        return empty
    if since is None:
        return None
    try:
        old = _data_files(DeltaTable(dedup.table_uri, version=since,
                                     storage_options=delta_rs_storage(dedup.table_uri)))
    except Exception:  # noqa: BLE001 -- that version is gone (vacuumed log): rebuild
        return None
    added = _data_files(dedup) - old
    if not added:
        return empty
    import pyarrow.dataset as pads

    data = dedup.to_pyarrow_dataset()
    fragments = [f for f in data.get_fragments() if f.path in added]
    ids = pads.FileSystemDataset(fragments, data.schema, data.format, data.filesystem) \
        .to_table(columns=["sample_id"]).column("sample_id")
    return pc.unique(ids) if len(ids) else empty


def _fragments_of(ds, ids: pa.Array) -> set[int]:
    """The fragments holding `ids` (Lance answers from its sample_id index if any)."""
    if len(ids) == 0:
        return set()
    hits = ds.to_table(columns=["sample_id"], filter=pc.field("sample_id").isin(ids),
                       with_row_address=True)
    return {int(a) >> 32 for a in hits.column("_rowaddr").to_pylist()}


def sync(spark, cfg: Config) -> MetaSync | None:
    """Bring curated_meta to the curated table's current version (None: not published,
    or no curated table yet). `spark` is unused: every read and write is pylance and
    delta-rs in this process (a night's change is a few fragments)."""
    del spark
    if not cfg.catalog.publish_curated_meta:
        return None
    import lance

    lay = tables.layout(cfg)
    if not lance_exists(lay.curated):
        return None
    ds = lance.dataset(lay.curated)
    columns = [c for c in mirrored_columns(ds.schema) if c not in DEDUP_COLUMNS]
    fragments = {f.fragment_id: f for f in ds.get_fragments()}
    signatures = {str(i): _signature(f) for i, f in fragments.items()}
    memo_state = DerivedState(lay.curated_meta_memo, _KIND)
    table = delta_rs_table(lay.curated_meta, write=True)
    dedup = delta_rs_table(lay.dedup)
    memo = None if table is None else memo_state.load({"delta_version": table.version()})
    roles = None if memo is None else _dedup_changed(dedup, memo.get("dedup_version"))
    written = [*columns, *DEDUP_COLUMNS, FRAGMENT_COLUMN]  # the table's columns
    if memo is None or memo.get("columns") != written or roles is None or \
            len(roles) > _DEDUP_LOOKUP:
        out = _full(cfg, lay.curated_meta, list(fragments.values()), columns, ds, dedup)
    else:
        stale = _fragments_of(ds, roles)
        out = _incremental(lay.curated_meta, table, memo, fragments, signatures, stale,
                           columns, ds, dedup)
    memo_state.save({"delta_version": out.delta_version},
                    {"lance_version": ds.version, "columns": written,
                     "dedup_version": None if dedup is None else dedup.version(),
                     "fragments": signatures})
    log.info("curated_meta: %s at Lance version %d (%d fragment(s), %d row(s) written)",
             out.mode, out.lance_version, out.fragments, out.rows)
    return out


def _full(cfg: Config, path: str, fragments: list, columns: list[str], ds,
          dedup) -> MetaSync:
    """Every live row, replacing whatever the table held (schema included). The
    description is the catalog comment (etl.lakehouse.registration), so registering it
    adds no commit."""
    from deltalake import write_deltalake

    data = _rows(fragments, columns, ds.schema, dedup)
    write_deltalake(object_url(path), data, mode="overwrite", schema_mode="overwrite",
                    storage_options=delta_rs_storage(path, write=True),
                    description=f"{cfg.catalog.comment_prefix}: "
                                f"{tables.DELTA_TABLES[tables.CURATED_META]}")
    version = delta_rs_table(path).version()
    return MetaSync(ds.version, version, "full", len(fragments), data.num_rows)


def _incremental(path: str, table, memo: dict, fragments: dict, signatures: dict[str, str],
                 stale: set[int], columns: list[str], ds, dedup) -> MetaSync:
    from deltalake import write_deltalake

    before = memo.get("fragments") or {}
    changed = sorted({int(i) for i, sig in signatures.items() if before.get(i) != sig}
                     | (stale & set(fragments)))
    gone = [int(i) for i in before if i not in signatures]
    if not changed and not gone:
        return MetaSync(ds.version, table.version(), "unchanged", 0, 0)
    ids = ", ".join(str(i) for i in sorted(changed + gone))
    predicate = f"{FRAGMENT_COLUMN} IN ({ids})"
    data = _rows([fragments[i] for i in changed], columns, ds.schema, dedup)
    if data.num_rows:
        # One commit: the rows of these fragments replaced by their live rows.
        write_deltalake(table, data, mode="overwrite", predicate=predicate)
    else:
        table.delete(predicate)
    return MetaSync(ds.version, delta_rs_table(path).version(), "incremental",
                    len(changed) + len(gone), data.num_rows)
