"""HTTP(S) fetching of URLs that strangers wrote, inside Spark tasks.

* **Address policy at connect time.** A host is resolved once, and each address is
  checked right before the socket connects to it (:func:`guarded_connection`): the
  address checked is the address connected to, so DNS that answers differently the
  second time (rebinding) has no second time to exploit. Loopback, link-local (the
  cloud metadata address), private, shared (CGNAT), multicast, unspecified and reserved
  addresses are refused -- also when written as decimal/hex/octal IPv4 or embedded in
  IPv6 -- unless they are in ``fetch.allow_networks``. Redirects are followed here, one
  hop at a time, so every hop goes through the same check (and its scheme is checked
  again). No proxy from the environment is used: a proxy would connect on our behalf.
* **Limits that protect the fetcher.** A deadline per request covers the whole
  response, headers included (a server that trickles bytes is cut at ``timeout_s``);
  the status line and headers are capped (``max_header_bytes``); the body is capped on
  the wire and again once gzip/deflate-decoded (``max_bytes``), decoding in bounded
  steps so a compression bomb never inflates past the cap.
* **Politeness.** Per host: at most ``fetch.per_host`` requests in flight across the
  threads of a Python worker, and, when the source sets ``per_host_rps``, requests
  spaced at least ``1/rps`` apart. Every hop counts against its own host.
* **Connections kept open.** A response read to its end from a server that keeps the
  connection open (HTTP/1.1) leaves the connection for the next request to the same
  host, port and resolved addresses under the same address policy (:class:`_Idle`): no
  new TCP or TLS handshake per image from one host. Each request on it still has its
  own deadline; one the server closed while it was idle is replaced by a new one.
* **Opt-out.** ``X-Robots-Tag`` directives (``noai``, ``noimageai``, ``noindex``,
  ``noimageindex`` by default; ``none`` implies ``noindex``) on the image's response,
  unscoped or scoped to a user agent that names this fetcher, make the row
  ``opted_out``; the body is not read.

Each request ends as a :class:`FetchResult`; nothing here raises for a bad URL or a
hostile server.
"""

from __future__ import annotations

import errno
import functools
import http.client
import io
import ipaddress
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from etl.config import FetchConfig

__all__ = [
    "FetchResult",
    "RefRules",
    "refusal",
    "guarded_connection",
    "resolve_host",
    "open_socket",
    "agent_tokens",
    "opt_out",
    "fetch_once",
    "classify_error",
]

_CHUNK = 1 << 16
_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class FetchResult:
    data: bytes | None
    status: str
    detail: str | None = None
    attempts: int = 1


