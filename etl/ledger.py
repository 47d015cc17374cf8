"""The run ledger: a Delta table `<root>/delta/runs`, one row per run and stage
(and per table-changing command: `caption`, `dedup`, `latents`, `compact`, ...).

Rows are MERGEd on ``(run_id, stage)``: a stage's row is written ``running`` when it
starts and updated when it ends, so a run killed midway leaves ``running`` rows; the
next run, taking over the crashed run's stale lock, marks them ``crashed``. The row with
``stage = "run"`` covers the whole run (its report path is in ``note``).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path

from pyspark.sql import Row, SparkSession

from etl.config import Config
from etl.schema import RUNS_SCHEMA

__all__ = ["config_hash", "code_version", "record", "mark_crashed", "recent_runs", "utcnow"]


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def config_hash(cfg: Config) -> str:
    """sha256 of the parsed config (first 16 hex digits): same settings, same hash."""
    blob = json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@lru_cache(maxsize=1)
def code_version() -> str:
    """The package version, plus the git commit (and `-dirty`) in a source checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("lakeshard")
    except PackageNotFoundError:
        ver = "0+unknown"
    repo = Path(__file__).resolve().parents[1]
    if (repo / ".git").exists():
        try:
            sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                    "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            if sha:
                ver += f"+g{sha}" + (".dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return ver


def _row(values: dict) -> Row:
    return Row(**{f.name: values.get(f.name) for f in RUNS_SCHEMA.fields})


def _ensure(spark: SparkSession, path: str):
    from delta.tables import DeltaTable

    DeltaTable.createIfNotExists(spark).location(path).addColumns(RUNS_SCHEMA).execute()
    return DeltaTable.forPath(spark, path)


def record(spark: SparkSession, path: str, rows: list[dict]) -> None:
    """Insert or update ledger rows, keyed by (run_id, stage)."""
    from delta.tables import DeltaTable

    keys = [(r["run_id"], r["stage"]) for r in rows]
    if len(set(keys)) != len(keys):
        raise ValueError(f"ledger rows repeat a (run_id, stage): {keys}")
    new_table = not DeltaTable.isDeltaTable(spark, path)
    table = _ensure(spark, path)
    source = spark.createDataFrame([_row(r) for r in rows], RUNS_SCHEMA)
    if new_table:
        # Nothing to match yet: a plain append is the same rows, and about half the
        # cost of a first MERGE in a fresh JVM (measured 7.7 s vs 13.5 s locally).
        source.write.format("delta").mode("append").save(path)
        return
    (
        table.alias("t")
        .merge(source.alias("s"), "t.run_id = s.run_id AND t.stage = s.stage")
        .whenMatchedUpdateAll()
        .whenNotMatchedInsertAll()
        .execute()
    )


def mark_crashed(spark: SparkSession, path: str, run_id: str, note: str) -> int:
    """Rows of `run_id` still `running` become `crashed`; returns how many."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    if not DeltaTable.isDeltaTable(spark, path):
        return 0
    table = DeltaTable.forPath(spark, path)
    cond = (F.col("run_id") == run_id) & (F.col("status") == "running")
    n = table.toDF().where(cond).count()
    if n:
        table.update(cond, {"status": F.lit("crashed"), "note": F.lit(note)})
    return n


def recent_runs(spark: SparkSession, path: str, limit: int = 10) -> list[Row]:
    """Rows of the `limit` most recent runs, newest run first, its stages in order."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    if not DeltaTable.isDeltaTable(spark, path):
        return []
    df = spark.read.format("delta").load(path)
    runs = (
        df.where(F.col("stage") == "run").orderBy(F.col("started_at").desc()).limit(limit)
        .select("run_id")
    )
    return (
        df.join(runs, "run_id")
        .orderBy(F.col("run_id").desc(), (F.col("stage") != "run").cast("int"),
                 "started_at")
        .collect()
    )
