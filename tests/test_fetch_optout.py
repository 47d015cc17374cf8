"""Opt-out signals: X-Robots-Tag parsing, the fetch that honours it (per source), and a
curate run that counts opted_out, blocked_address and bad_scheme per source and lists
them in the report."""

from __future__ import annotations

import json
import os

import pytest
from conftest import jpeg_bytes, make_config
from httpserver import Server

from etl.config import FetchConfig
from etl.config.images import OPT_OUT_DIRECTIVES
from etl.jobs.curate import CurateResult
from udfs.fetch import fetch_ref
from udfs.fetch_http import RefRules, agent_tokens, opt_out

DIRECTIVES = frozenset(OPT_OUT_DIRECTIVES)
OURS = agent_tokens("lakeshard/0.1 (+https://data.example/crawler)")


@pytest.mark.parametrize("values, opted", [
    (["noai"], True), (["noimageai"], True), (["noindex"], True), (["noimageindex"], True),
    (["NoAI"], True), (["nofollow, noai"], True), (["none"], True),
    (["nofollow"], False), (["noarchive, nosnippet"], False), ([], False),
    (["lakeshard: noai"], True), (["LakeShard:noimageai"], True), (["*: noindex"], True),
    (["otherbot: noai"], False), (["googlebot: noindex, nofollow"], False),
    (["googlebot: nofollow", "lakeshard: noimageindex"], True),
    (["googlebot: nofollow, lakeshard: noai"], True),  # a second scope in one value
    (["lakeshard: nofollow, otherbot: noai"], False),
    (["unavailable_after: 25 Jun 2010 15:00:00 PST"], False),
    (["max-image-preview:none"], False),  # "none" as a value, not the directive
    (["otherbot: noai", "noai"], True),
])
def test_x_robots_tag_rules(values, opted):
    assert (opt_out(values, OURS, DIRECTIVES) is not None) is opted


def test_scopes_match_the_configured_user_agent():
    tokens = agent_tokens("Mozilla/5.0 (compatible; AcmeBot/2.1; +https://acme.example/bot)")
    assert {"lakeshard", "acmebot", "mozilla"} <= tokens
    assert "acme.example" not in tokens and "https" not in tokens
    assert opt_out(["acmebot: noai"], tokens, DIRECTIVES)
    assert opt_out(["lakeshard: noai"], tokens, DIRECTIVES)  # the tool's own name, always
    assert not opt_out(["acmebot: noai"], OURS, DIRECTIVES)


@pytest.fixture(scope="module")
def server():
    img = jpeg_bytes()
    with Server() as srv:
        srv.files["ok.jpg"] = img
        srv.raw.update({
            "/noai.jpg": ([("X-Robots-Tag", "noai")], img),
            "/scoped.jpg": ([("X-Robots-Tag", "googlebot: nofollow"),
                             ("X-Robots-Tag", "lakeshard: noimageai")], img),
            "/other.jpg": ([("X-Robots-Tag", "otherbot: noai")], img),
            # An opted-out image bigger than any cap: refused on its headers, unread.
            "/noai-big.jpg": ([("X-Robots-Tag", "noindex")], b"\0" * (2 << 20)),
        })
        yield srv, img


OPTS = FetchConfig(timeout_s=2.0, retries=2, backoff_s=0.01, max_bytes=1 << 20,
                   allow_networks=["127.0.0.1/32"])


@pytest.mark.parametrize("route, detail", [
    ("/noai.jpg", "X-Robots-Tag: noai"), ("/scoped.jpg", "X-Robots-Tag: lakeshard: noimageai"),
    ("/noai-big.jpg", "X-Robots-Tag: noindex"),
])
def test_opted_out_images_are_not_kept(server, route, detail):
    srv, _ = server
    before = srv.hits.get(route, 0)
    res = fetch_ref(srv.url + route, opts=OPTS)
    assert (res.status, res.data, res.detail, res.attempts) == ("opted_out", None, detail, 1)
    assert srv.hits[route] == before + 1  # asked once, never again