@dataclass(frozen=True)
class RefRules:
    """What one source's references may name, and how its rows are fetched.

    The default is for references an adapter made itself from the source's configured
    path (tar members, image files): local paths and every supported scheme. Sources
    whose images are named by a URL column get their configured rules
    (:func:`udfs.fetch.rules_for`)."""

    local: bool = True
    schemes: frozenset[str] = frozenset(
        ("http", "https", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")
    )
    respect_opt_out: bool = True
    per_host_rps: float | None = None
    # References an adapter listed itself (`file:` + the path, byte for byte): the path
    # after `file:` is taken verbatim, never parsed as a URL.
    own: bool = True
    # Follow a symbolic link that is the last part of a local path (the listing has
    # already checked where it leads); false: a link is refused (`symlink`).
    follow_symlinks: bool = True
    # A table of embedded images (its `image` column, dotted into a struct): a reference
    # with an offset and no length is a row of a parquet file (udfs.fetch_table).
    table_image: str | None = None


# ------------------------------------------------------------------ address policy

_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT; Alibaba's metadata
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_V4_COMPAT = ipaddress.ip_network("::/96")


def _category(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why an address is not a public one (None: it is)."""
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.is_unspecified:
        return "unspecified"
    if ip.version == 4 and ip in _SHARED:
        return "shared (carrier-grade NAT)"
    if ip.is_private or ip.is_reserved or not ip.is_global:
        return "private or reserved"
    return None


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, 6to4, NAT64, compatible)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64 or (ip in _V4_COMPAT and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _allowed(ip, allow: tuple) -> bool:
    return any(ip.version == net.version and ip in net for net in allow)


def refusal(ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
            allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
            ) -> str | None:
    """Why the fetcher may not connect to `ip` (None: it may). `allow`: networks
    exempt from the policy (``fetch.allow_networks``)."""
    if _allowed(ip, allow):
        return None
    if ip.version == 6:
        v4 = _embedded_v4(ip)
        if v4 is not None:
            if _allowed(v4, allow):
                return None
            why = _category(v4)
            if why is not None:
                return f"{why} ({v4} inside IPv6)"
            if ip.ipv4_mapped is not None:
                return None  # ::ffff:<public IPv4> is that public address
    return _category(ip)


@functools.lru_cache(maxsize=32)
def _networks(cidrs: tuple[str, ...]) -> tuple:
    return tuple(ipaddress.ip_network(c) for c in cidrs)


class _Refused(Exception):
    def __init__(self, host: str, ip: str, why: str):
        super().__init__(f"{ip} is {why}" if host == ip else f"{host}: {ip} is {why}")


def resolve_host(host: str, port: int) -> list[tuple[int, tuple]]:
    """The resolver hook: ``(family, sockaddr)`` for each address of host:port."""
    return [(family, sockaddr) for family, _, _, _, sockaddr in
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


def open_socket(family: int, sockaddr: tuple, timeout: float) -> socket.socket:
    """The connect hook: a TCP connection to exactly this address."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(sockaddr)
        return sock
    except BaseException:
        sock.close()
        raise


def guarded_connection(host: str, port: int, timeout: float, allow: tuple = (),
                       addresses: list[tuple[int, tuple]] | None = None) -> socket.socket:
    """Resolve `host` once (unless `addresses` says what it resolved to) and connect to
    the first of its addresses the policy permits; refused addresses are never
    connected to. Raises the last connection error, or a refusal when every address
    was refused."""
    refused: _Refused | None = None
    error: OSError | None = None
    for family, sockaddr in (resolve_host(host, port) if addresses is None else addresses):
        ip = ipaddress.ip_address(sockaddr[0])
        why = refusal(ip, allow)
        if why is not None:
            refused = refused or _Refused(host, str(ip), why)
            continue
        try:
            return open_socket(family, sockaddr, timeout)
        except OSError as exc:
            error = exc
    if error is not None:
        raise error
    if refused is not None:
        raise refused
    raise socket.gaierror(socket.EAI_NONAME, f"no address for {host}")


# ------------------------------------------------------------ per-host politeness


class _HostGate:
    """At most `limit` requests in flight per key (a host name, an address), across a
    Python worker's threads (Spark reuses the worker across tasks). Keys with nothing in
    flight are forgotten."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: dict[str, int] = {}

    @contextmanager
    def slot(self, host: str, limit: int) -> Iterator[None]:
        with self._cond:
            while self._active.get(host, 0) >= limit:
                self._cond.wait()
            self._active[host] = self._active.get(host, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                left = self._active[host] - 1
                if left:
                    self._active[host] = left
                else:
                    del self._active[host]
                self._cond.notify_all()


class _HostPacer:
    """Requests to one host at least ``1/rps`` seconds apart (per Python worker): each
    request reserves the next free start time, then sleeps until it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}

    def wait(self, host: str, rps: float | None) -> None:
        if not rps:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next.get(host, now))
            self._next[host] = start + 1.0 / rps
            if len(self._next) > 4096:
                self._next = {h: t for h, t in self._next.items() if t > now}
        if start > now:
            time.sleep(start - now)


_GATE = _HostGate()
_PACER = _HostPacer()


# ------------------------------------------------------- connections kept open

_IDLE_S = 4.0  # an idle connection older than this is closed, not reused (servers close
# theirs after 5-75 s idle; one closed sooner is replaced on first use anyway)
_IDLE_MAX = 64  # idle connections a Python worker keeps, over all hosts


