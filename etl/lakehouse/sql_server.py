"""The SQL endpoint (``lakeshard sql-server``): Spark's Thrift server (HiveServer2
protocol: beeline, DBeaver, any Hive JDBC/ODBC client) over lakeshard's session, read-only.

The session is the one :func:`etl.session.get_spark` makes for the config (Delta, the
catalog of ``catalog:`` when one is configured, Hive support), plus the parser extension
``lakeshard.sql.ReadOnlyExtension`` (Java, ``jars/sqlguard/``): every statement any
connection sends is parsed by Spark's parser and then judged by
:func:`etl.lakehouse.readonly.plan_refusal` -- the rule ``lakeshard sql`` applies, called
back from the JVM through py4j -- before Spark analyses it. The views of
:func:`etl.lakehouse.views.register_views` (curated, curated_meta, …) are registered in
the server's session at start; each connection's own session gets a copy on its first
statement (so one connection's ``USE`` or settings never reach another's).

The JAR is built once with ``javac`` against pyspark's own JARs into the machine cache
(keyed by its sources' digest), or taken from ``<spark.jars_dir>/sqlguard/`` where one
was placed (a cluster without a JDK: build it where there is one, and ship it).
:func:`run_statements` is the client side: a small Hive JDBC client
(``lakeshard.sql.Client``, same JAR) run as a subprocess -- ``lakeshard sql``'s warm path.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

from pyspark.sql import SparkSession

from etl.config import Config
from etl.errors import ConfigError, JarsMissingError

__all__ = [
    "GUARD_SOURCES", "guard_jar", "build_guard_jar", "endpoint_conf", "start_endpoint",
    "serve", "Endpoint", "StatementResult", "run_statements", "check_host", "jdbc_url",
]

log = logging.getLogger(__name__)

GUARD_SOURCES = Path(__file__).resolve().parents[2] / "jars" / "sqlguard"
_JAR_NAME = "lakeshard-sqlguard.jar"
_EXTENSION = "lakeshard.sql.ReadOnlyExtension"
_LOOPBACK = ("localhost",)


def _pyspark_jars() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent / "jars"


def _sources() -> list[Path]:
    return sorted(GUARD_SOURCES.rglob("*.java"))


def build_guard_jar(out: Path) -> Path:
    """Compile ``jars/sqlguard`` with ``javac`` against pyspark's JARs into the JAR `out`
    (written to a temporary name, then renamed: a reader never sees half a JAR)."""
    javac = shutil.which("javac", path=str(Path(os.environ["JAVA_HOME"], "bin"))
                         if os.environ.get("JAVA_HOME") else None) or shutil.which("javac")
    if javac is None:
        raise JarsMissingError(
            "javac not found: the SQL endpoint's read-only guard (jars/sqlguard) is built "
            "with a JDK (`apt-get install openjdk-17-jdk-headless`), or run `make jars` on a "
            "machine with one and ship .jars/sqlguard/")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        subprocess.run(
            [javac, "-nowarn", "-d", tmp, "-cp", str(_pyspark_jars() / "*"),
             *map(str, _sources())], check=True, capture_output=True, text=True)
        partial = Path(tmp, _JAR_NAME)
        with zipfile.ZipFile(partial, "w") as jar:
            for cls in sorted(Path(tmp).rglob("*.class")):
                jar.write(cls, cls.relative_to(tmp).as_posix())
        os.replace(partial, out)
    return out


def guard_jar(cfg: Config) -> Path:
    """The guard JAR: ``<spark.jars_dir>/sqlguard/`` (a copy shipped there), else built
    once into the machine cache under its sources' digest."""
    if cfg.spark.jars_dir is not None:
        shipped = Path(cfg.spark.jars_dir, "sqlguard", _JAR_NAME)
        if shipped.is_file():
            return shipped
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in _sources())).hexdigest()[:16]
    cached = Path(cfg.storage.machine_cache, "sqlguard", digest, _JAR_NAME)
    return cached if cached.is_file() else build_guard_jar(cached)


