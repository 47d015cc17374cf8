"""Helpers shared by the tests that are not fixtures: a checked config on a `tmp_path`,
small images and tars built in memory, in-process runs of the pipeline and the CLI,
and the odd process or environment trick. Fixtures live in conftest.py; the servers
the tests talk to in httpserver.py and s3server.py.

Test files import from here (`from support import make_config`); conftest.py re-exports
the older names so `from conftest import ...` keeps working."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JARS_DIR = REPO / ".jars"

__all__ = [
    "JARS_DIR", "REPO", "cli_in_process", "console_scripts", "dead_pid", "files_holding",
    "frame", "jpeg_bytes", "make_config", "photo_png", "png_bytes", "run_all", "scoped_env",
    "tar_bytes", "write_tar",
]


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


def frame(spark, schema, rows, **common):
    """A DataFrame of `schema` (a StructType) from dicts that name only the fields a test
    cares about: `common` fills every row, a field neither gives is null."""
    names = schema.fieldNames()
    unknown = ({k for r in rows for k in r} | set(common)) - set(names)
    if unknown:
        raise KeyError(f"not in the schema: {sorted(unknown)}")
    full = [{**dict.fromkeys(names), **common, **r} for r in rows]
    return spark.createDataFrame([tuple(r[n] for n in names) for r in full], schema)


# ------------------------------------------------------------ images and tars


def jpeg_bytes(size=(64, 48), color=(200, 30, 30), **save_kw) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="JPEG", **save_kw)
    return buf.getvalue()


def photo(i: int) -> bytes:
    """A small distinct JPEG for a folder source's record `i` (its size and colour
    follow `i`; another `i` is another image)."""
    return jpeg_bytes(size=(60 + i, 50), color=(20 * i % 255, 90, 160))


def photo_folder(folder: Path, n: int) -> Path:
    """An image folder of `n` photos ``p<i>.jpg``, a sidecar caption for ``p1``, and one
    undecodable ``bad.jpg`` (a rejected record)."""
    folder.mkdir()
    for i in range(n):
        (folder / f"p{i}.jpg").write_bytes(photo(i))
    (folder / "p1.txt").write_text("a caption")
    (folder / "bad.jpg").write_bytes(b"not a jpeg")
    return folder


def png_bytes(size=(40, 30), mode="RGB", color=(10, 200, 10)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


def photo_png(seed: int) -> bytes:
    """A distinct 64x48 'photo' (a gradient with a seed-dependent pattern): unlike the
    flat images above, no two seeds are near-duplicates."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, 64)[None, :, None]
    img = (x + rng.integers(0, 120, size=(48, 1, 3))) % 256
    buf = io.BytesIO()
    Image.fromarray(np.broadcast_to(img, (48, 64, 3)).astype("uint8")).save(buf, "PNG")
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


# ------------------------------------------------------------ running lakeshard


def run_all(cfg, *, stages=(), export_names=None):
    """`lakeshard run` in-process: (run id, curate result, export results)."""
    from etl.jobs.curate import CurateResult
    from etl.jobs.export import ExportRun
    from etl.pipeline.runner import run_pipeline

    out = run_pipeline(cfg, only=tuple(stages), export_names=export_names)
    exports = out.detail("export", ExportRun)
    return (out.run_id, out.detail("curate", CurateResult),
            list(exports.exports) if exports else [])


def cli_in_process(args: list[str]) -> tuple[int, str, str]:
    """`lakeshard …` in-process (on the shared Spark session): exit code, stdout, stderr."""
    from etl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


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


# ------------------------------------------------------------ processes, environment


def console_scripts() -> dict[str, str]:
    """`[project.scripts]` of pyproject.toml: script name -> `module:function`."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def dead_pid() -> int:
    """The pid of a process that has exited (what a crashed run leaves in its lock)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@contextlib.contextmanager
def scoped_env(env: Mapping[str, str]) -> Iterator[None]:
    """`env` set in os.environ for the block; each variable restored (or removed) after."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def non_null_fields(t) -> list[str]:
    """Names of the non-nullable fields anywhere in the Spark type `t` (struct fields,
    array elements as ``<element>``): a UDF's result type must have none (Spark 4.0
    checks an Arrow result's nullability; udfs/arrow_types.py)."""
    from pyspark.sql import types as T

    if isinstance(t, T.StructType):
        return [f.name for f in t.fields if not f.nullable] + [
            n for f in t.fields for n in non_null_fields(f.dataType)]
    if isinstance(t, T.ArrayType):
        return ([] if t.containsNull else ["<element>"]) + non_null_fields(t.elementType)
    return []
