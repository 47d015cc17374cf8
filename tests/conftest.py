"""Shared fixtures: one real local[2] SparkSession (Delta JARs + Lance data source)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
JARS_DIR = REPO / ".jars"


def make_config(root: Path, sources: list[dict] | None = None, **extra):
    """A Config rooted at `root`, using the project's fetched JARs, parsed and checked
    against the registries as the CLI does."""
    from etl.config import parse_config
    from etl.pipeline.preflight import check_config

    raw = {
        "storage": {"root": str(root)},
        "spark": {
            "master": "local[2]",
            "jars_dir": str(JARS_DIR),
            "conf": {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false",
                     # Delta rebuilds a table's state in 50 tasks by default: slow here.
                     "spark.databricks.delta.snapshotPartitions": "2"},
        },
        "sources": sources or [{"name": "dummy", "kind": "image_folder", "path": str(root)}],
        **extra,
    }
    return check_config(parse_config(raw))


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    from etl.session import get_spark

    root = tmp_path_factory.mktemp("spark-root")
    session = get_spark(make_config(root))
    yield session
    session.stop()


def jpeg_bytes(size=(64, 48), color=(200, 30, 30), **save_kw) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="JPEG", **save_kw)
    return buf.getvalue()


def tar_bytes(members) -> bytes:
    """A tar of ``(name, data)`` members; `data` may be ``(type, linkname)`` for a link or
    special member (``tarfile.SYMTYPE``, ``tarfile.FIFOTYPE``, ...)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if isinstance(data, tuple):
                info.type, info.linkname = data
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_tar(path, members) -> None:
    """:func:`tar_bytes` written to `path`."""
    Path(path).write_bytes(tar_bytes(members))


def png_bytes(size=(40, 30), mode="RGB", color=(10, 200, 10)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


def run_all(cfg, *, stages=(), export_names=None):
    """`lakeshard run` in-process: (run id, curate result, export results)."""
    from etl.pipeline.runner import run_pipeline

    out = run_pipeline(cfg, only=tuple(stages), export_names=export_names)
    return out.run_id, out.detail("curate"), out.detail("export") or []


def files_holding(path, needle: bytes) -> list[str]:
    """The files under `path` (relative paths) whose bytes contain `needle`: where a
    removed image's bytes still are."""
    hits = []
    for dp, _, fs in os.walk(path):
        for f in fs:
            with open(os.path.join(dp, f), "rb") as fh:
                if needle in fh.read():
                    hits.append(os.path.relpath(os.path.join(dp, f), path))
    return hits