def check_host(cfg: Config, host: str) -> None:
    """A loopback address, or the one the config names (`sql.host`): binding elsewhere
    exposes the root's tables to the network (docs/sql.md, "Security")."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host in _LOOPBACK
    if not loopback and host != cfg.sql.host:
        raise ConfigError(
            f"sql-server --host {host}: not a loopback address, and sql.host is "
            f"{cfg.sql.host!r}; set sql.host: {host} in the config to serve on it "
            "(docs/sql.md, \"Security\": what that exposes)")


def jdbc_url(host: str, port: int) -> str:
    return f"jdbc:hive2://{host}:{port}/"


def endpoint_conf(cfg: Config, host: str, port: int, jar: Path) -> dict[str, str]:
    """The Spark settings the endpoint adds to the config's: the guard JAR and extension,
    Hive support, a session per connection, the Thrift server's address."""
    from etl.session import spark_conf

    base = spark_conf(cfg)
    extensions = [e for e in base.get("spark.sql.extensions", "").split(",") if e.strip()]
    jars = [j for j in cfg.spark.conf.get("spark.jars", "").split(",") if j.strip()]
    every = [j for j in base.get("spark.jars", "").split(",") if j.strip()]
    # On the driver's class path too: the Thrift server's threads resolve the Delta
    # catalog and the guard with the application class loader, not spark.jars'.
    class_path = [base.get("spark.driver.extraClassPath", ""), *every, str(jar)]
    return {
        "spark.jars": ",".join([*jars, str(jar)]),
        "spark.driver.extraClassPath": os.pathsep.join(p for p in class_path if p),
        "spark.sql.extensions": ",".join([*extensions, _EXTENSION]),
        "spark.sql.catalogImplementation": "hive",
        "spark.sql.hive.thriftServer.singleSession": "false",  # a session per connection
        "spark.hadoop.hive.server2.thrift.bind.host": host,
        "spark.hadoop.hive.server2.thrift.port": str(port),
        "spark.hadoop.hive.server2.transport.mode": "binary",
        "spark.hadoop.hive.server2.enable.doAs": "false",
        "spark.ui.enabled": base.get("spark.ui.enabled", "false"),
    }


class _Guard:
    """The py4j side of ``lakeshard.sql.Guard``: the read-only rule, for the root."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.starting = True  # lakeshard's own statements before the server listens
        # (registering the catalog's tables); closed for good before any connection

    def refusal(self, plan, session) -> str | None:
        from etl.lakehouse.readonly import plan_refusal

        if self.starting:
            return None
        return plan_refusal(plan, session, self.root)

    class Java:
        implements = ["lakeshard.sql.Guard"]


@dataclass(frozen=True)
class Endpoint:
    """A running endpoint: its session, the JVM server object, its JDBC URL."""

    spark: SparkSession
    server: object
    url: str
    views: tuple[str, ...]

    def stop(self) -> None:
        self.server.stop()
        self.spark.stop()


def start_endpoint(cfg: Config, host: str, port: int) -> Endpoint:
    """Start the session (guard installed before any statement), register the views and,
    with a catalog configured, every Delta table of the root by name (as a run does:
    idempotent, free when the memo says they are), start the Thrift server on
    `host`:`port`."""
    from pyspark.java_gateway import ensure_callback_server_started

    from etl.lakehouse.registration import register_tables
    from etl.lakehouse.views import register_views
    from etl.session import get_spark

    check_host(cfg, host)
    extra = endpoint_conf(cfg, host, port, guard_jar(cfg))
    served = cfg.model_copy(update={"spark": cfg.spark.model_copy(
        update={"conf": {**cfg.spark.conf, **extra}})})
    spark = get_spark(served)
    gateway = spark.sparkContext._gateway
    ensure_callback_server_started(gateway)
    jvm = spark.sparkContext._jvm
    guard = _Guard(cfg.storage.root)
    jvm.lakeshard.sql.ReadOnlyParser.install(guard, spark._jsparkSession)
    views = tuple(register_views(spark, cfg))
    register_tables(spark, cfg)
    guard.starting = False  # before the Thrift server takes its first connection
    thrift = jvm.org.apache.spark.sql.hive.thriftserver.HiveThriftServer2
    server = thrift.startWithContext(spark._jsparkSession.sqlContext())
    return Endpoint(spark, server, jdbc_url(host, port), views)


def serve(cfg: Config, host: str, port: int) -> int:
    """Run the endpoint until SIGTERM or SIGINT; print its JDBC URL once it listens.
    The handlers are installed once the session is up (starting Spark installs its own
    SIGINT handler)."""
    endpoint = start_endpoint(cfg, host, port)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set())
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        print(f"lakeshard sql-server: listening on {endpoint.url} (read-only; views: "
              f"{', '.join(endpoint.views) or 'none'}); stop with SIGTERM or Ctrl-C",
              flush=True)
        while not stop.wait(1.0):
            pass
        endpoint.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("lakeshard sql-server: stopped", flush=True)
    return 0


@dataclass(frozen=True)
class StatementResult:
    """One statement's answer from the endpoint: columns and rows (strings, None for
    NULL), or the server's error."""

    columns: tuple[str, ...] = ()
    rows: tuple[tuple[str | None, ...], ...] = ()
    error: str | None = None


