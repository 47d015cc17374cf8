"""Where lakeshard writes, how it starts Spark, what it reads, and how a run operates."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal
from urllib.parse import urlparse

from pydantic import Field, field_validator, model_validator

from etl.config.base import FieldError, Name, Section, Strings, StrMap, Text, local_path
from etl.config.budgets import BudgetsConfig
from etl.errors import ConfigError

__all__ = [
    "StorageConfig", "S3Config", "S3Settings", "SparkConfig", "SourceConfig", "RunConfig",
    "OBJECT_STORE_SCHEMES", "S3_SCHEMES", "is_url", "S3_RETRIES", "S3A_RETRY_CONF",
]

# Schemes lakeshard reaches with its own S3 clients (S3A, pylance, boto3, pyarrow).
S3_SCHEMES = ("s3", "s3a")
# Every object-store scheme a storage root may use; only S3 gets the object-store run
# lock, the others need `run.lock_path` (a POSIX path) or `run.lock: false`.
OBJECT_STORE_SCHEMES = (*S3_SCHEMES, "gs", "abfs", "abfss")

# Retries of throttling (503 SlowDown, 429), 5xx and connection errors, per client; the
# standard AWS variables AWS_RETRY_MODE / AWS_MAX_ATTEMPTS override the boto3 ones.
S3_RETRIES = {"mode": "standard", "max_attempts": 5}
# S3A's (docs/operations.md, "Retries"): its own retry policy around the SDK's retries.
S3A_RETRY_CONF = {
    "fs.s3a.attempts.maximum": "5",           # SDK retries per request (throttling, 5xx)
    "fs.s3a.retry.limit": "7",                 # S3A retries of a failed operation ...
    "fs.s3a.retry.interval": "500ms",          # ... sleeping 0.5 s, 1 s, 1.5 s, ...
    "fs.s3a.retry.throttle.limit": "20",       # throttled (503 SlowDown) operations ...
    "fs.s3a.retry.throttle.interval": "1000ms",  # ... backing off exponentially from 1 s
    "fs.s3a.connection.establish.timeout": "30s",
    "fs.s3a.connection.timeout": "200s",
}


def is_url(path: str) -> bool:
    """True for ``scheme://...`` other than ``file://``: an object store."""
    return "://" in path and not path.startswith("file://")


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class S3Settings:
    """How every S3 client of a run reaches the store: the standard AWS environment,
    overridden by ``storage.s3``. No credentials here: they stay in the environment (or
    the instance profile / web identity) and never enter config, logs or Spark's conf."""

    endpoint: str | None  # None: AWS itself
    region: str | None
    path_style: bool
    allow_http: bool

    def environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The variables to set so that every client reads these settings from the
        environment: boto3 (AWS_ENDPOINT_URL, AWS_REGION/AWS_DEFAULT_REGION,
        AWS_RETRY_MODE/AWS_MAX_ATTEMPTS), Mosaic Streaming (S3_ENDPOINT_URL) and pylance's
        object store (AWS_ALLOW_HTTP, AWS_VIRTUAL_HOSTED_STYLE_REQUEST)."""
        env: dict[str, str] = {}
        if self.endpoint:
            env["AWS_ENDPOINT_URL"] = env["S3_ENDPOINT_URL"] = self.endpoint
            if "AWS_ENDPOINT_URL_S3" in environ:  # botocore prefers it: keep them equal
                env["AWS_ENDPOINT_URL_S3"] = self.endpoint
            env["AWS_ALLOW_HTTP"] = "true" if self.allow_http else "false"
        if self.endpoint or "AWS_VIRTUAL_HOSTED_STYLE_REQUEST" in environ:
            env["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "false" if self.path_style else "true"
        if self.region:
            env["AWS_REGION"] = env["AWS_DEFAULT_REGION"] = self.region
        if "AWS_RETRY_MODE" not in environ:
            env["AWS_RETRY_MODE"] = S3_RETRIES["mode"]
        if "AWS_MAX_ATTEMPTS" not in environ:
            env["AWS_MAX_ATTEMPTS"] = str(S3_RETRIES["max_attempts"])
        return env


def _check_endpoint(endpoint: str) -> str:
    url = urlparse(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"{endpoint!r} is not an http(s)://host[:port] URL")
    if url.username or url.password:
        raise ValueError("must not hold credentials: give them in AWS_ACCESS_KEY_ID / "
                         "AWS_SECRET_ACCESS_KEY (or an instance profile), never in config")
    return endpoint.rstrip("/")


class S3Config(Section):
    """`storage.s3`: overrides of the standard AWS environment for every S3 client --
    Spark's S3A, pylance, boto3 (exports, the run lock) and pyarrow (reports)."""

    # An S3-compatible endpoint (MinIO, Ceph, R2, a test server); default: the
    # environment's AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3, S3_ENDPOINT_URL), else AWS.
    endpoint: Text | None = None
    # Default: AWS_REGION / AWS_DEFAULT_REGION; us-east-1 with a custom endpoint.
    region: Text | None = None
    # Path-style URLs (http://host/bucket/key); default: true with a custom endpoint.
    path_style: bool | None = None
    # Plain-HTTP endpoints; default: true exactly when the endpoint is http://.
    allow_http: bool | None = None
    # How Spark reaches s3:// and s3a://: `auto` -- lakeshard adds S3A (its JARs from
    # <jars_dir>/s3a, s3:// mapped to it) when it supplies Spark's JARs (spark.jars_dir
    # set); with jars_dir null (EMR's EMRFS, Databricks) the platform's own connector is
    # used untouched. `s3a`: always configure S3A; `platform`: never.
    connector: Literal["auto", "s3a", "platform"] = "auto"

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, endpoint: str | None) -> str | None:
        return None if endpoint is None else _check_endpoint(endpoint)

    @model_validator(mode="after")
    def _http_allowed(self) -> S3Config:
        if self.endpoint and self.endpoint.startswith("http://") and self.allow_http is False:
            raise FieldError("allow_http", f"false, but endpoint {self.endpoint!r} is http://")
        return self

    def resolve(self, environ: Mapping[str, str]) -> S3Settings:
        """These settings over the environment `environ` (usually ``os.environ``)."""
        endpoint = self.endpoint or next(
            (environ[k] for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL")
             if environ.get(k)), None)
        if endpoint and not self.endpoint:
            try:
                endpoint = _check_endpoint(endpoint)
            except ValueError as exc:
                raise ConfigError(f"AWS_ENDPOINT_URL: {exc}") from None
        region = (self.region or environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")
                  or ("us-east-1" if endpoint else None))
        if self.path_style is not None:
            path_style = self.path_style
        elif environ.get("AWS_VIRTUAL_HOSTED_STYLE_REQUEST"):
            path_style = not _truthy(environ["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"])
        else:
            path_style = endpoint is not None
        is_http = bool(endpoint) and endpoint.startswith("http://")
        if self.allow_http is not None:
            allow_http = self.allow_http
        elif environ.get("AWS_ALLOW_HTTP") and not self.endpoint:
            allow_http = _truthy(environ["AWS_ALLOW_HTTP"])
        else:
            allow_http = is_http
        if is_http and not allow_http:
            raise ConfigError(f"storage.s3: endpoint {endpoint!r} is http:// but plain HTTP "
                              "is not allowed (AWS_ALLOW_HTTP / storage.s3.allow_http)")
        return S3Settings(endpoint, region, path_style, allow_http)


