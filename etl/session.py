"""The one SparkSession factory, driven by config.

Delta comes in through its JARs (``spark.jars`` from the folder ``make jars`` fills)
and its SQL extension and catalog; Lance through the Python data source
:class:`etl.writers.lance.LanceDataSource`, registered as format ``lance`` (SQL views
over the tables: :mod:`etl.lakehouse.views`) -- in a pipeline run's session only when
lakeshard first reads a table through it (``lance_format=False``: the registration makes
Spark start a Python process, which a night that reads nothing through Spark skips).

Object storage: when the root or a source is on ``s3://``/``s3a://`` and lakeshard
supplies Spark's JARs, it adds the Hadoop S3A connector (``<jars_dir>/s3a``, filled by
``make jars-s3a``), maps ``s3://`` to it, and points it at the store the rest of the
process uses (``storage.s3`` over the AWS environment: endpoint, region, path style;
credentials from the environment / instance profile / web identity, never in Spark's
conf). Platforms with their own ``s3://`` filesystem (EMR's EMRFS, Databricks) install
their JARs themselves (``spark.jars_dir: null``) and get nothing added.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
from pathlib import Path

from pyspark.sql import SparkSession

from etl import tables
from etl.config import Config
from etl.config.catalog import GLUE_FACTORY, GLUE_FACTORY_KEY
from etl.config.runtime import S3_SCHEMES, S3A_RETRY_CONF
from etl.errors import JarsMissingError, UnsupportedSparkError
from etl.runtime.jvm import driver_jvm, starts_own_jvm
from etl.storage import use_storage
from etl.writers.remote import s3_settings

__all__ = [
    "spark_conf", "get_spark", "JarsMissingError", "uses_s3", "supplies_s3a",
    "check_spark_version", "SUPPORTED_SPARK", "catalog_conf",
]

# Delta's Spark JAR for Scala 2.13: `delta-spark_2.13-4.0.*.jar` (Delta 4.0, Spark 4.0) or
# `delta-spark_4.1_2.13-4.4.*.jar` (Delta >= 4.1 names the Spark it is built for).
_DELTA_JAR = "delta-spark_*2.13-*.jar"
# The Spark versions lakeshard is tested on (docs/operations.md, "Platforms"): the
# Python data source API (with Arrow writers) is Spark >= 4.0; 4.2 is not tested yet.
SUPPORTED_SPARK = ((4, 0), (4, 1))
_S3A_JAR = "hadoop-aws-*.jar"
_JAVA_OPTIONS = "spark.driver.extraJavaOptions"
_S3A_FS = "org.apache.hadoop.fs.s3a.S3AFileSystem"
# Credentials: the AWS SDK's default chain -- environment (AWS_ACCESS_KEY_ID, ...,
# AWS_SESSION_TOKEN), system properties, web identity (EKS IRSA), profile, container
# (EKS Pod Identity, ECS), EC2 instance profile.
_S3A_CREDENTIALS = "software.amazon.awssdk.auth.credentials.DefaultCredentialsProvider"


def uses_s3(cfg: Config) -> bool:
    """Whether Spark reads or writes ``s3://``/``s3a://`` paths for `cfg`: the root, or
    a source. (Exports and the run lock go through boto3, not Spark.)"""
    paths = [cfg.storage.root, *(s.path for s in cfg.sources)]
    return any(p.split("://", 1)[0] in S3_SCHEMES for p in paths if "://" in p)


def supplies_s3a(cfg: Config) -> bool:
    """Whether lakeshard configures S3A for Spark (storage.s3.connector; `auto`: when it
    supplies the JARs and Spark touches S3)."""
    connector = cfg.storage.s3.connector
    if connector == "platform":
        return False
    if connector == "s3a":
        return True
    return cfg.spark.jars_dir is not None and uses_s3(cfg)


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
    if supplies_s3a(cfg):
        s3a = sorted(glob.glob(str(jars_dir / "s3a" / "*.jar")))
        if not any(Path(j).match(_S3A_JAR) for j in s3a):
            raise JarsMissingError(
                f"storage on s3:// needs the Hadoop S3A connector, not found in "
                f"{jars_dir / 's3a'} (spark.jars_dir). Run `make jars-s3a` (Maven, 12 MB) "
                "to fetch it; on a platform with its own s3:// filesystem set "
                "storage.s3.connector: platform."
            )
        jars += s3a
    return jars


def _s3a_conf(cfg: Config) -> dict[str, str]:
    """Hadoop settings of S3A on the process's S3 settings (no credentials)."""
    s = s3_settings()
    conf = {
        "spark.hadoop.fs.s3.impl": _S3A_FS,
        "spark.hadoop.fs.AbstractFileSystem.s3.impl": "org.apache.hadoop.fs.s3a.S3A",
        "spark.hadoop.fs.s3a.aws.credentials.provider": _S3A_CREDENTIALS,
        "spark.hadoop.fs.s3a.path.style.access": "true" if s.path_style else "false",
        **{f"spark.hadoop.{k}": v for k, v in S3A_RETRY_CONF.items()},
    }
    if s.endpoint:
        conf["spark.hadoop.fs.s3a.endpoint"] = s.endpoint
        conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] = (
            "false" if s.endpoint.startswith("http://") else "true")
    if s.region:
        conf["spark.hadoop.fs.s3a.endpoint.region"] = s.region
    return conf


