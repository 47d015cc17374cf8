"""How lakeshard reaches a table: object URLs and the process's S3 environment, whether a
Lance or Delta table exists, and Delta tables opened by Spark or, without a Spark job,
by delta-rs (its log read in this process): versions and properties.

The names and paths of lakeshard's own tables are :mod:`etl.tables`; what each holds,
its writes and its queries, :mod:`etl.lakehouse.catalog`.
"""

from __future__ import annotations

import os

from etl.config import StorageConfig
from etl.config.runtime import S3_SCHEMES, is_url

__all__ = [
    "object_url",
    "use_storage",
    "delta_exists",
    "lance_exists",
    "read_delta",
    "delta_rs_table",
    "delta_rs_storage",
    "delta_rs_unsupported",
    "delta_version",
    "delta_properties",
]


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


def read_delta(spark, path: str):
    """The Delta table at `path` as a DataFrame, or None if there is none yet."""
    if not delta_exists(path):  # its log looked for here: no JVM call for no table
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
