"""The run ledger: a Delta table `<root>/delta/runs` of events, append-only, about
every run and its stages (and every table-changing command: `caption`, `dedup`,
`latents`, `compact`, ...).

A stage's ``running`` event is appended when it starts and its ``ok``/``failed`` event
when it ends (each with the whole row: counts, versions, timing); the latest event of a
``(run_id, stage)`` (by ``recorded_at``) is its status -- :func:`latest_runs`, the
``runs`` SQL view. A run killed midway leaves ``running`` as the latest status; the
next run, taking over the crashed run's stale lock, appends ``crashed`` events for
them. The row with ``stage = "run"`` covers the whole run (its report path in ``note``).
Every row is built by :func:`transition`: a stage's counts are its
:class:`~etl.runtime.metrics.Metrics` in their flat form (``accepted``,
``rejected:<reason>``, ``samples:<export>``).

Events are appended with delta-rs, in this process: one small commit per transition,
no Spark job and no MERGE, so a run's bookkeeping costs milliseconds however long the
ledger grows. Spark reads the table like any other.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql import Row, SparkSession

from etl import storage
from etl.config import Config
from etl.schema import RUNS_SCHEMA
from etl.schema import arrow_schema as schema_as_arrow

if TYPE_CHECKING:
    from etl.runtime.stage import StageResult

log = logging.getLogger(__name__)

__all__ = [
    "config_hash", "code_version", "arrow_schema", "transition", "append", "record",
    "mark_crashed", "latest_runs", "read_runs", "recent_runs", "recent_runs_local",
    "recorded_stages", "utcnow",
]


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


def manifests_json(manifests: dict[str, dict]) -> str | None:
    """Export manifests as the ledger keeps them (JSON, keys sorted), None for none."""
    return json.dumps(manifests, sort_keys=True) if manifests else None


def transition(base: dict, stage: str, status: str, started: datetime, *,
               result: StageResult | None = None, **more: Any) -> dict:
    """The ledger row of one transition: the run's identity (`base`: run id, config
    hash, code version, host), the stage (``run`` for the whole run), its status and
    start; for a stage that returned, its counts, table versions, export manifests and
    note; then `more` (``ended_at``, ``seconds``, a ``note`` of its own, ...)."""
    row = {**base, "stage": stage, "status": status, "started_at": started}
    if result is not None:
        row.update(inputs=result.inputs.as_map(), outputs=result.outputs.as_map(),
                   table_versions=result.table_versions,
                   export_manifests=manifests_json(result.manifests), note=result.note)
    row.update(more)
    return row


@lru_cache(maxsize=1)
def arrow_schema():
    """RUNS_SCHEMA as Arrow (how delta-rs appends events; Spark reads them back as
    RUNS_SCHEMA)."""
    return schema_as_arrow(RUNS_SCHEMA)


def _utc(value):
    # The ledger's timestamps are naive UTC (utcnow); Arrow needs them marked so.
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


def _event(values: dict, recorded_at: datetime) -> dict:
    row = {f.name: _utc(values.get(f.name)) for f in RUNS_SCHEMA.fields}
    row["recorded_at"] = _utc(recorded_at)
    for key in ("inputs", "outputs", "table_versions"):
        if row[key] is not None:
            row[key] = list(row[key].items())
    return row


def append(path: str, rows: list[dict], spark: SparkSession | None = None) -> None:
    """Append ledger events: one small Delta commit, written by delta-rs (no Spark
    job); creates the table on the first call. A table with a feature delta-rs cannot
    write (one Spark created with settings of its own) is appended to by `spark`."""
    import pyarrow as pa
    from deltalake import write_deltalake
    from deltalake.exceptions import DeltaError

    keys = [(r["run_id"], r["stage"]) for r in rows]
    if len(set(keys)) != len(keys):
        raise ValueError(f"ledger rows repeat a (run_id, stage): {keys}")
    now = utcnow()
    data = pa.Table.from_pylist([_event(r, now) for r in rows], schema=arrow_schema())
    try:
        table = storage.delta_rs_table(path, write=True)
        write_deltalake(table or storage.object_url(path), data, mode="append",
                        storage_options=None if table else storage.delta_rs_storage(
                            path, write=True))
    except DeltaError as exc:
        if spark is None or not storage.delta_rs_unsupported(exc):
            raise
        log.info("ledger %s: a table feature delta-rs does not write (%s): appending "
                 "with Spark", path, exc)
        events = [Row(**{f.name: {**r, "recorded_at": now}.get(f.name)
                         for f in RUNS_SCHEMA.fields}) for r in rows]
        spark.createDataFrame(events, RUNS_SCHEMA).write.format("delta").mode(
            "append").save(path)


def record(spark: SparkSession | None, path: str, rows: list[dict]) -> None:
    """Record ledger rows: each is an event appended to the table; the latest event of
    a ``(run_id, stage)`` is its status (:func:`latest_runs`). `spark` is
    only used for a table delta-rs cannot write."""
    append(path, rows, spark)


def latest_runs(events):
    """The run ledger's status table from its events: the latest event of each
    ``(run_id, stage)`` (the last appended; rows a MERGE-era ledger wrote have no
    ``recorded_at`` and one row per key). A DataFrame in, a DataFrame out."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if "recorded_at" not in events.columns:  # a ledger not migrated yet (read-only use)
        events = events.withColumn("recorded_at", F.lit(None).cast("timestamp"))
    order = Window.partitionBy("run_id", "stage").orderBy(
        F.col("recorded_at").desc_nulls_last(),
        (F.col("status") != "running").cast("int").desc(),  # a tie: the outcome wins
    )
    return (
        events.withColumn("_latest", F.row_number().over(order))
        .where("_latest = 1").drop("_latest")
    )


