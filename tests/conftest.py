"""Shared fixtures: one real local[2] SparkSession (Delta JARs + Lance data source).

Helpers that are not fixtures live in support.py; they are re-exported here for the
test files that still import them from conftest."""

from __future__ import annotations

import pytest
from support import (  # noqa: F401  (re-exported)
    JARS_DIR,
    REPO,
    files_holding,
    jpeg_bytes,
    make_config,
    png_bytes,
    run_all,
    tar_bytes,
    write_tar,
)


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    from etl.session import get_spark

    root = tmp_path_factory.mktemp("spark-root")
    session = get_spark(make_config(root))
    yield session
    session.stop()
