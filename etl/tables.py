"""Every table lakeshard keeps: its name, where it lives under ``storage.root``, and how
to open it (or fail saying which command creates it).

::

    <root>/lance/<namespace>/curated.lance   curated (Lance): one row per accepted sample
    <root>/delta/manifest                    bronze manifest: one row per source record
    <root>/delta/rejects                     records that did not make it, and why
    <root>/delta/accounting                  per run and source: records by outcome
    <root>/delta/dedup                       duplicate clusters of the curated rows
    <root>/delta/runs                        the run ledger (append-only events)
    <root>/delta/takedowns                   takedown requests and what they matched
    <root>/delta/curated_meta                the curated columns without image bytes and
                                             vectors, for SQL engines (catalog.publish_curated_meta)
    <root>/mds/<export>/                     MDS exports
    <root>/reports/<run_id>/                 run reports
    <root>/_lock/run.lock                    the run lock (a file, or an S3 object)
    <root>/_catalog/metastore_db             Spark's embedded Hive metastore (catalog.kind
    <root>/_catalog/warehouse                hive without a metastore_uri) and its warehouse

The root may be a local folder or ``s3://bucket/prefix`` (``s3a://``): Delta paths keep
the root's scheme (Spark's connector reads them), Lance tables and exports are handed
out as ``s3://`` (what pylance and boto3 speak). Every helper here that hands out a path
under a root first points this process's S3 clients at the root's store
(:func:`etl.storage.use_storage`). How a table is opened, and whether by Spark or in
this process (delta-rs, pylance), is :mod:`etl.storage`; what each table holds and its
queries, :mod:`etl.lakehouse.catalog`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from etl.config import Config, StorageConfig
from etl.errors import TableMissingError
from etl.storage import lance_exists, object_url, use_storage

__all__ = [
    "CURATED",
    "MANIFEST",
    "REJECTS",
    "ACCOUNTING",
    "DEDUP",
    "RUNS",
    "TAKEDOWNS",
    "CURATED_META",
    "DELTA_TABLES",
    "Layout",
    "layout",
    "export_path",
    "lock_path",
    "open_curated",
]

log = logging.getLogger(__name__)

CURATED = "curated"  # Lance
MANIFEST = "manifest"  # Delta tables from here on
REJECTS = "rejects"
ACCOUNTING = "accounting"
DEDUP = "dedup"
RUNS = "runs"
TAKEDOWNS = "takedowns"
CURATED_META = "curated_meta"  # Delta mirror of curated (catalog.publish_curated_meta)

# Every Delta table a run may write, with what it is: the comment it is registered
# under in a catalog (etl.lakehouse.registration).
DELTA_TABLES = {
    MANIFEST: "bronze manifest: one row per source record, with its fingerprint and "
              "whether it was removed",
    REJECTS: "records that did not make it into the curated table, with their stage "
             "and reason",
    ACCOUNTING: "per run and source: input records by outcome (curated, rejected, "
                "removed)",
    DEDUP: "duplicate clusters of the curated rows: cluster id and role per sample",
    RUNS: "the run ledger: one row per run and stage transition, with counts and "
          "table versions",
    TAKEDOWNS: "takedown requests and the samples they matched",
    CURATED_META: "the curated table's columns without image bytes and vectors, kept in "
                  "step with the Lance table after every stage",
}


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


@dataclass(frozen=True)
class Layout:
    """Paths under one storage root."""

    root: str
    namespace: str = "default"

    @classmethod
    def of(cls, storage: StorageConfig) -> Layout:
        use_storage(storage)
        return cls(storage.root, storage.namespace)

    @property
    def lance_dir(self) -> str:
        return _join(object_url(self.root), "lance", self.namespace)

    @property
    def delta_dir(self) -> str:
        return _join(self.root, "delta")

    @property
    def mds_dir(self) -> str:
        return _join(object_url(self.root), "mds")

    @property
    def reports_dir(self) -> str:
        return _join(object_url(self.root), "reports")

    @property
    def meta_dir(self) -> str:
        """lakeshard's own state under the root (the layout marker)."""
        return _join(object_url(self.root), "_lakeshard")

    @property
    def source_versions(self) -> str:
        """The source versions the last completed curate fully handled
        (:mod:`etl.lakehouse.curate_state`)."""
        return _join(self.meta_dir, "source_versions.json")

    @property
    def curate_quiet(self) -> str:
        """What a quiet night of curate needs (:mod:`etl.lakehouse.curate_state`)."""
        return _join(self.meta_dir, "curate_quiet.json")

    def counts_cache(self, table: str) -> str:
        """Counts per fragment / data file of a table, kept for the report
        (:mod:`etl.lakehouse.counts`)."""
        return _join(self.meta_dir, "counts", f"{table}.json")

    @property
    def catalog_dir(self) -> str:
        """Spark's embedded Hive metastore and its warehouse (a local root only)."""
        return _join(self.root, "_catalog")

    @property
    def metastore_db(self) -> str:
        return _join(self.catalog_dir, "metastore_db")

    @property
    def catalog_warehouse(self) -> str:
        return _join(self.catalog_dir, "warehouse")

    @property
    def catalog_memo(self) -> str:
        """Where and what the last registration registered
        (:mod:`etl.lakehouse.registration`)."""
        return _join(self.meta_dir, "catalog.json")

    @property
    def table_containers(self) -> str:
        """The table files curate last read in full, and their size and mtime
        (:mod:`etl.lakehouse.curate_state`)."""
        return _join(self.meta_dir, "table_containers.json")

    @property
    def curated_meta_memo(self) -> str:
        """The Lance version and fragments curated_meta last mirrored
        (:mod:`etl.lakehouse.curated_meta`)."""
        return _join(self.meta_dir, "curated_meta.json")

    @property
    def samples_dir(self) -> str:
        return _join(self.root, "samples")

    def lance_table(self, name: str) -> str:
        return _join(self.lance_dir, f"{name}.lance")

    def delta_table(self, name: str) -> str:
        return _join(self.delta_dir, name)

    def export_dir(self, name: str) -> str:
        return _join(self.mds_dir, name)

    def report_dir(self, name: str) -> str:
        return _join(self.reports_dir, name)

    @property
    def curated(self) -> str:
        return self.lance_table(CURATED)

    @property
    def manifest(self) -> str:
        return self.delta_table(MANIFEST)

    @property
    def rejects(self) -> str:
        return self.delta_table(REJECTS)

    @property
    def accounting(self) -> str:
        return self.delta_table(ACCOUNTING)

    @property
    def dedup(self) -> str:
        return self.delta_table(DEDUP)

    @property
    def runs(self) -> str:
        return self.delta_table(RUNS)

    @property
    def takedowns(self) -> str:
        return self.delta_table(TAKEDOWNS)

    @property
    def curated_meta(self) -> str:
        return self.delta_table(CURATED_META)


def layout(cfg: Config) -> Layout:
    return Layout.of(cfg.storage)


def lock_path(cfg: Config) -> str:
    """The run lock of this root: `run.lock_path`, or <root>/_lock/run.lock (an S3
    object on an ``s3://`` root: etl.runtime.lock takes it with a conditional write)."""
    use_storage(cfg.storage)
    return object_url(cfg.run.lock_path or _join(cfg.storage.root, "_lock", "run.lock"))


def export_path(cfg: Config, name: str) -> str:
    """Where export `name` is written: its `path`, or <root>/mds/<name>."""
    use_storage(cfg.storage)
    return object_url(cfg.export(name).path or layout(cfg).export_dir(name))


def open_curated(cfg: Config, version: int | None = None):
    """The curated Lance dataset (at `version`), or TableMissingError naming the fix."""
    import lance

    path = layout(cfg).curated
    try:
        return lance.dataset(path, version=version)
    except (ValueError, OSError) as exc:
        if not lance_exists(path):  # raises when the store does not answer
            raise TableMissingError(
                f"no curated table at {path}: run `lakeshard curate` first"
            ) from None
        if version is not None:
            raise TableMissingError(f"{path} has no version {version}: {exc}") from None
        raise
