"""Fetch image bytes by reference, inside Spark tasks.

A reference is a local path, ``file://``, ``http(s)://`` or any fsspec URL (``s3://``,
``gs://``, ...), optionally with a byte range (a member of a tar shard), or a row of a
parquet table file whose rows embed their images (:mod:`udfs.fetch_table`). What a
reference may name depends on where it came from (:class:`RefRules`, per source):
references an adapter made from the source's own configured path may name anything
supported; a URL column -- a list someone else wrote -- may name http(s) URLs, the
object-store schemes the source lists in ``url_schemes``, and local paths or
``file://`` only with ``allow_local: true``. Everything else is ``bad_scheme``.

Every fetch ends with a status from a small closed set instead of an exception:
:data:`FETCH_STATUSES` plus ``http_<code>`` (404, 503, ...). An unexpected exception in
the fetch code itself is ``internal_error`` (:mod:`udfs.outcomes`): not the reference's
fault, so it is counted apart, budgeted and retried by the next run.

HTTP(S) is fetched by :mod:`udfs.fetch_http`: the address policy checked on the
address connected to (every redirect hop too), a deadline per request, header and
(decoded) body caps, per-host concurrency and rate, the user agent, and
``X-Robots-Tag`` opt-outs. Retries with exponential backoff and jitter are for
transient failures only (timeouts, connection errors, DNS, 429 and 5xx).
"""

from __future__ import annotations

import random
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import pandas as pd
from pyspark.sql import types as T
from pyspark.sql.functions import pandas_udf

from etl.config import FetchConfig, SourceConfig
from udfs.arrow_types import nullable_type
from udfs.fetch_http import FetchResult, RefRules, classify_error, fetch_once
from udfs.fetch_local import LOCAL_STATUSES, read_local
from udfs.fetch_table import read_table_row
from udfs.outcomes import INTERNAL_ERROR, internal_detail

__all__ = [
    "FetchResult",
    "RefRules",
    "OWN_REFS",
    "FETCH_TYPE",
    "FETCH_STATUSES",
    "TRANSIENT_STATUSES",
    "rules_for",
    "fetch_ref",
    "fetch_many",
    "start_fetches",
    "clip_detail",
    "fetch_udf",
]

FETCH_STATUSES = (
    "ok", "timeout", "too_large", "dns", "connection", "too_many_redirects",
    "missing_file", "truncated", "bad_url", "error",
    # An unexpected exception in the fetch code itself, not the reference's fault.
    INTERNAL_ERROR,
    # URLs strangers wrote: refused before any request, or by the site's own signal.
    "blocked_address", "bad_scheme", "opted_out",
    # Hostile or broken servers.
    "header_too_large", "bad_encoding", "bad_response",
    # Local files: a link the source does not follow; a FIFO, device or socket.
    *LOCAL_STATUSES,
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

# References an adapter made from a source's configured path (tar members, files).
OWN_REFS = RefRules()


def rules_for(source: SourceConfig) -> RefRules:
    """The fetch rules of one source's rows."""
    if source.has_url_column:
        # A list's local references are the list's to name (allow_local): no listing
        # checked them, and a link adds no reach the list did not already have.
        return RefRules(local=source.allow_local, schemes=frozenset(source.url_schemes),
                        respect_opt_out=source.respect_opt_out,
                        per_host_rps=source.per_host_rps, own=False)
    # An image folder's references are entries its listing found inside the folder, and
    # a link among them was refused there unless the source follows links: at read time
    # too, a link there is not followed (a file swapped for one since the listing). A
    # tar shard or a table file may be a link the config names itself: followed.
    follow = source.follow_symlinks is not False or source.kind != "image_folder"
    # A table's rows name their images by file and row (etl.sources.file_table).
    table_image = source.columns.get("image") if source.kind == "table" else None
    return RefRules(respect_opt_out=source.respect_opt_out, per_host_rps=source.per_host_rps,
                    follow_symlinks=follow, table_image=table_image)


def is_transient(status: str) -> bool:
    return status in TRANSIENT_STATUSES or (status.startswith("http_5") and len(status) == 8)


def _http(url: str, opts: FetchConfig, rules: RefRules, rng: tuple[int, int] | None
          ) -> FetchResult:
    attempts = 0
    while True:
        attempts += 1
        res = fetch_once(url, opts, rules, rng)
        if res.status == "ok" and rng is not None and len(res.data) != rng[1]:
            # A server that ignored the Range header: cut the range ourselves.
            data = res.data[rng[0]: rng[0] + rng[1]]
            res = FetchResult(data, "ok" if len(data) == rng[1] else "error",
                              None if len(data) == rng[1] else "short range")
        if not is_transient(res.status) or attempts > opts.retries:
            return FetchResult(res.data, res.status, res.detail, attempts)
        # Exponential backoff with full jitter, outside any host slot.
        time.sleep(random.uniform(0, opts.backoff_s * (2 ** (attempts - 1))))


# ---------------------------------------------------------------- files, fsspec


def _local(path: str, opts: FetchConfig, rng: tuple[int, int] | None,
           rules: RefRules) -> FetchResult:
    return read_local(path, rng, opts.max_bytes, opts.timeout_s, rules.follow_symlinks)


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
        return classify_error(exc)


def _is_local(scheme: str) -> bool:
    return scheme in ("", "file") or len(scheme) == 1  # a path (or a Windows drive letter)


def fetch_ref(
    ref: str | None, offset: int | None = None, length: int | None = None,
    opts: FetchConfig | None = None, rules: RefRules = OWN_REFS,
) -> FetchResult:
    """Fetch one reference (optionally a byte range of it) under `rules`; never raises.
    The default rules are for references lakeshard made itself from a configured path;
    rows of a URL column are fetched with their source's (:func:`rules_for`)."""
    opts = opts or FetchConfig()
    if not ref or not isinstance(ref, str):
        return FetchResult(None, "bad_url", "empty reference", 0)
    rng = None if length is None else (int(offset or 0), int(length))
    try:
        if rules.table_image is not None and offset is not None and length is None:
            return read_table_row(ref, int(offset), rules.table_image, opts)
        if rules.own and rules.local and ref.startswith("file:"):
            return _local(ref[len("file:"):], opts, rng, rules)  # as listed, verbatim
        scheme = urllib.parse.urlsplit(ref).scheme.lower()
        if _is_local(scheme):
            if not rules.local:
                return FetchResult(None, "bad_scheme", "a local path or file:// URL (the "
                                   "source does not set allow_local)", 0)
            if scheme != "file":
                path = ref  # a path is a path
            else:  # a file:// URL a stranger wrote: URL syntax, percent-decoded
                path = urllib.request.url2pathname(urllib.parse.urlsplit(ref).path)
            return _local(path, opts, rng, rules)
        if scheme not in rules.schemes:
            return FetchResult(None, "bad_scheme", f"{scheme}:// is not allowed for this "
                               f"source (allowed: {', '.join(sorted(rules.schemes)) or 'none'})",
                               0)
        if scheme in ("http", "https"):
            return _http(ref, opts, rules, rng)
        if "::" in ref:  # an fsspec chain ("simplecache::s3://..."): not one object store
            return FetchResult(None, "bad_scheme", "a chained fsspec URL", 0)
        return _fsspec(ref, opts, rng)
    except Exception as exc:  # noqa: BLE001 - counted apart and budgeted, not "bad URL"
        return FetchResult(None, INTERNAL_ERROR, internal_detail(exc))


def _jobs(refs: list, offsets: list, lengths: list,
          rules: RefRules | Sequence[RefRules]) -> list[tuple]:
    per_row = [rules] * len(refs) if isinstance(rules, RefRules) else list(rules)
    return list(zip(refs, offsets, lengths, per_row, strict=True))


def fetch_many(
    refs: list, offsets: list, lengths: list, opts: FetchConfig,
    rules: RefRules | Sequence[RefRules] = OWN_REFS,
) -> list[FetchResult]:
    """Fetch a batch concurrently (threads; the per-host limits still apply). `rules`:
    one for every reference, or one per reference."""
    jobs = _jobs(refs, offsets, lengths, rules)
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(opts.threads, len(jobs)))) as pool:
        return list(pool.map(lambda j: fetch_ref(j[0], j[1], j[2], opts, j[3]), jobs))


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    """One fetch pool per size per Python worker (Spark reuses workers across tasks)."""
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="lakeshard-fetch")
    return _POOLS[threads]