def _default_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return local_path(os.path.join(base, "lakeshard"))


# Characters a storage root may not hold: quoting (backtick, quotes, backslash), URL
# syntax delta-rs and Hadoop read as such (| # ? %), and glob syntax.
_ROOT_UNSAFE = frozenset("`'\"\\|#?%*[]{}<>^")


class StorageConfig(Section):
    # Everything lakeshard writes goes under this folder, or s3://bucket/prefix (s3a://
    # too; gs:// and abfss:// through the platform's connector).
    root: Text
    # Lance tables live under <root>/lance/<namespace>/.
    namespace: Name = "default"
    # Object-store client settings (endpoint, region, ...) over the AWS environment.
    s3: S3Config = Field(default_factory=S3Config)
    # A local folder for what a run builds on this machine (the smoke-test caption
    # model); default <root>/cache for a local root, else $XDG_CACHE_HOME/lakeshard
    # (~/.cache/lakeshard). Never an object store: models load from local files.
    cache_dir: Text | None = None

    @field_validator("root")
    @classmethod
    def _absolute(cls, root: str) -> str:
        bad = sorted({ch for ch in root if ch in _ROOT_UNSAFE or not ch.isprintable()})
        if bad:
            raise ValueError(
                f"contains {', '.join(repr(ch) for ch in bad)}: a root must be a plain "
                "path or URL (it goes into Spark SQL `delta.`...`` names, Hadoop globs "
                "and delta-rs URIs); not allowed: control characters and "
                + " ".join(sorted(_ROOT_UNSAFE))
            )
        if not is_url(root):
            # Local roots are made absolute once, here: Spark, Delta and pylance then
            # agree on every path whatever their working directory.
            return local_path(root.rstrip("/") or "/")
        url = urlparse(root)
        if url.scheme not in OBJECT_STORE_SCHEMES or not url.netloc:
            raise ValueError(
                f"{root!r}: expected a local folder or an object-store URL "
                f"({', '.join(s + '://bucket/prefix' for s in OBJECT_STORE_SCHEMES[:2])})"
            )
        return root.rstrip("/")

    @field_validator("cache_dir")
    @classmethod
    def _local(cls, path: str | None) -> str | None:
        if path is None:
            return None
        if is_url(path):
            raise ValueError(f"{path!r} must be a local folder, not an object-store URL")
        return local_path(path)

    @property
    def is_remote(self) -> bool:
        return is_url(self.root)

    @property
    def scheme(self) -> str:
        """The root's URL scheme (``s3``, ``s3a``, ...); "" for a local root."""
        return urlparse(self.root).scheme if self.is_remote else ""

    @property
    def machine_cache(self) -> str:
        """The cache of what belongs to this machine's installation rather than to one
        root (the driver JVM's class archive): `cache_dir`, else ~/.cache/lakeshard."""
        return self.cache_dir or _default_cache()

    @property
    def local_cache(self) -> str:
        """The local cache folder (see `cache_dir`)."""
        if self.cache_dir:
            return self.cache_dir
        return os.path.join(self.root, "cache") if not self.is_remote else _default_cache()


