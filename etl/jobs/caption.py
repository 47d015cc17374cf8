"""Caption job: a named caption version over the curated Lance table, as new columns.

For version ``v`` the table gains ``caption_v`` plus provenance columns (see
:func:`etl.columns.caption_columns`): status and error, caption-check flags, generated tokens,
model, prompt hash, generation parameters and a timestamp. The values are written with
:func:`etl.writers.lance_columns.write_columns` -- new data files holding only those
columns, one ``Update`` commit -- so the data files holding image bytes are never
rewritten. A rerun captions only the rows lacking the version (null status, e.g. rows
appended since) or whose last attempt ``failed``; with nothing to do it commits nothing.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from pyspark import StorageLevel
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from etl import tables
from etl.columns import caption_columns
from etl.config import CaptionVersionConfig, Config
from etl.errors import ConfigError
from etl.runtime.stage import RunContext, StageResult
from etl.tiny_vlm import TINY_MODEL, ensure_tiny_vlm
from etl.writers.lance import FRAGMENT_ID
from etl.writers.lance_columns import write_columns
from etl.writers.remote import write_file
from udfs.caption import CaptionSpec, caption_udf

__all__ = [
    "CaptionPlan",
    "CaptionResult",
    "caption_spec",
    "plan_caption",
    "caption",
    "format_caption",
    "write_caption_report",
    "stage",
    "check",
]

log = logging.getLogger(__name__)


def caption_spec(cfg: Config, v: CaptionVersionConfig) -> CaptionSpec:
    """The executor-side spec: the version's settings and where its model is (on first
    use the smoke-test model is built, into the local cache folder -- never under the
    root, which may be an object store the model could not load from)."""
    where = f"caption.versions.{v.name}"
    model, local = v.model, False
    if v.model == TINY_MODEL:
        models = Path(cfg.storage.local_cache, "models")
        try:
            model, local = str(ensure_tiny_vlm(models)), True
        except OSError as exc:
            raise ConfigError(
                f"{where}.model: could not build {TINY_MODEL} in {models} ({exc}); set "
                "storage.cache_dir to a writable local folder"
            ) from None
    elif Path(v.model).expanduser().exists():
        model, local = str(Path(v.model).expanduser().resolve()), True
    elif v.model.startswith(("/", ".", "~")):
        raise ConfigError(f"{where}.model: no model folder at {v.model!r}")
    if v.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"{where}.backend: vllm is not installed; pip install 'lakeshard[vllm]' "
            "(on the driver and the GPU executors)"
        )
    return CaptionSpec(settings=v, model_path=model, local_files_only=local)


@dataclass(frozen=True)
class CaptionPlan:
    version: CaptionVersionConfig
    spec: CaptionSpec
    table_path: str
    table_version: int
    table_rows: int
    predicate: str | None  # Lance SQL of the rows to caption
    todo: int


def _q(name: str) -> str:
    return f"`{name}`"


def plan_caption(cfg: Config, name: str | None = None, *, force: bool = False) -> CaptionPlan:
    """Everything checked before Spark: config, model, table, provenance, rows to do."""

    v = cfg.caption.version(name)
    where = f"caption.versions.{v.name}"
    path = tables.layout(cfg).curated
    ds = tables.open_curated(cfg)
    spec = caption_spec(cfg, v)
    cols = caption_columns(v.name)
    status, model_col, sha_col, params_col = (
        f"{v.column}_status", f"{v.column}_model", f"{v.column}_prompt_sha256",
        f"{v.column}_params",
    )
    names = set(ds.schema.names)
    clash = [c for c in cols if c in names and c != v.column and status not in names]
    if v.column in names and status not in names or clash:
        raise ConfigError(
            f"{where}: the table has a column {v.column!r} that is not a lakeshard caption "
            "version; choose another version name"
        )
    conds = []
    if v.where:
        conds.append(f"({v.where})")
    if status in names and not force:
        made = ds.to_table(
            columns=[model_col, sha_col, params_col], filter=f"{_q(status)} = 'ok'"
        ).group_by([model_col, sha_col, params_col]).aggregate([]).to_pylist()
        current = {model_col: v.model, sha_col: v.prompt_sha256,
                   params_col: v.params_json()}
        other = [m for m in made if m != current]
        if other:
            raise ConfigError(
                f"{where}: {v.column} already holds captions from another model, prompt or "
                f"generation parameters ({other[0]}); configure a new version name, or pass "
                "--force to recaption every row under this name"
            )
        conds.append(f"({_q(status)} IS NULL OR {_q(status)} = 'failed')")
    predicate = " AND ".join(conds) or None
    try:
        todo = ds.count_rows(filter=predicate)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{where}.where: {v.where!r}: {exc}") from None
    return CaptionPlan(v, spec, path, ds.version, ds.count_rows(), predicate, todo)


@dataclass(frozen=True)
class CaptionResult:
    version: str
    column: str
    model: str
    smoke_test_model: bool
    table_path: str
    version_before: int
    version_after: int
    table_rows: int
    todo: int
    captioned: int
    statuses: dict[str, int] = field(default_factory=dict)
    flags: dict[str, int] = field(default_factory=dict)
    # Per Python worker that captioned: model loads (cumulative in the worker) and
    # Arrow batches it processed in this run.
    workers: dict[str, dict[str, int]] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0
    bytes_written: int = 0


def caption(
    spark: SparkSession | None, cfg: Config, name: str | None = None, *,
    force: bool = False, limit: int | None = None,
) -> CaptionResult:
    """Caption the rows of the curated table that lack version `name`; one table version
    (two when the columns are new). `spark` may be None when there is nothing to do."""
    t0 = time.perf_counter()
    plan = plan_caption(cfg, name, force=force)
    v, spec = plan.version, plan.spec
    cols = list(caption_columns(v.name))
    base = dict(
        version=v.name, column=v.column, model=v.model, smoke_test_model=v.model == TINY_MODEL,
        table_path=plan.table_path, version_before=plan.table_version,
        table_rows=plan.table_rows, todo=plan.todo,
    )
    if plan.todo == 0:
        log.info("caption %s: every row has it; nothing to do", v.name)
        return CaptionResult(**base, version_after=plan.table_version, captioned=0,
                             seconds=time.perf_counter() - t0)

    if spark is None:
        raise ValueError("caption: a SparkSession is needed, there are rows to caption")
    sc = spark.sparkContext
    sc.setJobDescription(f"lakeshard caption {v.name}")
    reader = (
        spark.read.format("lance")
        .option("version", str(plan.table_version))
        .option("columns", "sample_id,image")
        .option("fragment_id", "true")
    )
    if plan.predicate:
        reader = reader.option("filter", plan.predicate)
    rows = reader.load(plan.table_path)
    if limit is not None:
        rows = rows.limit(limit)
    if v.partitions:
        rows = rows.repartition(v.partitions)
    udf = caption_udf(spec).asNondeterministic()  # evaluated once per row, never inlined
    now = datetime.now(UTC).replace(tzinfo=None)
    c = F.col("_c")
    types = caption_columns(v.name)
    values = [
        c.caption, c.status, c.error, c.flags, c.tokens, F.lit(v.model),
        F.lit(v.prompt_sha256), F.lit(v.params_json()), F.lit(now),
    ]
    out = (
        rows.select("sample_id", FRAGMENT_ID, udf(F.col("image")).alias("_c"))
        .select(
            "sample_id", FRAGMENT_ID,
            *[val.cast(types[name]).alias(name) for name, val in zip(cols, values, strict=True)],
            c.worker.alias("_worker"), c.model_loads.alias("_loads"), c.batch.alias("_batch"),
        )
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    status_col, flags_col = f"{v.column}_status", f"{v.column}_flags"
    statuses = {r[0]: r[1] for r in out.groupBy(status_col).count().collect()}
    flags = {
        r[0]: r[1]
        for r in out.select(F.explode(F.split(flags_col, ",")).alias("f"))
        .where("f != ''").groupBy("f").count().collect()
    }
    workers = {
        r["_worker"]: {"model_loads": r["loads"], "batches": r["batches"]}
        for r in out.groupBy("_worker")
        .agg(F.max("_loads").alias("loads"), F.countDistinct("_batch").alias("batches"))
        .collect()
    }
    tokens = out.agg(F.sum(f"{v.column}_tokens")).first()[0] or 0
    sc.setJobDescription(f"lakeshard caption {v.name}: write columns")
    written = write_columns(spark, plan.table_path, out.drop("_worker", "_loads", "_batch"))
    sc.setJobDescription(None)
    out.unpersist()
    return CaptionResult(
        **base,
        version_after=written.version,
        captioned=written.rows,
        statuses=dict(sorted(statuses.items())),
        flags=dict(sorted(flags.items())),
        workers=dict(sorted(workers.items())),
        tokens=int(tokens),
        seconds=time.perf_counter() - t0,
        bytes_written=written.bytes_written,
    )


def format_caption(r: CaptionResult) -> str:
    lines = [f"caption version {r.version!r} -> column {r.column} (model: {r.model})"]
    if r.smoke_test_model:
        lines.append(
            f"NOTE: {TINY_MODEL} is an untrained, randomly initialised smoke-test model: its "
            "captions are noise. Set caption.versions.<name>.model to a real checkpoint (a "
            "local folder or a hub id such as Qwen/Qwen2.5-VL-7B-Instruct) for real captions."
        )
    lines.append(
        f"rows to caption   : {r.todo} of {r.table_rows} "
        f"({r.table_rows - r.todo} already have this version or are not selected)"
    )
    if r.todo == 0:
        lines.append("nothing to do: the table is unchanged")
    else:
        st = ", ".join(f"{k}={n}" for k, n in r.statuses.items()) or "-"
        fl = ", ".join(f"{k}={n}" for k, n in r.flags.items()) or "none"
        loads = sum(w["model_loads"] for w in r.workers.values())
        batches = sum(w["batches"] for w in r.workers.values())
        rate = r.captioned / r.seconds if r.seconds else 0.0
        lines += [
            f"captioned         : {r.captioned} ({st}); flags: {fl}",
            f"workers           : {len(r.workers)}, model loaded {loads} time(s) for "
            f"{batches} batch(es); {r.tokens} tokens generated",
            f"time              : {r.seconds:.1f} s ({rate:.2f} images/s, Spark start-up "
            "excluded)",
        ]
    lines.append(
        f"curated (Lance)   : {r.table_path}  version {r.version_before} -> {r.version_after}"
        f" ({r.bytes_written / 1e3:.1f} kB of caption data; image files untouched)"
    )
    return "\n".join(lines)


def write_caption_report(cfg: Config, r: CaptionResult) -> str | None:
    """``<root>/reports/caption-<version>-<time>/summary.json``, on a local root or an
    object store alike; returns its path."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = tables.layout(cfg).report_dir(f"caption-{r.version}-{stamp}")
    path = f"{out_dir}/summary.json"
    write_file(path, json.dumps(asdict(r), indent=2).encode())
    return path


