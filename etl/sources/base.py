"""The adapter interface and the columns every adapter's output gets in common."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema

from etl.config import ConfigError, SourceConfig
from etl.schema import SOURCE_SCHEMA, sample_id_col, sample_id_of

__all__ = [
    "SourceAdapter", "finish_ingest", "finish_ingest_arrow", "is_local_path", "local_path",
    "require_exists", "file_uri", "FLAG_KEYS",
]

# Mapping keys for the upstream flags every kind may map (to a column or JSON field).
FLAG_KEYS = frozenset({"quality", "nsfw", "watermark", "pii"})


class SourceAdapter(ABC):
    kind: str
    # Common-schema fields a `columns:` mapping may name, and those it must name.
    mappable: frozenset[str] = frozenset()
    required_mapping: frozenset[str] = frozenset()
    # Whether its containers' records carry no container fingerprint of their own (table
    # files: records are keyed): an unchanged container is then told by what curate
    # remembers beside the manifest (:mod:`etl.lakehouse.curate_state`), not by the
    # manifest's fingerprints (tar shards).
    remembered_containers: bool = False

    def validate_config(self, source: SourceConfig, where: str) -> None:
        """Static checks on the parsed config; raise ConfigError naming the field."""
        unknown = sorted(set(source.columns) - self.mappable)
        if unknown:
            allowed = ", ".join(sorted(self.mappable)) or "none"
            raise ConfigError(
                f"{where}.columns: {unknown[0]!r} is not a field a {self.kind} source "
                f"can map (allowed: {allowed})"
            )
        for key in sorted(self.required_mapping - set(source.columns)):
            raise ConfigError(f"{where}.columns.{key}: required for kind {self.kind!r}")
        if not source.has_url_column:
            # The rules of a URL list; this source's references come from its own path.
            for key in sorted({"allow_local", "url_schemes"} & source.model_fields_set):
                raise ConfigError(
                    f"{where}.{key}: only for sources whose images are named by a URL "
                    "column (columns.url)"
                )

    @abstractmethod
    def check_inputs(self, source: SourceConfig) -> None:
        """Driver-side checks against the inputs (no Spark job): paths, columns."""

    @abstractmethod
    def read(
        self, spark: SparkSession, source: SourceConfig, skip: frozenset[str] = frozenset(),
        version: int | None = None,
    ) -> DataFrame:
        """Rows of :data:`etl.sources.records.RAW_SCHEMA`: one per input record, the
        image either embedded (`image_bytes`) or referenced (`image_ref` + range), read
        failures as `read_status`/`read_reason`. `skip`: containers (see
        :meth:`containers`) known unchanged, not to be opened at all. `version`: the
        table version to read (see :meth:`snapshot_version`); None: the latest."""

    def listing_digest(self, source: SourceConfig) -> str | None:
        """A driver-side digest of what :meth:`read` would list (file names, sizes, mtimes;
        a table's version), computed without opening a record; None when a kind cannot
        tell cheaply. Two equal digests promise the same records with the same
        fingerprints: curate then skips comparing the listing with the manifest."""
        return None

    def lists_in_driver(self, source: SourceConfig,
                        skip: frozenset[str] = frozenset()) -> bool:
        """Whether :meth:`read` lists this source on the driver, handing Spark an Arrow
        table of local data (a small local URL list; a night's few changed table files,
        the containers in `skip` left unopened): curate then takes the same rows from
        :meth:`read_arrow` and numbers their repeated keys, compares them with the
        manifest and counts them on the driver, without a Spark job. False for kinds
        read in Spark tasks."""
        return False

    def read_arrow(self, source: SourceConfig, skip: frozenset[str] = frozenset()
                   ) -> pa.Table:
        """The rows :meth:`read` gives (the containers in `skip` left unopened), read in
        this process as an Arrow table of :data:`etl.sources.records.RAW_SCHEMA` (kinds
        whose :meth:`lists_in_driver`)."""
        raise NotImplementedError(f"kind {self.kind!r} is not read on the driver")

    def driver_listing(self, source: SourceConfig) -> dict[str, str | None] | None:
        """``source_key -> fingerprint`` of every record :meth:`read` would list, listed
        on the driver without opening a record (a folder's names, sizes and mtimes);
        None for kinds whose records are only known by reading them (tables, shards).
        Curate then compares it with the manifest on the driver and reads through Spark
        only the records that are new or changed (:meth:`read_keys`). Its keys are
        unique, and it has no containers (nothing that can fail to list part of it)."""
        return None

    def read_keys(self, spark: SparkSession, source: SourceConfig,
                  keys: frozenset[str], on_driver: bool = False) -> DataFrame:
        """:meth:`read`, for only the records with these `keys` (kinds with a
        :meth:`driver_listing`). `on_driver`: the keys are few, and what the read does
        per record in Python (a sidecar's parse) is done here on the driver, so that
        the frame's plan holds no Python UDF (no Python worker starts for it)."""
        raise NotImplementedError(f"kind {self.kind!r} has no driver listing")

    def names_rows(self, source: SourceConfig) -> bool:
        """Whether its records name their embedded images by file and row
        (``image_ref``, ``image_offset``) instead of carrying them: the fetch reads a
        file's rows a part at a time, so the records to prepare go to the tasks sorted
        by them (a table of parquet files with an ``image`` column)."""
        return False

    def hints_records(self, source: SourceConfig) -> bool:
        """Whether :meth:`records_hint` may answer for this source, told without
        listing it (a local path, a kind that implements it)."""
        return False

    def records_hint(self, source: SourceConfig,
                     skip: frozenset[str] = frozenset()) -> int | None:
        """How many records the containers not in `skip` hold, when the kind can tell
        without reading them (local parquet files, by their footers); None when it
        cannot. A hint, not a count: curate starts the executors' Python workers
        while it lists when the hint says the night will be prepared in Spark."""
        return None

    def containers(self, source: SourceConfig) -> dict[str, str] | None:
        """Files holding many records (tar shards, table files) -> fingerprint, listed
        on the driver, for kinds that can skip an unchanged container whole; None for
        other kinds. Every record :meth:`read` lists from a container has the
        container's URI as its ``source_uri``."""
        return None

    # Removals. Every kind finds the records its source no longer lists by comparing
    # the manifest with the listing; a kind with a change history (Delta, Lance) first
    # asks the history which keys were deleted since the version the last run read, and
    # checks only those.

    def snapshot_version(self, spark: SparkSession, source: SourceConfig) -> int | None:
        """The source table's current version, which this run reads (`read(version=)`)
        and the next run's history starts from; None for kinds without versions."""
        return None

    def deleted_keys(self, spark: SparkSession, source: SourceConfig, since: int,
                     until: int) -> tuple[DataFrame, str] | None:
        """``source_key`` s deleted between versions `since` (exclusive) and `until`
        (inclusive) and how that was read ("change data feed", "version diff"); None
        when the history cannot say (kept no further back, not enabled): the caller then
        compares the whole listing with the manifest."""
        return None


def finish_ingest(df: DataFrame, source: SourceConfig) -> DataFrame:
    """Add `source` and the stable `sample_id`, apply the source's default licence,
    and return exactly the source columns (:data:`etl.schema.SOURCE_SCHEMA`); columns
    an adapter does not produce are null."""
    out = df.withColumn("source", F.lit(source.name))
    for f in SOURCE_SCHEMA.fields:
        if f.name not in out.columns and f.name != "sample_id":
            out = out.withColumn(f.name, F.lit(None).cast(f.dataType))
    if source.license is not None:
        out = out.withColumn("license", F.coalesce(F.col("license"), F.lit(source.license)))
    out = out.withColumn("sample_id", sample_id_col(F.col("source"), F.col("source_key")))
    return out.select(*SOURCE_SCHEMA.fieldNames())


def finish_ingest_arrow(raw: pa.Table, source: SourceConfig) -> pa.Table:
    """:func:`finish_ingest` for rows read on the driver (:meth:`SourceAdapter.read_arrow`),
    in Arrow: the same columns and values, computed in this process."""
    schema = to_arrow_schema(SOURCE_SCHEMA)
    keys = raw.column("source_key").to_pylist()
    columns = []
    for f in schema:
        if f.name == "source":
            values = pa.array([source.name] * raw.num_rows, f.type)
        elif f.name == "sample_id":
            values = pa.array([None if k is None else sample_id_of(source.name, k)
                               for k in keys], f.type)
        elif f.name in raw.column_names:
            values = raw.column(f.name).cast(f.type)
        else:
            values = pa.nulls(raw.num_rows, f.type)
        if f.name == "license" and source.license is not None:
            values = pc.fill_null(values, source.license)
        columns.append(values)
    return pa.Table.from_arrays(columns, schema=schema)


def is_local_path(path: str) -> bool:
    scheme = urlparse(path).scheme
    return scheme in ("", "file") or len(scheme) == 1  # a Windows drive letter


def file_uri(path: str | Path) -> str:
    """`file:` + the absolute path, byte for byte (no percent-encoding, links not
    resolved): read back by stripping the prefix, never by URL parsing
    (:class:`udfs.fetch_http.RefRules` ``own``)."""
    return "file:" + os.path.abspath(os.fspath(path))


def local_path(path: str) -> Path:
    """The local path of a configured `path` (a path, or a `file://` URL someone typed)."""
    return Path(urlparse(path).path if path.startswith("file:") else path)


def require_exists(source: SourceConfig) -> None:
    if is_local_path(source.path) and not local_path(source.path).exists():
        raise ConfigError(
            f"source {source.name!r}: path {source.path!r} does not exist "
            f"(field sources[].path of {source.name!r})"
        )
