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
:func:`run_statements` is the client side, ``lakeshard sql``'s warm path: a HiveServer2
client in Python (PyHive over Thrift, SASL PLAIN), so a query starts neither Spark nor a
JVM in the caller's process.
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from etl.config import Config
from etl.errors import ConfigError, JarsMissingError

if TYPE_CHECKING:  # the client side (`lakeshard sql`'s warm path) starts no Spark
    from pyspark.sql import SparkSession

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


def _text(value: object) -> str | None:
    """A value as the Hive JDBC driver's ``getString`` writes it: None for NULL,
    ``true``/``false``, text for bytes (complex types already arrive as JSON text)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _server_error(exc: Exception) -> str:
    """The server's message in a PyHive error (its argument is the Thrift response:
    ``status.errorMessage``, or ``errorMessage`` for an operation's status)."""
    response = exc.args[0] if exc.args else None
    status = getattr(response, "status", None)
    text = getattr(status, "errorMessage", None) or getattr(response, "errorMessage", None)
    return _message(text or str(exc))


def _connect(endpoint: str, settings: dict[str, str] | None, timeout_s: float):
    """A PyHive connection to `endpoint` (SASL PLAIN, the Thrift server's default
    ``hive.server2.authentication=NONE``) with a socket timeout; a server that is not
    there, or that refuses the session, raises :class:`ConnectionError`."""
    import thrift_sasl
    from pyhive import exc as hive_errors
    from pyhive import hive
    from thrift.transport.TSocket import TSocket
    from thrift.transport.TTransport import TTransportException

    host, _, port = endpoint.rpartition(":")
    sock = TSocket(host, int(port))
    sock.setTimeout(timeout_s * 1000)
    transport = thrift_sasl.TSaslClientTransport(
        lambda: hive.get_installed_sasl(host=host, sasl_auth="PLAIN", username="lakeshard",
                                        password="x"), "PLAIN", sock)
    socket_log = logging.getLogger("thrift.transport.TSocket")  # it logs the failure we
    level = socket_log.level  # raise, with our message, below: once is enough
    socket_log.setLevel(logging.CRITICAL)
    try:
        return hive.connect(thrift_transport=transport, username="lakeshard",
                            configuration=settings)
    except (TTransportException, OSError) as exc:
        raise ConnectionError(
            f"SQL endpoint {endpoint} (sql.endpoint): cannot connect ({exc}); start one "
            "with `lakeshard sql-server`, or remove sql.endpoint to run the query in a "
            "Spark session of its own") from exc
    except hive_errors.Error as exc:
        raise ConnectionError(f"SQL endpoint {endpoint}: {_server_error(exc)}") from exc
    finally:
        socket_log.setLevel(level)


def run_statements(endpoint: str, statements: list[str], *,
                   limit: int | None = None, settings: dict[str, str] | None = None,
                   timeout_s: float = 600) -> list[StatementResult]:
    """Run `statements` over one HiveServer2 connection to `endpoint` (``host:port``;
    session `settings` as a Hive JDBC URL's ``?key=value`` sends them, which the endpoint
    refuses) with PyHive: pure Python, no JVM in this process. At most `limit` rows of
    each answer are fetched."""
    from pyhive import exc as hive_errors

    results = []
    conn = _connect(endpoint, settings, timeout_s)
    try:
        for statement in statements:
            cursor = conn.cursor(arraysize=min(limit or 10_000, 10_000))
            try:
                cursor.execute(statement.strip())
                columns = tuple(d[0] for d in cursor.description or ())
                rows = cursor.fetchmany(limit) if limit is not None else cursor.fetchall()
                results.append(StatementResult(
                    columns, tuple(tuple(_text(v) for v in r) for r in rows)))
            except hive_errors.Error as exc:
                results.append(StatementResult(error=_server_error(exc)))
            finally:
                cursor.close()
    finally:
        conn.close()
    return results


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
