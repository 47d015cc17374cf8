"""How images are fetched and prepared. Both sections are also the executor-side
settings of their UDFs (:mod:`udfs.fetch`, :mod:`udfs.images`): the parsed, frozen
object is shipped to the tasks as it is."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from etl.config.base import Section, Text

__all__ = [
    "PrepareConfig", "FetchConfig", "USER_AGENT_TEMPLATE", "USER_AGENT_PLACEHOLDER",
    "OPT_OUT_DIRECTIVES", "URL_SCHEMES",
]


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
    # in decode/encode); 1 = one image at a time. Null: as many as the task has cores --
    # curate gives each of a night's fetch + prepare tasks the job's cores over its
    # tasks (at most 8, at least 1: tasks that fill the cores prepare one image at a
    # time, as a second thread then only costs CPU); a night on the driver, the driver's
    # cores. Anywhere else null is 1.
    threads: Annotated[int, Field(ge=1, le=64)] | None = None

    def task_threads(self, cores: int, tasks: int) -> int:
        """Threads per task for `tasks` tasks on `cores` task slots: ``threads``, or for
        null each task's cores (from 1 to :data:`AUTO_THREADS_MAX`). Tasks that fill
        the slots prepare one image at a time: with a task per core a second thread
        only adds the switching between them (~5 % more CPU per image measured,
        docs/performance.md); a few tasks on many cores use them all."""
        if self.threads is not None:
            return self.threads
        return max(1, min(AUTO_THREADS_MAX, cores // max(1, tasks)))


# Threads per task that prepare.threads null gives at most: a batch's GIL-bound Python
# work (~1 ms of an image's ~5) caps what more would buy.
AUTO_THREADS_MAX = 8


# The contact URL of the default user agent: a placeholder the operator replaces with a
# page that says who fetches and how to reach them (a warning names the field until then).
USER_AGENT_PLACEHOLDER = "https://contact-url.invalid"
USER_AGENT_TEMPLATE = f"lakeshard/0.1 (+{USER_AGENT_PLACEHOLDER}; image-text dataset builder)"
# Remote schemes a source's URL column may be allowed (`url_schemes`): the web, and the
# object stores fsspec reads.
URL_SCHEMES = ("http", "https", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")
# X-Robots-Tag directives that opt an image out (img2dataset's default set).
OPT_OUT_DIRECTIVES = ("noai", "noimageai", "noindex", "noimageindex")


def _cidr(value: str) -> str:
    try:
        return str(ipaddress.ip_network(value.strip(), strict=True))
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a CIDR network (e.g. 10.20.0.0/16): {exc}") from None


def _directive(value: str) -> str:
    value = value.strip().lower()
    if not re.fullmatch(r"[a-z][a-z0-9_-]*", value):
        raise ValueError(f"{value!r} is not an X-Robots-Tag directive (e.g. noai)")
    return value


def _header_value(value: str) -> str:
    # Sent as a header: printable ASCII only (no CR/LF that would inject headers).
    if not re.fullmatch(r"[\x20-\x7e]+", value):
        raise ValueError("must be printable ASCII on one line (it is sent as a header)")
    return value


Cidrs = Annotated[tuple[Annotated[str, AfterValidator(_cidr)], ...], Field(strict=False)]
Directives = Annotated[tuple[Annotated[str, AfterValidator(_directive)], ...],
                       Field(strict=False)]


class FetchConfig(Section):
    """Fetching images by reference (URL columns, tar members) inside Spark tasks.

    The per-source rules (local paths, schemes, opt-out, rate) are in each source's
    settings (:class:`etl.config.SourceConfig`); these apply to every fetch."""

    timeout_s: Annotated[float, Field(gt=0)] = 10.0  # connect/read timeout; deadline per request
    retries: Annotated[int, Field(ge=0, le=10)] = 2  # extra attempts for transient errors
    backoff_s: Annotated[float, Field(gt=0)] = 0.5  # first backoff; doubles (full jitter)
    # Larger bodies: too_large -- on the wire and once decoded (gzip/deflate bombs).
    max_bytes: Annotated[int, Field(ge=1)] = 64 * 1024 * 1024
    # Status line + response headers larger than this: header_too_large.
    max_header_bytes: Annotated[int, Field(ge=1024, le=1024 * 1024)] = 64 * 1024
    max_redirects: Annotated[int, Field(ge=0, le=20)] = 5
    per_host: Annotated[int, Field(ge=1, le=256)] = 4  # concurrent requests per host
    # Concurrent fetches per Python worker: the next Arrow batch's downloads start while
    # the current batch goes on to be prepared.
    threads: Annotated[int, Field(ge=1, le=256)] = 16
    user_agent: Annotated[Text, AfterValidator(_header_value)] = USER_AGENT_TEMPLATE
    # Networks exempt from the address policy, which otherwise refuses loopback,
    # link-local (cloud metadata), private, shared, multicast and reserved addresses.
    allow_networks: Cidrs = ()
    # X-Robots-Tag directives that opt an image out (sources with respect_opt_out).
    opt_out_directives: Directives = OPT_OUT_DIRECTIVES

    @property
    def user_agent_is_template(self) -> bool:
        """The contact URL placeholder is still in `user_agent`."""
        return USER_AGENT_PLACEHOLDER in self.user_agent
