"""URL fetching against a real HTTP server on 127.0.0.1 (routes that 404, stall,
redirect, loop and serve oversized bodies); plus files and byte ranges. The server is
loopback, which the address policy refuses by default: these tests allow 127.0.0.1
explicitly (the policy itself: tests/test_fetch_policy.py)."""

from __future__ import annotations

import time

import pytest
from conftest import jpeg_bytes
from httpserver import Server

from etl.config import FetchConfig
from udfs.fetch import fetch_many, fetch_ref

LOOPBACK = ["127.0.0.1/32"]
FAST = FetchConfig(timeout_s=1.0, retries=2, backoff_s=0.05, max_bytes=1 << 20,
                   user_agent="lakeshard-test/1 (+polite)", allow_networks=LOOPBACK)


@pytest.fixture(scope="module")
def server():
    with Server() as srv:
        srv.files["a.jpg"] = jpeg_bytes()
        yield srv


def test_ok_redirect_and_user_agent(server):
    res = fetch_ref(f"{server.url}/img/a.jpg", opts=FAST)
    assert (res.status, res.data, res.attempts) == ("ok", jpeg_bytes(), 1)
    assert fetch_ref(f"{server.url}/redirect/a.jpg", opts=FAST).data == jpeg_bytes()
    assert "lakeshard-test/1 (+polite)" in server.user_agents


def test_byte_range_over_http(server):
    res = fetch_ref(f"{server.url}/img/a.jpg", 2, 10, FAST)
    assert res.status == "ok" and res.data == jpeg_bytes()[2:12]


@pytest.mark.parametrize(
    "route, status",
    [("/404", "http_404"), ("/big", "too_large"), ("/bigchunked", "too_large"),
     ("/loop", "too_many_redirects")],
)
def test_failures_are_statuses(server, route, status):
    before = server.hits.get(route, 0)
    res = fetch_ref(server.url + route, opts=FAST)
    assert res.status == status and res.data is None
    assert res.attempts == 1  # not transient: no retry
    if route != "/loop":
        assert server.hits[route] - before == 1


def test_transient_failures_are_retried_with_backoff(server):
    before = server.hits.get("/500", 0)
    res = fetch_ref(server.url + "/500", opts=FAST)
    assert res.status == "http_500" and res.attempts == 3
    assert server.hits["/500"] - before == 3


def test_a_stalling_server_times_out_within_the_deadline(server):
    opts = FetchConfig(timeout_s=0.5, retries=0, allow_networks=LOOPBACK)
    t0 = time.monotonic()
    res = fetch_ref(server.url + "/stall", opts=opts)
    assert res.status == "timeout"
    assert time.monotonic() - t0 < 2.5


def test_dns_and_connection_errors(monkeypatch):
    import socket

    from udfs import fetch_http

    # A name that does not resolve, without asking a real DNS server (no traffic leaves
    # the machine): the resolver hook answers as getaddrinfo does for an unknown name.
    def no_such_name(host, port):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with monkeypatch.context() as m:
        m.setattr(fetch_http, "resolve_host", no_such_name)
        res = fetch_ref("http://no-such-host.invalid/x.jpg", opts=FetchConfig(retries=0))
    assert (res.status, res.attempts) == ("dns", 1)
    # a port nobody listens on
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    res = fetch_ref(f"http://127.0.0.1:{port}/x",
                    opts=FetchConfig(retries=1, backoff_s=0.01, allow_networks=LOOPBACK))
    assert res.status == "connection" and res.attempts == 2


def test_per_host_limit_holds_under_many_threads(server):
    for i in range(12):
        server.files[f"s{i}.jpg"] = b"x"
    server.max_active = 0
    opts = FetchConfig(per_host=2, threads=12, timeout_s=5, allow_networks=LOOPBACK)
    urls = [f"{server.url}/slowhost/s{i}.jpg" for i in range(12)]
    results = fetch_many(urls, [None] * 12, [None] * 12, opts)
    assert all(r.status == "ok" for r in results)
    assert server.max_active == 2


def test_files_ranges_and_missing(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(100)))
    assert fetch_ref(str(p)).data == bytes(range(100))
    assert fetch_ref(f"file://{p}", 10, 5).data == bytes(range(10, 15))
    assert fetch_ref(f"file:{p}", 98, 5).status == "truncated"
    assert fetch_ref(str(tmp_path / "nope.jpg")).status == "missing_file"
    assert fetch_ref(str(p), opts=FetchConfig(max_bytes=10)).status == "too_large"
    assert fetch_ref(None).status == "bad_url"


def test_fetch_runs_inside_spark_tasks(spark, server, tmp_path):
    """Each row is fetched under its own source's rules: the same kinds of reference
    succeed for one source and are refused for another."""
    from etl.config import SourceConfig
    from etl.transforms.fetch import fetch_images

    local = tmp_path / "a.jpg"
    local.write_bytes(jpeg_bytes())
    cols = {"key": "k", "url": "u"}
    sources = [
        SourceConfig(name="web", kind="table", path="/x", columns=cols),
        SourceConfig(name="mirror", kind="table", path="/x", columns=cols, allow_local=True),
        SourceConfig(name="folder", kind="image_folder", path=str(tmp_path)),
    ]
    rows = [("a", "web", f"{server.url}/img/a.jpg", "ok"),
            ("b", "web", f"{server.url}/404", "ok"),
            ("c", "web", f"{server.url}/img/a.jpg", "rejected"),
            ("d", "web", local.as_uri(), "ok"),
            ("e", "mirror", local.as_uri(), "ok"),
            ("f", "folder", "file:" + str(local), "ok"),
            ("g", "web", "ftp://example.org/a.jpg", "ok")]
    df = spark.createDataFrame(
        [(k, src, None, u, None, None, s, None) for k, src, u, s in rows],
        "k string, source string, image_bytes binary, image_ref string, image_offset long, "
        "image_length long, read_status string, read_reason string",
    )
    opts = FetchConfig(retries=0, allow_networks=LOOPBACK)
    out = {r.k: r for r in fetch_images(df, opts, sources).collect()}
    assert out["a"].image_bytes == jpeg_bytes() and out["a"].read_status == "ok"
    assert (out["b"].read_status, out["b"].read_reason, out["b"].fetch_failed) == (
        "rejected", "http_404", True)
    assert out["c"].image_bytes is None and out["c"].fetch_failed is False
    # file:// in a web list: refused; the same URL in a list that allows local files,
    # and an image folder's own file reference: read.
    assert (out["d"].read_reason, out["d"].image_bytes) == ("bad_scheme", None)
    assert out["e"].image_bytes == jpeg_bytes() and out["f"].image_bytes == jpeg_bytes()
    assert out["g"].read_reason == "bad_scheme" and "ftp" in out["g"].fetch_detail
    # Without the allowlist the loopback server is refused, never asked.
    before = server.hits.get("/img/a.jpg", 0)
    out = {r.k: r for r in fetch_images(df, FetchConfig(retries=0), sources).collect()}
    assert out["a"].read_reason == "blocked_address" and "127.0.0.1" in out["a"].fetch_detail
    assert server.hits.get("/img/a.jpg", 0) == before
