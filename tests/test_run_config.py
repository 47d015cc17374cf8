"""The `run:` section of the config: every bad value refused before Spark with the
field it names; a remote root without a lock only when said so."""

from __future__ import annotations

import re

import pytest
from support import make_config

from etl.config import ConfigError


@pytest.mark.parametrize(
    ("run", "storage", "message"),
    [
        ({"stages": ["curate", "captions"]}, None, "run.stages[1]: unknown stage 'captions'"),
        ({"stages": []}, None, "run.stages: expected a non-empty list"),
        ({}, "gs://bucket/corpus", "run.lock_path: storage.root is on gs://, where"),
        ({"lock_path": "gs://b/lock"}, None,
         "run.lock_path: 'gs://b/lock': an object-store lock must be s3://bucket/key"),
        ({"progress_interval_s": -1}, None, "run.progress_interval_s: must be >= 0"),
        ({"heartbeat_s": 60, "stale_lock_s": 60}, None, "run.heartbeat_s: 60 must be below"),
        ({"report": "yes"}, None, "run.report: expected true or false"),
        ({"lock": True, "color": 1}, None, "run: unknown key 'color'"),
    ],
)
def test_bad_run_config_names_the_field(tmp_path, run, storage, message):
    from etl.config import parse_config
    from etl.pipeline.preflight import check_config

    cfg = make_config(tmp_path)
    raw = {"storage": {"root": storage or str(tmp_path)}, "run": run,
           "sources": [{"name": "x", "kind": "image_folder", "path": str(tmp_path)}]}
    assert cfg.run.lock  # defaults parse
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(parse_config(raw))


def test_remote_root_without_lock_is_allowed_when_said_so(tmp_path):
    from etl.config import parse_config

    cfg = parse_config({"storage": {"root": "s3://bucket/corpus"}, "run": {"lock": False},
                        "sources": [{"name": "x", "kind": "image_folder", "path": "s3://b/x"}]})
    assert cfg.run.lock is False
