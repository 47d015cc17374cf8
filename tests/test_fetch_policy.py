"""The address policy and the schemes a URL list may name.

Everything here stays on loopback. "Private space" is simulated with the allowlist: a
server on 127.0.0.1 (allowed) and one on 127.0.0.2 (not). The metadata address and other
forbidden targets are checked on the resolver and connect hooks of udfs/fetch_http.py:
the connect hook is replaced by a recorder that never opens a socket, and the resolver
by one that answers numeric hosts locally (AI_NUMERICHOST) and names from a table, so
no packet (not even a DNS query) leaves the machine.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
import urllib.parse

import pytest
from conftest import jpeg_bytes
from httpserver import Server

from etl.config import FetchConfig, SourceConfig
from udfs import fetch_http
from udfs.fetch import fetch_ref, rules_for
from udfs.fetch_http import RefRules, refusal

ONLY_FIRST = ["127.0.0.1/32"]  # 127.0.0.2 plays a host in private space
OPTS = FetchConfig(timeout_s=2.0, retries=0, allow_networks=ONLY_FIRST)


@pytest.fixture(scope="module")
def servers():
    with Server("127.0.0.1") as public, Server("127.0.0.2") as private:
        public.files["a.jpg"] = private.files["a.jpg"] = jpeg_bytes()
        yield public, private


class Hooks:
    """Recording resolver/connect hooks. `names`: host -> addresses (answers in order,
    one list per call, the last one repeated); numeric hosts resolve locally."""

    def __init__(self, names=None, connect=True):
        self.names = {k: list(v) for k, v in (names or {}).items()}
        self.resolved: list[str] = []
        self.connected: list[str] = []
        self.connect = connect
        self._real_open = fetch_http.open_socket

    def resolve(self, host, port):
        self.resolved.append(host)
        if host in self.names:
            answers = self.names[host]
            addrs = answers.pop(0) if len(answers) > 1 else answers[0]
            return [(socket.AF_INET6 if ":" in a else socket.AF_INET,
                     (a, port) if ":" not in a else (a, port, 0, 0)) for a in addrs]
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_NUMERICHOST)
        return [(family, sockaddr) for family, _, _, _, sockaddr in infos]

    def open(self, family, sockaddr, timeout):
        self.connected.append(sockaddr[0])
        if not self.connect or not ipaddress.ip_address(sockaddr[0]).is_loopback:
            raise ConnectionRefusedError("test hook: no connection made")
        return self._real_open(family, sockaddr, timeout)


@pytest.fixture
def hooks(monkeypatch):
    def install(names=None, connect=True):
        h = Hooks(names, connect)
        monkeypatch.setattr(fetch_http, "resolve_host", h.resolve)
        monkeypatch.setattr(fetch_http, "open_socket", h.open)
        return h

    return install


@pytest.mark.parametrize("address, expected", [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("10.1.2.3", "private or reserved"), ("172.16.5.4", "private or reserved"),
    ("192.168.0.1", "private or reserved"), ("fd00:ec2::254", "private or reserved"),
    ("100.100.100.200", "shared (carrier-grade NAT)"),
    ("224.0.0.251", "multicast"), ("ff02::1", "multicast"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("240.0.0.1", "private or reserved"), ("255.255.255.255", "private or reserved"),
    ("::ffff:169.254.169.254", "link-local (169.254.169.254 inside IPv6)"),
    ("64:ff9b::a9fe:a9fe", "link-local (169.254.169.254 inside IPv6)"),
    ("2002:a00:1::1", "private or reserved (10.0.0.1 inside IPv6)"),
    ("::127.0.0.1", "loopback (127.0.0.1 inside IPv6)"),
    ("93.184.215.14", None), ("2606:4700:4700::1111", None), ("::ffff:93.184.215.14", None),
])
def test_which_addresses_are_refused(address, expected):
    assert refusal(ipaddress.ip_address(address)) == expected


def test_allow_networks_exempts_exactly_their_addresses():
    allow = (ipaddress.ip_network("10.20.0.0/16"), ipaddress.ip_network("fd00:1::/64"))
    assert refusal(ipaddress.ip_address("10.20.3.4"), allow) is None
    assert refusal(ipaddress.ip_address("::ffff:10.20.3.4"), allow) is None
    assert refusal(ipaddress.ip_address("fd00:1::5"), allow) is None
    assert refusal(ipaddress.ip_address("10.21.0.1"), allow) == "private or reserved"
    assert refusal(ipaddress.ip_address("169.254.169.254"), allow) == "link-local"


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "https://169.254.169.254/computeMetadata/v1/",
    "http://2852039166/latest/meta-data/",            # the same address, as one number
    "http://0xa9fea9fe/", "http://0251.0376.0251.0376/", "http://169.254.43518/",
    "http://[::ffff:169.254.169.254]/", "http://[fd00:ec2::254]/latest/meta-data/",
    "http://100.100.100.200/latest/meta-data/",
])
def test_metadata_addresses_are_refused_without_a_packet(hooks, url):
    h = hooks()
    res = fetch_ref(url, opts=FetchConfig(retries=2, backoff_s=0.01))
    assert res.status == "blocked_address", res
    assert res.attempts == 1  # a refusal is final: no retry
    host = urllib.parse.urlsplit(url).hostname
    assert host in res.detail
    assert h.resolved == [host] and h.connected == []


def test_a_name_that_resolves_to_metadata_is_refused_by_name(hooks):
    h = hooks({"metadata.google.internal": [["169.254.169.254"]],
               "imds.example.test": [["fd00:ec2::254"]]})
    for host, ip in [("metadata.google.internal", "169.254.169.254"),
                     ("imds.example.test", "fd00:ec2::254")]:
        res = fetch_ref(f"http://{host}/computeMetadata/v1/", opts=FetchConfig(retries=0))
        assert res.status == "blocked_address"
        assert res.detail.startswith(f"{host}: {ip} is ")
    assert h.connected == []


def test_the_address_checked_is_the_address_connected_to(hooks, servers):
    """DNS rebinding: the name answers an allowed address, then a refused one. The
    fetcher resolves once per connection and connects to what it checked, so the second
    answer is refused instead of being connected to after a check of the first."""
    public, _ = servers
    port = public.url.rsplit(":", 1)[1]
    h = hooks({"images.test": [["127.0.0.1"], ["127.0.0.2"], ["127.0.0.1"]]})
    statuses = [fetch_ref(f"http://images.test:{port}/img/a.jpg", opts=OPTS).status
                for _ in range(3)]
    assert statuses == ["ok", "blocked_address", "ok"]
    assert h.resolved == ["images.test"] * 3  # one resolution per connection, no pre-check
    assert h.connected == ["127.0.0.1", "127.0.0.1"]


def test_only_permitted_addresses_of_a_name_are_tried(hooks, servers):
    public, _ = servers
    port = public.url.rsplit(":", 1)[1]
    h = hooks({"mixed.test": [["127.0.0.2", "169.254.169.254", "127.0.0.1"]]})
    res = fetch_ref(f"http://mixed.test:{port}/img/a.jpg", opts=OPTS)
    assert res.status == "ok" and res.data == jpeg_bytes()
    assert h.connected == ["127.0.0.1"]


def test_redirects_into_private_space_are_refused(hooks, servers):
    public, private = servers
    h = hooks()
    before = dict(private.hits)
    target = urllib.parse.quote(f"{private.url}/img/a.jpg", safe="")
    res = fetch_ref(f"{public.url}/to?{target}", opts=OPTS)
    assert res.status == "blocked_address"
    assert "127.0.0.2" in res.detail and "redirect 1" in res.detail
    # The metadata address through a redirect: refused at the hop, nothing sent there.
    meta = urllib.parse.quote("http://169.254.169.254/latest/meta-data/", safe="")
    res = fetch_ref(f"{public.url}/to?{meta}", opts=OPTS)
    assert res.status == "blocked_address" and "169.254.169.254" in res.detail
    # Straight at the private server: refused as well.
    assert fetch_ref(f"{private.url}/img/a.jpg", opts=OPTS).status == "blocked_address"
    assert private.hits == before
    assert set(h.connected) == {"127.0.0.1"}
    # Control: with the second address allowed, the same redirect is followed.
    both = FetchConfig(timeout_s=2.0, retries=0, allow_networks=["127.0.0.0/30"])
    res = fetch_ref(f"{public.url}/to?{target}", opts=both)
    assert res.status == "ok" and res.data == jpeg_bytes()
    assert private.hits["/img/a.jpg"] == before.get("/img/a.jpg", 0) + 1


def test_loopback_is_refused_unless_allowed(servers):
    public, _ = servers
    before = public.hits.get("/img/a.jpg", 0)
    res = fetch_ref(f"{public.url}/img/a.jpg", opts=FetchConfig(retries=0))
    assert (res.status, res.detail) == ("blocked_address", "127.0.0.1 is loopback")
    res = fetch_ref(public.url.replace("127.0.0.1", "localhost") + "/img/a.jpg",
                    opts=FetchConfig(retries=0))
    assert res.status == "blocked_address" and res.detail.startswith("localhost: ")
    assert public.hits.get("/img/a.jpg", 0) == before


URL_LIST = SourceConfig(name="web", kind="table", path="/lists",
                        columns={"key": "k", "url": "u"})


@pytest.mark.parametrize("ref", [
    "file:///etc/passwd", "/etc/passwd", "relative/cat.jpg", "C:\\images\\cat.jpg",
    "ftp://example.org/cat.jpg", "gopher://127.0.0.1:70/", "data:image/png;base64,AAAA",
    "javascript:alert(1)", "s3://bucket/cat.jpg", "dict://127.0.0.1:11211/stat",
])
def test_a_url_list_names_only_the_web_by_default(hooks, ref):
    h = hooks()
    res = fetch_ref(ref, opts=OPTS, rules=rules_for(URL_LIST))
    assert (res.status, res.data, res.attempts) == ("bad_scheme", None, 0)
    assert h.resolved == [] and h.connected == []


def test_local_files_and_object_stores_when_the_source_says_so(tmp_path, hooks):
    h = hooks()
    p = tmp_path / "cat.jpg"
    p.write_bytes(b"meow")
    local = rules_for(URL_LIST.model_copy(update={"allow_local": True}))
    assert fetch_ref(p.as_uri(), opts=OPTS, rules=local).data == b"meow"
    assert fetch_ref(str(p), opts=OPTS, rules=local).data == b"meow"
    stores = rules_for(URL_LIST.model_copy(update={"url_schemes": ("s3",)}))
    assert stores.schemes == {"s3"} and not stores.local
    # http is no longer listed for this source; an fsspec chain is never one object.
    assert fetch_ref("http://example.org/a.jpg", opts=OPTS, rules=stores).status == "bad_scheme"
    assert fetch_ref("simplecache::s3://b/k", opts=OPTS, rules=stores).status == "bad_scheme"
    assert h.connected == []
    # An adapter's own references (image folders, tar members) keep reading local files.
    assert fetch_ref(str(p), opts=OPTS).data == b"meow"
    assert rules_for(SourceConfig(name="f", kind="webdataset", path="/p")) == RefRules()
    # An image folder's files are read as listed: a link there is not followed.
    assert rules_for(SourceConfig(name="f", kind="image_folder", path="/p")) == \
        RefRules(follow_symlinks=False)


def test_a_redirect_to_another_scheme_is_refused(servers, tmp_path):
    public, _ = servers
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"executor file")
    anything = RefRules()  # even rules that allow local files do not follow a redirect there
    for target in (secret.as_uri(), "ftp://127.0.0.1/x", "gopher://127.0.0.1:70/x"):
        res = fetch_ref(f"{public.url}/to?{urllib.parse.quote(target, safe='')}",
                        opts=OPTS, rules=anything)
        assert (res.status, res.data) == ("bad_scheme", None), target
        assert res.detail.startswith("redirect 1 to ")


def _self_signed(tmp_path):
    """A certificate for 127.0.0.1 and a client context that trusts only it."""
    import datetime

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lakeshard test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(pem)
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    client = ssl.create_default_context(cadata=pem.decode())
    return server, client


def test_https_goes_through_the_same_connect_hook(tmp_path, monkeypatch, hooks, servers):
    _, private = servers
    server_ctx, client_ctx = _self_signed(tmp_path)
    monkeypatch.setattr(fetch_http, "_tls_context", lambda: client_ctx)
    with Server("127.0.0.1", tls=server_ctx) as tls:
        tls.files["a.jpg"] = jpeg_bytes()
        h = hooks()
        # Allowed: TLS on the connection the hook made, the certificate checked.
        res = fetch_ref(f"{tls.url}/img/a.jpg", opts=OPTS)
        assert (res.status, res.data) == ("ok", jpeg_bytes())
        assert h.connected == ["127.0.0.1"]
        # Refused before any TLS: no connection at all.
        res = fetch_ref(f"{tls.url}/img/a.jpg", opts=FetchConfig(retries=0))
        assert res.status == "blocked_address" and h.connected == ["127.0.0.1"]
        # From https into private space over a redirect: refused at the hop.
        target = urllib.parse.quote(f"{private.url}/img/a.jpg", safe="")
        res = fetch_ref(f"{tls.url}/to?{target}", opts=OPTS)
        assert res.status == "blocked_address" and "127.0.0.2" in res.detail
        # A certificate the client does not trust is a failed connection, not bytes.
        monkeypatch.setattr(fetch_http, "_tls_context", ssl.create_default_context)
        res = fetch_ref(f"{tls.url}/img/a.jpg", opts=OPTS)
        assert res.status == "connection" and res.data is None
