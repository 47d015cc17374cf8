"""Hostile input that never needs Spark: names with a trailing newline, storage roots
that break quoting, a forget --file that is someone's secret, a FIFO read locally, and
one loopback address spelled four ways against the per-host limit."""

from __future__ import annotations

import os
import time

import pytest
from httpserver import Server

from etl.config import ConfigError, FetchConfig, parse_config
from etl.pipeline.preflight import check_run_id
from udfs.fetch import fetch_many, fetch_ref
from udfs.fetch_local import read_local


def _raw(tmp_path, **over):
    raw = {"storage": {"root": str(tmp_path / "out")},
           "sources": [{"name": "photos", "kind": "image_folder", "path": str(tmp_path)}]}
    for section, values in over.items():
        raw[section] = values if section == "sources" else {**raw.get(section, {}), **values}
    return raw


@pytest.mark.parametrize("over, field", [
    ({"storage": {"namespace": "default\n"}}, "storage.namespace"),
    ({"sources": [{"name": "photos\n", "kind": "image_folder", "path": "/tmp"}]},
     "sources[0] ('photos\\n').name"),
    ({"storage": {"root": "/tmp/a|b"}}, "storage.root"),
    ({"storage": {"root": "/tmp/a`b"}}, "storage.root"),
    ({"storage": {"root": "/tmp/a`) OR 1=1 --"}}, "storage.root"),
    ({"storage": {"root": "/tmp/new\nline"}}, "storage.root"),
])
def test_names_and_roots_are_refused_naming_the_field(tmp_path, over, field):
    with pytest.raises(ConfigError) as err:
        parse_config(_raw(tmp_path, **over))
    assert str(err.value).startswith(field), str(err.value)


def test_plain_names_and_roots_still_parse(tmp_path):
    cfg = parse_config(_raw(tmp_path, storage={"root": str(tmp_path / "a b-c_d.e"),
                                               "namespace": "default"}))
    assert cfg.storage.root == str(tmp_path / "a b-c_d.e")


def test_a_run_id_with_a_trailing_newline_is_refused():
    check_run_id("nightly-2026-12-01")
    with pytest.raises(ConfigError, match="--run-id"):
        check_run_id("x\n")


def test_forget_file_errors_quote_no_content(tmp_path):
    from etl.jobs.forget import parse_request

    for name, text in [("shadow", "root:$6$saltsalt$hashhashhash:19000:0:99999:7:::\n"),
                       ("passwd", "key photos:a.jpg\nroot:x:0:0:root:/root:/bin/bash\n"),
                       ("bad-id", "sample-id s3cr3t-t0ken-value\n")]:
        f = tmp_path / name
        f.write_text(text)
        with pytest.raises(ConfigError) as err:
            parse_request({"file": str(f), "by": "dpo", "reason": "r"})
        message = str(err.value)
        assert f"forget --file {f} line" in message
        for secret in ("root", "$6$", "s3cr3t", "/bin/bash"):
            assert secret not in message.replace(str(f), ""), message
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        parse_request({"file": str(fifo), "by": "dpo", "reason": "r"})


def test_local_reads_never_block_and_never_follow_unless_told(tmp_path):
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    res = read_local(str(fifo), None, 1 << 20, 5.0)
    assert (res.status, res.data) == ("not_a_file", None)
    assert time.monotonic() - t0 < 2
    (tmp_path / "real.jpg").write_bytes(b"abc")
    os.symlink(tmp_path / "real.jpg", tmp_path / "link.jpg")
    assert read_local(str(tmp_path / "link.jpg"), None, 1 << 20, 5.0, False).status == "symlink"
    assert read_local(str(tmp_path / "link.jpg"), None, 1 << 20, 5.0, True).data == b"abc"
    os.symlink(tmp_path / "gone", tmp_path / "dangling.jpg")
    assert read_local(str(tmp_path / "dangling.jpg"), None, 9, 5.0).status == "missing_file"
    assert read_local(str(tmp_path), None, 9, 5.0).status == "missing_file"
    assert read_local(str(tmp_path / "real.jpg"), (1, 1), 9, 5.0).data == b"b"
    assert read_local(str(tmp_path / "real.jpg"), None, 2, 5.0).status == "too_large"
    # A name with %2F, #, TAB: the file of that exact name (an adapter's own reference).
    odd = tmp_path / "a%2F..%2Fb\tc#d.jpg"
    odd.write_bytes(b"odd")
    (tmp_path / "b").write_bytes(b"what a URL parser would read")
    assert fetch_ref("file:" + str(odd)).data == b"odd"


def test_per_host_holds_for_one_address_in_every_spelling():
    spellings = ["127.0.0.1", "2130706433", "0x7f000001", "127.1"]
    with Server() as server:
        port = server.url.rsplit(":", 1)[1]
        for i in range(16):
            server.files[f"s{i}.jpg"] = b"x"
        urls = [f"http://{spellings[i % 4]}:{port}/slowhost/s{i}.jpg" for i in range(16)]
        opts = FetchConfig(per_host=4, threads=16, timeout_s=10, retries=0,
                           allow_networks=["127.0.0.1/32"])
        server.max_active = 0
        results = fetch_many(urls, [None] * 16, [None] * 16, opts)
        assert [r.status for r in results] == ["ok"] * 16
        assert server.max_active == 4


def test_per_host_slots_are_released_after_failures():
    # A refused connection and a DNS failure hold no slot: later requests still run.
    opts = FetchConfig(per_host=1, threads=4, timeout_s=2, retries=0,
                       allow_networks=["127.0.0.1/32"])
    with Server() as server:
        server.files["a.jpg"] = b"x"
        port = server.url.rsplit(":", 1)[1]
        for _ in range(3):
            assert fetch_ref("http://127.0.0.1:1/a.jpg", opts=opts).status == "connection"
        assert fetch_ref(f"http://127.1:{port}/img/a.jpg", opts=opts).data == b"x"
