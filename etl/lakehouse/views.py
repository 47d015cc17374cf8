"""Spark SQL temporary views for analysts (``lakeshard sql``, the notebooks).

:func:`register_views` creates, for every Lance table under ``<root>/lance/<namespace>/``:

* ``<table>`` (``curated`` for ``curated.lance``): every column;
* ``<table>_meta``: every column except binary ones (image bytes) and vectors -- Spark's
  Python data sources get no column pruning from SQL, so a query over ``curated`` reads
  the image bytes; over ``curated_meta`` it never does;
* ``<table>_versions``: the table's versions (version, timestamp, rows, fragments,
  data_bytes), to pick one for time travel;

and, once dedup has run, ``dedup`` (one row per sample), ``dup_clusters`` (one row per
cluster of 2+: size, canonical member, members, sources, kinds) and ``curated`` with
``dup_cluster_id, is_canonical, dup_kind, cluster_size`` joined in; once a run was
recorded, ``runs`` (the latest status of every run and stage) and ``run_events`` (the
run ledger as appended: every transition).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.fs as pafs
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from etl import ledger, storage, tables
from etl.config import Config
from etl.writers.lance import lance_reader
from etl.writers.remote import filesystem

__all__ = ["meta_columns", "register_views", "register_dedup_views", "register_ledger_views"]


def meta_columns(schema: pa.Schema) -> list[str]:
    """Columns that are cheap to scan: no binary payloads, no fixed-size vectors."""
    heavy = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_fixed_size_list)
    return [f.name for f in schema if not any(is_(f.type) for is_ in heavy)]


def _lance_tables(cfg: Config) -> list[tuple[str, str]]:
    """(name, path) of every ``*.lance`` table under the namespace folder, local or on
    an object store (listed through pyarrow: one LIST request there)."""
    lance_dir = tables.layout(cfg).lance_dir
    fs, inner = filesystem(lance_dir)
    entries = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    names = sorted(
        e.base_name[: -len(".lance")] for e in entries
        if e.type == pafs.FileType.Directory and e.base_name.endswith(".lance")
    )
    return [(name, f"{lance_dir}/{name}.lance") for name in names]


def register_views(spark: SparkSession, cfg: Config) -> list[str]:
    """Create every view; returns their names."""
    import lance

    from etl.lakehouse.maintenance import table_versions

    names = []
    for name, path in _lance_tables(cfg):
        lance_reader(spark).load(path).createOrReplaceTempView(name)
        cols = meta_columns(lance.dataset(path).schema)
        (
            lance_reader(spark).option("columns", ",".join(cols)).load(path)
            .createOrReplaceTempView(f"{name}_meta")
        )
        versions = [
            (v.version, v.timestamp, v.rows, v.fragments, v.data_bytes)
            for v in table_versions(path)
        ]
        spark.createDataFrame(
            versions, "version long, timestamp timestamp, rows long, fragments long, "
            "data_bytes long"
        ).createOrReplaceTempView(f"{name}_versions")
        names += [name, f"{name}_meta", f"{name}_versions"]
    names += [n for n in register_dedup_views(spark, cfg) if n not in names]
    names += [n for n in register_ledger_views(spark, cfg) if n not in names]
    return names


def register_ledger_views(spark: SparkSession, cfg: Config) -> list[str]:
    """`runs` (latest status per run and stage) and `run_events` (every event); no-op
    before the first run."""
    path = tables.layout(cfg).runs
    events = ledger.read_runs(spark, path, latest=False)
    if events is None:
        return []
    events.createOrReplaceTempView("run_events")
    ledger.latest_runs(events).createOrReplaceTempView("runs")
    return ["runs", "run_events"]


def register_dedup_views(spark: SparkSession, cfg: Config) -> list[str]:
    """`dedup`, `dup_clusters` and `curated` with the dedup columns joined in; no-op
    without a dedup table."""
    table = storage.read_delta(spark, tables.layout(cfg).dedup)
    if table is None:
        return []
    table.createOrReplaceTempView("dedup")
    clusters = (
        table.where("cluster_size > 1")
        .groupBy("dup_cluster_id")
        .agg(
            F.count(F.lit(1)).alias("cluster_size"),
            F.max(F.when(F.col("is_canonical"), F.col("sample_id"))).alias("canonical_sample_id"),
            F.max(F.when(F.col("is_canonical"), F.col("source"))).alias("canonical_source"),
            F.sort_array(F.collect_list("sample_id")).alias("members"),
            F.sort_array(F.collect_set("source")).alias("sources"),
            F.sum((F.col("dup_kind") == "exact").cast("int")).alias("exact"),
            F.sum((F.col("dup_kind") == "near").cast("int")).alias("near"),
        )
    )
    clusters.createOrReplaceTempView("dup_clusters")
    names = ["dedup", "dup_clusters"]
    curated_path = tables.layout(cfg).curated
    if not storage.lance_exists(curated_path):
        return names
    curated = lance_reader(spark).load(curated_path)
    dup_cols = table.select("sample_id", "dup_cluster_id", "is_canonical", "dup_kind",
                            "cluster_size")
    curated.join(dup_cols, "sample_id", "left").createOrReplaceTempView("curated")
    return [*names, "curated"]
