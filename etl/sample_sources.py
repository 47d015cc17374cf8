"""Bundled sample sources for the embedded default config.

Built on first run from real photos that scikit-image ships inside its wheel (read
from the installed package; nothing is downloaded), on local disk -- also when
``storage.root`` is on an object store (they are inputs, read by a local Spark): an
image folder with sidecar captions and a parquet file with embedded image bytes and
alt text. Each sample also
carries a few bad records, so a first run shows how rejects are reported.
"""

from __future__ import annotations

import io
import logging
from importlib import resources
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from etl.config import Config, ConfigError, SourceConfig
from etl.sources.base import is_local_path, local_path

__all__ = [
    "ensure_samples", "FOLDER_PHOTOS", "FOLDER_FLAGGED", "FOLDER_BAD", "TABLE_PHOTOS",
    "TAR_PHOTOS", "URL_PHOTOS", "DELTA_PHOTOS", "LANCE_PHOTOS",
]

log = logging.getLogger(__name__)

# file in skimage/data -> (relative path in the folder source, caption or None)
FOLDER_PHOTOS = {
    "astronaut.png": ("people/astronaut.png", "Astronaut Eileen Collins in an orange "
                      "flight suit, smiling, with an American flag and a space shuttle "
                      "model behind her."),
    "chelsea.png": ("animals/chelsea.png", "A tabby cat lying down, looking to the "
                    "left, lit from the side."),
    "coffee.png": ("objects/coffee.png", "A cup of coffee with latte art on a saucer "
                   "with a spoon, seen from above on a wooden table."),
    "rocket.jpg": ("objects/rocket.jpg", "A rocket on a launch pad under a clear "
                   "sky, with a service tower beside it."),
    "logo.png": ("graphics/logo.png", None),  # RGBA, no caption: kept, caption null
    "camera.png": ("people/cameraman.png", "A black-and-white photo of a man "
                   "operating a camera on a tripod."),
}
# Decodable but flagged by the light filters (kept in the table with keep = false):
# relative path -> (source photo, thumbnail size, caption)
FOLDER_FLAGGED = {
    "thumbs/chelsea_icon.png": ("chelsea.png", (48, 32), "A tiny thumbnail of a cat."),
}
# bad records: relative path -> bytes (a truncated JPEG, an empty file, text as .png)
FOLDER_BAD = {
    "broken/truncated.jpg": None,  # the first half of rocket.jpg
    "broken/empty.jpg": b"",
    "broken/notes.png": b"this is a text file with an image extension\n",
}

TABLE_PHOTOS = [
    ("hubble", "hubble_deep_field.jpg", "Hubble deep field: hundreds of distant "
     "galaxies on a black background."),
    ("retina", "retina.jpg", "A fundus photograph of a human retina with blood "
     "vessels."),
    ("motorcycle", "motorcycle_left.png", "A motorcycle parked indoors, seen from "
     "the side."),
    ("page", "page.png", "A scanned page of printed text."),
    ("coins", "coins.png", "Greek coins on a dark background, black and white."),
    ("brick", "brick.png", "A close-up of a grey brick wall texture."),
]


def _skimage_file(name: str) -> bytes:
    from etl.errors import require

    require("skimage", "samples", "the bundled sample sources (their images)")
    return resources.files("skimage").joinpath("data", name).read_bytes()


