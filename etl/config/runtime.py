"""Where lakeshard writes, how it starts Spark, what it reads, and how a run operates."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from etl.config.base import FieldError, Name, Section, Strings, StrMap, Text, local_path

__all__ = ["StorageConfig", "SparkConfig", "SourceConfig", "RunConfig"]


class StorageConfig(Section):
    # Everything lakeshard writes goes under this folder (or s3://bucket/prefix).
    root: Text
    # Lance tables live under <root>/lance/<namespace>/.
    namespace: Name = "default"

    @field_validator("root")
    @classmethod
    def _absolute(cls, root: str) -> str:
        root = root.rstrip("/") or "/"
        # Local roots are made absolute once, here: Spark, Delta and pylance then agree
        # on every path whatever their working directory.
        return root if "://" in root else local_path(root)

    @property
    def is_remote(self) -> bool:
        return "://" in self.root


class SparkConfig(Section):
    master: Text = "local[*]"
    app_name: Text = "lakeshard"
    # Folder with the JARs `make jars` fetched; null/empty on clusters that install them
    # as cluster libraries.
    jars_dir: str | None = ".jars"
    # Any Spark setting; applied after lakeshard's own (docs/configuration.md).
    conf: StrMap = Field(default_factory=dict)

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
    # The lock file; default <root>/_lock/run.lock. Needed when the root is an object
    # store: a POSIX path every possible driver of a run sees.
    lock_path: Text | None = None
    # A lock whose heartbeat is older than this is stale (a crashed run on another
    # host); on the same host a lock whose process is gone is stale at once.
    stale_lock_s: Annotated[int, Field(ge=1)] = 600
    heartbeat_s: Annotated[int, Field(ge=1)] = 30
    # <root>/reports/<run_id>/index.html + PNGs after each run.
    report: bool = True
    report_samples: Annotated[int, Field(ge=0, le=500)] = 24  # images per contact sheet
    report_max_rows: Annotated[int, Field(ge=100)] = 200_000  # histogram sample size
    # Console progress of running Spark stages, every this many seconds (0: off).
    progress_interval_s: Annotated[float, Field(ge=0)] = 10.0

    @field_validator("lock_path")
    @classmethod
    def _posix(cls, path: str | None) -> str | None:
        if path is None:
            return None
        if "://" in path:
            raise ValueError(
                f"{path!r} must be a POSIX path (a local or mounted folder), not an "
                "object-store URL"
            )
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
