"""Which SQL statements ``lakeshard sql`` runs: read-only ones only.

``lakeshard sql`` is for analysts: it holds no run lock and writes no ledger row, so a
statement that changes a table (``DELETE FROM delta.`…/rejects```), creates one
anywhere (``CREATE TABLE … LOCATION '/elsewhere'``) or changes the session would go
around every guarantee a run keeps (the accounting, the rejects, the root). The
statement is parsed with the session's own parser (Spark's, with the Delta
extensions) -- not run -- and every node of the parsed plan must be of a read-only
kind: a query (``SELECT``, ``WITH``, ``VALUES``, table-valued functions), ``EXPLAIN`` of
one, ``SHOW …``, ``DESCRIBE …`` (and Delta's ``DESCRIBE HISTORY`` / ``DETAIL``),
``USE`` (the session's current namespace only: every Hive JDBC connection opens with
``use <database>``).
Anything else is refused before Spark runs it, naming the statement's kind.

A read-only statement can still reach further than the tables, so its contents are
judged too (every expression, in subqueries, CTEs, lambdas and table-valued functions'
arguments alike):

* functions: Spark's built-ins only, less those that call into the JVM (``reflect``,
  ``java_method``, ``try_reflect``: any static Java method, so code execution) or read
  the Python workers' logs (``python_worker_logs``); a name computed at run time
  (``IDENTIFIER(<expression>)``) is refused, since what it names cannot be judged here;
* path-based relations (``text.`/etc/hostname```, ``delta.`…```, any data source's
  ``format.`path```): the path must lie under the storage root once ``..``, symlinks
  and ``file:`` are resolved, and may hold no glob characters.

The one implementation: ``lakeshard sql`` calls :func:`refusal`; the SQL endpoint
(:mod:`etl.sqlserver`) calls :func:`plan_refusal` on every statement its Thrift
sessions parse.
"""

from __future__ import annotations

import os
import posixpath
from functools import lru_cache

from pyspark.sql import SparkSession

__all__ = [
    "READ_ONLY_NODES", "DENIED_FUNCTIONS", "refusal", "plan_refusal", "statement_kinds",
    "inside_root",
]

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
    # USE: the connection's own current namespace (every Hive JDBC connection opens with
    # `use <database>`); a path as a namespace is judged as a path
    "SetCatalogAndNamespace",
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
    "CreateFunctionCommand": "CREATE FUNCTION", "DropFunctionCommand": "DROP FUNCTION",
    "ClearCacheCommand": "CLEAR CACHE",
    "LoadData": "LOAD DATA", "RefreshResource": "REFRESH", "AnalyzeTable": "ANALYZE TABLE",
    "AnalyzeColumn": "ANALYZE TABLE", "AnalyzeTables": "ANALYZE TABLES",
    "ListJarsCommand": "LIST JAR", "ListFilesCommand": "LIST FILE",
    "ListArchivesCommand": "LIST ARCHIVE", "UnresolvedExecuteImmediate": "EXECUTE IMMEDIATE",
    "SetVariable": "SET VAR", "CreateVariable": "DECLARE VARIABLE",
    "DropVariable": "DROP VARIABLE",
    "PlanWithUnresolvedIdentifier": "IDENTIFIER() with a computed name",
    "ScriptTransformation": "TRANSFORM … USING (a shell command)",
}
# Built-in functions that are refused: they call static Java methods (reflect and its
# kin: code execution on the driver) or read the Python workers' logs.
DENIED_FUNCTIONS = frozenset({"reflect", "java_method", "try_reflect", "python_worker_logs"})
# Qualifiers that still name a built-in (`builtin.abs`, `system.builtin.abs`).
_BUILTIN_QUALIFIERS = {(), ("builtin",), ("system", "builtin")}
# Expressions whose plan is not among their children (subqueries).
_SUBQUERIES = frozenset({
    "ScalarSubquery", "Exists", "ListQuery", "LateralSubquery",
    "FunctionTableSubqueryArgumentExpression",
})
# Plan nodes naming a table by a multipart identifier (a path for `format.`path``).
_NAMED = frozenset({"UnresolvedRelation", "UnresolvedTable", "UnresolvedTableOrView",
                    "UnresolvedView", "UnresolvedNamespace"})
_GLOB = set("*?[]{}\\")


def _name(node) -> str:
    return node.getClass().getSimpleName().rstrip("$")  # a Scala object: `Name$`


def _seq(seq) -> list:
    return [seq.apply(i) for i in range(seq.size())]


def _children(node) -> list:
    out = _seq(node.children())
    name = _name(node)
    if name == "ExplainCommand":
        out.append(node.logicalPlan())
    elif name == "DescribeQueryCommand":
        out.append(node.plan())
    elif name == "RelationTimeTravel":  # its relation is a field, not a child
        out.append(node.relation())
    elif name == "UnresolvedWith":  # the WITH clause's own queries
        out += [rel._2() for rel in _seq(node.cteRelations())]
    return out


def _plan_nodes(plan) -> list:
    """Every plan node of `plan`, root first, with the plans of subquery expressions."""
    todo, nodes = [plan], []
    while todo:
        node = todo.pop(0)
        nodes.append(node)
        todo.extend(_children(node))
        for expr in _expressions(node):
            if _name(expr) in _SUBQUERIES:
                todo.append(expr.plan())
    return nodes


def _expressions(node) -> list:
    """Every expression of one plan node (trees flattened; subquery plans not entered)."""
    todo, out = _seq(node.expressions()), []
    while todo:
        expr = todo.pop()
        out.append(expr)
        todo.extend(_seq(expr.children()))
    return out


