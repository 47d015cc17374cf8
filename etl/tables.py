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
    <root>/mds/<export>/                     MDS exports
    <root>/reports/<run_id>/                 run reports
    <root>/_lock/run.lock                    the run lock (a file, or an S3 object)

The root may be a local folder or ``s3://bucket/prefix`` (``s3a://``): Delta paths keep
the root's scheme (Spark's connector reads them), Lance tables and exports are handed
out as ``s3://`` (what pylance and boto3 speak). :func:`use_storage` points this
process's S3 clients at the root's store; every helper here that hands out a path under
a root calls it first.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from etl.config import Config, StorageConfig
from etl.config.runtime import S3_SCHEMES, is_url
from etl.errors import TableMissingError

__all__ = [
    "CURATED",
    "delta_exists",
    "MANIFEST",
    "REJECTS",
    "ACCOUNTING",
    "DEDUP",
    "RUNS",
    "TAKEDOWNS",
    "Layout",
    "layout",
    "use_storage",
    "object_url",
    "export_path",
    "lock_path",
    "lance_exists",
    "open_curated",
    "read_delta",
    "delta_version",
    "delta_properties",
    "delta_rs_table",
    "delta_rs_storage",
    "delta_rs_unsupported",
]

log = logging.getLogger(__name__)

CURATED = "curated"  # Lance
MANIFEST = "manifest"  # Delta tables from here on
REJECTS = "rejects"
ACCOUNTING = "accounting"
DEDUP = "dedup"
RUNS = "runs"
TAKEDOWNS = "takedowns"

def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def object_url(path: str) -> str:
    """`path` as pylance, boto3 and Mosaic Streaming spell it: ``s3a://`` -> ``s3://``
    (the same object); anything else unchanged."""
    for scheme in S3_SCHEMES:
        if path.startswith(f"{scheme}://"):
            return "s3://" + path[len(scheme) + 3:]
    return path


def use_storage(storage: StorageConfig) -> None:
    """Point this process's S3 clients at `storage`'s store: the standard AWS
    environment with ``storage.s3`` applied, written back into ``os.environ`` (endpoint,
    region, addressing style, plain-HTTP permission, retry mode -- never credentials),
    where boto3, pylance and Mosaic Streaming read it. Idempotent; cheap."""
    for key, value in storage.s3.resolve(os.environ).environment(os.environ).items():
        if os.environ.get(key) != value:
            os.environ[key] = value


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

    def counts_cache(self, table: str) -> str:
        """Counts per fragment / data file of a table, kept for the report
        (:mod:`etl.lakehouse.counts`)."""
        return _join(self.meta_dir, "counts", f"{table}.json")

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


# ----------------------------------------------------------------------------- Lance


def _not_found(exc: Exception) -> bool:
    """pylance's "no dataset here" (as opposed to a store that did not answer)."""
    text = str(exc)
    return "was not found" in text or "Not found:" in text.split(",", 1)[0]


def delta_exists(path: str) -> bool:
    """Whether there is a Delta table at `path` (its log read here, no Spark job)."""
    from deltalake import DeltaTable

    return DeltaTable.is_deltatable(object_url(path), storage_options=delta_rs_storage(path))


def lance_exists(path: str) -> bool:
    """Whether a Lance table is at `path`. A store that does not answer (after
    pylance's retries) raises: on object storage "unreachable" must never read as
    "absent", or a writer would start the table afresh."""
    import lance

    try:
        lance.dataset(path)
        return True
    except (ValueError, OSError) as exc:
        if _not_found(exc) or not is_url(path) and not os.path.exists(path):
            return False
        raise OSError(f"could not read the Lance table at {path}: {exc}") from None


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


# ----------------------------------------------------------------------------- Delta


def read_delta(spark, path: str):
    """The Delta table at `path` as a DataFrame, or None if there is none yet."""
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, path):
        return None
    return spark.read.format("delta").load(path)


def delta_rs_table(path: str, *, write: bool = False):
    """The Delta table at `path` opened with delta-rs (no Spark job: its log is read in
    this process), or None if there is none. On an object store, `write` lets delta-rs
    commit with a plain PUT: only the run lock's holder writes a lakeshard table, the
    same single-writer guarantee Spark's S3 log store relies on."""
    from deltalake import DeltaTable

    url = object_url(path)
    opts = delta_rs_storage(path, write=write)
    if not DeltaTable.is_deltatable(url, storage_options=opts):
        return None
    return DeltaTable(url, storage_options=opts)


def delta_rs_storage(path: str, *, write: bool = False) -> dict[str, str] | None:
    """delta-rs's storage options for `path` (see :func:`delta_rs_table`); the rest of
    its S3 settings come from the environment :func:`use_storage` set."""
    if write and is_url(object_url(path)):
        return {"AWS_S3_ALLOW_UNSAFE_RENAME": "true"}
    return None


def delta_rs_unsupported(exc: Exception) -> bool:
    """Whether `exc` is delta-rs refusing a table for a protocol feature it does not
    implement (a table Spark created with settings of its own), as opposed to a
    failure of the read or commit itself."""
    from deltalake.exceptions import DeltaError, DeltaProtocolError

    return isinstance(exc, DeltaProtocolError) or (
        isinstance(exc, DeltaError) and "Unsupported table features" in str(exc))


def _delta_metadata(spark, path: str) -> tuple[int, dict[str, str]] | None:
    """(latest version, table properties) of the Delta table at `path`, None if there
    is none: read from its log by delta-rs, without a Spark job. A table using a
    feature delta-rs does not read (Spark wrote it with settings of its own) is asked
    through Spark instead."""
    from deltalake.exceptions import DeltaError

    try:
        table = delta_rs_table(path)
        if table is None:
            return None
        return table.version(), dict(table.metadata().configuration or {})
    except DeltaError as exc:
        if not delta_rs_unsupported(exc):
            raise
        from delta.tables import DeltaTable

        if not DeltaTable.isDeltaTable(spark, path):
            return None
        table = DeltaTable.forPath(spark, path)
        version = table.history(1).select("version").first()[0]
        return version, dict(table.detail().select("properties").first()[0] or {})


def delta_version(spark, path: str) -> int | None:
    """The latest version of the Delta table at `path`, None if there is none."""
    meta = _delta_metadata(spark, path)
    return None if meta is None else meta[0]


def delta_properties(spark, path: str) -> dict[str, str] | None:
    """The table properties of the Delta table at `path` (from its log, no Spark job),
    None if there is none."""
    meta = _delta_metadata(spark, path)
    return None if meta is None else meta[1]