class _Idle:
    """Open connections between requests, per key (scheme, host, port, the addresses the
    host resolved to, the address policy), at most :data:`_IDLE_MAX` over all keys (a
    full pool drops what idled too long, else its oldest): a request takes one of its
    key's (the newest) or opens its own, and gives it back only once its response was
    read to the end on a connection the server keeps open. Keyed by the resolution and
    the policy, a connection is reused only where a new one would connect to the same
    address under the same check. Per process: a forked child starts with none."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conns: dict[tuple, list[tuple[float, http.client.HTTPConnection]]] = {}
        self._count = 0
        self._pid = os.getpid()

    def take(self, key: tuple) -> http.client.HTTPConnection | None:
        old: list[http.client.HTTPConnection] = []
        conn = None
        with self._lock:
            self._forked()
            idle = self._conns.get(key, [])
            while idle and conn is None:
                since, c = idle.pop()
                self._count -= 1
                if time.monotonic() - since <= _IDLE_S:
                    conn = c
                else:
                    old.append(c)
            if not idle:
                self._conns.pop(key, None)
        for c in old:
            c.close()
        return conn

    def give(self, key: tuple, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._forked()
            old = self._evicted() if self._count >= _IDLE_MAX else []
            self._conns.setdefault(key, []).append((time.monotonic(), conn))
            self._count += 1
        for c in old:
            c.close()

    def _evicted(self) -> list[http.client.HTTPConnection]:
        """Room for one more (the lock held): every connection idle too long, else the
        one idle longest -- hosts seen once do not keep the newer ones out."""
        now = time.monotonic()
        out = []
        for key in list(self._conns):
            fresh = [(t, c) for t, c in self._conns[key] if now - t <= _IDLE_S]
            out += [c for t, c in self._conns[key] if now - t > _IDLE_S]
            if fresh:
                self._conns[key] = fresh
            else:
                del self._conns[key]
        if not out and self._conns:
            key = min(self._conns, key=lambda k: self._conns[k][0][0])
            out.append(self._conns[key].pop(0)[1])
            if not self._conns[key]:
                del self._conns[key]
        self._count -= len(out)
        return out

    def _forked(self) -> None:
        if self._pid != os.getpid():  # the parent's sockets are not this process's
            self._conns, self._count, self._pid = {}, 0, os.getpid()


_IDLE = _Idle()


# ------------------------------------------------------------------------ opt-out

# Directives whose value contains a colon: not a user-agent scope.
_VALUED = frozenset({"unavailable_after", "max-snippet", "max-image-preview",
                     "max-video-preview"})
_SCOPED = re.compile(r"\s*([A-Za-z0-9*][\w.*-]*)\s*:(.*)", re.S)
_PRODUCT = re.compile(r"(?:^|[\s;(])([A-Za-z][\w.-]*)/[^\s;()]*")


@functools.lru_cache(maxsize=8)
def agent_tokens(user_agent: str) -> frozenset[str]:
    """Names a site may scope ``X-Robots-Tag`` rules to for this fetcher: ``lakeshard``
    and every product token (``Name/version``) of the configured user agent."""
    return frozenset({"lakeshard"} | {m.group(1).lower() for m in _PRODUCT.finditer(user_agent)})


def opt_out(values: Iterable[str], agents: frozenset[str], directives: frozenset[str]
            ) -> str | None:
    """The ``X-Robots-Tag`` value that opts this fetcher out, or None.

    Each header value is a comma-separated list of rules; ``name: rule`` starts rules
    scoped to user agent `name` (until the next scope in that value). A rule applies
    when unscoped, scoped to ``*`` or to one of `agents`; ``none`` means ``noindex,
    nofollow``."""
    for value in values:
        scope = None
        for part in value.split(","):
            m = _SCOPED.fullmatch(part)
            if m and m.group(1).lower() not in _VALUED:
                scope, part = m.group(1).lower(), m.group(2)
            words = set(part.lower().split())
            if "none" in words:
                words |= {"noindex", "nofollow"}
            if (scope is None or scope == "*" or scope in agents) and words & directives:
                return "X-Robots-Tag: " + " ".join(value.split())[:300]
    return None


# ---------------------------------------------------------------- one response


class _HeaderTooLarge(http.client.HTTPException):
    pass


class _DeadlinePassed(TimeoutError):
    pass


class _TooLarge(Exception):
    pass


class _DeadlineReader(io.RawIOBase):
    """The socket, read with a timeout that shrinks to what is left of the request's
    deadline: no read can wait past it, however slowly the bytes come."""

    def __init__(self, sock: socket.socket, deadline: float, timeout: float):
        super().__init__()
        self._sock = sock
        # A socket file like http.client's own: it keeps the socket open until closed.
        self._file = sock.makefile("rb", buffering=0)
        self._deadline, self._timeout = deadline, timeout

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise _DeadlinePassed(f"response not complete in {self._timeout:g}s")
        self._sock.settimeout(min(self._timeout, left))
        try:
            return self._file.readinto(buf)
        except TimeoutError:  # the wait was cut to what the deadline left
            raise _DeadlinePassed(f"response not complete in {self._timeout:g}s") from None

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


class _HeaderCap:
    """The response's file: the status line and headers may take at most `cap` bytes."""

    def __init__(self, fp: io.BufferedReader, cap: int):
        self._fp, self._left, self._cap = fp, cap, cap
        self.counting = True

    def readline(self, limit: int = -1) -> bytes:
        line = self._fp.readline(limit)
        if self.counting:
            self._left -= len(line)
            if self._left < 0:
                raise _HeaderTooLarge(f"response headers over {self._cap} bytes")
        return line

    def __getattr__(self, name):
        return getattr(self._fp, name)