def stage(spark: SparkSession, cfg: Config, ctx: RunContext) -> StageResult:
    """A caption version (the default one, or the command's) for rows lacking it."""
    if not cfg.caption.versions:
        return StageResult(note="no caption versions configured")
    name = ctx.option("caption", "version")
    force = ctx.option("caption", "force", False)
    limit = ctx.option("caption", "limit")
    res = caption(spark, cfg, name, force=force, limit=limit)
    if res.todo == 0:
        return StageResult(note="up to date", inputs={"rows": res.table_rows}, detail=res)
    return StageResult(
        inputs={"rows": res.table_rows, "todo": res.todo},
        outputs={f"status:{k}": v for k, v in res.statuses.items()},
        table_versions={"lance:curated": res.version_after}, detail=res,
        note=f"{res.column}: untrained smoke-test model" if res.smoke_test_model else None,
    )


def check(cfg: Config, ctx: RunContext) -> None:
    """Before Spark: the version and its model (built if it is the smoke-test model);
    for `lakeshard caption`, also the table and the rows to do."""
    if not cfg.caption.versions:
        return
    name = ctx.option("caption", "version")
    if ctx.option("caption", "command", False):
        plan_caption(cfg, name, force=ctx.option("caption", "force", False))
    else:
        caption_spec(cfg, cfg.caption.version(name))
