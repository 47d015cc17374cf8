"""A real HTTP server on loopback for URL-fetching tests (nothing leaves the machine)."""

from __future__ import annotations

import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Server:
    """Routes: /img/<name> (bytes registered in `files`), /redirect/<name> (302 to
    /img/<name>), /to?<url> (302 to any URL), /404, /500, /stall (headers, then
    silence), /big (declared size over any cap), /bigchunked (no Content-Length,
    endless body), /slowhost/<name> (counts concurrent requests), /trickle (a body one
    byte at a time, for ever), /trickleheaders (the headers one byte at a time), and
    any path registered in `raw`: ``raw[path] = (headers, body)`` sent as they are
    (with a Content-Length unless `headers` has one).

    `host`: any loopback address (127.0.0.2 is a second "machine" for address-policy
    tests); `tls`: a server-side ssl.SSLContext to serve HTTPS. `hits` counts requests
    per path, `arrivals` records (path, monotonic time)."""

    def __init__(self, host: str = "127.0.0.1", tls=None):
        self.files: dict[str, bytes] = {}
        self.raw: dict[str, tuple[list[tuple[str, str]], bytes]] = {}
        self.hits: dict[str, int] = {}
        self.arrivals: list[tuple[str, float]] = []
        self.user_agents: list[str] = []
        self.active = 0
        self.max_active = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                path = self.path
                with lock:
                    outer.hits[path] = outer.hits.get(path, 0) + 1
                    outer.arrivals.append((path, time.monotonic()))
                    outer.user_agents.append(self.headers.get("User-Agent", ""))
                    outer.active += 1
                    outer.max_active = max(outer.max_active, outer.active)
                try:
                    self._route(path)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _done(self):
                with lock:
                    outer.active -= 1

            def _route(self, path):
                if path.startswith("/slowhost/"):
                    time.sleep(0.2)
                # Counted as active until the response starts (before the client can see
                # it end), so `max_active` is the real number of overlapping requests.
                self._done()
                if path in outer.raw:
                    headers, body = outer.raw[path]
                    self.send_response(200)
                    for name, value in headers:
                        self.send_header(name, value)
                    if not any(n.lower() == "content-length" for n, _ in headers):
                        self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif path.startswith("/img/") or path.startswith("/slowhost/"):
                    name = path.split("/", 2)[2]
                    if name not in outer.files:
                        return self._status(404)
                    body = outer.files[name]
                    self.send_response(200)
                    self.send_header("Content-Type", "image/jpeg")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif path.startswith("/redirect/"):
                    self._redirect("/img/" + path.split("/", 2)[2])
                elif path.startswith("/to?"):
                    self._redirect(urllib.parse.unquote(path[len("/to?"):]))
                elif path == "/loop":
                    self._redirect("/loop")
                elif path == "/500":
                    self._status(500)
                elif path == "/stall":
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b"x" * 10)
                    self.wfile.flush()
                    time.sleep(3)
                elif path == "/trickle":
                    self.send_response(200)
                    self.send_header("Content-Length", "1000000")
                    self.end_headers()
                    self._trickle(b"x" * 1000)
                elif path == "/trickleheaders":
                    self._trickle(b"HTTP/1.0 200 OK\r\n" + b"X-Padding: y\r\n" * 100 + b"\r\n")
                elif path == "/big":
                    self.send_response(200)
                    self.send_header("Content-Length", str(1 << 30))
                    self.end_headers()
                elif path == "/bigchunked":
                    self.send_response(200)
                    self.end_headers()
                    for _ in range(64):
                        self.wfile.write(b"y" * 65536)
                else:
                    self._status(404)

            def _trickle(self, data: bytes):
                """One byte every 50 ms (about 20 bytes/s) until the client leaves."""
                self.wfile.flush()
                for i in range(len(data)):
                    self.wfile.write(data[i:i + 1])
                    self.wfile.flush()
                    time.sleep(0.05)

            def _redirect(self, location):
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _status(self, code):
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://{host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