class DriverJvmConfig(Section):
    """The driver JVM of a process that starts its own Spark (a `lakeshard run` on
    local[*] or a standalone cluster; not under spark-submit or a platform's session):
    etl/runtime/jvm.py."""
    # Archive the classes the driver loads (AppCDS) in the local cache once, and map
    # them at every later start.
    class_archive: bool = True
    # The client compiler only (-XX:TieredStopAtLevel=1): a short run's JVM code is
    # compiled sooner.
    quick_jit: bool = True


class SparkConfig(Section):
    master: Text = "local[*]"
    app_name: Text = "lakeshard"
    # Folder with the JARs `make jars` fetched; null/empty on clusters that install them
    # as cluster libraries.
    jars_dir: str | None = ".jars"
    # Any Spark setting; applied after lakeshard's own (docs/configuration.md).
    conf: StrMap = Field(default_factory=dict)
    driver_jvm: DriverJvmConfig = Field(default_factory=DriverJvmConfig)

    @field_validator("jars_dir")
    @classmethod
    def _empty_is_none(cls, value: str | None) -> str | None:
        return value or None


class SourceConfig(Section):
    name: Name
    # A registered source kind (etl/sources); checked by the preflight, not here.
    kind: Text
    path: Text
    # Common-schema field -> source column, for tabular kinds (e.g. caption: alt_text).
    columns: StrMap = Field(default_factory=dict)
    format: Text | None = None
    license: Text | None = None
    # True: one of lakeshard's bundled sample sources; built if missing.
    sample: bool = False
    # URL sources (`columns.url`): what the list's URLs may name. Local paths and file://
    # only when true (whoever wrote the list could otherwise read executor files).
    allow_local: bool = False
    # Remote schemes fetched from the URL column: http/https, and object stores (s3, gs,
    # ...) when the list names objects; anything else is rejected as bad_scheme.
    url_schemes: Strings = ("http", "https")
    # Skip images whose X-Robots-Tag opts out of AI use (fetch.opt_out_directives).
    respect_opt_out: bool = True
    # Requests per second to one host, per Python worker; null: only fetch.per_host.
    per_host_rps: Annotated[float, Field(gt=0)] | None = None
    # A record the source no longer lists (a file deleted, a row gone): `delete` removes
    # it from every table and the next export (docs/sources.md#removals); `keep` leaves
    # it where it is, for append-only archives whose old records must stay.
    on_removed: Literal["delete", "keep"] = "delete"
    # Symbolic links in the source's folder (image_folder files and sidecars, table files
    # and tar shards found by listing a folder or a glob): false (default) -- a link is
    # a reject (`symlink`) and never opened; true -- followed when it leads to a file
    # inside the folder (else `outside_source`); "anywhere" -- followed wherever it
    # leads. A link to a folder is descended into only when followed.
    follow_symlinks: bool | Literal["anywhere"] = False
    # Captions longer than this many characters (a .txt sidecar or tar member, a JSON
    # field, a table column): the record is rejected as `caption_too_long`.
    max_caption_chars: Annotated[int, Field(ge=1, le=16 * 1024 * 1024)] = 65536

    @field_validator("url_schemes")
    @classmethod
    def _known_schemes(cls, schemes: tuple[str, ...]) -> tuple[str, ...]:
        from etl.config.images import URL_SCHEMES

        out = tuple(s.strip().lower() for s in schemes)
        for scheme in out:
            if scheme == "file":
                raise ValueError("'file' is not listed here: set allow_local: true for "
                                 "file:// URLs and paths")
            if scheme not in URL_SCHEMES:
                raise ValueError(f"{scheme!r} is not one of {', '.join(URL_SCHEMES)}")
        return out

    @property
    def has_url_column(self) -> bool:
        """Images are named by a URL column: a list someone else wrote."""
        return "url" in self.columns

    @property
    def fetches_web(self) -> bool:
        """Rows of this source may be fetched over HTTP(S)."""
        if self.has_url_column:
            return bool({"http", "https"} & set(self.url_schemes))
        return self.path.split("://", 1)[0].lower() in ("http", "https")