def _executor_env(cfg: Config) -> dict[str, str]:
    """The non-secret S3 settings for executors' Python workers (pylance, the MDS
    writer), as the driver resolved them; empty when no S3 setting is in play."""
    keys = ("AWS_ENDPOINT_URL", "S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION",
            "AWS_DEFAULT_REGION", "AWS_ALLOW_HTTP", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST",
            "AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS")
    if not (uses_s3(cfg) or any(os.environ.get(k) for k in keys[:3])):
        return {}
    return {f"spark.executorEnv.{k}": os.environ[k] for k in keys if os.environ.get(k)}


def catalog_conf(cfg: Config) -> dict[str, str]:
    """Spark's catalog settings for `catalog:` (docs/sql.md): Hive support for kinds
    hive and glue -- the embedded Derby metastore under ``<root>/_catalog`` (a local
    root: etl.config refuses it on an object store), a standalone one at
    `metastore_uri`, or EMR's Glue client; nothing for ``none`` and ``unity``
    (Databricks' session is the cluster's own)."""
    cat = cfg.catalog
    if cat.kind not in ("hive", "glue"):
        return {}
    conf = {"spark.sql.catalogImplementation": "hive"}
    if cat.embedded:
        lay = tables.layout(cfg)
        db = Path(lay.metastore_db).resolve()
        conf.update({
            "spark.hadoop.javax.jdo.option.ConnectionURL":
                f"jdbc:derby:;databaseName={db};create=true",
            "spark.sql.warehouse.dir": str(Path(lay.catalog_warehouse).resolve()),
        })
    elif cat.metastore_uri is not None:
        conf["spark.hadoop.hive.metastore.uris"] = cat.metastore_uri
    else:
        conf[GLUE_FACTORY_KEY] = GLUE_FACTORY
    return conf


