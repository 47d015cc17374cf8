"""Limits that protect the fetchers, against a hostile server on 127.0.0.1: compression
bombs, huge headers, slow-loris responses, short bodies, and the per-host rate."""

from __future__ import annotations

import gzip
import time
import tracemalloc
import zlib

import pytest
from conftest import jpeg_bytes
from httpserver import Server

from etl.config import FetchConfig
from udfs.fetch import fetch_many, fetch_ref
from udfs.fetch_http import RefRules

CAP = 1 << 20
OPTS = FetchConfig(timeout_s=2.0, retries=0, max_bytes=CAP, allow_networks=["127.0.0.1/32"])


def _deflate(data: bytes, wbits: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return c.compress(data) + c.flush()


@pytest.fixture(scope="module")
def server():
    img = jpeg_bytes(size=(300, 200))
    zeros = b"\0" * (64 << 20)  # 64 MiB: 64 times the cap once decoded
    with Server() as srv:
        srv.raw.update({
            "/gzip": ([("Content-Encoding", "gzip")], gzip.compress(img)),
            "/gzip2": ([("Content-Encoding", "gzip")],
                       gzip.compress(img[:100]) + gzip.compress(img[100:])),
            "/deflate": ([("Content-Encoding", "deflate")], zlib.compress(img)),
            "/rawdeflate": ([("Content-Encoding", "deflate")], _deflate(img, -15)),
            "/gzipbomb": ([("Content-Encoding", "gzip")], gzip.compress(zeros, 9)),
            "/deflatebomb": ([("Content-Encoding", "deflate")], zlib.compress(zeros, 9)),
            "/brotli": ([("Content-Encoding", "br")], b"\x1b\x03\x00\xf8"),
            "/notgzip": ([("Content-Encoding", "gzip")], b"plainly not gzip" * 10),
            "/cutgzip": ([("Content-Encoding", "gzip")], gzip.compress(img)[:-40]),
            "/hugeheader": ([(f"X-Filler-{i}", "z" * 1000) for i in range(90)], img),
            "/longline": ([("X-Long", "z" * 70_000)], img),
            "/manyheaders": ([(f"X-H{i}", "1") for i in range(150)], img),
            "/bigheader": ([("X-Big", "z" * 20_000)], img),
            "/short": ([("Content-Length", "5000")], img[:1000]),
        })
        del zeros
        yield srv, img


@pytest.mark.parametrize("route", ["/gzip", "/gzip2", "/deflate", "/rawdeflate"])
def test_encoded_bodies_are_decoded(server, route):
    srv, img = server
    res = fetch_ref(srv.url + route, opts=OPTS)
    assert (res.status, res.data) == ("ok", img)


@pytest.mark.parametrize("route", ["/gzipbomb", "/deflatebomb"])
def test_a_compression_bomb_stops_at_the_cap_in_bounded_memory(server, route):
    srv, _ = server
    wire = len(srv.raw[route][1])
    assert wire < CAP  # small on the wire: only the decoded size gives it away
    tracemalloc.start()
    try:
        res = fetch_ref(srv.url + route, opts=OPTS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert res.status == "too_large" and res.data is None
    assert f"decoded body over {CAP} bytes" in res.detail
    # Decoded in bounded steps: never much more than the cap held at once (fully
    # inflating the bomb would take 64 MiB).
    assert peak < 4 * CAP, peak


@pytest.mark.parametrize("route, detail", [
    ("/brotli", "Content-Encoding br"), ("/notgzip", "gzip:"), ("/cutgzip", "ends early"),
])
def test_bad_or_unknown_encodings(server, route, detail):
    srv, _ = server
    res = fetch_ref(srv.url + route, opts=OPTS)
    assert res.status == "bad_encoding" and detail in res.detail


@pytest.mark.parametrize("route, opts", [
    ("/hugeheader", OPTS),  # 90 KB of headers, each line short: over the 64 KiB default
    ("/longline", OPTS),  # one line longer than any header line may be
    ("/manyheaders", OPTS),  # more header lines than any response needs
    ("/bigheader", OPTS.model_copy(update={"max_header_bytes": 16384})),
])
def test_oversized_headers_are_refused(server, route, opts):
    srv, _ = server
    res = fetch_ref(srv.url + route, opts=opts)
    assert (res.status, res.data, res.attempts) == ("header_too_large", None, 1)


def test_headers_under_the_cap_are_fine(server):
    srv, img = server
    assert fetch_ref(srv.url + "/bigheader", opts=OPTS).data == img


@pytest.mark.parametrize("route", ["/trickle", "/trickleheaders"])
def test_a_slow_loris_is_cut_at_the_timeout(server, route):
    """Bytes keep coming (20 per second), so no single read ever times out: the
    request's deadline is what ends it."""
    srv, _ = server
    opts = OPTS.model_copy(update={"timeout_s": 1.0})
    t0 = time.monotonic()
    res = fetch_ref(srv.url + route, opts=opts)
    elapsed = time.monotonic() - t0
    assert res.status == "timeout" and "not complete in 1s" in res.detail
    assert elapsed < 2.5, elapsed


def test_a_body_shorter_than_declared_is_truncated(server):
    srv, _ = server
    res = fetch_ref(srv.url + "/short", opts=OPTS)
    assert res.status == "truncated" and res.data is None


def test_per_host_rate_spaces_requests():
    rps, n = 5.0, 6
    with Server() as srv:
        for i in range(n):
            srv.files[f"r{i}.jpg"] = b"x"
        urls = [f"{srv.url}/img/r{i}.jpg" for i in range(n)]
        opts = OPTS.model_copy(update={"threads": n, "per_host": n})
        results = fetch_many(urls, [None] * n, [None] * n, opts, RefRules(per_host_rps=rps))
        assert [r.status for r in results] == ["ok"] * n
        times = sorted(t for _, t in srv.arrivals)
    # n requests at most `rps` per second: the last starts (n - 1) / rps after the first.
    assert times[-1] - times[0] >= 0.9 * (n - 1) / rps


def test_every_redirect_hop_counts_against_the_rate():
    rps, n = 4.0, 3
    with Server() as srv:
        for i in range(n):
            srv.files[f"h{i}.jpg"] = b"x"
        urls = [f"{srv.url}/redirect/h{i}.jpg" for i in range(n)]
        opts = OPTS.model_copy(update={"threads": n, "per_host": n})
        results = fetch_many(urls, [None] * n, [None] * n, opts, RefRules(per_host_rps=rps))
        assert [r.status for r in results] == ["ok"] * n
        times = sorted(t for _, t in srv.arrivals)
    assert len(times) == 2 * n
    assert times[-1] - times[0] >= 0.9 * (2 * n - 1) / rps
