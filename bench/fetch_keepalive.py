"""The fetcher's CPU per URL with connections kept open, against a new connection per
request, over HTTP and HTTPS on loopback.

A server in its own process (Python's ThreadingHTTPServer speaking HTTP/1.1; for HTTPS
with a self-signed certificate for 127.0.0.1 that the client is made to trust) serves one
web-sized JPEG (~110 kB) at N paths. This process fetches them with lakeshard's fetcher
as a Python worker does (`udfs.fetch.fetch_many`: batches of 100 on 16 threads,
`fetch.per_host` 16) two ways, alternating, best of `--passes`:

* kept   -- as it runs: a connection read to its end is kept for the next request to
            the host (`udfs/fetch_http.py`, `_Idle`);
* closed -- every connection closed after its response: a TCP (and TLS) handshake per
            URL, as before connections were kept, and as img2dataset's urllib does.

Printed: CPU milliseconds per URL of this process (the client's threads; the server's
CPU is not counted) and the wall time of the pass.

    .venv/bin/python bench/fetch_keepalive.py               # 1,000 URLs, HTTP and HTTPS
    .venv/bin/python bench/fetch_keepalive.py --n 300 --passes 5
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import ipaddress
import resource
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SERVER = """
import ssl, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
body = open(sys.argv[1], "rb").read()
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "image/jpeg")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
ThreadingHTTPServer.request_queue_size = 128  # a new connection per URL from 16 threads
httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
httpd.daemon_threads = True
if len(sys.argv) > 2:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(sys.argv[2], sys.argv[3])
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
print(httpd.server_address[1], flush=True)
httpd.serve_forever()
"""


def self_signed(folder: Path) -> tuple[Path, Path, str]:
    """A certificate for 127.0.0.1 (cert.pem, key.pem) and its PEM text."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lakeshard bench")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=2))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (folder / "cert.pem").write_bytes(pem)
    (folder / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return folder / "cert.pem", folder / "key.pem", pem.decode()


def photo(folder: Path) -> Path:
    """One web-sized JPEG (a 0.5 MP crop of a photo scikit-image bundles, q90)."""
    import io

    from PIL import Image
    from skimage import data

    im = Image.fromarray(data.astronaut()).resize((800, 600))
    out = io.BytesIO()
    im.save(out, format="JPEG", quality=90)
    (folder / "photo.jpg").write_bytes(out.getvalue())
    return folder / "photo.jpg"


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="URLs per pass")
    ap.add_argument("--passes", type=int, default=3, help="passes of each way, alternating")
    args = ap.parse_args()

    from etl.config import FetchConfig, SourceConfig
    from udfs import fetch_http
    from udfs.fetch import fetch_many, rules_for

    class Closed(fetch_http._Idle):
        """Every connection closed after its response: none kept."""

        def give(self, key, conn) -> None:
            conn.close()

    opts = FetchConfig(allow_networks=["127.0.0.1/32"], per_host=16, threads=16)
    rules = rules_for(SourceConfig(name="web", kind="table", path=str(REPO),
                                   format="parquet", columns={"key": "key", "url": "url"}))
    work = Path(tempfile.mkdtemp(prefix="fetch-keepalive-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    body = photo(work)
    cert, key, pem = self_signed(work)
    print(f"{args.n} URLs per pass, one {body.stat().st_size / 1e3:.0f} kB JPEG; client: "
          f"lakeshard's fetcher, 16 threads, batches of 100; best of {args.passes}")
    print(f"{'scheme':<7} {'connections':<12} {'CPU ms/URL':>10} {'wall s':>7}")
    client = ssl.create_default_context(cadata=pem)
    fetch_http._tls_context = lambda: client  # trust the bench's certificate
    for scheme in ("http", "https"):
        extra = [str(cert), str(key)] if scheme == "https" else []
        server = subprocess.Popen([sys.executable, "-c", SERVER, str(body), *extra],
                                  stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            urls = [f"{scheme}://127.0.0.1:{port}/p{i:06d}.jpg" for i in range(args.n)]
            ways = {"kept": fetch_http._Idle, "closed": Closed}
            best = {way: (float("inf"), 0.0) for way in ways}
            for _ in range(args.passes):
                for way, pool in ways.items():
                    fetch_http._IDLE = pool()
                    t0, c0 = time.monotonic(), cpu_seconds()
                    for i in range(0, len(urls), 100):
                        got = fetch_many(urls[i:i + 100], [None] * 100, [None] * 100, opts,
                                         [rules] * 100)
                        bad = [r for r in got if r.status != "ok"]
                        if bad:
                            raise SystemExit(f"{scheme} {way}: {bad[0].status} {bad[0].detail}")
                    cpu, wall = cpu_seconds() - c0, time.monotonic() - t0
                    fetch_http._IDLE = fetch_http._Idle()  # the pass's connections closed
                    if cpu < best[way][0]:
                        best[way] = (cpu, wall)
            for way, (cpu, wall) in best.items():
                print(f"{scheme:<7} {way:<12} {cpu / args.n * 1e3:>10.3f} {wall:>7.2f}",
                      flush=True)
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
