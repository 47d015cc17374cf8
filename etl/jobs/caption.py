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
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from pyspark import StorageLevel
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from etl import tables
from etl.columns import caption_columns
from etl.config import CaptionVersionConfig, Config
from etl.errors import ConfigError
from etl.runtime.options import flag, positive
from etl.runtime.stage import Metrics, RowTally, RunContext, StageDetail, StageResult
from etl.tiny_vlm import TINY_MODEL, ensure_tiny_vlm
from etl.writers.lance import FRAGMENT_ID, ROW_ADDRESS, lance_reader
from etl.writers.lance_columns import write_columns
from etl.writers.remote import write_file
from udfs.caption import CaptionSpec, caption_mapper, output_schema
from udfs.worker import GPU_SCHEDULING, python_worker_pool

__all__ = [
    "CaptionPlan",
    "CaptionResult",
    "caption_spec",
    "plan_caption",
    "caption",
    "format_caption",
    "write_caption_report",
    "CaptionOptions",
    "stage",
    "check",
    "render",
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
class CaptionResult(StageDetail):
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
    # Per Python worker that captioned (host:pid): its executor (host:pid of the caption
    # pool's daemon), device, tasks, model loads and generate() calls in this run.
    workers: dict[str, dict] = field(default_factory=dict)
    # Per executor: workers, model loads and the devices they used in this run.
    executors: dict[str, dict] = field(default_factory=dict)
    model_loads: int = 0
    tasks: int = 0
    batches: int = 0  # generate() calls
    tokens: int = 0  # generated
    image_tokens: int = 0  # in the prompts of the captioned rows
    padding: int = 0  # pad tokens their batches added
    padding_share: float = 0.0  # padding / (padding + image_tokens)
    worker_reuse: bool = True  # spark.python.worker.reuse
    seconds: float = 0.0
    bytes_written: int = 0

    def summary_section(self) -> str | None:
        """What captioning did, in the run's summary when there were rows to do."""
        return format_caption(self) if self.todo else None


def _gpu_share(spark: SparkSession, v: CaptionVersionConfig) -> float:
    """The share of a GPU each task holds; checked before any Spark job: `device: cuda`
    needs Spark to schedule GPUs."""
    if v.device != "cuda":
        return 1.0
    amount = spark.sparkContext.getConf().get("spark.task.resource.gpu.amount", None)
    if amount is None:
        raise ConfigError(
            f"caption.versions.{v.name}.device: cuda is the GPU Spark assigns to each task, "
            f"but this Spark session schedules no GPUs: set {GPU_SCHEDULING} in spark.conf "
            "(see conf/databricks.yaml), or name one GPU with device: cuda:N"
        )
    return float(amount)


def _run_stats(out, status_col: str, flags_col: str, tokens_col: str) -> dict:
    """Everything the summary reports, in one Spark job over the captioned rows:
    statuses, flags, tokens and padding; per worker and per executor, tasks, model loads
    (done in this run) and generate() calls."""
    groups = (
        out.groupBy("_worker", "_executor", "_task", status_col, flags_col)
        .agg(F.count(F.lit(1)).alias("rows"), F.sum(tokens_col).alias("tokens"),
             F.sum("_image_tokens").alias("image_tokens"), F.sum("_padding").alias("padding"),
             F.max("_loads").alias("loads"), F.max("_device").alias("device"),
             F.min("_batch").alias("first"), F.max("_batch").alias("last"))
        .collect()
    )
    statuses: dict[str, int] = {}
    flags: dict[str, int] = {}
    tasks: dict[tuple, dict] = {}
    for g in groups:
        statuses[g[status_col]] = statuses.get(g[status_col], 0) + g["rows"]
        for f in filter(None, (g[flags_col] or "").split(",")):
            flags[f] = flags.get(f, 0) + g["rows"]
        t = tasks.setdefault((g["_worker"], g["_task"]), {
            "executor": g["_executor"], "device": None, "loads": 0, "first": None,
            "last": None})
        t["loads"] = max(t["loads"], g["loads"])
        t["device"] = t["device"] or g["device"]
        if g["first"] is not None:  # a task's generate() calls are numbered consecutively
            t["first"] = g["first"] if t["first"] is None else min(t["first"], g["first"])
            t["last"] = g["last"] if t["last"] is None else max(t["last"], g["last"])
    workers: dict[str, dict] = {}
    for (worker, _), t in sorted(tasks.items()):
        w = workers.setdefault(worker, {"executor": t["executor"], "device": None,
                                        "tasks": 0, "model_loads": 0, "batches": 0})
        w["tasks"] += 1
        w["model_loads"] += t["loads"]
        w["batches"] += t["last"] - t["first"] + 1 if t["first"] is not None else 0
        w["device"] = w["device"] or t["device"]
    executors: dict[str, dict] = {}
    for w in workers.values():
        e = executors.setdefault(w["executor"], {"workers": 0, "model_loads": 0, "devices": []})
        e["workers"] += 1
        e["model_loads"] += w["model_loads"]
        if w["device"] and w["device"] not in e["devices"]:
            e["devices"].append(w["device"])
    return {
        "statuses": dict(sorted(statuses.items())), "flags": dict(sorted(flags.items())),
        "workers": workers, "executors": dict(sorted(executors.items())),
        "tasks": len(tasks), "batches": sum(w["batches"] for w in workers.values()),
        "model_loads": sum(w["model_loads"] for w in workers.values()),
        **{k: sum(int(g[k] or 0) for g in groups) for k in ("tokens", "image_tokens",
                                                             "padding")},
    }


def caption(
    spark: SparkSession | None, cfg: Config, name: str | None = None, *,
    force: bool = False, limit: int | None = None,
) -> CaptionResult:
    """Caption the rows of the curated table that lack version `name`; one table version
    (two when the columns are new). `spark` may be None when there is nothing to do."""
    t0 = time.perf_counter()
    plan = plan_caption(cfg, name, force=force)
    v = plan.version
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
    spec = replace(plan.spec, gpu_share=_gpu_share(spark, v))
    sc = spark.sparkContext
    reuse = sc.getConf().get("spark.python.worker.reuse", "true").lower() == "true"
    if not reuse:
        log.warning("spark.python.worker.reuse is false: every caption task loads the model")
    sc.setJobDescription(f"lakeshard caption {v.name}")
    rows = _rows_to_caption(spark, plan, limit)
    out = _captioned(spark, spec, plan, rows).persist(StorageLevel.MEMORY_AND_DISK)
    stats = _run_stats(out, f"{v.column}_status", f"{v.column}_flags", f"{v.column}_tokens")
    sc.setJobDescription(f"lakeshard caption {v.name}: write columns")
    written = write_columns(spark, plan.table_path,
                            out.select(*_CAPTION_KEYS, *caption_columns(v.name)))
    sc.setJobDescription(None)
    out.unpersist()
    padding, image_tokens = stats["padding"], stats["image_tokens"]
    return CaptionResult(
        **base,
        version_after=written.version,
        captioned=written.rows,
        **stats,
        padding_share=padding / (padding + image_tokens) if padding + image_tokens else 0.0,
        worker_reuse=reuse,
        seconds=time.perf_counter() - t0,
        bytes_written=written.bytes_written,
    )


# The columns a captioned row is written back by: its id and its fragment.
_CAPTION_KEYS = ("sample_id", FRAGMENT_ID)


def _rows_to_caption(spark: SparkSession, plan: CaptionPlan, limit: int | None):
    """Keys and row addresses of the rows to caption, at the planned version (each task
    takes its image bytes from Lance itself); the first `limit`, spread over the
    version's partitions if it sets them."""
    reader = (
        lance_reader(spark)
        .option("version", str(plan.table_version))
        .option("columns", "sample_id")
        .option("row_address", "true")
        .option("fragment_id", "true")
    )
    if plan.predicate:
        reader = reader.option("filter", plan.predicate)
    rows = reader.load(plan.table_path)
    if limit is not None:
        rows = rows.limit(limit)
    if plan.version.partitions:
        rows = rows.repartition(plan.version.partitions)
    return rows


def _captioned(spark: SparkSession, spec: CaptionSpec, plan: CaptionPlan, rows):
    """`rows` captioned by the caption pool's workers: the keys, the version's columns
    (typed, with its provenance) and the per-row run figures :func:`_run_stats` reads."""
    v = plan.version
    keys = list(_CAPTION_KEYS)
    mapper = caption_mapper(spec, plan.table_path, plan.table_version, keys=keys,
                            row_address=ROW_ADDRESS)
    schema = output_schema(to_arrow_schema(rows.select(*keys).schema))
    with python_worker_pool(spark, "caption"):  # one model copy per task slot
        captioned = rows.mapInArrow(mapper, from_arrow_schema(schema))
    now = datetime.now(UTC).replace(tzinfo=None)
    types = caption_columns(v.name)
    values = [
        F.col("caption"), F.col("status"), F.col("error"), F.col("flags"), F.col("tokens"),
        F.lit(v.model), F.lit(v.prompt_sha256), F.lit(v.params_json()), F.lit(now),
    ]
    return captioned.select(
        *keys,
        *[val.cast(types[name]).alias(name) for name, val in zip(types, values, strict=True)],
        *[F.col(c).alias(f"_{c}") for c in ("image_tokens", "padding", "worker",
                                            "executor", "device", "task", "batch")],
        F.col("model_loads").alias("_loads"),
    )


def _counts(values: list[int]) -> str:
    """1 (x4)  or  1-2 (3x1, 1x2): the distribution of small counts."""
    if not values:
        return "-"
    seen = sorted(set(values))
    if len(seen) == 1:
        return f"{seen[0]} (x{len(values)})"
    spread = ", ".join(f"{values.count(k)}x{k}" for k in seen)
    return f"{seen[0]}-{seen[-1]} ({spread})"


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
        devices = sorted({d for e in r.executors.values() for d in e["devices"]})
        rate = r.captioned / r.seconds if r.seconds else 0.0
        lines += [
            f"captioned         : {r.captioned} ({st}); flags: {fl}",
            f"model loads       : {r.model_loads} in {len(r.workers)} worker(s) on "
            f"{len(r.executors)} executor(s) ({', '.join(devices) or 'no device'}), "
            f"{r.tasks} task(s)",
            f"  per worker      : {_counts([w['model_loads'] for w in r.workers.values()])}",
            f"  per executor    : {_counts([e['model_loads'] for e in r.executors.values()])}",
            f"batches           : {r.batches} generate() call(s); padding "
            f"{100 * r.padding_share:.1f} % of image tokens ({r.padding} of "
            f"{r.padding + r.image_tokens}); {r.tokens} tokens generated",
            f"time              : {r.seconds:.1f} s ({rate:.2f} images/s, Spark start-up "
            "excluded)",
        ]
        if not r.worker_reuse:
            lines.append("WARNING           : spark.python.worker.reuse is false: every "
                         "task loaded its own model copy; set it to true")
        if r.statuses.get("failed"):
            lines.append(f"failed            : {r.statuses['failed']} row(s): generation "
                         f"raised ({r.column}_error says why); the next run retries them")
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


def _failure_examples(r: CaptionResult, n: int) -> tuple[str, ...]:
    """Up to `n` failed rows of this version (generation failures first, then images
    that did not decode), as ``sample_id: status: error``, from the committed table."""
    import lance

    if not (r.statuses.get("failed") or r.statuses.get("bad_image")):
        return ()
    ds = lance.dataset(r.table_path, version=r.version_after)
    status, error = f"{r.column}_status", f"{r.column}_error"
    out: list[str] = []
    for kind in ("failed", "bad_image"):
        if len(out) >= n or not r.statuses.get(kind):
            continue
        rows = ds.to_table(columns=["sample_id", error], filter=f"{_q(status)} = '{kind}'",
                           limit=n - len(out)).to_pylist()
        out += [f"{row['sample_id']}: {kind}: {row[error]}" for row in rows]
    return tuple(out)


@dataclass(frozen=True)
class CaptionOptions:
    """`lakeshard caption`'s flags (a `lakeshard run` captions the default version)."""

    version: str | None = flag(
        None, "caption version under `caption.versions` (default: caption.default)")
    force: bool = flag(
        False, "recaption every selected row, not only those lacking the version")
    limit: int | None = flag(None, "caption at most N rows", type=positive)


def stage(spark: SparkSession, cfg: Config, ctx: RunContext) -> StageResult[CaptionResult]:
    """A caption version (the default one, or the command's) for rows lacking it.

    Its failure budget (``run.budgets.failed_rate.caption``, checked by the runner) is on
    the rows captioned this run: the captions are committed first (one table version,
    every row with its status), so a failed run keeps what it captioned and the next run
    retries the ``failed`` rows."""
    if not cfg.caption.versions:
        return StageResult(note="no caption versions configured")
    opts = ctx.options_for(CaptionOptions)
    res = caption(spark, cfg, opts.version, force=opts.force, limit=opts.limit)
    if res.todo == 0:
        return StageResult(note="up to date", inputs={"rows": res.table_rows}, detail=res)
    tally = RowTally(
        rows=sum(res.statuses.values()), ok=res.statuses.get("ok", 0),
        failed=res.statuses.get("failed", 0),
        examples=_failure_examples(res, cfg.run.budgets.examples),
        failed_label=f"{res.column}_status = failed",
    )
    return StageResult(
        inputs={"rows": res.table_rows, "todo": res.todo},
        outputs=Metrics(by={"status": res.statuses}),
        table_versions={"lance:curated": res.version_after}, tally=tally, detail=res,
        note=f"{res.column}: untrained smoke-test model" if res.smoke_test_model else None,
    )


def check(cfg: Config, ctx: RunContext) -> None:
    """Before Spark: the version and its model (built if it is the smoke-test model);
    for `lakeshard caption`, also the table and the rows to do."""
    if not cfg.caption.versions:
        return
    opts = ctx.options_for(CaptionOptions)
    name = opts.version
    if ctx.command:
        plan_caption(cfg, name, force=opts.force)
    else:
        caption_spec(cfg, cfg.caption.version(name))


def render(cfg: Config, opts: CaptionOptions, result: StageResult[CaptionResult]) -> str:
    """What `lakeshard caption` prints -- and the version's caption report, written here
    (``<root>/reports/caption-…``) so that the line naming it is true."""
    if result.detail is None:  # no caption versions configured
        return f"caption: {result.note}"
    text = format_caption(result.detail)
    report = write_caption_report(cfg, result.detail)
    return f"{text}\nreport            : {report}" if report else text
