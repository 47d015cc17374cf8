"""URL fetching against a real HTTP server on 127.0.0.1 (routes that 404, stall,
redirect, loop and serve oversized bodies); plus files and byte ranges."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import jpeg_bytes
from httpserver import Server

from etl.config import FetchConfig
from udfs.fetch import fetch_many, fetch_ref

FAST = FetchConfig(timeout_s=1.0, retries=2, backoff_s=0.05, max_bytes=1 << 20,
                    user_agent="lakeshard-test/1 (+polite)")


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
    opts = FetchConfig(timeout_s=0.5, retries=0)
    t0 = time.monotonic()
    res = fetch_ref(server.url + "/stall", opts=opts)
    assert res.status == "timeout"
    assert time.monotonic() - t0 < 2.5


def test_dns_and_connection_errors():
    assert fetch_ref("http://no-such-host.invalid/x.jpg", opts=FetchConfig(retries=0)).status \
        == "dns"
    # a port nobody listens on
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    res = fetch_ref(f"http://127.0.0.1:{port}/x", opts=FetchConfig(retries=1, backoff_s=0.01))
    assert res.status == "connection" and res.attempts == 2


def test_per_host_limit_holds_under_many_threads(server):
    for i in range(12):
        server.files[f"s{i}.jpg"] = b"x"
    server.max_active = 0
    opts = FetchConfig(per_host=2, threads=12, timeout_s=5)
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


def test_fetch_runs_inside_spark_tasks(spark, server):
    from etl.config import FetchConfig
    from etl.transforms.fetch import fetch_images

    rows = [("a", f"{server.url}/img/a.jpg", "ok"), ("b", f"{server.url}/404", "ok"),
            ("c", f"{server.url}/img/a.jpg", "rejected")]
    df = spark.createDataFrame(
        [(k, None, u, None, None, s, None) for k, u, s in rows],
        "k string, image_bytes binary, image_ref string, image_offset long, "
        "image_length long, read_status string, read_reason string",
    )
    out = {r.k: r for r in fetch_images(df, FetchConfig(retries=0)).collect()}
    assert out["a"].image_bytes == jpeg_bytes() and out["a"].read_status == "ok"
    assert (out["b"].read_status, out["b"].read_reason, out["b"].fetch_failed) == (
        "rejected", "http_404", True)
    assert out["c"].image_bytes is None and out["c"].fetch_failed is False
    assert threading.active_count() >= 1