def test_opt_out_is_per_source(server):
    srv, img = server
    assert fetch_ref(srv.url + "/other.jpg", opts=OPTS).data == img
    assert fetch_ref(srv.url + "/img/ok.jpg", opts=OPTS).data == img
    ignoring = RefRules(respect_opt_out=False)
    assert fetch_ref(srv.url + "/noai.jpg", opts=OPTS, rules=ignoring).data == img
    # Other directives can be configured: here only noai counts.
    only_noai = OPTS.model_copy(update={"opt_out_directives": ("noai",)})
    assert fetch_ref(srv.url + "/scoped.jpg", opts=only_noai).data == img


@pytest.mark.slow
def test_refusals_are_rejects_counted_per_source_and_reported(spark, tmp_path):
    """A curate run (with its report) over two URL lists with the same rows: one honours
    opt-outs (the default), one does not. Every refusal is a reject with its reason and
    detail, counted per source, in the accounting and in the report's reason counts."""
    from etl.pipeline.runner import run_pipeline

    with Server() as srv:
        img = jpeg_bytes(size=(96, 80))
        srv.files["ok.jpg"] = img
        srv.raw["/noai.jpg"] = ([("X-Robots-Tag", "noai, noimageai")], img)
        local = tmp_path / "local.jpg"
        local.write_bytes(img)
        rows = [
            {"id": "ok", "url": f"{srv.url}/img/ok.jpg", "cap": "fine"},
            {"id": "noai", "url": f"{srv.url}/noai.jpg", "cap": "opted out"},
            {"id": "meta", "url": "http://169.254.169.254/latest/meta-data/", "cap": "x"},
            {"id": "file", "url": local.as_uri(), "cap": "a file on the executor"},
        ]
        (tmp_path / "urls.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        source = {"kind": "table", "path": str(tmp_path / "urls.jsonl"),
                  "columns": {"key": "id", "url": "url", "caption": "cap"}}
        cfg = make_config(
            tmp_path / "out",
            sources=[{"name": "polite", **source},
                     {"name": "ignores", **source, "respect_opt_out": False}],
            fetch={"retries": 0, "timeout_s": 5, "allow_networks": ["127.0.0.1/32"],
                   "user_agent": "lakeshard/0.1 (+https://data.example/crawler)"},
            run={"progress_interval_s": 0, "report_samples": 2},
        )
        out = run_pipeline(cfg, only=("curate",), run_id="optout")

    counts = {c.source: c for c in out.detail("curate", CurateResult).counts}
    assert counts["polite"].reasons == {"bad_scheme": 1, "blocked_address": 1, "opted_out": 1}
    assert counts["ignores"].reasons == {"bad_scheme": 1, "blocked_address": 1}
    assert (counts["polite"].accepted, counts["ignores"].accepted) == (1, 2)

    from etl import tables

    paths = tables.layout(cfg)
    rejects = {(r.source, r.source_key): r for r in
               spark.read.format("delta").load(paths.rejects).collect()}
    assert len(rejects) == 5
    assert {(k, r.stage, r.reason) for k, r in rejects.items()} == {
        (("polite", "noai"), "fetch", "opted_out"),
        (("polite", "meta"), "fetch", "blocked_address"),
        (("polite", "file"), "fetch", "bad_scheme"),
        (("ignores", "meta"), "fetch", "blocked_address"),
        (("ignores", "file"), "fetch", "bad_scheme"),
    }
    assert "169.254.169.254" in rejects[("polite", "meta")].detail
    assert rejects[("polite", "noai")].detail == "X-Robots-Tag: noai, noimageai"
    acc = spark.read.format("delta").load(paths.accounting).where("run_id = 'optout'")
    stored = {(r.source, r.reason): r.n for r in acc.where("status = 'rejected'")
              .groupBy("source", "reason").agg({"count": "sum"})
              .withColumnRenamed("sum(count)", "n").collect()}
    assert stored == {("polite", "opted_out"): 1, ("polite", "blocked_address"): 1,
                      ("polite", "bad_scheme"): 1, ("ignores", "blocked_address"): 1,
                      ("ignores", "bad_scheme"): 1}
    report = json.load(open(os.path.join(os.path.dirname(out.report), "report.json")))
    reasons = {r["reason"]: r["count"] for r in report["reasons"] if r["kind"] == "rejected"}
    assert reasons == {"opted_out": 1, "blocked_address": 2, "bad_scheme": 2}