class RunConfig(Section):
    """`run:` -- how `lakeshard run` operates: stages, lock, report, progress."""

    # Stages to run, by registered name (checked by the preflight); null: every stage.
    # They always run in the registry's order, whatever the order here.
    stages: Annotated[Strings | None, Field(min_length=1)] = None
    # Refuse a second run against the same root while one holds the lock.
    lock: bool = True
    # The lock; default <root>/_lock/run.lock -- on S3 an object created with a
    # conditional write (If-None-Match), so no shared disk is needed. A POSIX path (a
    # local or mounted folder every driver sees) or an s3:// URL.
    lock_path: Text | None = None
    # A lock whose heartbeat is older than this is stale (a crashed run on another
    # host); on the same host a lock whose process is gone is stale at once.
    stale_lock_s: Annotated[int, Field(ge=1)] = 600
    heartbeat_s: Annotated[int, Field(ge=1)] = 30
    # <root>/reports/<run_id>/index.html + PNGs after each run.
    report: bool = True
    report_samples: Annotated[int, Field(ge=0, le=500)] = 24  # images per contact sheet
    report_max_rows: Annotated[int, Field(ge=100)] = 50_000  # histogram sample size
    # Console progress of running Spark stages, every this many seconds (0: off; then
    # Spark's own console progress bar is on instead).
    progress_interval_s: Annotated[float, Field(ge=0)] = 10.0
    # When a stage's failed rows fail the stage and the run (etl/config/budgets.py).
    budgets: BudgetsConfig = Field(default_factory=BudgetsConfig)

    @field_validator("lock_path")
    @classmethod
    def _lock_where(cls, path: str | None) -> str | None:
        if path is None:
            return None
        if is_url(path):
            url = urlparse(path)
            if url.scheme not in S3_SCHEMES or not url.netloc or not url.path.strip("/"):
                raise ValueError(
                    f"{path!r}: an object-store lock must be s3://bucket/key (S3 "
                    "conditional writes); elsewhere use a POSIX path every driver sees"
                )
            return path
        return local_path(path)

    @model_validator(mode="after")
    def _heartbeat_below_stale(self) -> RunConfig:
        if self.heartbeat_s >= self.stale_lock_s:
            raise FieldError(
                "heartbeat_s",
                f"{self.heartbeat_s} must be below run.stale_lock_s ({self.stale_lock_s}), "
                "or a live run's lock would look stale",
            )
        return self
