"""The whole configuration and the checks that span sections."""

from __future__ import annotations

import logging
from typing import Annotated

from pydantic import BeforeValidator, Field, field_validator, model_validator

from etl.config.base import FieldError, Section, keyed
from etl.config.bounds import DriverBounds, moved_bounds
from etl.config.catalog import GLUE_FACTORY, GLUE_FACTORY_KEY, CatalogConfig
from etl.config.curation import DedupConfig, ExportConfig, LakehouseConfig
from etl.config.images import USER_AGENT_PLACEHOLDER, FetchConfig, PrepareConfig
from etl.config.inference import CaptionConfig, LatentsConfig
from etl.config.runtime import (
    S3_SCHEMES,
    RunConfig,
    SourceConfig,
    SparkConfig,
    StorageConfig,
)
from etl.config.sql import SqlConfig
from etl.errors import ConfigError

__all__ = ["Config"]

log = logging.getLogger(__name__)

_SECTIONS_WITH_DEFAULTS = (
    "spark", "prepare", "exports", "caption", "latents", "lakehouse", "dedup", "run", "fetch",
    "driver", "catalog",
)

_SECTIONS_WITH_DEFAULTS += ("sql",)  # the SQL endpoint's (etl/config/sql.py)


class Config(Section):
    storage: StorageConfig
    sources: Annotated[tuple[SourceConfig, ...], Field(strict=False, min_length=1)]
    spark: SparkConfig = Field(default_factory=SparkConfig)
    sql: SqlConfig = Field(default_factory=SqlConfig)
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    exports: Annotated[dict[str, ExportConfig], BeforeValidator(keyed)] = Field(
        default_factory=dict
    )
    caption: CaptionConfig = Field(default_factory=CaptionConfig)
    latents: LatentsConfig = Field(default_factory=LatentsConfig)
    lakehouse: LakehouseConfig = Field(default_factory=LakehouseConfig)
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    fetch: FetchConfig = Field(default_factory=FetchConfig)
    driver: DriverBounds = Field(default_factory=DriverBounds)
    catalog: CatalogConfig = Field(default_factory=CatalogConfig)

    @model_validator(mode="before")
    @classmethod
    def _moved_bounds(cls, raw):
        return moved_bounds(raw)

    @field_validator(*_SECTIONS_WITH_DEFAULTS, mode="before")
    @classmethod
    def _empty_section_is_default(cls, value, info):
        # `caption:` with nothing under it in YAML is null: the section's defaults.
        if value is None:
            return cls.model_fields[info.field_name].get_default(call_default_factory=True)
        return value

    @model_validator(mode="after")
    def _across_sections(self) -> Config:
        seen: set[str] = set()
        for i, src in enumerate(self.sources):
            if src.name in seen:
                raise FieldError(f"sources[{i}].name", f"duplicate source name {src.name!r}")
            seen.add(src.name)
        for i, name in enumerate(self.dedup.source_priority):
            if name not in seen:
                raise FieldError(
                    f"dedup.source_priority[{i}]",
                    f"{name!r} is not a configured source (sources: {', '.join(seen)})",
                )
        for exp in self.exports.values():
            for name in exp.latents:
                if name not in self.latents.encoders:
                    known = ", ".join(sorted(self.latents.encoders)) or "none"
                    raise FieldError(
                        f"exports.{exp.name}.latents",
                        f"{name!r} is not an encoder under latents.encoders "
                        f"(configured: {known})",
                    )
        web = [src.name for src in self.sources if src.fetches_web]
        if web and self.fetch.user_agent_is_template:
            # A warning, not an error: local trials may fetch a few URLs before an
            # operator has a contact page to name.
            log.warning(
                "fetch.user_agent still holds the contact URL placeholder (%s) and "
                "source(s) %s fetch from the web: set it to name you and a page site "
                "owners can reach you by, e.g. 'lakeshard/0.1 (+https://your-team.example/"
                "crawler)'", USER_AGENT_PLACEHOLDER, ", ".join(web),
            )
        if (self.run.lock and self.run.lock_path is None and self.storage.is_remote
                and self.storage.scheme not in S3_SCHEMES):
            raise FieldError(
                "run.lock_path",
                f"storage.root is on {self.storage.scheme}://, where lakeshard has no "
                "object-store lock (it has one on s3://): give a POSIX path every driver "
                "sees, an s3:// lock, or `run.lock: false` when the scheduler alone prevents "
                "overlapping runs",
            )
        self._check_catalog()
        return self

    def _check_catalog(self) -> None:
        """The catalog against the root and Spark's settings: a metastore a run can
        reach, names it can register."""
        cat = self.catalog
        if cat.embedded and self.storage.is_remote:
            raise FieldError(
                "catalog.metastore_uri",
                f"storage.root is on {self.storage.scheme}://, where Spark's embedded "
                "(Derby) metastore cannot live: give the thrift:// URI of a Hive metastore "
                "every driver reaches (docs/sql.md)")
        if cat.kind == "unity" and self.storage.root.startswith("/Volumes/"):
            raise FieldError(
                "storage.root",
                "Unity Catalog registers external tables at cloud URLs (s3://, abfss://, "
                "gs://) of an external location, never under /Volumes: put the root on "
                "the external location's URL (docs/sql.md, \"Databricks\")")
        factory = self.spark.conf.get(GLUE_FACTORY_KEY)
        if cat.kind == "glue" and factory not in (None, GLUE_FACTORY):
            raise FieldError(
                f"spark.conf.{GLUE_FACTORY_KEY}",
                f"is {factory!r}, but catalog.kind glue needs {GLUE_FACTORY} (or unset: "
                "lakeshard sets it)")
        if cat.kind != "glue" and factory == GLUE_FACTORY:
            raise FieldError("catalog.kind", f"spark.conf sets the Glue metastore client; "
                             f"set catalog.kind: glue (not {cat.kind})")

    def source(self, name: str) -> SourceConfig:
        for src in self.sources:
            if src.name == name:
                return src
        raise ConfigError(
            f"sources: no source named {name!r} "
            f"(configured: {', '.join(s.name for s in self.sources)})"
        )

    def export(self, name: str) -> ExportConfig:
        if name not in self.exports:
            known = ", ".join(self.exports) or "none"
            raise ConfigError(f"exports: no export named {name!r} (configured: {known})")
        return self.exports[name]