def statement_kinds(spark: SparkSession, sql: str) -> list[str]:
    """The node classes of `sql`'s parsed plan, root first (a parse error raises as
    Spark raises it)."""
    return [_name(n) for n in _plan_nodes(_parse(spark, sql))]


def _parse(spark: SparkSession, sql: str):
    from py4j.protocol import Py4JJavaError
    from pyspark.errors.exceptions.captured import convert_exception

    parser = spark._jsparkSession.sessionState().sqlParser()
    try:
        return parser.parsePlan(sql)
    except Py4JJavaError as exc:  # as spark.sql raises it (a ParseException)
        raise convert_exception(exc.java_exception) from None


@lru_cache(maxsize=1)
def _builtins(jvm) -> frozenset[str]:
    """Spark's built-in scalar, aggregate and table-valued function names."""
    analysis = jvm.org.apache.spark.sql.catalyst.analysis
    names = set()
    for registry in (analysis.FunctionRegistry.builtin(),
                     analysis.TableFunctionRegistry.builtin()):
        names.update(f.funcName().lower() for f in _seq(registry.listFunction()))
    return frozenset(names)


def _function_refusal(parts: list[str], builtins: frozenset[str]) -> str | None:
    name = parts[-1].lower()
    qualifier = tuple(p.lower() for p in parts[:-1])
    shown = ".".join(parts)
    if name in DENIED_FUNCTIONS:
        return f"{shown}() (a function that calls into the JVM or reads its workers)"
    if qualifier not in _BUILTIN_QUALIFIERS or name not in builtins:
        return f"{shown}() (not one of Spark's built-in functions)"
    return None


def _expression_refusal(expr, builtins: frozenset[str]) -> str | None:
    name = _name(expr)
    if name == "UnresolvedFunction":
        return _function_refusal(_seq(expr.nameParts()), builtins)
    if name == "UnresolvedGenerator":
        ident = expr.name()
        db = ident.database()
        return _function_refusal([*([db.get()] if db.isDefined() else []), ident.funcName()],
                                 builtins)
    if name == "ExpressionWithUnresolvedIdentifier":
        return "IDENTIFIER() with a computed name (what it names cannot be judged)"
    return None


def inside_root(path: str, root: str | None) -> bool:
    """Whether `path` (as Spark would read it: relative to the working directory, with
    ``file:``, ``..`` and symlinks resolved) lies under the storage root `root`."""
    if root is None or not path or _GLOB & set(path):
        return False
    scheme, _, rest = path.partition(":") if ":" in path.split("/", 1)[0] else ("", "", path)
    root_scheme, _, root_rest = (root.partition("://") if "://" in root else ("", "", root))
    if root_scheme in ("", "file"):
        if scheme.lower() not in ("", "file"):
            return False
        local = "/" + rest.lstrip("/") if scheme else rest
        real, base = os.path.realpath(local), os.path.realpath(root_rest)
        return real == base or real.startswith(base.rstrip("/") + "/")
    s3 = {"s3", "s3a", "s3n"}
    same = scheme.lower() == root_scheme.lower() or {scheme.lower(), root_scheme.lower()} <= s3
    if not same or not rest.startswith("//"):
        return False
    norm = posixpath.normpath(rest[2:])
    base = posixpath.normpath(root_rest)
    return norm == base or norm.startswith(base.rstrip("/") + "/")


def _is_data_source(jvm, session, name: str) -> bool:
    """Whether Spark reads ``<name>.`<path>``` as a file of that format."""
    if name.lower() in ("lance",) or "." in name:
        return True
    try:
        jvm.org.apache.spark.sql.execution.datasources.DataSource.lookupDataSource(
            name, session.sessionState().conf())
    except Exception:  # noqa: BLE001 -- py4j: not a data source name
        return False
    return True


def _relation_refusal(node, jvm, session, root: str | None) -> str | None:
    parts = _seq(node.multipartIdentifier())
    if len(parts) < 2:
        return None
    head, path = ".".join(parts[:-1]), parts[-1]
    if not ("/" in path or ":" in path
            or (len(parts) == 2 and _is_data_source(jvm, session, head))):
        return None
    if inside_root(path, root):
        return None
    return (f"{head}.`{path}` (a path-based relation outside the storage root "
            f"{root or '(none)'})")


def plan_refusal(plan, session, root: str | None) -> str | None:
    """Why the parsed `plan` (a JVM LogicalPlan of `session`) may not run read-only
    (None: it may): the first node of a kind that is not read-only; else the first
    function or path it may not use."""
    nodes = _plan_nodes(plan)
    for node in nodes:
        name = _name(node)
        if name not in READ_ONLY_NODES:
            kind = _KINDS.get(name)
            return f"{kind} ({name})" if kind else name
    from pyspark import SparkContext

    gateway_jvm = SparkContext._jvm
    builtins = _builtins(gateway_jvm)
    for node in nodes:
        name = _name(node)
        if name == "UnresolvedTableValuedFunction":
            refused = _function_refusal(_seq(node.name()), builtins)
            if refused:
                return refused
        if name in _NAMED:
            refused = _relation_refusal(node, gateway_jvm, session, root)
            if refused:
                return refused
        for expr in _expressions(node):
            refused = _expression_refusal(expr, builtins)
            if refused:
                return refused
    return None


def refusal(spark: SparkSession, sql: str, root: str | None = None) -> str | None:
    """Why `sql` may not run as a read-only statement in `spark` with storage root
    `root` (None: it may)."""
    return plan_refusal(_parse(spark, sql), spark._jsparkSession, root)
