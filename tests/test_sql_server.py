"""`lakeshard sql-server` with real clients: one endpoint per module, started as the CLI
starts it (a process of its own, on a free loopback port) over a small curated Lance
table and a Delta rejects table. A Python HiveServer2 client (PyHive, `lakeshard sql`'s
warm path) and beeline (hive-jdbc from pyspark's JARs) find the tables by name, run the
docs' recipes, and are refused writes and attacks with the rule's reason; `lakeshard sql`
takes its warm path through it without importing pyspark; SIGTERM stops it with exit 0
and frees the port. DuckDB reads the same
tables without Spark (deltalake -> Arrow for Delta: DuckDB's delta extension is
downloaded on first use, and this machine has no network)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest
import yaml
from conftest import JARS_DIR, REPO, make_config
from lakehouse_data import ROWS, write_curated
from test_hostile_sql import ATTACKS
from test_sql_recipes import REJECTS, recipes

from etl import tables
from etl.errors import ConfigError
from etl.lakehouse import curated_meta
from etl.lakehouse.sql_server import check_host, run_statements
from etl.schema import REJECTS_SCHEMA

# The recipes that make a temporary view (and those reading it) are for a session of
# one's own: the endpoint refuses CREATE (docs/sql.md#read-only).
_SESSION_ONLY = {"time_travel_view", "time_travel_count", "time_travel_diff"}
# Every sixth attack of tests/test_hostile_sql.py (all of them judge the same function,
# tested there in full), less the relative path: the endpoint's working directory here
# is the storage root, where `hostname` is inside it.
THRIFT_ATTACKS = [a for a in ATTACKS[::6] if "`hostname`" not in a[0]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def endpoint(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("sql-server")
    cfg = make_config(root)
    lay = tables.layout(cfg)
    write_curated(spark, lay.curated, ROWS, parts=2)
    spark.createDataFrame(REJECTS, REJECTS_SCHEMA).write.format("delta").save(lay.rejects)
    catalog = {"kind": "hive", "publish_curated_meta": True}
    assert curated_meta.sync(spark, make_config(root, catalog=catalog)) is not None
    port = _free_port()
    conf = root / "conf.yaml"
    conf.write_text(yaml.safe_dump({
        "storage": {"root": str(root)},
        "spark": {"master": "local[1]", "jars_dir": str(JARS_DIR),
                  "conf": {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false",
                           "spark.databricks.delta.snapshotPartitions": "2"}},
        "sql": {"port": port},
        "catalog": catalog,
        "sources": [{"name": "dummy", "kind": "image_folder", "path": str(root)}],
    }))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = root / "server.log"  # a file, not a pipe: a full pipe would stall the server
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "etl.cli", "sql-server", "--conf", str(conf)],
            stdout=out, stderr=subprocess.STDOUT, text=True, env=env, cwd=root)
    deadline = time.monotonic() + 300
    while "listening on" not in log.read_text() and proc.poll() is None \
            and time.monotonic() < deadline:  # the URL is printed once the port listens
        time.sleep(1)
    assert _listening(port), log.read_text()[-5000:]
    endpoint = f"127.0.0.1:{port}"
    url_line = next(x for x in log.read_text().splitlines() if "listening on" in x)
    yield {"endpoint": endpoint,
           "proc": proc, "port": port, "conf": conf, "url_line": url_line, "lay": lay,
           "log": log}
    if proc.poll() is None:
        proc.kill()


def test_clients_find_tables_run_recipes_and_are_refused(endpoint):
    at, lay = endpoint["endpoint"], endpoint["lay"]
    assert f"jdbc:hive2://{at}/" in endpoint["url_line"]
    queries = {name: sql.replace("lakeshard-data/delta/rejects", lay.rejects)
               for name, sql in recipes().items() if name not in _SESSION_ONLY}
    statements = ["SHOW TABLES", "SELECT count(*) FROM curated",
                  # the catalog's tables by name, registered by the endpoint at start
                  "SHOW TABLES IN lakeshard", "SELECT count(*) FROM lakeshard.rejects",
                  "SELECT count(*) FROM lakeshard.curated_meta", *queries.values(),
                  *(sql for sql, _ in THRIFT_ATTACKS),
                  f"DELETE FROM delta.`{lay.rejects}`", "SELECT count(*) FROM curated_meta"]
    results = run_statements(at, statements)
    assert len(results) == len(statements)
    shown, count, registered, rejects, meta, *rest = results
    assert {"curated", "curated_meta", "curated_versions"} <= {r[1] for r in shown.rows}
    assert count.rows == ((str(len(ROWS)),),)
    assert {("lakeshard", "rejects"), ("lakeshard", "curated_meta")} <= {
        r[:2] for r in registered.rows}, registered
    assert rejects.rows == ((str(len(REJECTS)),),)
    assert meta.rows == ((str(len(ROWS)),),)
    answers = dict(zip(queries, rest[: len(queries)], strict=True))
    assert {n: a.error for n, a in answers.items()} == dict.fromkeys(queries)
    # What they answer, computed from the rows written (as tests/test_sql_recipes.py).
    by_source = sorted((s, str(len(rs)), str(sum(r["keep"] for r in rs)))
                       for s in {r["source"] for r in ROWS}
                       for rs in [[r for r in ROWS if r["source"] == s]])
    assert [a[:3] for a in answers["counts_by_source"].rows] == by_source
    rejected = Counter((r[1], r[4], r[5]) for r in REJECTS)
    assert answers["rejects_by_reason"].rows == tuple(
        (*k, str(n)) for k, n in sorted(rejected.items()))
    attacks = rest[len(queries): len(queries) + len(THRIFT_ATTACKS)]
    wrong = {sql: a.error for (sql, reason), a in zip(THRIFT_ATTACKS, attacks, strict=True)
             if not (a.error and "lakeshard: refused" in a.error)
             or reason.replace("storage root /r)", "storage root") not in a.error}
    assert not wrong
    delete, after = rest[-2:]
    assert "lakeshard: refused: DELETE (DeleteFromTable)" in delete.error
    assert after.rows == ((str(len(ROWS)),),)  # the connection still answers
    # Settings asked for when the session opens (what a Hive JDBC URL's
    # `?spark.sql.ansi.enabled=false` sends; applied by the Thrift server without SET):
    # the connection never opens.
    with pytest.raises(ConnectionError, match=r"asked for by the connection \(spark\.sql"):
        run_statements(at, ["SELECT 1"], settings={"set:hiveconf:spark.sql.ansi.enabled": "false"})
    # A bare key goes to Hive's own session conf, never to Spark's: ANSI division stays.
    (ansi,) = run_statements(at, ["SELECT 1/0"], settings={"spark.sql.ansi.enabled": "false"})
    assert "DIVIDE_BY_ZERO" in ansi.error


def test_beeline_and_the_warm_path(endpoint, capsys):
    import pyspark

    from etl.cli import main

    jars = os.path.join(os.path.dirname(pyspark.__file__), "jars", "*")
    res = subprocess.run(
        ["java", "-cp", jars, "org.apache.hive.beeline.BeeLine", "-u",
         f"jdbc:hive2://{endpoint['endpoint']}/", "--outputformat=csv2", "--silent=true",
         "--force=true", "-e",
         "SELECT source, count(*) AS n FROM curated_meta GROUP BY source ORDER BY source; "
         "SELECT reflect('java.lang.System', 'getProperty', 'user.name');"],
        capture_output=True, text=True, timeout=300)
    want = Counter(r["source"] for r in ROWS)
    assert [tuple(line.split(",")) for line in res.stdout.split()[1:]] == \
        [(s, str(n)) for s, n in sorted(want.items())], res.stdout + res.stderr[-3000:]
    assert "lakeshard: refused: reflect()" in res.stderr

    # docs/sql.md's PyHive recipe: an open connection, as a notebook without Spark holds one.
    from pyhive import hive

    host, port = endpoint["endpoint"].rsplit(":", 1)
    conn = hive.connect(host=host, port=int(port), auth="NONE", username="analyst")
    try:
        cur = conn.cursor()
        started = time.perf_counter()
        cur.execute("SELECT source, count(*) FROM curated_meta GROUP BY source ORDER BY source")
        assert cur.fetchall() == sorted(want.items())
        round_trip = time.perf_counter() - started
    finally:
        conn.close()

    # `lakeshard sql` with sql.endpoint, a process of its own as a user runs it: the
    # endpoint answers over PyHive; no Spark session, no JVM is started here (warm).
    conf = endpoint["conf"]
    warm = conf.with_name("warm.yaml")
    raw = yaml.safe_load(conf.read_text())
    warm.write_text(yaml.safe_dump({**raw, "sql": {"endpoint": endpoint["endpoint"]}}))
    started = time.perf_counter()
    res = _cli("sql", "--conf", str(warm), "SELECT count(*) AS n FROM curated_meta")
    took = time.perf_counter() - started
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(rf"^\|\s*{len(ROWS)}\|$", res.stdout, re.M), res.stdout
    assert "no Spark" in res.stdout
    capsys.readouterr()
    assert main(["sql", "--conf", str(warm), "SELECT * FROM text.`/etc/hostname`"]) == 2
    assert "refused: text.`/etc/hostname`" in capsys.readouterr().err
    # Nothing listening there: a clear message naming sql.endpoint, no traceback.
    closed = f"127.0.0.1:{_free_port()}"
    warm.write_text(yaml.safe_dump({**raw, "sql": {"endpoint": closed}}))
    assert main(["sql", "--conf", str(warm), "SELECT 1"]) == 1
    err = capsys.readouterr().err
    assert f"SQL endpoint {closed} (sql.endpoint): cannot connect" in err, err
    assert "Traceback" not in err
    with capsys.disabled():
        print(f"\nwarm: a query on an open PyHive connection {round_trip:.2f} s; "
              f"lakeshard sql through the endpoint (whole process) {took:.2f} s")


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`lakeshard *args` in a fresh Python that then says whether it started Spark (a
    JVM: py4j's gateway)."""
    code = ("import sys; from etl.cli import main; rc = main(sys.argv[1:]); "
            "from pyspark import SparkContext; "  # imported by the CLI's stage registry
            "print('no Spark' if SparkContext._active_spark_context is None "
            "and SparkContext._gateway is None else 'Spark started'); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_duckdb_reads_delta_and_lance_without_spark(endpoint):
    import duckdb
    import lance
    from deltalake import DeltaTable

    lay = endpoint["lay"]
    rejects = DeltaTable(lay.rejects).to_pyarrow_dataset()  # noqa: F841 -- read by DuckDB
    got = duckdb.sql("SELECT reason, count(*) FROM rejects GROUP BY 1 ORDER BY 1").fetchall()
    assert got == sorted(Counter(r[5] for r in REJECTS).items())
    scan = lance.dataset(lay.curated).scanner(columns=["source", "keep"])  # noqa: F841
    got = duckdb.sql("SELECT source, count(*) FROM scan GROUP BY 1 ORDER BY 1").fetchall()
    assert got == sorted(Counter(r["source"] for r in ROWS).items())


def test_only_loopback_unless_the_config_names_the_address(tmp_path):
    cfg = make_config(tmp_path)
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_host(cfg, host)
    for host in ("0.0.0.0", "192.0.2.7", "example.org"):
        with pytest.raises(ConfigError, match=f"set sql.host: {host}"):
            check_host(cfg, host)
    check_host(make_config(tmp_path, sql={"host": "0.0.0.0"}), "0.0.0.0")


def test_sigterm_stops_it_and_frees_the_port(endpoint):
    proc = endpoint["proc"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    out = endpoint["log"].read_text()
    assert proc.returncode == 0, out[-3000:]
    assert "lakeshard sql-server: stopped" in out
    assert not _listening(endpoint["port"])
