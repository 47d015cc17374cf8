"""Connections kept open between requests to one host (HTTP/1.1 keep-alive).

A real HTTP/1.1 server on loopback records which connection (the client's port) each
request came on. A response read to its end leaves its connection for the next request
to that host; anything else closes it; a connection the server closed while idle is
replaced without failing the row; every request keeps its own deadline; and a kept
connection is never reused where the address policy would not connect.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import jpeg_bytes

from etl.config import FetchConfig
from udfs import fetch_http
from udfs.fetch import fetch_ref

IMAGE = jpeg_bytes()
OPTS = FetchConfig(timeout_s=1.0, retries=0, allow_networks=["127.0.0.1/32"])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # connections stay open unless a side closes them

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802
        self.server.seen.append((self.client_address[1], self.path))
        if self.path == "/chunked.jpg":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            half = len(IMAGE) // 2
            for piece in (IMAGE[:half], IMAGE[half:]):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
            return
        if self.path == "/gone":
            body = b"no such image " * 100
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path == "/slow.jpg":
            self.send_response(200)
            self.send_header("Content-Length", str(len(IMAGE)))
            self.end_headers()
            self.wfile.write(IMAGE[:100])
            self.wfile.flush()
            time.sleep(3)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(IMAGE)))
        self.end_headers()
        self.wfile.write(IMAGE)
        if self.path == "/once.jpg":  # closes without saying so: the client finds out
            self.close_connection = True


@contextmanager
def _serving():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.seen = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def server():
    with _serving() as served:
        yield served


def _connections(httpd) -> int:
    return len({port for port, _ in httpd.seen})


def test_responses_read_to_the_end_leave_their_connection_for_the_next(server):
    httpd, url = server
    results = [fetch_ref(f"{url}/{name}", opts=OPTS) for name in
               ("a.jpg", "b.jpg", "chunked.jpg", "c.jpg", "chunked.jpg")]
    assert [(r.status, r.data, r.attempts) for r in results] == [("ok", IMAGE, 1)] * 5
    assert [path for _, path in httpd.seen] == [
        "/a.jpg", "/b.jpg", "/chunked.jpg", "/c.jpg", "/chunked.jpg"]
    assert _connections(httpd) == 1


def test_a_connection_the_server_closed_while_idle_is_replaced(server):
    httpd, url = server
    assert fetch_ref(f"{url}/once.jpg", opts=OPTS).status == "ok"
    time.sleep(0.2)  # the server has closed its end by now
    res = fetch_ref(f"{url}/a.jpg", opts=OPTS)
    assert (res.status, res.data, res.attempts) == ("ok", IMAGE, 1)  # not a retry
    assert [path for _, path in httpd.seen] == ["/once.jpg", "/a.jpg"]
    assert _connections(httpd) == 2


def test_an_answer_not_read_to_its_end_closes_its_connection(server):
    httpd, url = server
    assert fetch_ref(f"{url}/gone", opts=OPTS).status == "http_404"  # body left unread
    assert fetch_ref(f"{url}/a.jpg", opts=OPTS).data == IMAGE
    assert fetch_ref(f"{url}/b.jpg", opts=OPTS).data == IMAGE
    assert _connections(httpd) == 2  # the 404's, then one for both images


def test_each_request_on_a_kept_connection_has_its_own_deadline(server):
    httpd, url = server
    assert fetch_ref(f"{url}/a.jpg", opts=OPTS).status == "ok"
    time.sleep(1.2)  # past the first request's deadline (timeout_s 1.0)
    assert fetch_ref(f"{url}/b.jpg", opts=OPTS).data == IMAGE
    t0 = time.monotonic()
    res = fetch_ref(f"{url}/slow.jpg", opts=OPTS)
    took = time.monotonic() - t0
    assert res.status == "timeout" and took < 2.5
    assert _connections(httpd) == 1  # all three on the first connection


def test_a_kept_connection_is_not_reused_where_the_policy_refuses_its_address(server):
    httpd, url = server
    assert fetch_ref(f"{url}/a.jpg", opts=OPTS).status == "ok"  # loopback allowed
    strict = FetchConfig(timeout_s=1.0, retries=0)  # loopback refused
    res = fetch_ref(f"{url}/b.jpg", opts=strict)
    assert res.status == "blocked_address"
    assert [path for _, path in httpd.seen] == ["/a.jpg"]  # nothing sent


def test_a_full_pool_makes_room_for_the_newest_host(server, monkeypatch):
    """Hosts fetched once must not keep the pool full: the oldest idle one goes."""
    monkeypatch.setattr(fetch_http, "_IDLE_MAX", 1)
    monkeypatch.setattr(fetch_http, "_IDLE", fetch_http._Idle())  # none from other tests
    httpd, url = server
    with _serving() as (other, other_url):
        assert fetch_ref(f"{other_url}/a.jpg", opts=OPTS).status == "ok"  # kept: full
        for name in ("a.jpg", "b.jpg", "c.jpg"):
            assert fetch_ref(f"{url}/{name}", opts=OPTS).data == IMAGE
    assert _connections(httpd) == 1  # the other host's connection made room
    assert fetch_http._IDLE._count == 1  # and the pool stayed at its cap
