"""Bring tables an older lakeshard wrote to the current layout, in place, under the run
lock, at the start of every table-changing command.

Layout 1 (lakeshard up to 0.1.0, before the architecture refactor) -> layout 2:

* the curated Lance table's ``phash`` (it always held a dHash), ``image_bytes`` and
  ``original_bytes`` (byte counts, not bytes) become ``dhash``, ``image_size_bytes``
  and ``original_size_bytes``: one metadata-only Lance commit, no data file rewritten;
* the Delta ``dedup`` table's ``phash`` becomes ``dhash``: the table is rewritten once
  (one atomic overwrite; it holds a few small columns per sample) and keeps its
  lakeshard properties;
* the bronze manifest moves from ``<root>/delta/samples`` to ``<root>/delta/manifest``
  (a directory rename: Delta's log refers to its files relative to the table).

Layout 2 -> layout 3:

* the run ledger ``<root>/delta/runs`` becomes an append-only event table: it gains a
  ``recorded_at`` column (a metadata-only Delta commit: ``ADD COLUMNS``). Its rows, one
  per run and stage as the MERGE-era ledger left them, keep a null ``recorded_at`` and
  stay each key's status until an event is appended for that key.

Each step checks what is there, so a migration interrupted half-way finishes on the
next run. ``<root>/_lakeshard/layout.json`` records the layout once every step is done;
with it, a run pays one small read and nothing else -- on a local root or on S3 alike
(the marker is read and written with :mod:`etl.writers.remote`; a store that does not
answer fails the run, it is never taken for "no marker").
"""

from __future__ import annotations

import json
import logging

from etl import storage, tables
from etl.config import Config
from etl.lakehouse.dedup_table import DedupTable
from etl.writers.remote import read_file, write_file

__all__ = ["LAYOUT_VERSION", "CURATED_RENAMES", "migrate"]

log = logging.getLogger(__name__)

LAYOUT_VERSION = 3
# Old curated column -> new name.
CURATED_RENAMES = {
    "phash": "dhash",
    "image_bytes": "image_size_bytes",
    "original_bytes": "original_size_bytes",
}
_LEGACY_MANIFEST = "samples"


def _marker(cfg: Config) -> str:
    return f"{tables.layout(cfg).meta_dir}/layout.json"


def _layout_version(cfg: Config) -> int | None:
    body = read_file(_marker(cfg))
    return None if body is None else int(json.loads(body)["layout"])


def _write_layout_version(cfg: Config) -> None:
    write_file(_marker(cfg), json.dumps({"layout": LAYOUT_VERSION}).encode())


def _rename_curated_columns(cfg: Config) -> str | None:
    import lance

    path = tables.layout(cfg).curated
    if not storage.lance_exists(path):
        return None
    ds = lance.dataset(path)
    names = set(ds.schema.names)
    renames = {old: new for old, new in CURATED_RENAMES.items()
               if old in names and new not in names}
    if not renames:
        return None
    ds.alter_columns(*({"path": old, "name": new} for old, new in renames.items()))
    return "curated: renamed " + ", ".join(f"{o} -> {n}" for o, n in renames.items())


def _rename_dedup_column(spark, cfg: Config) -> str | None:
    path = tables.layout(cfg).dedup
    table = storage.read_delta(spark, path)
    if table is None or "phash" not in table.columns or "dhash" in table.columns:
        return None
    props = DedupTable(spark, cfg).state() or {}
    (
        table.withColumnRenamed("phash", "dhash")
        .write.format("delta").mode("overwrite").option("overwriteSchema", "true")
        .save(path)
    )
    if props:
        settings = ", ".join(f"'{k}' = '{v}'" for k, v in sorted(props.items()))
        spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({settings})")
    return "dedup: renamed phash -> dhash (table rewritten)"


def _move_manifest(spark, cfg: Config) -> str | None:
    from delta.tables import DeltaTable

    paths = tables.layout(cfg)
    old = paths.delta_table(_LEGACY_MANIFEST)
    if not DeltaTable.isDeltaTable(spark, old) or DeltaTable.isDeltaTable(spark, paths.manifest):
        return None
    jvm = spark.sparkContext._jvm
    src, dst = jvm.org.apache.hadoop.fs.Path(old), jvm.org.apache.hadoop.fs.Path(paths.manifest)
    fs = src.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    if fs.exists(dst):  # an empty folder a failed attempt left
        fs.delete(dst, True)
    if not fs.rename(src, dst):
        raise RuntimeError(f"could not move the bronze manifest {old} to {paths.manifest}")
    return f"manifest: moved {old} -> {paths.manifest}"


def _ledger_events(spark, cfg: Config) -> str | None:
    path = tables.layout(cfg).runs
    table = storage.read_delta(spark, path)
    if table is None or "recorded_at" in table.columns:
        return None
    spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS (recorded_at TIMESTAMP)")
    return "runs: the ledger is append-only (added recorded_at)"


def migrate(spark, cfg: Config) -> list[str]:
    """Migrate the tables under `cfg`'s root to the current layout; returns what was
    done (empty when nothing was needed). Call it holding the run lock."""
    if (_layout_version(cfg) or 0) >= LAYOUT_VERSION:
        return []
    done = [
        step for step in (
            _rename_curated_columns(cfg),
            _rename_dedup_column(spark, cfg),
            _move_manifest(spark, cfg),
            _ledger_events(spark, cfg),
        ) if step
    ]
    for step in done:
        log.warning("migrated %s", step)
    _write_layout_version(cfg)
    return done
