"""Which SQL statements ``lakeshard sql`` runs: read-only ones only.

``lakeshard sql`` is for analysts: it holds no run lock and writes no ledger row, so a
statement that changes a table (``DELETE FROM delta.`…/rejects```), creates one
anywhere (``CREATE TABLE … LOCATION '/elsewhere'``) or changes the session would go
around every guarantee a run keeps (the accounting, the rejects, the root). The
statement is parsed with the session's own parser (Spark's, with the Delta
extensions) -- not run -- and every node of the parsed plan must be of a read-only
kind: a query (``SELECT``, ``WITH``, ``VALUES``, table-valued functions), ``EXPLAIN`` of
one, ``SHOW …``, ``DESCRIBE …`` (and Delta's ``DESCRIBE HISTORY`` / ``DETAIL``).
Anything else is refused before Spark runs it, naming the statement's kind.
"""

from __future__ import annotations

from pyspark.sql import SparkSession

__all__ = ["READ_ONLY_NODES", "refusal", "statement_kinds"]

# Parsed-plan node classes (their simple names) a read-only statement is made of.
READ_ONLY_NODES = frozenset({
    # queries
    "Project", "Filter", "Aggregate", "Sort", "GlobalLimit", "LocalLimit", "Offset",
    "Limit", "Tail", "Join", "LateralJoin", "Union", "Intersect", "Except", "Distinct",
    "Deduplicate", "SubqueryAlias", "UnresolvedWith", "WithCTE", "CTERelationDef",
    "CTERelationRef", "UnresolvedRelation", "UnresolvedInlineTable", "LocalRelation",
    "OneRowRelation", "Range", "Window", "WithWindowDefinition",
    "UnresolvedTableValuedFunction", "UnresolvedTVFAliases", "Generate", "Pivot", "Unpivot",
    "Sample", "RepartitionByExpression", "Repartition", "RebalancePartitions",
    "UnresolvedHint", "Expand", "UnresolvedSubqueryColumnAliases", "UnresolvedHaving",
    "UnresolvedFunctionName", "RelationTimeTravel",
    # what SHOW / DESCRIBE name (names only: nothing is resolved or read here)
    "UnresolvedTable", "UnresolvedTableOrView", "UnresolvedView", "UnresolvedNamespace",
    "CurrentNamespace", "UnresolvedFunction", "UnresolvedIdentifier",
    # SHOW, DESCRIBE, EXPLAIN (whose statement is judged too)
    "ShowTables", "ShowTablesExtended", "ShowTablePartition", "ShowViews", "ShowColumns",
    "ShowFunctions", "ShowNamespaces", "ShowPartitions", "ShowTableProperties",
    "ShowCreateTable", "ShowCatalogsCommand", "ShowCurrentNamespaceCommand",
    "ShowCatalogs", "ShowCurrentNamespace", "ShowNamespacesCommand",
    "DescribeRelation", "DescribeColumn", "DescribeFunction", "DescribeNamespace",
    "DescribeQueryCommand", "ExplainCommand",
    "DescribeDeltaHistory", "DescribeDeltaHistoryCommand", "DescribeDeltaDetailCommand",
})
# How a refused statement is named (its plan node -> the SQL people write).
_KINDS = {
    "DeleteFromTable": "DELETE", "UpdateTable": "UPDATE", "MergeIntoTable": "MERGE",
    "InsertIntoStatement": "INSERT", "OverwriteByExpression": "INSERT OVERWRITE",
    "CreateTableAsSelect": "CREATE TABLE AS SELECT", "CreateTable": "CREATE TABLE",
    "ReplaceTableAsSelect": "REPLACE TABLE AS SELECT", "ReplaceTable": "REPLACE TABLE",
    "CreateView": "CREATE VIEW", "CreateViewCommand": "CREATE VIEW",
    "CreateTempViewUsing": "CREATE TEMPORARY VIEW", "DropTable": "DROP TABLE",
    "DropView": "DROP VIEW", "DropNamespace": "DROP DATABASE",
    "CreateNamespace": "CREATE DATABASE", "SetCommand": "SET", "ResetCommand": "RESET",
    "SetNamespaceLocation": "ALTER DATABASE SET LOCATION",
    "SetTableLocation": "ALTER TABLE SET LOCATION", "AlterTableCommand": "ALTER TABLE",
    "TruncateTable": "TRUNCATE TABLE", "CacheTable": "CACHE TABLE",
    "CacheTableAsSelect": "CACHE TABLE", "UncacheTable": "UNCACHE TABLE",
    "InsertIntoDir": "INSERT OVERWRITE DIRECTORY", "AddColumns": "ALTER TABLE ADD COLUMNS",
    "SetTableProperties": "ALTER TABLE SET TBLPROPERTIES", "RenameTable": "ALTER TABLE RENAME",
    "CreateFunction": "CREATE FUNCTION", "DropFunction": "DROP FUNCTION",
    "AddJarsCommand": "ADD JAR", "AddFilesCommand": "ADD FILE",
    "AddArchivesCommand": "ADD ARCHIVE", "SetCatalogAndNamespace": "USE",
    "RefreshTable": "REFRESH TABLE", "RepairTable": "MSCK REPAIR TABLE",
    "VacuumTableCommand": "VACUUM", "OptimizeTableCommand": "OPTIMIZE",
    "RestoreTableStatement": "RESTORE", "ConvertToDeltaCommand": "CONVERT TO DELTA",
    "DeltaGenerateCommand": "GENERATE", "DeltaReorgTable": "REORG TABLE",
}


def _name(node) -> str:
    return node.getClass().getSimpleName().rstrip("$")  # a Scala object: `Name$`


def _children(node) -> list:
    out = [node.children().apply(i) for i in range(node.children().size())]
    name = _name(node)
    if name == "ExplainCommand":
        out.append(node.logicalPlan())
    elif name == "DescribeQueryCommand":
        out.append(node.plan())
    elif name == "UnresolvedWith":  # the WITH clause's own queries
        rels = node.cteRelations()
        for i in range(rels.size()):
            out.append(rels.apply(i)._2())
    return out


def statement_kinds(spark: SparkSession, sql: str) -> list[str]:
    """The node classes of `sql`'s parsed plan, root first (a parse error raises as
    Spark raises it)."""
    from py4j.protocol import Py4JJavaError
    from pyspark.errors.exceptions.captured import convert_exception

    parser = spark._jsparkSession.sessionState().sqlParser()
    try:
        plan = parser.parsePlan(sql)
    except Py4JJavaError as exc:  # as spark.sql raises it (a ParseException)
        raise convert_exception(exc.java_exception) from None
    todo, names = [plan], []
    while todo:
        node = todo.pop(0)
        names.append(_name(node))
        todo.extend(_children(node))
    return names


def refusal(spark: SparkSession, sql: str) -> str | None:
    """Why `sql` may not run as a read-only statement (None: it may): the kind of the
    first node that is not read-only."""
    for name in statement_kinds(spark, sql):
        if name not in READ_ONLY_NODES:
            kind = _KINDS.get(name)
            return f"{kind} ({name})" if kind else name
    return None
