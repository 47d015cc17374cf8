"""`lakeshard sql`'s rule (and the SQL endpoint's: the same function), judged on Spark's
own parsed plan (nothing is run): which statements are read-only, which functions and
paths a read-only one may use, and how a refused one is named. The command end to end:
tests/test_hostile_run.py; over Thrift: tests/test_sql_server.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from etl.lakehouse.readonly import inside_root, refusal

ROOT = "/r"  # the storage root the statements are judged against

READ_ONLY = [
    "SELECT 1", "VALUES (1), (2)", "SELECT * FROM range(3)",
    "WITH a AS (SELECT 1 AS x) SELECT * FROM a",
    "SELECT a, count(*) FROM t GROUP BY a HAVING count(*) > 1 ORDER BY 1 LIMIT 3 OFFSET 1",
    "SELECT * FROM t TABLESAMPLE (10 PERCENT)", "SELECT /*+ REPARTITION(2) */ * FROM t",
    "SELECT * FROM t PIVOT (sum(a) FOR b IN (1, 2))",
    "SELECT * FROM t LATERAL VIEW explode(x) e AS y", "SELECT * FROM t VERSION AS OF 3",
    "SELECT * FROM (SELECT 1 AS a) s WHERE a IN (SELECT 1)", "SELECT 1 UNION ALL SELECT 2",
    "EXPLAIN SELECT 1", "EXPLAIN EXTENDED WITH a AS (SELECT 1) SELECT * FROM a",
    "SHOW TABLES", "SHOW VIEWS", "SHOW DATABASES", "SHOW FUNCTIONS", "SHOW COLUMNS IN t",
    "SHOW TBLPROPERTIES t", "SHOW CREATE TABLE t", "SHOW PARTITIONS t",
    "DESCRIBE t", "DESCRIBE t a", "DESCRIBE FUNCTION abs",
    "DESCRIBE HISTORY delta.`/r/x`", "DESCRIBE DETAIL delta.`/r/x`",
    # contents: built-ins (qualified too), lambdas, paths under the root, harmless TVFs
    "SELECT upper(a), transform(x, v -> v + 1), builtin.abs(-1), system.builtin.abs(1)",
    "SELECT * FROM delta.`/r/delta/rejects`", "SELECT * FROM delta.`file:/r/delta/x`",
    "SELECT * FROM parquet.`/r/a/../b`", "SELECT * FROM delta.`/r/delta/rejects@v1`",
    "SELECT * FROM explode(array(1, 2))", "SELECT * FROM db.t", "SELECT * FROM cat.db.t",
    "SELECT * FROM t LATERAL VIEW explode(x) e AS y",
    "SHOW TABLES IN lakeshard", "USE lakeshard", "USE spark_catalog.default",
    "SHOW TABLE EXTENDED LIKE 'r*'", "DESCRIBE lakeshard.rejects",
]
_JVM = "(a function that calls into the JVM or reads its workers)"
_OUTSIDE = "(a path-based relation outside the storage root /r)"
_NOT_BUILTIN = "(not one of Spark's built-in functions)"
# What an attacker tries: run Java, read files outside the root, change the session.
ATTACKS = [
    ("SELECT reflect('java.lang.System', 'getProperty', 'user.name')", f"reflect() {_JVM}"),
    ("SELECT JAVA_METHOD('java.lang.Runtime', 'getRuntime')", f"JAVA_METHOD() {_JVM}"),
    ("SELECT try_reflect('java.lang.System', 'exit', 0)", f"try_reflect() {_JVM}"),
    ("SELECT `reflect`('a', 'b')", f"reflect() {_JVM}"),
    ("SELECT /* x */ rEfLeCt -- c\n('a', 'b')", f"rEfLeCt() {_JVM}"),
    ("SELECT system.builtin.reflect('a', 'b')", f"system.builtin.reflect() {_JVM}"),
    ("SELECT transform(array(1), x -> java_method('a', 'b'))", f"java_method() {_JVM}"),
    ("SELECT (SELECT reflect('a', 'b'))", f"reflect() {_JVM}"),
    ("SELECT 1 WHERE EXISTS (SELECT java_method('a', 'b'))", f"java_method() {_JVM}"),
    ("SELECT 1 WHERE 1 IN (SELECT reflect('a', 'b'))", f"reflect() {_JVM}"),
    ("WITH a AS (SELECT reflect('a', 'b') AS r) SELECT * FROM a", f"reflect() {_JVM}"),
    ("EXPLAIN SELECT reflect('a', 'b')", f"reflect() {_JVM}"),
    ("SELECT * FROM stack(1, reflect('a', 'b'))", f"reflect() {_JVM}"),
    ("SELECT * FROM range(1) LATERAL VIEW explode(array(reflect('a', 'b'))) e AS y",
     f"reflect() {_JVM}"),
    ("SELECT IDENTIFIER('reflect')('a', 'b')", "IDENTIFIER() with a computed name"),
    ("SELECT IDENTIFIER('ref' || 'lect')('a', 'b')", "IDENTIFIER() with a computed name"),
    ("SELECT * FROM IDENTIFIER('text.`/etc`')", "IDENTIFIER() with a computed name"),
    ("SELECT * FROM python_worker_logs()", f"python_worker_logs() {_JVM}"),
    ("SELECT * FROM read_files('/etc/hostname')", f"read_files() {_NOT_BUILTIN}"),
    ("SELECT mydb.myudf(1)", f"mydb.myudf() {_NOT_BUILTIN}"),
    ("SELECT system.session.f(1)", f"system.session.f() {_NOT_BUILTIN}"),
    ("SELECT * FROM text.`/etc/hostname`", f"text.`/etc/hostname` {_OUTSIDE}"),
    ("SELECT * FROM `TEXT`.`/etc/hostname`", f"TEXT.`/etc/hostname` {_OUTSIDE}"),
    ("SELECT * FROM csv.`file:///etc/passwd`", f"csv.`file:///etc/passwd` {_OUTSIDE}"),
    ("SELECT * FROM json.`/r/../etc/passwd`", f"json.`/r/../etc/passwd` {_OUTSIDE}"),
    ("SELECT * FROM parquet.`/r/*/../../etc`", f"parquet.`/r/*/../../etc` {_OUTSIDE}"),
    ("SELECT * FROM orc.`/{r,etc}/x`", f"orc.`/{{r,etc}}/x` {_OUTSIDE}"),
    ("SELECT * FROM binaryFile.`/etc`", f"binaryFile.`/etc` {_OUTSIDE}"),
    ("SELECT * FROM avro.`s3a://other/x`", f"avro.`s3a://other/x` {_OUTSIDE}"),
    ("SELECT * FROM delta.`/rx/delta`", f"delta.`/rx/delta` {_OUTSIDE}"),
    ("SELECT * FROM text.`hostname`", f"text.`hostname` {_OUTSIDE}"),
    ("SELECT * FROM org.apache.spark.sql.execution.datasources.v2.text.TextDataSourceV2"
     ".`/etc/hostname`", _OUTSIDE),
    ("SELECT * FROM `org.apache.spark.sql.execution.datasources.v2.text.TextDataSourceV2`"
     ".`/etc/hostname`", _OUTSIDE),
    ("SELECT * FROM (SELECT * FROM text.`/etc/hostname`)", _OUTSIDE),
    ("SELECT 1 WHERE EXISTS (SELECT * FROM text.`/etc/hostname`)", _OUTSIDE),
    ("WITH a AS (SELECT * FROM text.`/etc/hostname`) SELECT * FROM a", _OUTSIDE),
    ("SELECT * FROM delta.`/r/x` UNION ALL SELECT * FROM text.`/etc/hostname`", _OUTSIDE),
    ("DESCRIBE text.`/etc/hostname`", _OUTSIDE), ("USE text.`/etc`", _OUTSIDE),
    ("DESCRIBE HISTORY delta.`/tmp/t`", _OUTSIDE),
    ("SELECT * FROM delta.`/etc` VERSION AS OF 1", _OUTSIDE),
    ("SELECT TRANSFORM(a) USING 'id' AS (b) FROM t", "ScriptTransformation"),
    ("FROM t SELECT TRANSFORM(a) USING 'sh -c id'", "ScriptTransformation"),
    ("ADD JAR '/tmp/x.jar'", "ADD JAR"), ("ADD FILE '/tmp/x'", "ADD FILE"),
    ("ADD ARCHIVE '/tmp/x.zip'", "ADD ARCHIVE"), ("LIST JAR", "LIST JAR"),
    ("CREATE TEMPORARY FUNCTION f AS 'x.Y'", "CREATE FUNCTION"),
    ("CREATE FUNCTION f AS 'x.Y' USING JAR '/tmp/x.jar'", "CREATE FUNCTION"),
    ("SET spark.sql.runSQLOnFiles=true", "SET (SetCommand)"),
    ("SET spark.hadoop.fs.file.impl=x", "SET (SetCommand)"), ("SET -v", "SET (SetCommand)"),
    ("RESET", "RESET"), ("RESET spark.sql.ansi.enabled", "RESET"),
    ("SET VAR x = 1", "SET VAR"), ("DECLARE VARIABLE v INT", "DECLARE VARIABLE"),
    ("EXECUTE IMMEDIATE 'SELECT reflect(1)'", "EXECUTE IMMEDIATE"),
    ("CACHE TABLE t", "CACHE TABLE"), ("CACHE LAZY TABLE c AS SELECT 1", "CACHE TABLE"),
    ("UNCACHE TABLE t", "UNCACHE TABLE"), ("CLEAR CACHE", "CLEAR CACHE"),
    ("LOAD DATA LOCAL INPATH '/etc/passwd' INTO TABLE t", "LOAD DATA"),
    ("INSERT OVERWRITE DIRECTORY '/tmp/x' USING text SELECT 'x'",
     "INSERT OVERWRITE DIRECTORY"),
    ("INSERT OVERWRITE LOCAL DIRECTORY '/tmp/x' SELECT 'x'", "INSERT OVERWRITE DIRECTORY"),
    ("CREATE TABLE t (a INT) USING text LOCATION '/etc'", "CREATE TABLE"),
    ("CREATE TEMPORARY VIEW v USING text OPTIONS (path '/etc/hostname')",
     "CREATE TEMPORARY VIEW"),
    ("MSCK REPAIR TABLE t", "MSCK REPAIR TABLE"), ("REFRESH TABLE t", "REFRESH TABLE"),
    ("REFRESH '/etc'", "REFRESH"), ("ANALYZE TABLE t COMPUTE STATISTICS", "ANALYZE TABLE"),
    ("ANALYZE TABLES COMPUTE STATISTICS", "ANALYZE TABLES"),
    ("DROP TEMPORARY FUNCTION f", "DROP FUNCTION"), ("DROP VIEW curated", "DROP VIEW"),
    ("OPTIMIZE delta.`/r/x`", "OPTIMIZE"), ("RESTORE delta.`/r/x` TO VERSION AS OF 0",
                                           "RESTORE"),
]
REFUSED = [
    ("DELETE FROM delta.`/r/delta/rejects` WHERE 1 = 1", "DELETE (DeleteFromTable)"),
    ("UPDATE t SET a = 1", "UPDATE (UpdateTable)"),
    ("MERGE INTO t USING s ON t.a = s.a WHEN MATCHED THEN DELETE", "MERGE (MergeIntoTable)"),
    ("INSERT INTO t SELECT 1", "INSERT (InsertIntoStatement)"),
    ("WITH a AS (SELECT 1) INSERT INTO t SELECT * FROM a", "INSERT (InsertIntoStatement)"),
    ("INSERT OVERWRITE DIRECTORY '/tmp/x' SELECT 1", "INSERT OVERWRITE DIRECTORY"),
    ("CREATE TABLE t USING delta LOCATION '/outside' AS SELECT 1",
     "CREATE TABLE AS SELECT (CreateTableAsSelect)"),
    ("CREATE TABLE t (a INT) USING delta", "CREATE TABLE (CreateTable)"),
    ("CREATE OR REPLACE TEMPORARY VIEW v AS SELECT 1", "CREATE VIEW"),
    ("DROP TABLE t", "DROP TABLE (DropTable)"),
    ("ALTER TABLE t SET LOCATION '/x'", "ALTER TABLE SET LOCATION (SetTableLocation)"),
    ("TRUNCATE TABLE t", "TRUNCATE TABLE"), ("SET spark.sql.x = 1", "SET (SetCommand)"),
    ("SET", "SET (SetCommand)"),
    ("CACHE TABLE t", "CACHE TABLE"), ("VACUUM delta.`/x`", "VACUUM (VacuumTableCommand)"),
    ("EXPLAIN DELETE FROM t", "DELETE (DeleteFromTable)"),
]


def test_read_only_statements_pass(spark):
    assert {sql: refusal(spark, sql, ROOT) for sql in READ_ONLY} == dict.fromkeys(READ_ONLY)


def test_writing_statements_are_refused_by_kind(spark):
    for sql, kind in REFUSED:
        assert (refusal(spark, sql, ROOT) or "").startswith(kind), sql


def test_attacks_are_refused_with_the_reason(spark):
    got = {sql: refusal(spark, sql, ROOT) or "" for sql, _ in ATTACKS}
    wrong = {sql: got[sql] for sql, reason in ATTACKS if reason not in got[sql]}
    assert not wrong


def test_paths_resolve_symlinks_and_schemes(tmp_path):
    root = tmp_path / "root"
    (root / "delta").mkdir(parents=True)
    (root / "out").symlink_to("/etc")
    assert inside_root(f"{root}/delta/rejects", str(root))
    assert inside_root(f"file://{root}/delta", str(root))
    assert not inside_root(f"{root}/out/hostname", str(root))  # a symlink out of the root
    assert not inside_root(f"{root}/../x", str(root))
    assert not inside_root(f"{root}x/delta", str(root))
    assert not inside_root("/etc/hostname", None)  # no root: no path at all
    assert inside_root("s3a://b/root/delta/t", "s3://b/root")
    assert not inside_root("s3://b/root/../other", "s3://b/root")
    assert not inside_root("s3://c/root/t", "s3://b/root")
    assert not inside_root("/b/root/t", "s3://b/root")


def test_every_recipe_query_in_the_doc_passes(spark):
    text = (Path(__file__).resolve().parents[1] / "docs" / "sql.md").read_text()
    queries = re.findall(r"<!-- recipe: \w+ -->\s*```sql\n(.*?)```", text, flags=re.S)
    assert queries
    for block in queries:
        for sql in (s for s in block.split(";") if s.strip()):
            if sql.strip().upper().startswith("CREATE OR REPLACE TEMPORARY VIEW"):
                continue  # for a session of one's own (docs/sql.md#read-only)
            assert refusal(spark, sql, "lakeshard-data") is None, sql


def test_a_parse_error_is_spark_s_own(spark):
    from pyspark.errors import ParseException

    with pytest.raises(ParseException):
        refusal(spark, "SELEC 1")
