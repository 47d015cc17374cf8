"""`lakeshard sql`'s rule, judged on Spark's own parsed plan (nothing is run): which
statements are read-only, and how a refused one is named. The command end to end:
tests/test_hostile_run.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from etl.lakehouse.readonly import refusal

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
    "DESCRIBE HISTORY delta.`/x`", "DESCRIBE DETAIL delta.`/x`",
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
    ("SET", "SET (SetCommand)"), ("USE x", "USE (SetCatalogAndNamespace)"),
    ("CACHE TABLE t", "CACHE TABLE"), ("VACUUM delta.`/x`", "VACUUM (VacuumTableCommand)"),
    ("EXPLAIN DELETE FROM t", "DELETE (DeleteFromTable)"),
]


@pytest.mark.parametrize("sql", READ_ONLY)
def test_read_only_statements_pass(spark, sql):
    assert refusal(spark, sql) is None


@pytest.mark.parametrize("sql, kind", REFUSED)
def test_writing_statements_are_refused_by_kind(spark, sql, kind):
    assert (refusal(spark, sql) or "").startswith(kind)


def test_every_recipe_query_in_the_doc_passes(spark):
    text = (Path(__file__).resolve().parents[1] / "docs" / "sql.md").read_text()
    queries = re.findall(r"<!-- recipe: \w+ -->\s*```sql\n(.*?)```", text, flags=re.S)
    assert queries
    for block in queries:
        for sql in (s for s in block.split(";") if s.strip()):
            if sql.strip().upper().startswith("CREATE OR REPLACE TEMPORARY VIEW"):
                continue  # for a session of one's own (docs/sql.md#read-only)
            assert refusal(spark, sql) is None, sql


def test_a_parse_error_is_spark_s_own(spark):
    from pyspark.errors import ParseException

    with pytest.raises(ParseException):
        refusal(spark, "SELEC 1")