class _Response(http.client.HTTPResponse):
    def __init__(self, sock, *args, make_file, **kwargs):
        super().__init__(sock, *args, **kwargs)
        self.fp.close()  # the plain socket file http.client opened; ours replaces it
        self.fp = make_file(sock)

    def begin(self) -> None:
        super().begin()
        self.fp.counting = False  # chunk sizes and trailers are body, not headers


def _address_key(addresses: list[tuple[int, tuple]], allow: tuple) -> str:
    """The politeness key of a resolved host: the address it will connect to (the
    first the policy permits), in one canonical spelling -- so `127.0.0.1`,
    `2130706433`, `0x7f000001`, `127.1` and any name resolving there share one limit."""
    ips = [ipaddress.ip_address(sockaddr[0]) for _, sockaddr in addresses]
    ip = next((i for i in ips if refusal(i, allow) is None), ips[0] if ips else None)
    return f"address {ip}"


def _connection(scheme: str, host: str, port: int, opts: FetchConfig, deadline: float,
                addresses: list[tuple[int, tuple]] | None = None):
    allow = _networks(opts.allow_networks)
    if scheme == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=opts.timeout_s,
                                           context=_tls_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=opts.timeout_s)

    def connect(address, timeout, source_address=None):
        left = max(0.001, min(timeout, conn.deadline - time.monotonic()))
        return guarded_connection(address[0], address[1], left, allow, addresses)

    def make_file(sock):  # per response: the deadline of the request it answers
        raw = _DeadlineReader(sock, conn.deadline, opts.timeout_s)
        return _HeaderCap(io.BufferedReader(raw, _CHUNK), opts.max_header_bytes)

    conn.deadline = deadline  # set again by each request a kept connection serves

    # http.client opens its socket through this attribute (HTTPS wraps the result in
    # TLS for the host name): the one place every connection is made.
    conn._create_connection = connect
    conn.response_class = functools.partial(_Response, make_file=make_file)
    return conn


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


class _Inflater:
    """gzip/deflate decoding in bounded steps: never more than `cap` + 1 bytes out."""

    def __init__(self, encoding: str, cap: int):
        self._wbits = 31 if encoding in ("gzip", "x-gzip") else 15
        self._d = zlib.decompressobj(self._wbits)
        self._started = False
        self._cap = cap
        self.out = bytearray()

    def feed(self, data: bytes) -> None:
        while data:
            try:
                piece = self._d.decompress(data, self._cap + 1 - len(self.out))
            except zlib.error:
                if self._started or self._wbits != 15:
                    raise
                self._wbits = -15  # "deflate" sent raw, without the zlib wrapper
                self._d = zlib.decompressobj(self._wbits)
                continue
            self._started = True
            self.out += piece
            if len(self.out) > self._cap:
                raise _TooLarge(f"decoded body over {self._cap} bytes")
            data = self._d.unconsumed_tail
            if self._d.eof:
                data = self._d.unused_data + data if self._wbits == 31 else b""
                if data:  # the next member of a multi-member gzip stream
                    self._d = zlib.decompressobj(self._wbits)

    def finish(self) -> bytes:
        if not self._d.eof:
            raise zlib.error("compressed stream ends early")
        return bytes(self.out)