def _derby_log(cfg: Config, conf: dict[str, str]) -> None:
    """The embedded metastore's derby.log beside it, not in the working directory."""
    if cfg.catalog.embedded:
        log_dir = Path(tables.layout(cfg).catalog_dir).resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
        log_file = log_dir / "derby.log"
        conf[_JAVA_OPTIONS] = " ".join(filter(None, [
            conf.get(_JAVA_OPTIONS), f"-Dderby.stream.error.file={log_file}"]))


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
        # PySpark records the Python call site of every Column function for its error
        # messages: ~0.6 ms of JVM round trips per call, hundreds of calls as curate
        # plans a night (bench: docs/performance.md). lakeshard's expressions are its own,
        # and a failing stage still names its step and shows both tracebacks.
        "spark.python.sql.dataFrameDebugging.enabled": "false",
        # Spark's console progress bar, only when lakeshard prints no progress of its
        # own: the two interleave on one terminal line.
        "spark.ui.showConsoleProgress": "false" if cfg.run.progress_interval_s else "true",
    }
    if cfg.spark.master.startswith("local"):
        # Delta replays its log into 50 partitions by default: 50 tasks on every read
        # and MERGE of the small rejects/manifest/ledger tables, ~all overhead on one
        # machine. A cluster keeps Delta's default (or sets its own in spark.conf).
        conf["spark.databricks.delta.snapshotPartitions"] = "4"
        # The executors are this interpreter: its Python daemon imports what every task
        # needs once, before it forks the workers (etl/runtime/worker_daemon.py). A
        # cluster whose executors have lakeshard installed may set it in spark.conf.
        conf["spark.python.daemon.module"] = "etl.runtime.worker_daemon"
    use_storage(cfg.storage)
    jars = _jar_paths(cfg)
    if jars:
        conf["spark.jars"] = ",".join(jars)
    if supplies_s3a(cfg):
        conf.update(_s3a_conf(cfg))
    conf.update(_executor_env(cfg))
    root = cfg.storage.root
    # lakeshard keeps no catalog tables (path-based Delta, Lance views), but Spark makes
    # its warehouse folder at start: under a local root, else in the local cache -- never
    # a spark-warehouse/ in the working directory.
    warehouse = Path(root, "warehouse") if not cfg.storage.is_remote else Path(
        cfg.storage.local_cache, "spark-warehouse")
    conf["spark.sql.warehouse.dir"] = str(warehouse.resolve())
    conf.update(catalog_conf(cfg))
    # Extra JARs from config add to lakeshard's list instead of replacing it.
    extra = cfg.spark.conf.get("spark.jars")
    conf.update(cfg.spark.conf)
    if extra and jars:
        conf["spark.jars"] = ",".join([*jars, *(j for j in extra.split(",") if j.strip())])
    _derby_log(cfg, conf)
    return conf


def _check_java() -> None:
    java_home = os.environ.get("JAVA_HOME")
    java = Path(java_home, "bin", "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise JarsMissingError(
            "Java not found (no JAVA_HOME, no `java` on PATH). Spark 4 needs Java 17 or "
            "21: `apt-get install openjdk-17-jre-headless`."
        )


def check_spark_version(version: str) -> None:
    """Refuse, before any work, a Spark that lakeshard is not tested on: below 4.0 the
    Python data source API it writes Lance with does not exist; 4.2 and later are not
    tested (docs/operations.md, "Platforms")."""
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        raise UnsupportedSparkError(f"unrecognised Spark version {version!r}") from None
    if major_minor not in SUPPORTED_SPARK:
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_SPARK)
        need = ("the Python data source API (pyspark.sql.datasource, Spark >= 4.0), which "
                "lakeshard reads and writes Lance tables with" if major_minor < (4, 0)
                else "a Spark lakeshard is tested on")
        raise UnsupportedSparkError(
            f"Spark {version} is not supported: lakeshard needs {need}; supported: "
            f"{supported} (docs/operations.md, \"Platforms\")")


def get_spark(cfg: Config, *, archive_classes: bool = False,
              lance_format: bool = True) -> SparkSession:
    """Build (or return the running) SparkSession for `cfg`. `archive_classes`: a
    driver JVM this process starts may write the class archive (etl/runtime/jvm.py;
    pipeline runs do). `lance_format`: register format ``lance`` now, for code that
    names the format itself (notebooks, `lakeshard sql`); without it,
    :func:`etl.writers.lance.lance_reader` registers it on first use."""
    import pyspark

    check_spark_version(pyspark.__version__)
    from etl.writers.lance import register_lance

    if cfg.spark.master.startswith("local"):
        _check_java()
        # Executors are Python workers of this same interpreter.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    conf = spark_conf(cfg)
    jvm = None
    if starts_own_jvm():  # a driver JVM this process starts: etl/runtime/jvm.py
        opts = cfg.spark.driver_jvm
        jvm = driver_jvm(opts.class_archive, opts.quick_jit, cfg.storage.machine_cache,
                         _jar_paths(cfg), " ".join([conf.get("spark.driver.memory", ""),
                                                    conf.get(_JAVA_OPTIONS, "")]),
                         may_dump=archive_classes)
        conf[_JAVA_OPTIONS] = " ".join(filter(None, [jvm.java_options,
                                                     conf.get(_JAVA_OPTIONS)]))
    builder = SparkSession.builder.master(cfg.spark.master).appName(cfg.spark.app_name)
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    if jvm is not None:
        jvm.publish_at_exit(spark)
    spark.sparkContext.setLogLevel("WARN")
    if lance_format:
        register_lance(spark)
    return spark
