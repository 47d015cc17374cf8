"""`webdataset`: tar shards whose members are grouped by key (`<key>.jpg` +
`<key>.txt` / `<key>.json`), local or on any fsspec filesystem, named by a path,
a glob or a brace pattern (`shards/{0000..0099}.tar`).

The tar index is read inside Spark tasks (one task per shard): member headers,
plus the small caption/JSON members. Image bytes are not read here; each record
references its image as (shard, byte offset, length) and curate reads that range
only for new records. A shard whose size and mtime match the manifest is not opened
at all (see :meth:`containers`).

Bad input: a key with a caption but no image is ``missing_image``; a member whose
data runs past the end of the file is ``truncated``; a shard that is not a tar, or
whose headers break midway, adds a ``broken_tar`` reject (the members before the
break are kept). A member is never extracted to disk: a link member (symbolic or hard)
is never followed, and a key whose members include one is rejected (``symlink``), as a
key with a device or FIFO member is (``not_a_file``). A ``.json`` member is parsed with
bounded depth (``invalid_sidecar``), a ``.txt`` member over the caption limit is
``caption_too_long``, a ``.json`` member over :data:`SIDECAR_MAX_BYTES` is
``invalid_sidecar``. A shard found by a glob or a folder listing that is a link the
source does not follow, or a special file, is not opened: one ``unreadable_file``
reject whose detail says why (:mod:`etl.sources.listing`); the source then removes
nothing that run.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from etl.config import ConfigError, SourceConfig
from etl.sources.base import FLAG_KEYS, SourceAdapter
from etl.sources.listing import expand_pattern, fingerprint, listing_digest
from etl.sources.records import (
    CAPTION_REASONS,
    RAW_ARROW_SCHEMA,
    RAW_SCHEMA,
    SIDECAR_MAX_BYTES,
    RecordError,
    caption_bytes,
    map_fields,
    parse_json_object,
    raw_row,
    text_caption,
)

__all__ = ["WebDatasetSource", "list_tar"]

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


class WebDatasetSource(SourceAdapter):
    kind = "webdataset"
    mappable = frozenset({"caption", "license"}) | FLAG_KEYS

    def check_inputs(self, source: SourceConfig) -> None:
        if not expand_pattern(source.path, source.follow_symlinks):
            raise ConfigError(
                f"source {source.name!r}: path {source.path!r} does not exist or matches "
                "no tar shard (field sources[].path)"
            )

    def listing_digest(self, source: SourceConfig) -> str | None:
        return listing_digest(expand_pattern(source.path, source.follow_symlinks))

    def containers(self, source: SourceConfig) -> dict[str, str]:
        return {f.uri: fingerprint(f)
                for f in expand_pattern(source.path, source.follow_symlinks)}

    def read(
        self, spark: SparkSession, source: SourceConfig, skip: frozenset[str] = frozenset(),
        version: int | None = None,
    ) -> DataFrame:
        shards = [(f.uri, f.size, fingerprint(f), *(f.problem or (None, None)))
                  for f in expand_pattern(source.path, source.follow_symlinks)
                  if f.uri not in skip]
        mapping = {"caption": "caption", **dict(source.columns)}
        max_chars = source.max_caption_chars
        units = spark.createDataFrame(
            shards, "uri string, size long, fingerprint string, problem string, "
            "problem_detail string")

        def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            for batch in batches:
                for unit in batch.to_pylist():
                    if unit["problem"] is not None:  # never opened: removes nothing
                        name = unit["uri"].rsplit("/", 1)[-1]
                        rows = [_reject(f"{name}#unreadable", unit["uri"], unit["fingerprint"],
                                        "unreadable_file",
                                        f"{unit['problem']}: {unit['problem_detail']}")]
                    else:
                        rows = list_tar(unit["uri"], unit["size"], unit["fingerprint"],
                                        mapping, max_chars)
                    if rows:
                        yield pa.RecordBatch.from_pylist(rows, schema=RAW_ARROW_SCHEMA)

        return units.mapInArrow(run, RAW_SCHEMA)


def _open(uri: str):
    if uri.startswith("file:"):
        return open(uri[len("file:"):], "rb")
    import fsspec

    return fsspec.open(uri, "rb").open()


def _key_ext(name: str) -> tuple[str, str]:
    """WebDataset convention: the key is the path up to the first dot of the basename."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), (ext.lower() if dot else "")


@dataclass
class _TarScan:
    """What one pass over a shard's headers found (:func:`_scan_tar`)."""

    groups: dict[str, dict[str, tarfile.TarInfo]] = field(default_factory=dict)
    small: dict[tuple[str, str], bytes] = field(default_factory=dict)  # caption/JSON bytes
    odd: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> reason, detail
    broken: list[dict] = field(default_factory=list)  # broken_tar rejects


def list_tar(uri: str, size: int, fp: str, mapping: dict[str, str],
             max_caption_chars: int = 65536) -> list[dict]:
    """The records of one shard (RAW_SCHEMA rows), never raising for bad data."""
    name = uri.rsplit("/", 1)[-1]
    caption_cap = caption_bytes(max_caption_chars)
    try:
        scan = _scan_tar(uri, size, fp, caption_cap)
    except (tarfile.TarError, EOFError, OSError) as exc:
        return [_reject(f"{name}#unreadable", uri, fp, "broken_tar",
                        f"{type(exc).__name__}: {exc}")]
    rows = [_record(key, members, scan, uri, size, fp, mapping, max_caption_chars)
            for key, members in scan.groups.items()]
    return rows + scan.broken


