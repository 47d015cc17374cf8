"""Latents job: a text encoder's latents per caption version, as columns of the curated
Lance table (``lakeshard latents --encoder NAME``), and their export to MDS.

Per configured caption column ``<caption>`` and encoder ``<encoder>`` the table gains

=================================  ========  ============================================
column                             type      value
=================================  ========  ============================================
``latent_<caption>_<encoder>``     binary    ``max_tokens x hidden`` values of ``dtype``
``attention_mask_<caption>_<e…>``  binary    ``max_tokens`` uint8 (1 = token, 0 = pad)
``latent_tokens_<caption>_<e…>``   int       token count before truncation
``latent_error_<caption>_<e…>``    string    null, ``non_finite`` or ``encoder_error: …``
=================================  ========  ============================================

The latent column's Arrow field metadata (``lakeshard.latent``) records the encoder,
path, ``max_tokens``, ``hidden_size``, ``dtype`` and padding: exports read shapes from
it, and a config that no longer matches it is refused (``--recompute`` replaces).

Columns are added with :mod:`etl.writers.lance_columns`: new data files holding only
these columns, next to each fragment's files; the image data files are not touched.
Only rows without latents are encoded, so a rerun after new rows were appended, or
after some captions failed, does just that work. ``--drop`` removes an encoder's
columns (metadata only).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import pyarrow as pa
from pyspark.sql import SparkSession

from etl import tables
from etl.columns import LATENT_META, latent_columns, table_latents
from etl.config import Config, LatentEncoderConfig
from etl.errors import ConfigError
from etl.runtime.options import flag
from etl.runtime.stage import RunContext, StageDetail, StageResult
from etl.writers.lance import FRAGMENT_ID, lance_reader
from etl.writers.lance_columns import drop_columns, ensure_columns, write_columns
from udfs.latents import (
    STORAGE_BYTES,
    latents_mapper,
    model_hidden_size,
    output_columns,
    resolve_model_path,
)
from udfs.worker import GPU_SCHEDULING, python_worker_pool

__all__ = [
    "CaptionLatents",
    "LatentsResult",
    "LatentsDropped",
    "compute_latents",
    "drop_latents",
    "format_latents",
    "LatentsOptions",
    "stage",
    "check",
    "render",
]

log = logging.getLogger(__name__)

# The settings that determine the stored values; a mismatch means "recompute".
_SPEC_KEYS = ("path", "max_tokens", "hidden_size", "dtype", "padding", "compute_dtype")


@dataclass(frozen=True)
class CaptionLatents:
    caption: str
    rows: int  # rows of the table (seen)
    encoded: int  # rows with latents
    failed: int  # rows whose caption could not be encoded (no latents, an error)
    reasons: dict[str, int] = field(default_factory=dict)
    truncated: int = 0  # captions longer than max_tokens (cut)


@dataclass(frozen=True)
class LatentsResult(StageDetail):
    """What `lakeshard latents --encoder NAME` computed."""

    encoder: str
    table: str
    version: int
    max_tokens: int
    hidden_size: int
    dtype: str
    computed: int  # rows encoded by this run
    bytes_written: int  # new Lance data files (latents, masks, counts, errors)
    captions: tuple[CaptionLatents, ...]

    @property
    def raw_bytes_per_caption(self) -> int:
        """Latent + mask bytes per caption, before any compression."""
        return self.max_tokens * self.hidden_size * STORAGE_BYTES[self.dtype] + self.max_tokens


def _check(cfg: Config, name: str, schema: pa.Schema) -> tuple[LatentEncoderConfig, int]:
    """Everything that can be checked before Spark: captions, model folder, sizes."""
    enc = cfg.latents.encoder(name)
    where = f"latents.encoders.{name}"
    for cap in cfg.latents.captions:
        if cap not in schema.names:
            raise ConfigError(
                f"latents.captions: {cap!r} is not a column of the curated table "
                f"(its columns: {', '.join(schema.names)})"
            )
        if not pa.types.is_string(schema.field(cap).type) and not pa.types.is_large_string(
            schema.field(cap).type
        ):
            raise ConfigError(f"latents.captions: {cap!r} is {schema.field(cap).type}, not text")
    try:
        path = resolve_model_path(enc.path)
        hidden = model_hidden_size(enc.path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}.path: {exc}") from None
    with open(f"{path}/config.json", encoding="utf-8") as f:
        positions = json.load(f).get("max_position_embeddings")
    if positions and enc.max_tokens > positions:
        raise ConfigError(
            f"{where}.max_tokens: {enc.max_tokens} is more than the model's "
            f"max_position_embeddings ({positions})"
        )
    return enc, hidden


def _meta(enc: LatentEncoderConfig, caption: str, hidden: int) -> dict:
    return {
        "encoder": enc.name, "caption": caption, "path": enc.path,
        "max_tokens": enc.max_tokens, "hidden_size": hidden, "dtype": enc.dtype,
        "padding": enc.padding, "compute_dtype": enc.compute_dtype,
        "layout": f"{enc.dtype} little-endian [max_tokens, hidden_size], row-major",
    }


def _fields(enc: LatentEncoderConfig, caption: str, hidden: int) -> list[pa.Field]:
    names = latent_columns(caption, enc.name)
    meta = {LATENT_META: json.dumps(_meta(enc, caption, hidden), sort_keys=True)}
    return [
        pa.field(names.latent, pa.binary(), metadata=meta),
        pa.field(names.mask, pa.binary()),
        pa.field(names.tokens, pa.int32()),
        pa.field(names.error, pa.string()),
    ]


def drop_latents(cfg: Config, name: str) -> tuple[int, list[str]]:
    """Drop every latent column of encoder `name` (all captions); metadata only.

    Returns the new table version and the dropped columns."""
    path = tables.layout(cfg).curated
    table = tables.open_curated(cfg)
    columns = [
        c for m in table_latents(table.schema) if m["encoder"] == name
        for c in latent_columns(m["caption"], name).all() if c in table.schema.names
    ]
    version = drop_columns(path, columns) if columns else table.version
    return version, columns


def _caption_stats(ds, caption: str, enc: LatentEncoderConfig) -> CaptionLatents:
    names = latent_columns(caption, enc.name)
    errors = ds.to_table(columns=[names.error], filter=f"{names.error} IS NOT NULL")
    reasons: dict[str, int] = {}
    for e in errors.column(0).to_pylist():
        key = e.split(":", 1)[0]
        reasons[key] = reasons.get(key, 0) + 1
    return CaptionLatents(
        caption=caption,
        rows=ds.count_rows(),
        encoded=ds.count_rows(filter=f"{names.latent} IS NOT NULL"),
        failed=errors.num_rows,
        reasons=dict(sorted(reasons.items())),
        truncated=ds.count_rows(filter=f"{names.tokens} > {enc.max_tokens}"),
    )


def compute_latents(
    spark: SparkSession, cfg: Config, name: str, *, recompute: bool = False
) -> LatentsResult:
    """Encode every configured caption of the rows that lack latents of encoder `name`."""
    import lance

    path = tables.layout(cfg).curated
    table = tables.open_curated(cfg)
    enc, hidden = _check(cfg, name, table.schema)
    if enc.device == "cuda" and spark.sparkContext.getConf().get(
        "spark.task.resource.gpu.amount", None
    ) is None:
        raise ConfigError(
            f"latents.encoders.{name}.device: cuda is the GPU Spark assigns to each task, "
            f"but this Spark session schedules no GPUs: set {GPU_SCHEDULING} in spark.conf, "
            "or name one GPU with device: cuda:N"
        )
    captions = list(cfg.latents.captions)
    _prepare_columns(path, table.schema, name, enc, hidden, captions, recompute=recompute)
    written = _encode(spark, path, name, enc, captions)
    ds = lance.dataset(path)
    stats = tuple(_caption_stats(ds, cap, enc) for cap in captions)
    for s in stats:
        if s.encoded + s.failed != s.rows:
            raise RuntimeError(
                f"latents {name}/{s.caption}: {s.rows} rows, but {s.encoded} encoded + "
                f"{s.failed} failed"
            )
    return LatentsResult(
        encoder=name, table=path, version=ds.version, max_tokens=enc.max_tokens,
        hidden_size=hidden, dtype=enc.dtype, computed=written.rows,
        bytes_written=written.bytes_written, captions=stats,
    )


def _prepare_columns(path: str, schema: pa.Schema, name: str, enc: LatentEncoderConfig,
                     hidden: int, captions: list[str], *, recompute: bool) -> None:
    """The encoder's columns for every caption, added empty where missing; latents
    computed with other settings are dropped first with `recompute`, refused without."""
    existing = {m["caption"]: m for m in table_latents(schema) if m["encoder"] == name}
    changed = [
        cap for cap in captions if cap in existing
        and any(existing[cap].get(k) != _meta(enc, cap, hidden)[k] for k in _SPEC_KEYS)
    ]
    if recompute:
        drop_columns(path, [c for cap in captions for c in latent_columns(cap, name).all()])
    elif changed:
        was = {k: existing[changed[0]].get(k) for k in _SPEC_KEYS}
        raise ConfigError(
            f"latents.encoders.{name}: the table's latents for {changed[0]!r} were computed "
            f"with {was}; the config differs. Run `lakeshard latents --encoder {name} "
            "--recompute` to replace them (or --drop to remove them)"
        )
    ensure_columns(path, [f for cap in captions for f in _fields(enc, cap, hidden)])


def _encode(spark: SparkSession, path: str, name: str, enc: LatentEncoderConfig,
            captions: list[str]):
    """Encode the captions of the rows lacking a latent for any of them, in the latents
    pool's workers, and write the values as new columns (what
    :func:`etl.writers.lance_columns.write_columns` wrote)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    todo = " OR ".join(f"{latent_columns(cap, name).latent} IS NULL" for cap in captions)
    rows = (
        lance_reader(spark)
        .option("columns", ",".join(["sample_id", *captions]))
        .option("fragment_id", "true")
        .option("filter", todo)
        .load(path)
    )
    keys = ["sample_id", FRAGMENT_ID]
    out_schema = pa.schema(
        [pa.field("sample_id", pa.string()), pa.field(FRAGMENT_ID, pa.int32())]
        + [pa.field(n, t) for n, t in output_columns(captions, lambda c: latent_columns(c, name))]
    )
    mapper = latents_mapper(enc, captions, keys, lambda c: latent_columns(c, name))
    with python_worker_pool(spark, "latents"):  # one encoder copy per task slot
        encoded = rows.mapInArrow(mapper, from_arrow_schema(out_schema))
    sc = spark.sparkContext
    sc.setJobDescription(f"lakeshard latents: encode captions with {name}")
    try:
        return write_columns(spark, path, encoded)
    finally:
        sc.setJobDescription(None)


