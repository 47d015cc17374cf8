"""What happens to the curated table after curate: dedup, lakehouse upkeep, exports."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from etl.config.base import Column, FieldError, Name, Section, Strings, StrMap, Text
from etl.config.inference import EmbeddingConfig

__all__ = [
    "DEDUP_POLICY_KEYS",
    "DedupConfig",
    "SCALAR_INDEX_TYPES",
    "LakehouseConfig",
    "BucketSpec",
    "ExportConfig",
]

# Criteria the canonical member of a duplicate cluster is chosen by, in config order.
DEDUP_POLICY_KEYS = ("resolution", "source_priority", "earliest")


def _unique(values: tuple[str, ...]) -> tuple[str, ...]:
    if len(set(values)) != len(values):
        raise ValueError(f"a value is listed twice: {list(values)}")
    return values


class DedupConfig(Section):
    """Exact + near-duplicate annotation (etl/transforms/dedup.py)."""

    enabled: bool = True
    # Near duplicates: 64-bit dHashes at most this many bits apart.
    threshold: Annotated[int, Field(ge=0, le=63)] = 4
    # The hash is cut into `bands` blocks; candidate pairs agree exactly on at least
    # `bands - threshold` of them (every such combination is one LSH key), so every pair
    # within the threshold is found (pigeonhole). bands = threshold + 1 is classic banding.
    bands: Annotated[int, Field(ge=1, le=64)] = 6
    # Source names, best first, for the `source_priority` criterion.
    source_priority: Annotated[Strings, AfterValidator(_unique)] = ()
    policy: Annotated[
        tuple[Literal[DEDUP_POLICY_KEYS], ...],
        Field(strict=False, min_length=1),
        AfterValidator(_unique),
    ] = DEDUP_POLICY_KEYS
    # Bound on connected-components rounds (each round at least halves long chains).
    max_iterations: Annotated[int, Field(ge=1)] = 40

    @model_validator(mode="after")
    def _bands(self) -> DedupConfig:
        if self.bands <= self.threshold:
            raise FieldError(
                "bands",
                f"must be greater than dedup.threshold ({self.threshold}), got {self.bands}: "
                "a pair within the threshold must agree on at least one band",
            )
        if self.keys_per_hash > 1000:
            raise FieldError(
                "bands",
                f"{self.bands} bands with threshold {self.threshold} make "
                f"{self.keys_per_hash} LSH keys per hash (at most 1000); use fewer bands",
            )
        return self

    @property
    def keys_per_hash(self) -> int:
        return math.comb(self.bands, self.bands - self.threshold)


# Scalar index kinds lakeshard creates (Lance names): BITMAP for low-cardinality columns
# (source, keep, filter_reason, buckets), BTREE for ranges (width, height).
SCALAR_INDEX_TYPES = ("BITMAP", "BTREE", "ZONEMAP", "BLOOMFILTER", "LABEL_LIST")


def _index_types(raw):
    if not isinstance(raw, dict):
        return raw
    return {k: v.upper() if isinstance(v, str) else v for k, v in raw.items()}


class LakehouseConfig(Section):
    """The curated Lance table as a lakehouse: indexes, compaction, retention, search."""

    # Column -> scalar index type, created (or extended to new fragments) after every
    # curate write. Columns the table does not have yet are skipped and logged.
    scalar_indexes: Annotated[
        dict[Column, Literal[SCALAR_INDEX_TYPES]],
        BeforeValidator(_index_types),
    ] = Field(
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
    target_rows_per_fragment: Annotated[int, Field(ge=1)] = 1024 * 1024
    # ... then delete versions older than `retention_days` except the newest
    # `retain_versions` (time travel reaches back that far, no further).
    retention_days: Annotated[float, Field(ge=0)] = 7.0
    retain_versions: Annotated[int, Field(ge=1)] = 10
    # Removed rows (docs/lakehouse.md#removals-bytes-really-gone): the fragments that held
    # them are rewritten at once, and the versions before that -- the only ones still
    # holding their bytes -- are deleted once this many hours have passed (by the removing
    # run itself when 0, else by the first run, forget or compact after that), whatever
    # retention_days / retain_versions say. Takedowns (`lakeshard forget`):
    takedown_retention_hours: Annotated[float, Field(ge=0)] = 0.0
    # Records that left their source (nightly); null: nothing rewritten or deleted for
    # them beyond the row delete (old versions go by retention_days, via compact).
    removal_retention_hours: Annotated[float, Field(ge=0)] | None = 168.0
    embedding: EmbeddingConfig = Field(default_factory=EmbeddingConfig)

    @field_validator("scalar_indexes", "embedding", mode="before")
    @classmethod
    def _null_is_default(cls, value, info):
        if value is None:
            return cls.model_fields[info.field_name].get_default(call_default_factory=True)
        return value


class BucketSpec(Section):
    """Aspect-ratio buckets of an export (etl/writers/mds/buckets.py)."""

    base_resolution: Annotated[int, Field(ge=64)] = 512
    patch_size: Annotated[int, Field(ge=1)] = 64
    min_aspect: Annotated[float, Field(gt=0, le=1)] = 0.25
    max_aspect: Annotated[float, Field(ge=1)] = 4.0
    # Resize (cover + centre crop, Lanczos) to the bucket's size at export time.
    resize: bool = False

    @model_validator(mode="after")
    def _patch_divides(self) -> BucketSpec:
        if self.base_resolution % self.patch_size:
            raise FieldError(
                "patch_size",
                f"{self.patch_size} does not divide base_resolution {self.base_resolution}",
            )
        return self


def _buckets(raw):
    if raw in (None, False):
        return None
    return {} if raw is True else raw


def _export_path(path: str | None) -> str | None:
    if path is None or "://" in path and not path.startswith("file://"):
        return path.rstrip("/") if path else path
    return str(Path(path.removeprefix("file://")).expanduser().absolute())


class ExportConfig(Section):
    name: Name
    # Number of Spark tasks, i.e. MDS sub-directories, of the export.
    partitions: Annotated[int, Field(ge=1)] = 2
    size_limit: Annotated[int, Field(ge=1 << 16)] = 128 * 1024 * 1024
    compression: Literal["zstd", "gz", "bz2", "br", "snappy", "zstd:7", "zstd:3", "gz:6"] | None = (
        None
    )
    hashes: Annotated[
        tuple[Literal["sha1", "md5", "xxh64", "xxh3_64", "xxh128", "sha256"], ...],
        Field(strict=False),
    ] = ()
    # Which curated rows to export: a Lance SQL predicate, evaluated by Lance's scanner.
    # The default leaves out rows a light filter flagged (keep = false).
    where: Text | None = "keep"
    # MDS caption column -> curated column; each becomes a `str` column (null -> "").
    captions: StrMap = Field(default_factory=lambda: {"caption": "caption_original"})
    # Extra curated columns to carry as they are (str, int, float types).
    columns: Strings = ()
    # Seed of the order inside each partition; same table version + seed = same bytes.
    seed: Annotated[int, Field(ge=0)] = 0
    # Aspect-ratio buckets: one sub-folder + index per bucket (true: the defaults).
    buckets: Annotated[BucketSpec | None, BeforeValidator(_buckets)] = None
    # Where the export goes: default <root>/mds/<name>; s3://bucket/prefix for an object
    # store (shards are uploaded as they are written; nothing piles up on local disks).
    path: Annotated[Text | None, AfterValidator(_export_path)] = None
    # Text encoders (names under `latents.encoders`) whose precomputed latents to include,
    # per caption: latent_<caption key>_<encoder>, attention_mask_<caption key>_<encoder>.
    # Empty (the default): latents are computed online by the training loop.
    latents: Annotated[tuple[Name, ...], Field(strict=False), AfterValidator(_unique)] = ()
    # False: leave out rows dedup marked as non-canonical duplicates (is_canonical=false).
    include_duplicates: bool = False
    # True: when the table changed but the settings did not, write only new partitions
    # for rows that joined the selection and rewrite only the partitions holding rows
    # that left it or changed, keeping the rest (docs/exports.md, "Incremental exports").
    # False: every change rewrites the whole export.
    incremental: bool = True

    @field_validator("where", "captions", mode="before")
    @classmethod
    def _empty(cls, value, info):
        if info.field_name == "where":
            return None if value == "" else value
        return {} if value is None else value