def _submit(pool: ThreadPoolExecutor, jobs: list[tuple], opts: FetchConfig) -> list[Future]:
    return [pool.submit(fetch_ref, ref, offset, length, opts, rules)
            for ref, offset, length, rules in jobs]


def _none(v):
    return None if v is None or (isinstance(v, float) and v != v) or v is pd.NA else v


def start_fetches(refs: Sequence, offsets: Sequence, lengths: Sequence,
                  rules: Sequence[RefRules], opts: FetchConfig) -> list[Future]:
    """Start fetching each reference (values as an Arrow batch gives them: NaN and NA are
    null) on this worker's fetch pool, under its own rules; the futures in the same order.
    :func:`fetch_ref` never raises, so each future's result is a :class:`FetchResult`."""
    jobs = _jobs([_none(r) for r in refs], [_none(o) for o in offsets],
                 [_none(n) for n in lengths], rules)
    return _submit(_pool(opts.threads), jobs, opts)


def clip_detail(detail) -> str | None:
    """A fetch's detail as a row stores it: text, at most 500 characters."""
    return None if detail is None else str(detail)[:500]


def _frame(futures: list[Future]) -> pd.DataFrame:
    results = [f.result() for f in futures]  # fetch_ref never raises
    return pd.DataFrame(
        {
            "bytes": [r.data for r in results],
            "status": [r.status for r in results],
            "detail": [clip_detail(r.detail) for r in results],
            "attempts": [r.attempts for r in results],
        }
    )


def fetch_udf(opts: FetchConfig, rules: Mapping[str, RefRules]):
    """A pandas UDF (source, ref, offset, length) -> FETCH_TYPE: each row fetched under
    its source's rules (`rules`: source name -> rules; a source missing from it is a bug
    and fails the task). Rows with a null ref get status ``bad_url`` (callers only pass
    rows that need fetching)."""
    rules = dict(rules)

    @pandas_udf(nullable_type(FETCH_TYPE))  # Spark 4.0: udfs/arrow_types.py
    def _fetch(batches: Iterator[tuple[pd.Series, pd.Series, pd.Series, pd.Series]]
               ) -> Iterator[pd.DataFrame]:
        # One batch ahead: the next batch's downloads start before this one's rows go
        # back to Spark, so the network wait of one batch overlaps whatever is done with
        # the one before (curate fetches and prepares in one function: udfs/ingest.py). The
        # pool is first in, first out: the batch yielded next is the one whose fetches
        # started first.
        pending: list[Future] | None = None
        for sources, refs, offsets, lengths in batches:
            started = start_fetches(refs, offsets, lengths, [rules[s] for s in sources], opts)
            if pending is not None:
                yield _frame(pending)
            pending = started
        if pending is not None:
            yield _frame(pending)

    return _fetch
