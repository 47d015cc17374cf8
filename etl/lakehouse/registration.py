"""Every Delta table of the root, registered by name in the configured catalog
(`catalog:`; docs/sql.md), so analysts find it where their SQL tools look.

Each table is an external table at its location, with a comment saying what it is (the
Delta table's own description, which every engine shows: set once, through Spark, when
it differs).
Idempotent, and free on a night that changed nothing: a memo (derived state,
``<root>/_lakeshard/catalog.json``) holds the catalog, tables and locations last
registered, and when they are the ones the root holds now the metastore is not even
started. Otherwise one ``SHOW TABLE EXTENDED`` lists what the catalog holds (the
database is created when that finds none), and a table already registered at its
location costs nothing more. A table dropped from the catalog by hand comes back once
the memo goes (delete it, or change the `catalog:` section). A table
registered at another location (the root moved) is dropped from the catalog -- an
external table, so its files stay -- and created again at the new one, with a warning
naming both. A managed table of that name (lakeshard registers only external ones) is
refused, never dropped.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass

from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession

from etl import tables
from etl.config import Config
from etl.errors import ConfigError
from etl.lakehouse.derived import DerivedState
from etl.storage import delta_exists, delta_rs_table

__all__ = ["Registration", "register_tables", "catalog_tables", "warm_catalog"]

log = logging.getLogger(__name__)

_LOCATION = re.compile(r"^Location: (.*)$", re.MULTILINE)
_TYPE = re.compile(r"^Type: (.*)$", re.MULTILINE)
_COMMENT = re.compile(r"^Comment: (.*)$", re.MULTILINE)


@dataclass(frozen=True)
class Registration:
    """What one registration did: tables created, moved (re-registered), unchanged;
    `checked`: whether the catalog was asked (False: the memo said nothing changed)."""

    created: tuple[str, ...]
    moved: tuple[str, ...]
    unchanged: tuple[str, ...]
    seconds: float
    checked: bool = True


@dataclass(frozen=True)
class _Entry:
    location: str
    external: bool
    comment: str


def _normal(location: str) -> str:
    """A location as Hive, Glue or Unity print it, comparable with a layout path."""
    loc = location.strip().rstrip("/")
    for prefix in ("file://", "file:"):
        if loc.startswith(prefix):
            return loc[len(prefix):]
    return loc


def _check_session(spark: SparkSession, cfg: Config) -> None:
    if cfg.catalog.kind in ("hive", "glue"):
        impl = spark.conf.get("spark.sql.catalogImplementation", "in-memory")
        if impl != "hive":
            raise ConfigError(
                f"catalog.kind: {cfg.catalog.kind} needs a Spark session with Hive support, "
                f"but this process's session was started before with catalog {impl!r}: "
                "start a new process (etl.session.get_spark sets it from the config)")


def _present(cfg: Config) -> dict[str, str]:
    """The Delta tables the root holds, by name, with their locations."""
    lay = tables.layout(cfg)
    return {n: lay.delta_table(n) for n in tables.DELTA_TABLES
            if delta_exists(lay.delta_table(n))}


def _memo(cfg: Config) -> DerivedState:
    return DerivedState(tables.layout(cfg).catalog_memo, "catalog")


def _key(cfg: Config, present: dict[str, str]) -> dict:
    cat = cfg.catalog
    return {"kind": cat.kind, "namespace": cat.namespace, "uri": cat.metastore_uri,
            "prefix": cat.comment_prefix, "tables": present}


def warm_catalog(spark: SparkSession, cfg: Config) -> threading.Thread | None:
    """Start the metastore client on a thread, overlapping the stages: its start (the
    Hive client's classes, Derby or a metastore connection) is most of a registration's
    cost, and the tables are registered only once the stages have committed. None
    when no catalog is configured, or when the memo says the root's tables are
    registered already (a night that adds none never starts the client)."""
    if not cfg.catalog.enabled or _memo(cfg).load(_key(cfg, _present(cfg))) is not None:
        return None

    def start() -> None:
        try:
            spark.catalog.databaseExists(cfg.catalog.namespace)
        except Exception as exc:  # noqa: BLE001 -- register_tables reports it
            log.debug("catalog warm-up: %s", exc)

    thread = threading.Thread(target=start, name="lakeshard-catalog-warm", daemon=True)
    thread.start()
    return thread


def catalog_tables(spark: SparkSession, cfg: Config) -> dict[str, _Entry]:
    """The tables of the catalog's database, by name, with location, type and comment
    (one metadata query; an empty database: {})."""
    ns = cfg.catalog.namespace
    out = {}
    for row in spark.sql(f"SHOW TABLE EXTENDED IN {ns} LIKE '*'").collect():
        info = row["information"] or ""
        loc, typ, com = _LOCATION.search(info), _TYPE.search(info), _COMMENT.search(info)
        out[row["tableName"]] = _Entry(
            location=_normal(loc.group(1)) if loc else "",
            external=bool(typ) and typ.group(1).strip().upper() == "EXTERNAL",
            comment=com.group(1).strip() if com else "")
    return out


def _literal(text: str) -> str:
    """`text` as a Spark SQL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _comment(cfg: Config, name: str) -> str:
    return f"{cfg.catalog.comment_prefix}: {tables.DELTA_TABLES[name]}"


def _create(spark: SparkSession, cfg: Config, name: str, location: str) -> None:
    spark.sql(f"CREATE TABLE IF NOT EXISTS {cfg.catalog.qualified(name)} USING DELTA "
              f"LOCATION {_literal(location)}")


def _describe(spark: SparkSession, cfg: Config, name: str, location: str) -> bool:
    """The table's comment, set when its Delta description differs (read by delta-rs,
    no Spark job; a table delta-rs cannot read is commented regardless)."""
    want = _comment(cfg, name)
    try:
        table = delta_rs_table(location)
        if table is not None and table.metadata().description == want:
            return False
    except Exception:  # noqa: BLE001 -- delta-rs cannot read it: let Spark set it
        pass
    spark.sql(f"COMMENT ON TABLE {cfg.catalog.qualified(name)} IS {_literal(want)}")
    return True


def register_tables(spark: SparkSession, cfg: Config) -> Registration | None:
    """Register every Delta table the root holds (None: no catalog configured)."""
    cat = cfg.catalog
    if not cat.enabled:
        return None
    t0 = time.monotonic()
    _check_session(spark, cfg)
    present = _present(cfg)
    key = _key(cfg, present)
    if _memo(cfg).load(key) is not None:
        return Registration((), (), tuple(present), time.monotonic() - t0, checked=False)
    try:
        held = catalog_tables(spark, cfg)
    except AnalysisException:  # no such database yet: the first registration
        spark.sql(f"CREATE {'SCHEMA' if cat.kind == 'unity' else 'DATABASE'} IF NOT EXISTS "
                  f"{cat.namespace} COMMENT "
                  f"{_literal(f'{cat.comment_prefix}: the tables of {cfg.storage.root}')}")
        held = {}
    created, moved, unchanged = [], [], []
    for name, location in present.items():
        entry = held.get(name)
        if entry is None:
            _create(spark, cfg, name, location)
            created.append(name)
        elif entry.location == _normal(location):
            unchanged.append(name)
        elif not entry.external:
            raise ConfigError(
                f"catalog.database: {cat.qualified(name)} exists at {entry.location} and is "
                "a managed table, not an external one lakeshard registered: drop it or "
                "choose another catalog.database")
        else:
            log.warning("catalog: %s was registered at %s; the root moved, so it is "
                        "registered again at %s (the old files are untouched)",
                        cat.qualified(name), entry.location, location)
            spark.sql(f"DROP TABLE {cat.qualified(name)}")
            _create(spark, cfg, name, location)
            moved.append(name)
        _describe(spark, cfg, name, location)
    _memo(cfg).save(key, {"created": created, "moved": moved})
    out = Registration(tuple(created), tuple(moved), tuple(unchanged),
                       time.monotonic() - t0)
    log.info("catalog %s (%s): %d table(s) registered, %d moved, %d unchanged in %.2f s",
             cat.namespace, cat.kind, len(created), len(moved), len(unchanged), out.seconds)
    return out
