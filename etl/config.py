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
    "SourceConfig",
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
        )


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
    fetch: FetchConfig = field(default_factory=FetchConfig)

    def source(self, name: str) -> SourceConfig:
        for src in self.sources:
            if src.name == name:
                return src
        raise ConfigError(f"sources: no source named {name!r}")

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
    )


_COMPRESSIONS = {None, "zstd", "gz", "bz2", "br", "snappy", "zstd:7", "zstd:3", "gz:6"}
_HASHES = {"sha1", "md5", "xxh64", "xxh3_64", "xxh128", "sha256"}


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
            )
        )
    return tuple(out)


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
    return Config(
        storage=_parse_storage(raw["storage"]),
        sources=sources,
        spark=_parse_spark(raw.get("spark") or {}),
        prepare=_parse_prepare(raw.get("prepare") or {}),
        exports=_parse_exports(raw.get("exports") or {}),
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
