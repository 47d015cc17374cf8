"""Fetch and per-source URL settings: validated before Spark with the field named; the
user-agent template is a warning, not an error."""

from __future__ import annotations

import logging

import pytest
from conftest import make_config

from etl.config import ConfigError, load_config
from etl.config.images import USER_AGENT_TEMPLATE

URLS = {"name": "web", "kind": "table", "path": "/lists/urls.parquet",
        "columns": {"key": "k", "url": "u"}}
FILLED_IN = "lakeshard/0.1 (+https://data.example/crawler)"


@pytest.mark.parametrize("extra, needle", [
    ({"fetch": {"allow_networks": ["10.0.0.1/8"]}}, "fetch.allow_networks[0]: '10.0.0.1/8'"),
    ({"fetch": {"allow_networks": ["10.0.0.0/8", "intranet"]}}, "fetch.allow_networks[1]"),
    ({"fetch": {"user_agent": "lakeshard/0.1\r\nX-Injected: 1"}}, "fetch.user_agent: must be "
                                                                  "printable ASCII"),
    ({"fetch": {"opt_out_directives": ["no ai"]}}, "fetch.opt_out_directives[0]"),
    ({"fetch": {"max_header_bytes": 10}}, "fetch.max_header_bytes: must be >= 1024"),
    ({"sources": [{**URLS, "url_schemes": ["file"]}]},
     "sources[0] (web).url_schemes: 'file' is not listed here: set allow_local: true"),
    ({"sources": [{**URLS, "url_schemes": ["https", "ftp"]}]},
     "sources[0] (web).url_schemes: 'ftp' is not one of http, https, s3"),
    ({"sources": [{**URLS, "per_host_rps": 0}]}, "sources[0] (web).per_host_rps: must be > 0"),
    ({"sources": [{**URLS, "respect_opt_out": "no"}]},
     "sources[0] (web).respect_opt_out: expected true or false"),
    ({"sources": [{"name": "pics", "kind": "image_folder", "path": "/p", "allow_local": True}]},
     "sources[0] (pics).allow_local: only for sources whose images are named by a URL column"),
    ({"sources": [{"name": "t", "kind": "table", "path": "/t.parquet", "url_schemes": ["s3"],
                   "columns": {"key": "k", "image": "img"}}]}, "sources[0] (t).url_schemes"),
])
def test_bad_fetch_settings_name_the_field(tmp_path, extra, needle):
    with pytest.raises(ConfigError) as err:
        make_config(tmp_path, **extra)
    assert needle in str(err.value)


def test_per_source_settings_parse(tmp_path):
    cfg = make_config(tmp_path, sources=[
        {**URLS, "allow_local": True, "url_schemes": ["HTTPS", "s3"], "respect_opt_out": False,
         "per_host_rps": 2}],
        fetch={"allow_networks": ["10.20.0.0/16", "fd00:1::/64"], "user_agent": FILLED_IN})
    src = cfg.source("web")
    assert (src.allow_local, src.url_schemes, src.respect_opt_out, src.per_host_rps) == (
        True, ("https", "s3"), False, 2.0)
    assert cfg.fetch.allow_networks == ("10.20.0.0/16", "fd00:1::/64")
    defaults = make_config(tmp_path, sources=[URLS]).source("web")
    assert (defaults.allow_local, defaults.url_schemes, defaults.respect_opt_out,
            defaults.per_host_rps) == (False, ("http", "https"), True, None)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and "fetch.user_agent" in r.getMessage()]


def test_the_user_agent_template_warns_for_web_sources(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = make_config(tmp_path, sources=[URLS])
    assert cfg.fetch.user_agent == USER_AGENT_TEMPLATE
    (msg,) = _warnings(caplog)
    assert "contact URL placeholder" in msg and "web" in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        make_config(tmp_path, sources=[{"name": "shards", "kind": "webdataset",
                                        "path": "https://mirror.example/{000..009}.tar"}])
    assert len(_warnings(caplog)) == 1


def test_no_warning_when_filled_in_or_nothing_is_fetched_from_the_web(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        make_config(tmp_path, sources=[URLS], fetch={"user_agent": FILLED_IN})
        make_config(tmp_path, sources=[{**URLS, "url_schemes": ["s3"]}])
        make_config(tmp_path)  # an image folder
        cfg = load_config()  # the embedded default: its URL list names local files only
    assert _warnings(caplog) == []
    urls = cfg.source("sample_urls")
    assert urls.allow_local and urls.url_schemes == () and not urls.fetches_web


def test_the_sample_url_list_needs_allow_local(tmp_path):
    from etl.pipeline.checks import check_sources

    cfg = make_config(tmp_path, sources=[
        {"name": "sample_urls", "kind": "table", "path": str(tmp_path / "urls.jsonl"),
         "columns": {"key": "key", "url": "url", "caption": "caption"}, "sample": True}])
    with pytest.raises(ConfigError, match="'sample_urls'.*set allow_local: true"):
        check_sources(cfg)
    assert not (tmp_path / "urls.jsonl").exists()
