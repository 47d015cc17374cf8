"""A real HTTP server on 127.0.0.1 for URL-fetching tests (nothing leaves the machine)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Server:
    """Routes: /img/<name> (bytes registered in `files`), /redirect/<name> (302 to
    /img/<name>), /404, /500, /stall (headers, then silence), /big (declared size over
    any cap), /bigchunked (no Content-Length, endless body), /slowhost/<name> (counts
    concurrent requests)."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.hits: dict[str, int] = {}
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
                if path.startswith("/img/") or path.startswith("/slowhost/"):
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
                    self.send_response(302)
                    self.send_header("Location", "/img/" + path.split("/", 2)[2])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif path == "/loop":
                    self.send_response(302)
                    self.send_header("Location", "/loop")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif path == "/500":
                    self._status(500)
                elif path == "/stall":
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b"x" * 10)
                    self.wfile.flush()
                    time.sleep(3)
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

            def _status(self, code):
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