def _scan_tar(uri: str, size: int, fp: str, caption_cap: int) -> _TarScan:
    """Read the shard's member headers (never following a link, never extracting to
    disk) and its small caption/JSON members; a break midway, or data after the last
    member, adds a ``broken_tar`` reject. Raises when the shard cannot be opened."""
    name = uri.rsplit("/", 1)[-1]
    caps = {"txt": caption_cap, "json": SIDECAR_MAX_BYTES}
    scan = _TarScan()
    with _open(uri) as fh, tarfile.open(fileobj=fh, mode="r:") as tf:
        while True:
            try:
                member = tf.next()
            except (tarfile.TarError, EOFError, OSError) as exc:
                if tf.offset >= size:
                    break  # the last member runs past the end: rejected as truncated
                scan.broken.append(_reject(f"{name}#broken@{tf.offset}", uri, fp,
                                           "broken_tar", f"{type(exc).__name__}: {exc}"))
                break
            if member is None:
                break
            _add_member(scan, tf, member, size, caps)
        end = tf.offset
        if end < size:
            fh.seek(end)
            tail = fh.read(min(size - end, 1 << 16))
            if tail.strip(b"\0"):
                scan.broken.append(_reject(f"{name}#broken@{end}", uri, fp, "broken_tar",
                                           f"unreadable data after byte {end}"))
    return scan


def _add_member(scan: _TarScan, tf: tarfile.TarFile, member: tarfile.TarInfo, size: int,
                caps: dict[str, int]) -> None:
    """File `member` under its key: a link or special member marks the key odd, a
    caption/JSON member within its cap (and the file) is read, one over it marks the key."""
    if member.isdir():
        return
    key, ext = _key_ext(member.name)
    if not member.isfile():
        scan.groups.setdefault(key, {})
        scan.odd.setdefault(key, (
            ("symlink", f"member {member.name!r} is a link, not followed")
            if member.issym() or member.islnk() else
            ("not_a_file", f"member {member.name!r} is a device or FIFO")))
        return
    scan.groups.setdefault(key, {}).setdefault(ext, member)
    if ext in caps and member.offset_data + member.size <= size:
        if member.size <= caps[ext]:
            scan.small[(key, ext)] = tf.extractfile(member).read()
        else:
            scan.odd.setdefault(key, (
                "caption_too_long" if ext == "txt" else "invalid_sidecar",
                f"member {member.name!r}: {member.size} bytes, over {caps[ext]}"))


def _record(key: str, members: dict[str, tarfile.TarInfo], scan: _TarScan, uri: str,
            size: int, fp: str, mapping: dict[str, str], max_caption_chars: int) -> dict:
    """The RAW_SCHEMA row of one key: its sidecar fields and caption, then the first
    reason to reject it (an odd member, no image, an image past the end of the file)."""
    name = uri.rsplit("/", 1)[-1]
    image_ext = next((e for e in IMAGE_EXTS if e in members), None)
    fields, bad, detail = _sidecar_fields(key, scan.small, mapping, max_caption_chars)
    meta = json.loads(fields["metadata_json"]) if fields["metadata_json"] else {}
    meta["tar_members"] = sorted(m.name for m in members.values())
    if key in scan.odd:  # a link or special member, an oversized sidecar: before all else
        bad, detail = scan.odd[key]
        fields.update(caption_original=None, read_status="ok", read_reason=None)
    elif image_ext is None:
        bad = "missing_image"
    elif members[image_ext].offset_data + members[image_ext].size > size:
        bad = "truncated"
        detail = f"{members[image_ext].name} runs past the end of {name}"
    if detail is not None:
        meta["reject_detail"] = detail
    fields["metadata_json"] = json.dumps(meta, sort_keys=True)
    if bad is not None and fields["read_status"] == "ok":
        fields.update(read_status="rejected", read_reason=bad)
    img = members.get(image_ext) if image_ext else None
    return raw_row(
        source_key=key, source_uri=uri, **fields,
        image_ref=uri if img is not None else None,
        image_offset=img.offset_data if img is not None else None,
        image_length=img.size if img is not None else None,
        fingerprint=fp,
    )


def _sidecar_fields(key: str, small: dict[tuple[str, str], bytes], mapping: dict[str, str],
                    max_caption_chars: int) -> tuple[dict, str | None, str | None]:
    """The key's fields mapped from its ``.json`` member, with its ``.txt`` caption; and
    the reason (and detail) a bad sidecar or caption rejects it with, if any."""
    record: dict = {}
    bad, detail = None, None
    if (key, "json") in small:
        parsed = parse_json_object(small[(key, "json")])
        if isinstance(parsed, RecordError):
            bad, detail = "invalid_sidecar", parsed.detail
        else:
            record = parsed
    fields = map_fields(record, mapping, max_caption_chars=max_caption_chars)
    if (key, "txt") in small:
        text = text_caption(small[(key, "txt")], max_caption_chars)
        if isinstance(text, RecordError):
            if bad is None:
                bad, detail = text.reason, text.detail
        elif text:
            if fields["read_reason"] in CAPTION_REASONS:
                fields.update(read_status="ok", read_reason=None)
            fields["caption_original"] = text
    return fields, bad, detail


def _reject(key: str, uri: str, fp: str, reason: str, detail: str) -> dict:
    return raw_row(source_key=key, source_uri=uri, read_status="rejected",
                   read_reason=reason, fingerprint=fp,
                   metadata_json=json.dumps({"detail": detail}))