def _build_image_folder(root: Path) -> None:
    for src_name, (rel, caption) in FOLDER_PHOTOS.items():
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(_skimage_file(src_name))
        if caption is not None:
            dest.with_suffix(".txt").write_text(caption + "\n", encoding="utf-8")
    for rel, (src_name, size, caption) in FOLDER_FLAGGED.items():
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        thumb = Image.open(io.BytesIO(_skimage_file(src_name))).convert("RGB").resize(size)
        thumb.save(dest)
        dest.with_suffix(".txt").write_text(caption + "\n", encoding="utf-8")
    for rel, data in FOLDER_BAD.items():
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        rocket = _skimage_file("rocket.jpg")
        dest.write_bytes(rocket[: len(rocket) // 2] if data is None else data)


def _build_table(path: Path) -> None:
    rows = [
        {"id": key, "jpg": _skimage_file(name), "alt_text": caption,
         "url": f"https://example.org/images/{name}", "license": "BSD-3-Clause"}
        for key, name, caption in TABLE_PHOTOS
    ]
    rows.append({"id": "missing-bytes", "jpg": None, "alt_text": "an image that was "
                 "never downloaded", "url": "https://example.org/404.jpg", "license": None})
    rows.append({"id": "garbage", "jpg": b"\x00" * 64, "alt_text": "random bytes",
                 "url": "https://example.org/garbage.jpg", "license": None})
    schema = pa.schema([("id", pa.string()), ("jpg", pa.binary()), ("alt_text", pa.string()),
                        ("url", pa.string()), ("license", pa.string())])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


# WebDataset shards: key -> (skimage file or None, caption or None); two shards.
TAR_PHOTOS = {
    "shard-000.tar": [("0000", "grass.png", "Green grass, close up."),
                      ("0001", "gravel.png", "A gravel path texture."),
                      ("0002", None, "a caption whose image is missing")],
    "shard-001.tar": [("0003", "horse.png", "A silhouette of a horse."),
                      ("0004", "rocket.jpg", "A rocket on its launch pad.")],
}
# URL list (JSONL): key -> (skimage file or None, caption); file:// URLs into a folder
# next to it, so `make run` needs no network; one URL names a file that is not there.
URL_PHOTOS = [("u-astro", "astronaut.png", "An astronaut portrait."),
              ("u-coffee", "coffee.png", "A cup of coffee seen from above."),
              ("u-gone", None, "an image whose URL is dead")]
# Existing tables (Delta and Lance) with embedded bytes; one row without a caption
# value (null) is rejected as missing_caption.
DELTA_PHOTOS = [("d-camera", "camera.png", "A cameraman with a tripod."),
                ("d-moon", "moon.png", "The moon's surface, grey and cratered."),
                ("d-nocap", "text.png", None)]
LANCE_PHOTOS = [("l-clock", "clock_motion.png", "A clock face, blurred by motion."),
                ("l-cell", "cell.png", "A cell under a microscope.")]


def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _build_webdataset(path: Path) -> None:
    folder = path.parent if any(c in path.name for c in "*?[{") else path
    folder.mkdir(parents=True, exist_ok=True)
    for shard, items in TAR_PHOTOS.items():
        members = []
        for key, name, caption in items:
            if name is not None:
                ext = name.rsplit(".", 1)[1]
                members.append((f"{key}.{ext}", _skimage_file(name)))
            members.append((f"{key}.txt", caption.encode()))
        (folder / shard).write_bytes(_tar_bytes(members))


def _build_url_list(path: Path) -> None:
    import json

    images = path.parent / (path.stem + "-files")
    images.mkdir(parents=True, exist_ok=True)
    lines = []
    for key, name, caption in URL_PHOTOS:
        target = images / f"{key}.{(name or 'x.jpg').rsplit('.', 1)[1]}"
        if name is not None:
            target.write_bytes(_skimage_file(name))
        lines.append(json.dumps({"key": key, "url": target.resolve().as_uri(),
                                 "caption": caption, "punsafe": 0.02}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _photo_table(items) -> pa.Table:
    return pa.table({
        "key": [k for k, _, _ in items],
        "image": [_skimage_file(n) for _, n, _ in items],
        "caption": pa.array([c for _, _, c in items], pa.string()),
    })


def _build_delta(path: Path) -> None:
    """A Delta table written by the protocol (one parquet file + one commit), so the
    sample needs no Spark session: Spark reads it like any Delta table."""
    import json
    import time
    import uuid

    from pyspark.sql import types as T

    path.mkdir(parents=True, exist_ok=True)
    (path / "_delta_log").mkdir()
    data = "part-00000-sample.snappy.parquet"
    pq.write_table(_photo_table(DELTA_PHOTOS), path / data)
    schema = T.StructType([T.StructField("key", T.StringType()),
                           T.StructField("image", T.BinaryType()),
                           T.StructField("caption", T.StringType())])
    now = int(time.time() * 1000)
    actions = [
        {"protocol": {"minReaderVersion": 1, "minWriterVersion": 2}},
        {"metaData": {"id": str(uuid.uuid4()), "format": {"provider": "parquet", "options": {}},
                      "schemaString": schema.json(), "partitionColumns": [],
                      "configuration": {}, "createdTime": now}},
        {"add": {"path": data, "partitionValues": {}, "size": (path / data).stat().st_size,
                 "modificationTime": now, "dataChange": True}},
    ]
    (path / "_delta_log" / "00000000000000000000.json").write_text(
        "\n".join(json.dumps(a) for a in actions) + "\n", encoding="utf-8")


def _build_lance(path: Path) -> None:
    import lance

    path.parent.mkdir(parents=True, exist_ok=True)
    lance.write_dataset(_photo_table(LANCE_PHOTOS), str(path))


_BUILDERS = {"image_folder": _build_image_folder, "table": _build_table,
             "webdataset": _build_webdataset, "delta": _build_delta, "lance": _build_lance}


def ensure_samples(cfg: Config) -> list[SourceConfig]:
    """Build every source marked `sample: true` whose path does not exist yet."""
    built = []
    for src in cfg.sources:
        if not src.sample:
            continue
        if src.kind not in _BUILDERS or not is_local_path(src.path):
            raise ConfigError(
                f"source {src.name!r}: sample: true needs a local path and kind "
                f"{' or '.join(sorted(_BUILDERS))} (samples are built on this machine's "
                "disk; they stay there with a storage.root on an object store)"
            )
        path = local_path(src.path)
        builder = _BUILDERS[src.kind]
        if src.kind == "table" and src.has_url_column:
            if not src.allow_local:
                raise ConfigError(
                    f"source {src.name!r}: the sample URL list names local files "
                    "(file:// URLs); set allow_local: true on it"
                )
            builder = _build_url_list
        if src.kind == "webdataset":
            if path.parent.exists() and any(path.parent.glob("*.tar")):
                continue
        elif path.exists():
            continue
        log.info("building sample source %s at %s", src.name, path)
        builder(path)
        built.append(src)
    return built