def format_latents(res: LatentsResult) -> str:
    lines = [
        f"latents {res.encoder}: [{res.max_tokens}, {res.hidden_size}] {res.dtype} + mask "
        f"= {res.raw_bytes_per_caption:,} bytes per caption; {res.computed} rows encoded "
        f"this run, {res.bytes_written / 1e6:.2f} MB written",
        "",
        f"{'caption':<28} {'rows':>7} {'encoded':>8} {'failed':>7} {'truncated':>9}  reasons",
    ]
    for c in res.captions:
        why = ", ".join(f"{k}={v}" for k, v in c.reasons.items()) or "-"
        lines.append(
            f"{c.caption:<28} {c.rows:>7} {c.encoded:>8} {c.failed:>7} {c.truncated:>9}  {why}"
        )
    lines += ["", f"curated (Lance) : {res.table}  version {res.version}"]
    return "\n".join(lines)


@dataclass(frozen=True)
class LatentsDropped(StageDetail):
    """What `lakeshard latents --encoder NAME --drop` did: the table version it left and
    the columns it dropped (none: the encoder had none)."""

    version: int
    columns: tuple[str, ...]


@dataclass(frozen=True)
class LatentsOptions:
    """`lakeshard latents`'s flags: compute (or recompute) one encoder's latents, or drop
    its columns."""

    encoder: str | None = flag(None, "encoder name under `latents.encoders`", required=True)
    recompute: bool = flag(False, "replace existing latents of this encoder", group="what")
    drop: bool = flag(False, "drop this encoder's columns", group="what")