def read_runs(spark, path: str, *, latest: bool = True):
    """The run ledger at `path`: the latest status of every run and stage (or, with
    ``latest=False``, every event), or None when no run was recorded yet."""
    events = storage.read_delta(spark, path)
    if events is None or not latest:
        return events
    return latest_runs(events)


def mark_crashed(spark: SparkSession, path: str, run_id: str, note: str) -> int:
    """Stages of `run_id` whose latest status is `running` get a `crashed` event;
    returns how many."""

    latest = read_runs(spark, path)
    if latest is None:
        return 0
    stale = latest.where((latest.run_id == run_id) & (latest.status == "running")).collect()
    if stale:
        ended = utcnow()
        append(path, [{**r.asDict(), "status": "crashed", "note": note, "ended_at": ended}
                      for r in stale], spark)
    return len(stale)


def recent_runs(spark: SparkSession, path: str, limit: int = 10) -> list[Row]:
    """The latest status of every stage of the `limit` most recent runs, newest run
    first, its stages in order."""
    from pyspark.sql import functions as F

    df = read_runs(spark, path)
    if df is None:
        return []
    runs = (
        df.where(F.col("stage") == "run").orderBy(F.col("started_at").desc()).limit(limit)
        .select("run_id")
    )
    return (
        df.join(runs, "run_id")
        .orderBy(F.col("run_id").desc(), (F.col("stage") != "run").cast("int"),
                 "started_at")
        .drop("recorded_at")
        .collect()
    )


def recent_runs_local(path: str, limit: int = 10) -> list[dict] | None:
    """:func:`recent_runs` without Spark: the ledger read by delta-rs in this process
    (what `lakeshard runs` does, in about a second instead of a Spark start-up), the
    same rows as dicts. None when delta-rs cannot read the table (a feature it does not
    implement, deletion vectors): then ask :func:`recent_runs`."""
    from deltalake.exceptions import DeltaError

    try:
        table = storage.delta_rs_table(path)
        if table is None:
            return []
        if "deletionVectors" in (table.protocol().reader_features or []):
            return None
        from etl.writers.remote import subtree

        events = table.to_pyarrow_table(
            filesystem=subtree(storage.object_url(path))).to_pylist()
    except DeltaError as exc:
        if storage.delta_rs_unsupported(exc):
            return None
        raise

    def naive(value):  # as Spark returns timestamps: naive, in the session's UTC
        return value.astimezone(UTC).replace(tzinfo=None) if isinstance(value, datetime) \
            else value

    rows = []
    for event in events:
        row = {k: naive(v) for k, v in event.items()}
        for key in ("inputs", "outputs", "table_versions"):
            if row.get(key) is not None:
                row[key] = dict(row[key])
        rows.append(row)
    # In the order they were appended (an append's rows in the runner's stage order):
    # stages that started at the same instant are listed in the order they were recorded.
    rows.sort(key=lambda r: (r.get("recorded_at") is not None,
                             r.get("recorded_at") or datetime.min))
    latest: dict[tuple[str, str], tuple] = {}
    for row in rows:
        # The latest event of a (run, stage): by recorded_at (rows a MERGE-era ledger
        # wrote have none and one row per key); at a tie, the outcome over `running`.
        rank = (row.get("recorded_at") is not None, row.get("recorded_at") or datetime.min,
                row["status"] != "running")
        key = (row["run_id"], row["stage"])
        if key not in latest or rank > latest[key][0]:
            latest[key] = (rank, row)
    rows = [row for _, row in latest.values()]
    runs = sorted((r for r in rows if r["stage"] == "run"),
                  key=lambda r: r["started_at"], reverse=True)[:limit]
    wanted = {r["run_id"] for r in runs}
    out = sorted((r for r in rows if r["run_id"] in wanted),
                 key=lambda r: (r["stage"] != "run", r["started_at"]))
    out.sort(key=lambda r: r["run_id"], reverse=True)  # stable: stages stay in order
    for r in out:
        r.pop("recorded_at", None)
    return out


def recorded_stages(spark: SparkSession, path: str, run_id: str) -> set[str]:
    """The stages the ledger already has an event of for `run_id` (not the ``run`` row):
    a run continued by a later process under the same ``--run-id`` -- the next task of
    a Databricks job, the next step on EMR -- keeps what its earlier tasks recorded."""
    rows = recent_runs_local(path, limit=1 << 30)
    if rows is None:  # a feature delta-rs does not read: ask Spark
        df = read_runs(spark, path)
        rows = [] if df is None else [
            r.asDict() for r in df.where(df.run_id == run_id).select("run_id", "stage")
            .collect()]
    return {r["stage"] for r in rows if r["run_id"] == run_id and r["stage"] != "run"}