def _unescape(field: str) -> str | None:
    if field == "\\N":
        return None
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 1 < len(field):
            out.append({"t": "\t", "n": "\n", "\\": "\\"}.get(field[i + 1], field[i + 1]))
            i += 2
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _parse_output(text: str) -> list[StatementResult]:
    results, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("ERROR "):
            results.append(StatementResult(error=_unescape(line[6:])))
        elif line == "OK" or line.startswith("OK "):
            columns = tuple(_unescape(c) for c in line[3:].split("\t")) if line[3:] else ()
            rows = []
            while not lines[i].startswith("END "):
                rows.append(tuple(_unescape(f) for f in lines[i].split("\t")))
                i += 1
            i += 1
            results.append(StatementResult(columns, tuple(rows)))
    return results


def run_statements(cfg: Config, endpoint: str, statements: list[str], *,
                   limit: int | None = None, url_suffix: str = "",
                   timeout_s: float = 600) -> list[StatementResult]:
    """Run `statements` over one JDBC connection to `endpoint` (``host:port``; the
    URL's database and settings: `url_suffix`) with ``lakeshard.sql.Client`` (a JVM of
    its own: no Spark in this process)."""
    java = Path(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") \
        else shutil.which("java")
    if java is None:
        raise JarsMissingError("java not found: the endpoint's client is Java (hive-jdbc)")
    jar = guard_jar(cfg)
    host, _, port = endpoint.rpartition(":")
    cmd = [str(java), "-XX:TieredStopAtLevel=1", "-Xshare:auto", "-cp",
           f"{jar}{os.pathsep}{_pyspark_jars() / '*'}", "lakeshard.sql.Client",
           jdbc_url(host, int(port)) + url_suffix, str(limit or 2**31 - 1)]
    text = "".join(s.strip().replace("\\", "\\\\").replace("\n", "\\n") + "\n"
                   for s in statements)
    res = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        raise ConnectionError(f"SQL endpoint {endpoint}: {_message(res.stderr)}")
    return [replace(r, error=_message(r.error)) if r.error else r
            for r in _parse_output(res.stdout)]


def _message(error: str) -> str:
    """The server's reason without its Java stack: from ``lakeshard: refused:`` to the
    docs link when the guard refused, else the error's last cause line."""
    start = error.find("lakeshard: refused:")
    if start >= 0:
        end = error.find("(docs/sql.md#read-only)", start)
        return error[start:end + len("(docs/sql.md#read-only)")] if end >= 0 else error[start:]
    lines = [x.strip() for x in error.splitlines() if x.strip() and not x.strip().startswith("at ")]
    causes = [x for x in lines if x.startswith("Caused by:")]
    return (causes[-1] if causes else lines[0] if lines else error)[:2000]
