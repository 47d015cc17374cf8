"""How images are fetched and prepared. Both sections are also the executor-side
settings of their UDFs (:mod:`udfs.fetch`, :mod:`udfs.images`): the parsed, frozen
object is shipped to the tasks as it is."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from etl.config.base import Section, Text

__all__ = ["PrepareConfig", "FetchConfig"]


class PrepareConfig(Section):
    jpeg_quality: Annotated[int, Field(ge=1, le=100)] = 92
    chroma_subsampling: Literal["4:4:4", "4:2:2", "4:2:0"] = "4:2:0"
    # Larger inputs are rejected (too_large_bytes) before any decode.
    max_image_bytes: Annotated[int, Field(ge=1)] = 64 * 1024 * 1024
    # Width x height from the header above this: rejected (too_many_pixels), no decode.
    max_pixels: Annotated[int, Field(ge=1)] = 100_000_000
    # Downscale (Lanczos) so the longer side fits; null: keep the size.
    max_side: Annotated[int, Field(ge=16)] | None = None
    # Keep baseline RGB JPEGs within the limits as they are (no re-encode).
    passthrough_jpeg: bool = False
    # Light filters: they flag (keep=false, filter_reason), never delete.
    min_side: Annotated[int, Field(ge=1)] = 64
    max_aspect_ratio: Annotated[float, Field(ge=1)] = 5.0
    # Threads per Spark task preparing one Arrow batch's images (Pillow releases the GIL
    # in decode/encode); 1 = one image at a time.
    threads: Annotated[int, Field(ge=1, le=64)] = 2


class FetchConfig(Section):
    """Fetching images by reference (URL columns, tar members) inside Spark tasks."""

    timeout_s: Annotated[float, Field(gt=0)] = 10.0  # connect/read timeout and deadline
    retries: Annotated[int, Field(ge=0, le=10)] = 2  # extra attempts for transient errors
    backoff_s: Annotated[float, Field(gt=0)] = 0.5  # first backoff; doubles (full jitter)
    max_bytes: Annotated[int, Field(ge=1)] = 64 * 1024 * 1024  # larger bodies: too_large
    max_redirects: Annotated[int, Field(ge=0, le=20)] = 5
    per_host: Annotated[int, Field(ge=1, le=256)] = 4  # concurrent requests per host
    threads: Annotated[int, Field(ge=1, le=256)] = 16  # concurrent fetches per batch
    user_agent: Text = "lakeshard/0.1 (image-caption dataset builder)"