def stage(spark: SparkSession, cfg: Config, ctx: RunContext
          ) -> StageResult[LatentsResult | LatentsDropped]:
    """`lakeshard latents --encoder NAME [--recompute | --drop]`."""
    opts = ctx.options_for(LatentsOptions)
    name = opts.encoder
    if opts.drop:
        version, columns = drop_latents(cfg, name)
        return StageResult(outputs={"dropped_columns": len(columns)},
                           table_versions={"lance:curated": version},
                           detail=LatentsDropped(version, tuple(columns)))
    res = compute_latents(spark, cfg, name, recompute=opts.recompute)
    return StageResult(
        inputs={"rows": res.captions[0].rows if res.captions else 0},
        outputs={"encoded": res.computed, "bytes": res.bytes_written},
        table_versions={"lance:curated": res.version}, detail=res,
    )


def check(cfg: Config, ctx: RunContext) -> None:
    """Before Spark: the encoder is configured; to compute, the table, its caption
    columns and the model folder are there."""
    opts = ctx.options_for(LatentsOptions)
    name = opts.encoder
    cfg.latents.encoder(name)
    if not opts.drop:
        _check(cfg, name, tables.open_curated(cfg).schema)


def render(cfg: Config, opts: LatentsOptions,
           result: StageResult[LatentsResult | LatentsDropped]) -> str:
    """What `lakeshard latents` prints: the latents computed, or the columns dropped."""
    done = result.made()
    if isinstance(done, LatentsResult):
        return format_latents(done)
    if not done.columns:
        return f"latents {opts.encoder}: none in the curated table; nothing dropped"
    return f"latents {opts.encoder}: dropped {', '.join(done.columns)} (version {done.version})"
