"""A real S3-protocol server on 127.0.0.1 for the object-storage tests: moto's S3 WSGI
application in a threaded werkzeug server (what ``moto.server.ThreadedMotoServer`` runs),
with the switches the fault tests need:

* ``stop()`` / ``start()`` -- an outage: the listening socket closes (new connections
  are refused) and requests on kept-alive connections get their connection dropped;
  ``start()`` listens again on the same port. moto keeps its state in this process, so
  the buckets survive the outage, as a real store's would.
* ``stop_after(predicate)`` -- go down right after answering the first request for
  which ``predicate(method, path)`` is true (e.g. the first Lance data file PUT), so an
  outage lands in the middle of a stage at a known point.
* ``throttle_every(n)`` -- answer every n-th request with ``503 SlowDown`` (S3's
  throttling response) instead of passing it on; ``throttled`` counts them.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import make_server

__all__ = ["S3Server"]

_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")


class S3Server:
    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._app = DomainDispatcherApplication(create_backend_app)
        self._server = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.port = 0
        self.down = True
        self._trip: Callable[[str, str], bool] | None = None
        self.tripped = threading.Event()
        self._every = 0
        self._count = 0
        self.throttled = 0
        self.requests: list[tuple[str, str]] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        self._server = make_server("127.0.0.1", self.port, self._wsgi, threaded=True,
                                   request_handler=MotoRequestHandler)
        self.port = self._server.server_address[1]
        self.down = False
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.down = True
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join()

    def stop_after(self, predicate: Callable[[str, str], bool] | None) -> None:
        self.tripped.clear()
        self._trip = predicate

    def throttle_every(self, n: int) -> None:
        with self._lock:
            self._every, self._count, self.throttled = n, 0, 0

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="test", aws_secret_access_key="test")

    def _wsgi(self, environ, start_response):
        if self.down:  # a kept-alive connection after the outage began: drop it
            sock = environ.get("werkzeug.socket")
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            start_response("503 Service Unavailable", [("Connection", "close")])
            return [b""]
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        with self._lock:
            self.requests.append((method, path))
            self._count += 1
            throttle = self._every and self._count % self._every == 0
            if throttle:
                self.throttled += 1
        if throttle:
            start_response("503 Slow Down", [("Content-Type", "application/xml"),
                                             ("Content-Length", str(len(_SLOW_DOWN)))])
            return [_SLOW_DOWN]
        body = b"".join(self._app(environ, start_response))
        trip = self._trip
        if trip is not None and trip(method, path):
            self._trip = None
            self.down = True
            self.tripped.set()
            threading.Thread(target=self.stop, daemon=True).start()
        return [body]
