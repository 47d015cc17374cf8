"""Spark SQL views for analysts, next to the ones :func:`etl.session.register_lance_views`
creates (``curated``, every column).

* ``<table>_meta``: every column except binary ones (image bytes) and vectors -- Spark's
  Python data sources get no column pruning from SQL, so a query over ``curated`` reads
  the image bytes; over ``curated_meta`` it never does.
* ``<table>_versions``: the table's versions (version, timestamp, rows, fragments,
  data_bytes), to pick one for time travel.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from pyspark.sql import SparkSession

from etl.config import Config, ConfigError

__all__ = ["meta_columns", "register_lakehouse_views"]


def meta_columns(schema: pa.Schema) -> list[str]:
    """Columns that are cheap to scan: no binary payloads, no fixed-size vectors."""
    heavy = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_fixed_size_list)
    return [f.name for f in schema if not any(is_(f.type) for is_ in heavy)]


def register_lakehouse_views(spark: SparkSession, cfg: Config) -> list[str]:
    """Create ``<table>_meta`` and ``<table>_versions`` temp views per Lance table."""
    import lance

    from etl.lakehouse.maintenance import table_versions

    lance_dir = cfg.storage.lance_dir
    if "://" in lance_dir:
        raise ConfigError("register_lakehouse_views lists local folders only")
    names = []
    for table in sorted(Path(lance_dir).glob("*.lance")):
        name = table.name[: -len(".lance")]
        cols = meta_columns(lance.dataset(str(table)).schema)
        (
            spark.read.format("lance").option("columns", ",".join(cols)).load(str(table))
            .createOrReplaceTempView(f"{name}_meta")
        )
        versions = [
            (v.version, v.timestamp, v.rows, v.fragments, v.data_bytes)
            for v in table_versions(str(table))
        ]
        spark.createDataFrame(
            versions, "version long, timestamp timestamp, rows long, fragments long, "
            "data_bytes long"
        ).createOrReplaceTempView(f"{name}_versions")
        names += [f"{name}_meta", f"{name}_versions"]
    return names