def _body(resp: http.client.HTTPResponse, opts: FetchConfig, ranged: bool) -> FetchResult:
    declared = resp.getheader("Content-Length")
    if declared and declared.strip().isdigit() and int(declared) > opts.max_bytes:
        return FetchResult(None, "too_large", f"Content-Length {declared.strip()}")
    encoding = (resp.getheader("Content-Encoding") or "identity").strip().lower()
    inflater = None
    if encoding in ("gzip", "x-gzip", "deflate"):
        if ranged:
            return FetchResult(None, "bad_encoding", f"{encoding} body for a byte range")
        inflater = _Inflater(encoding, opts.max_bytes)
    elif encoding not in ("identity", ""):
        return FetchResult(None, "bad_encoding", f"Content-Encoding {encoding[:50]}")
    buf = bytearray()
    wire = 0
    while True:
        chunk = resp.read1(_CHUNK)  # returns after one socket read: the deadline holds
        if not chunk:
            break
        wire += len(chunk)
        if wire > opts.max_bytes:
            return FetchResult(None, "too_large", f"over {opts.max_bytes} bytes")
        if inflater is None:
            buf += chunk
        else:
            try:
                inflater.feed(chunk)
            except _TooLarge as exc:
                return FetchResult(None, "too_large", f"{exc} (Content-Encoding {encoding})")
            except zlib.error as exc:
                return FetchResult(None, "bad_encoding", f"{encoding}: {exc}")
    if resp.length:  # Content-Length promised more than came
        return FetchResult(None, "truncated", f"{resp.length} bytes missing")
    if inflater is None:
        return FetchResult(bytes(buf), "ok")
    try:
        return FetchResult(inflater.finish(), "ok")
    except zlib.error as exc:
        return FetchResult(None, "bad_encoding", f"{encoding}: {exc}")


def _target(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, request path) of an http(s) URL; ValueError if unusable."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    host = parts.hostname
    if not host:
        raise ValueError(f"no host in {url[:200]!r}")
    if ":" not in host:  # not an IPv6 literal
        host = host.encode("idna").decode("ascii")
    port = parts.port or (443 if scheme == "https" else 80)
    path = urllib.parse.quote(parts.path or "/", safe="/%!$&'()*+,;=:@-._~")
    if parts.query:
        path += "?" + urllib.parse.quote(parts.query, safe="/?%!$&'()*+,;=:@-._~")
    return scheme, host, port, path


def _request(target: tuple[str, str, int, str], opts: FetchConfig, rules: RefRules,
             rng: tuple[int, int] | None, addresses: list[tuple[int, tuple]] | None = None
             ) -> tuple[FetchResult | None, str | None]:
    """One request (no redirect followed): its result, or the redirect's Location. On a
    connection kept open from an earlier request when there is one (:class:`_Idle`;
    only with `addresses`, what the host resolved to for this request)."""
    scheme, host, port, path = target
    headers = {"User-Agent": opts.user_agent, "Accept": "image/*,*/*;q=0.5",
               "Accept-Encoding": "identity"}
    if rng is not None:
        headers["Range"] = f"bytes={rng[0]}-{rng[0] + rng[1] - 1}"
    deadline = time.monotonic() + opts.timeout_s
    key = None if addresses is None else (
        scheme, host, port, tuple(a for _, a in addresses), tuple(opts.allow_networks))
    conn = None if key is None else _IDLE.take(key)
    kept = False
    try:
        resp = None if conn is None else _on_kept(conn, path, headers, deadline, opts)
        if resp is None:
            if conn is not None:
                conn.close()
            conn = _connection(scheme, host, port, opts, deadline, addresses)
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
        if resp.status in _REDIRECTS:
            location = resp.getheader("Location")
            if not location:
                return FetchResult(None, f"http_{resp.status}", "redirect without Location"), None
            return None, location.strip()
        if resp.status not in (200, 206):
            return FetchResult(None, f"http_{resp.status}", resp.reason or None), None
        if rules.respect_opt_out:
            said = opt_out(resp.headers.get_all("X-Robots-Tag") or (),
                           agent_tokens(opts.user_agent), frozenset(opts.opt_out_directives))
            if said is not None:
                return FetchResult(None, "opted_out", said), None
        res = _body(resp, opts, rng is not None)
        # Read to its end (a chunked body closes itself; a sized one is at length 0),
        # and the server keeps the connection: the next request's.
        kept = (key is not None and res.status == "ok" and not resp.will_close
                and (resp.isclosed() or resp.length == 0) and conn.sock is not None)
        if kept:
            resp.close()  # the connection is ready for its next request
        return res, None
    finally:
        if kept:
            _IDLE.give(key, conn)
        elif conn is not None:
            conn.close()


