"""The one SparkSession factory, driven by config.

Delta comes in through its JARs (``spark.jars`` from the folder ``make jars`` fills)
and its SQL extension and catalog; Lance through the Python data source
:class:`etl.writers.lance.LanceDataSource`, registered as format ``lance`` (SQL views
over the tables: :mod:`etl.lakehouse.views`).
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
from pathlib import Path

from pyspark.sql import SparkSession

from etl.config import Config
from etl.errors import JarsMissingError

__all__ = ["spark_conf", "get_spark", "JarsMissingError"]

_DELTA_JAR = "delta-spark_4.1_2.13-*.jar"


def _jar_paths(cfg: Config) -> list[str]:
    if cfg.spark.jars_dir is None:
        return []  # a cluster that installs the JARs as libraries
    jars_dir = Path(cfg.spark.jars_dir).resolve()
    jars = sorted(glob.glob(str(jars_dir / "*.jar")))
    if not any(Path(j).match(_DELTA_JAR) for j in jars):
        raise JarsMissingError(
            f"Delta JAR ({_DELTA_JAR}) not found in {jars_dir} (spark.jars_dir). "
            "Run `make jars` (needs Maven: `apt-get install maven`) to fetch it."
        )
    return jars


def spark_conf(cfg: Config) -> dict[str, str]:
    """Every Spark setting lakeshard applies; config's `spark.conf` wins."""
    conf = {
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        # Image rows are ~0.1-20 MB: bound the rows per Arrow batch a UDF receives, or a
        # default 10,000-row batch of images can exhaust a Python worker's memory.
        "spark.sql.execution.arrow.maxRecordsPerBatch": "64",
        # ...and their bytes: a batch is also cut at 16 MiB, so 64 large images (20 MB
        # each would be 1.3 GB) cannot exhaust a worker either. Throughput cost: none
        # measurable (bench/prepare_throughput.py, 2-64 MiB all within noise).
        "spark.sql.execution.arrow.maxBytesPerBatch": str(16 << 20),
        "spark.python.worker.reuse": "true",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.shuffle.partitions": "8",
        "spark.ui.showConsoleProgress": "true",
    }
    if cfg.spark.master.startswith("local"):
        # Delta replays its log into 50 partitions by default: 50 tasks on every read
        # and MERGE of the small rejects/manifest/ledger tables, ~all overhead on one
        # machine. A cluster keeps Delta's default (or sets its own in spark.conf).
        conf["spark.databricks.delta.snapshotPartitions"] = "4"
    jars = _jar_paths(cfg)
    if jars:
        conf["spark.jars"] = ",".join(jars)
    root = cfg.storage.root
    if "://" not in root:
        conf["spark.sql.warehouse.dir"] = str(Path(root, "warehouse").resolve())
    conf.update(cfg.spark.conf)
    return conf


def _check_java() -> None:
    java_home = os.environ.get("JAVA_HOME")
    java = Path(java_home, "bin", "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise JarsMissingError(
            "Java not found (no JAVA_HOME, no `java` on PATH). Spark 4.1 needs Java 17 or "
            "21: `apt-get install openjdk-17-jre-headless`."
        )


def get_spark(cfg: Config) -> SparkSession:
    """Build (or return the running) SparkSession for `cfg`."""
    from etl.writers.lance import LanceDataSource

    if cfg.spark.master.startswith("local"):
        _check_java()
        # Executors are Python workers of this same interpreter.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.master(cfg.spark.master).appName(cfg.spark.app_name)
    for key, value in spark_conf(cfg).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    spark.dataSource.register(LanceDataSource)
    return spark
