"""Typed, validated configuration: YAML parsed into frozen pydantic models on the
driver, before any Spark job. Every error names the file and the field
(``sources[1] (pics).kind``); unknown keys are errors, not silently ignored typos.

This package imports nothing from lakeshard but :mod:`etl.errors`: checks that need
the registries (source kinds, stage names) or the inputs live in
:mod:`etl.pipeline.preflight`.
"""

from etl.config.base import FieldError
from etl.config.bounds import DriverBounds
from etl.config.budgets import BudgetsConfig
from etl.config.catalog import CatalogConfig
from etl.config.curation import (
    DEDUP_POLICY_KEYS,
    SCALAR_INDEX_TYPES,
    BucketSpec,
    DedupConfig,
    ExportConfig,
    LakehouseConfig,
)
from etl.config.images import FetchConfig, PrepareConfig
from etl.config.inference import (
    DEFAULT_CAPTION_PROMPT,
    VECTOR_INDEX_TYPES,
    CaptionConfig,
    CaptionVersionConfig,
    EmbeddingConfig,
    LatentEncoderConfig,
    LatentsConfig,
)
from etl.config.loader import default_config_text, load_config, parse_config
from etl.config.root import Config
from etl.config.runtime import RunConfig, SourceConfig, SparkConfig, StorageConfig
from etl.errors import ConfigError

__all__ = [
    "ConfigError",
    "FieldError",
    "Config",
    "StorageConfig",
    "SparkConfig",
    "SourceConfig",
    "RunConfig",
    "BudgetsConfig",
    "CatalogConfig",
    "DriverBounds",
    "PrepareConfig",
    "FetchConfig",
    "ExportConfig",
    "BucketSpec",
    "CaptionConfig",
    "CaptionVersionConfig",
    "DEFAULT_CAPTION_PROMPT",
    "LatentEncoderConfig",
    "LatentsConfig",
    "LakehouseConfig",
    "EmbeddingConfig",
    "DedupConfig",
    "DEDUP_POLICY_KEYS",
    "SCALAR_INDEX_TYPES",
    "VECTOR_INDEX_TYPES",
    "load_config",
    "parse_config",
    "default_config_text",
]