def _on_kept(conn: http.client.HTTPConnection, path: str, headers: dict, deadline: float,
             opts: FetchConfig) -> http.client.HTTPResponse | None:
    """The response to this request sent on a kept connection, under its own deadline;
    None where the server closed the connection while it was idle (no answer read)."""
    conn.deadline = deadline
    conn.sock.settimeout(max(0.001, min(opts.timeout_s, deadline - time.monotonic())))
    try:
        conn.request("GET", path, headers=headers)
        return conn.getresponse()
    except ConnectionError:  # reset, broken pipe, or closed before a status line
        return None


def classify_error(exc: BaseException) -> FetchResult:
    """The status of a fetch that raised `exc` (a network, protocol or policy error)."""
    if isinstance(exc, _Refused):
        return FetchResult(None, "blocked_address", str(exc))
    if isinstance(exc, socket.gaierror):
        return FetchResult(None, "dns", str(exc))
    if isinstance(exc, TimeoutError):
        return FetchResult(None, "timeout", str(exc) or "timed out")
    if isinstance(exc, _HeaderTooLarge | http.client.LineTooLong) or (
            isinstance(exc, http.client.HTTPException) and "more than" in str(exc)):
        return FetchResult(None, "header_too_large", str(exc)[:200])
    if isinstance(exc, http.client.IncompleteRead):
        return FetchResult(None, "truncated", f"{len(exc.partial)} bytes read")
    if isinstance(exc, ConnectionError | ssl.SSLError):
        return FetchResult(None, "connection", str(exc))
    if isinstance(exc, http.client.HTTPException):
        return FetchResult(None, "bad_response", f"{type(exc).__name__}: {str(exc)[:200]}")
    if isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET,
                                                  errno.EHOSTUNREACH, errno.ENETUNREACH):
        return FetchResult(None, "connection", str(exc))
    return FetchResult(None, "error", f"{type(exc).__name__}: {exc}")


def fetch_once(url: str, opts: FetchConfig, rules: RefRules, rng: tuple[int, int] | None
               ) -> FetchResult:
    """One attempt at an http(s) URL (optionally a byte range): the request and the
    redirects it leads to, each hop checked (scheme, address), paced and counted against
    its own host. The per-host limits hold for the host name and for the address it
    resolves to (resolved once, here; that answer is the one connected to), whatever
    the spelling. Retries are the caller's (:func:`udfs.fetch.fetch_ref`)."""
    hops = 0
    while True:
        via = f" (redirect {hops})" if hops else ""
        try:
            target = _target(url)
        except (ValueError, UnicodeError) as exc:
            return FetchResult(None, "bad_url", f"{exc}{via}")
        key = f"{target[1]}:{target[2]}"
        _PACER.wait(key, rules.per_host_rps)
        try:
            with _GATE.slot(key, opts.per_host):
                addresses = resolve_host(target[1], target[2])
                at = _address_key(addresses, _networks(opts.allow_networks))
                if at != f"address {target[1]}":  # a name, or an address spelled otherwise
                    _PACER.wait(at, rules.per_host_rps)
                with _GATE.slot(at, opts.per_host):
                    res, location = _request(target, opts, rules, rng, addresses)
        except (OSError, http.client.HTTPException, _Refused) as exc:
            res, location = classify_error(exc), None
        except (ValueError, UnicodeError) as exc:  # http.client's own check of the URL
            res, location = FetchResult(None, "bad_url", str(exc)[:200]), None
        if location is None:
            if via and res.status != "ok":
                res = FetchResult(None, res.status, f"{res.detail or ''}{via}".strip())
            return res
        hops += 1
        if hops > opts.max_redirects:
            return FetchResult(None, "too_many_redirects", f"more than {opts.max_redirects}")
        url = urllib.parse.urljoin(url, location)
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme not in ("http", "https") or scheme not in rules.schemes:
            return FetchResult(None, "bad_scheme", f"redirect {hops} to {url[:200]}")
