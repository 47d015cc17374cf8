"""Fetch image bytes by reference, inside Spark tasks.

A reference is a local path, ``file://``, ``http(s)://`` or any fsspec URL (``s3://``,
``gs://``, …), optionally with a byte range (a member of a tar shard). Every fetch
ends with a status from a small closed set instead of an exception:

``ok``, ``http_<code>`` (404, 503, …), ``timeout``, ``too_large``, ``dns``,
``connection``, ``too_many_redirects``, ``missing_file``, ``bad_url``, ``error``.

HTTP fetching is polite: a configurable user agent, a per-host limit on concurrent
requests (per Python worker), retries with exponential backoff and jitter for
transient failures only (timeouts, connection errors, 429 and 5xx), a connect/read
timeout plus an overall deadline per attempt (a server that trickles bytes cannot
hold a task), and a byte cap checked against Content-Length and again while reading.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pandas as pd
from pyspark.sql import types as T
from pyspark.sql.functions import pandas_udf

from etl.config import FetchConfig

__all__ = [
    "FetchResult",
    "FETCH_TYPE",
    "FETCH_STATUSES",
    "TRANSIENT_STATUSES",
    "fetch_ref",
    "fetch_many",
    "fetch_udf",
]

FETCH_STATUSES = (
    "ok", "timeout", "too_large", "dns", "connection", "too_many_redirects",
    "missing_file", "truncated", "bad_url", "error",
)  # plus http_<code>
# Worth another attempt later (also: in a later nightly run).
TRANSIENT_STATUSES = frozenset({"timeout", "connection", "dns", "http_429"})

FETCH_TYPE = T.StructType(
    [
        T.StructField("bytes", T.BinaryType(), True),
        T.StructField("status", T.StringType(), False),
        T.StructField("detail", T.StringType(), True),
        T.StructField("attempts", T.IntegerType(), False),
    ]
)

_CHUNK = 1 << 16


@dataclass(frozen=True)
class FetchResult:
    data: bytes | None
    status: str
    detail: str | None = None
    attempts: int = 1


def is_transient(status: str) -> bool:
    return status in TRANSIENT_STATUSES or (status.startswith("http_5") and len(status) == 8)


# --------------------------------------------------------------------- per-host limit

_host_lock = threading.Lock()
_host_slots: dict[tuple[str, int], threading.BoundedSemaphore] = {}


def _slot(host: str, limit: int) -> threading.BoundedSemaphore:
    """One semaphore per host per Python worker (Spark reuses workers across tasks)."""
    with _host_lock:
        sem = _host_slots.get((host, limit))
        if sem is None:
            sem = _host_slots[(host, limit)] = threading.BoundedSemaphore(limit)
        return sem


# --------------------------------------------------------------------------- HTTP


class _LimitedRedirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, limit: int):
        self.max_redirections = limit


def _opener(opts: FetchConfig) -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(_LimitedRedirects(opts.max_redirects))


def _http_once(url: str, opts: FetchConfig, rng: tuple[int, int] | None) -> FetchResult:
    headers = {"User-Agent": opts.user_agent, "Accept": "image/*,*/*;q=0.5"}
    if rng is not None:
        headers["Range"] = f"bytes={rng[0]}-{rng[0] + rng[1] - 1}"
    req = urllib.request.Request(url, headers=headers)
    deadline = time.monotonic() + opts.timeout_s
    try:
        with _opener(opts).open(req, timeout=opts.timeout_s) as resp:
            declared = resp.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > opts.max_bytes:
                return FetchResult(None, "too_large", f"Content-Length {declared}")
            buf = bytearray()
            while True:
                if time.monotonic() > deadline:
                    return FetchResult(None, "timeout", f"body not complete in {opts.timeout_s}s")
                chunk = resp.read(_CHUNK)
                if not chunk:
                    break
                buf += chunk
                if len(buf) > opts.max_bytes:
                    return FetchResult(None, "too_large", f"over {opts.max_bytes} bytes")
            return FetchResult(bytes(buf), "ok")
    except urllib.error.HTTPError as exc:
        if exc.code in (301, 302, 303, 307, 308):
            return FetchResult(None, "too_many_redirects", str(exc))
        return FetchResult(None, f"http_{exc.code}", exc.reason if exc.reason else None)
    except urllib.error.URLError as exc:
        return _classify(exc.reason if isinstance(exc.reason, BaseException) else exc)
    except TimeoutError as exc:
        return FetchResult(None, "timeout", str(exc) or "read timed out")
    except (ConnectionError, ssl.SSLError, OSError) as exc:
        return _classify(exc)
    except ValueError as exc:
        return FetchResult(None, "bad_url", str(exc))


def _classify(exc: BaseException) -> FetchResult:
    if isinstance(exc, socket.gaierror):
        return FetchResult(None, "dns", str(exc))
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return FetchResult(None, "timeout", str(exc) or "timed out")
    if isinstance(exc, (ConnectionError, ssl.SSLError)):
        return FetchResult(None, "connection", str(exc))
    if isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET,
                                                  errno.EHOSTUNREACH, errno.ENETUNREACH):
        return FetchResult(None, "connection", str(exc))
    return FetchResult(None, "error", f"{type(exc).__name__}: {exc}")


def _http(url: str, opts: FetchConfig, rng: tuple[int, int] | None) -> FetchResult:
    host = urllib.parse.urlsplit(url).netloc.lower()
    attempts = 0
    while True:
        attempts += 1
        with _slot(host, opts.per_host):
            res = _http_once(url, opts, rng)
        if res.status == "ok" and rng is not None and len(res.data) != rng[1]:
            # A server that ignored the Range header: cut the range ourselves.
            data = res.data[rng[0]: rng[0] + rng[1]]
            res = FetchResult(data, "ok" if len(data) == rng[1] else "error",
                              None if len(data) == rng[1] else "short range")
        if not is_transient(res.status) or attempts > opts.retries:
            return FetchResult(res.data, res.status, res.detail, attempts)
        # Exponential backoff with full jitter, outside the host slot.
        time.sleep(random.uniform(0, opts.backoff_s * (2 ** (attempts - 1))))


# ---------------------------------------------------------------- files, fsspec


def _local(path: str, opts: FetchConfig, rng: tuple[int, int] | None) -> FetchResult:
    try:
        size = os.path.getsize(path)
        want = rng[1] if rng is not None else size
        if want > opts.max_bytes:
            return FetchResult(None, "too_large", f"{want} bytes")
        with open(path, "rb") as f:
            if rng is not None:
                f.seek(rng[0])
            data = f.read(want)
        if len(data) != want:
            return FetchResult(None, "truncated", f"read {len(data)} of {want} bytes")
        return FetchResult(data, "ok")
    except FileNotFoundError as exc:
        return FetchResult(None, "missing_file", str(exc))
    except IsADirectoryError as exc:
        return FetchResult(None, "missing_file", f"is a directory: {exc}")
    except OSError as exc:
        return FetchResult(None, "error", f"{type(exc).__name__}: {exc}")


def _fsspec(url: str, opts: FetchConfig, rng: tuple[int, int] | None) -> FetchResult:
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        return FetchResult(None, "bad_url", f"{type(exc).__name__}: {exc}")
    try:
        if rng is None:
            size = fs.size(path)
            if size is not None and size > opts.max_bytes:
                return FetchResult(None, "too_large", f"{size} bytes")
            return FetchResult(fs.cat_file(path), "ok")
        if rng[1] > opts.max_bytes:
            return FetchResult(None, "too_large", f"{rng[1]} bytes")
        data = fs.cat_file(path, start=rng[0], end=rng[0] + rng[1])
        if len(data) != rng[1]:
            return FetchResult(None, "truncated", f"read {len(data)} of {rng[1]} bytes")
        return FetchResult(data, "ok")
    except FileNotFoundError as exc:
        return FetchResult(None, "missing_file", str(exc))
    except Exception as exc:  # noqa: BLE001 - any backend error is this row's status
        return _classify(exc)


def fetch_ref(
    ref: str | None, offset: int | None = None, length: int | None = None,
    opts: FetchConfig | None = None,
) -> FetchResult:
    """Fetch one reference (optionally a byte range of it); never raises."""
    opts = opts or FetchConfig()
    if not ref or not isinstance(ref, str):
        return FetchResult(None, "bad_url", "empty reference", 0)
    rng = None if length is None else (int(offset or 0), int(length))
    scheme = urllib.parse.urlsplit(ref).scheme.lower()
    try:
        if scheme in ("http", "https"):
            return _http(ref, opts, rng)
        if scheme == "file":
            return _local(urllib.request.url2pathname(urllib.parse.urlsplit(ref).path), opts, rng)
        if scheme == "" or len(scheme) == 1:  # a path (or a Windows drive letter)
            return _local(ref, opts, rng)
        return _fsspec(ref, opts, rng)
    except Exception as exc:  # noqa: BLE001 - a bug here must not fail the task
        return FetchResult(None, "error", f"{type(exc).__name__}: {exc}")


def fetch_many(
    refs: list, offsets: list, lengths: list, opts: FetchConfig
) -> list[FetchResult]:
    """Fetch a batch concurrently (threads; the per-host limit still applies)."""
    jobs = list(zip(refs, offsets, lengths, strict=True))
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(opts.threads, len(jobs)))) as pool:
        return list(pool.map(lambda j: fetch_ref(j[0], j[1], j[2], opts), jobs))


def _none(v):
    return None if v is None or (isinstance(v, float) and v != v) or v is pd.NA else v


def fetch_udf(opts: FetchConfig):
    """A pandas UDF (ref, offset, length) -> FETCH_TYPE; rows with a null ref get
    status ``bad_url`` (callers only pass rows that need fetching)."""

    @pandas_udf(FETCH_TYPE)
    def _fetch(batches: Iterator[tuple[pd.Series, pd.Series, pd.Series]]) -> Iterator[pd.DataFrame]:
        for refs, offsets, lengths in batches:
            results = fetch_many(
                [_none(r) for r in refs],
                [_none(o) for o in offsets],
                [_none(n) for n in lengths],
                opts,
            )
            yield pd.DataFrame(
                {
                    "bytes": [r.data for r in results],
                    "status": [r.status for r in results],
                    "detail": [None if r.detail is None else str(r.detail)[:500]
                               for r in results],
                    "attempts": [r.attempts for r in results],
                }
            )

    return _fetch
