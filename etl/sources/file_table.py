"""`table`: parquet, JSONL or CSV files (a file, a folder or a glob) whose rows carry
either embedded image bytes (`image:`) or an image reference (`url:` — a local path,
relative to the table's folder, `file://`, `http(s)://`, `s3://`…), plus caption,
licence and upstream-flag columns. This covers Hugging Face datasets exported to
parquet (`image: image.bytes`) and LAION/DataComp-style URL lists. Which references a
list may name is the source's to say (`allow_local`, `url_schemes`) and is enforced
when they are fetched (:func:`udfs.fetch.rules_for`); here they are only resolved.

``columns:`` maps common fields to source columns, e.g.
``{key: id, url: url, caption: caption, nsfw: NSFW, watermark: pwatermark}``. Every
column not mapped (and not binary) is kept as JSON in `metadata_json`.

A parquet file's embedded images are not carried by the listing: each record names
its image by file and row (``image_ref``, ``image_offset``), read again where it is
prepared (:mod:`udfs.fetch_table`); JSONL and CSV rows carry theirs. A file whose size
and mtime are unchanged since curate last read it is not opened at all
(:meth:`TableSource.containers`, :mod:`etl.lakehouse.curate_state`).

Files are read in Spark tasks with pyarrow — parquet one row group at a time — so a
bad part becomes rejects instead of a failed job: an unreadable row group rejects its
rows (`unreadable_row_group`, the count comes from the footer), an unreadable file is
one `unreadable_file` reject, a JSONL line that is not a JSON object (or is nested
deeper than :data:`etl.sources.records.MAX_JSON_DEPTH`, or longer than
:data:`MAX_LINE_BYTES`) or a CSV row with the wrong number of fields is
`malformed_row`: that one record, the rows beside it are read. A relative reference is
resolved against the table's folder and must stay inside it (`outside_source`; a link
on the way is judged by the source's ``follow_symlinks``). A file found by listing a
folder or a glob that is a link or a special file is not opened: one `unreadable_file`
reject whose detail says why (`symlink: …`, `not_a_file: …`; see
:mod:`etl.sources.listing`), and, as for any unreadable file, the source removes
nothing that run.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import os
import posixpath
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from etl.config import ConfigError, SourceConfig
from etl.config.bounds import DRIVER_IDS, DRIVER_READ_BYTES, DRIVER_REF_BYTES
from etl.sources.base import FLAG_KEYS, SourceAdapter, is_local_path, require_exists
from etl.sources.listing import expand_pattern, fingerprint, is_pattern, listing_digest
from etl.sources.records import (
    MISSING,
    RAW_ARROW_SCHEMA,
    RAW_SCHEMA,
    RecordError,
    lookup,
    map_fields,
    parse_json,
    raw_row,
)
from udfs.fetch_local import open_regular

__all__ = ["TableSource", "map_table_rows", "TABLE_MAPPABLE", "RowLimits", "MAX_LINE_BYTES"]

# The longest JSONL line read as a record (longer: malformed_row, the rest of the file
# still read) and the CSV reader's block (a row must fit in one).
MAX_LINE_BYTES = 64 << 20
_CSV_BLOCK = 64 << 20


@dataclass(frozen=True)
class RowLimits:
    """A source's rules for its rows' contents (shipped to the tasks)."""

    max_caption_chars: int = 65536
    follow_symlinks: bool | str = False

    @classmethod
    def of(cls, source: SourceConfig) -> RowLimits:
        return cls(source.max_caption_chars, source.follow_symlinks)

_FORMATS = ("parquet", "jsonl", "json", "csv")
_EXT_FORMAT = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl",
               ".ndjson": "jsonl", ".csv": "csv"}
TABLE_MAPPABLE = frozenset({"key", "image", "url", "caption", "license"}) | FLAG_KEYS


def validate_table_mapping(kind: str, source: SourceConfig, where: str) -> None:
    cols = source.columns
    if "key" not in cols:
        raise ConfigError(f"{where}.columns.key: required for kind {kind!r}")
    if ("image" in cols) == ("url" in cols):
        raise ConfigError(
            f"{where}.columns: map exactly one of 'image' (embedded bytes) or 'url' "
            f"(an image reference) for kind {kind!r}"
        )


def check_mapped_columns(source: SourceConfig, names: Iterable[str], what: str,
                         where: str | None = None) -> None:
    names = list(names)
    for field_name, column in sorted(source.columns.items()):
        if column.split(".", 1)[0] not in names:
            at = f"{where}; " if where else ""
            raise ConfigError(
                f"source {source.name!r}: columns.{field_name} maps to {column!r}, "
                f"which the {what} lacks ({at}its columns: {', '.join(names)})"
            )


class TableSource(SourceAdapter):
    kind = "table"
    mappable = TABLE_MAPPABLE
    remembered_containers = True

    def validate_config(self, source: SourceConfig, where: str) -> None:
        super().validate_config(source, where)
        validate_table_mapping(self.kind, source, where)
        if source.format is not None and source.format not in _FORMATS:
            raise ConfigError(
                f"{where}.format: {source.format!r} is not one of {', '.join(_FORMATS)}"
            )

    def _files(self, source: SourceConfig
               ) -> list[tuple[str, str, str | None, str | None, int]]:
        """(uri, format, problem, problem detail, size in bytes) of each data file."""
        files = []
        for f in expand_pattern(source.path, source.follow_symlinks):
            fmt = _format(f.uri, source)
            if fmt is None:
                continue  # _SUCCESS, README… next to the data files
            files.append((f.uri, fmt, *(f.problem or (None, None)), f.size))
        return files

    def listing_digest(self, source: SourceConfig) -> str | None:
        return listing_digest(expand_pattern(source.path, source.follow_symlinks))

    def names_rows(self, source: SourceConfig) -> bool:
        return "image" in source.columns

    def containers(self, source: SourceConfig) -> dict[str, str] | None:
        """Each readable data file -> its size and mtime, for a table whose rows embed
        their images (every record's ``source_uri`` is its file). A URL list's records
        are known by their URLs, not their file: None, read in full each run."""
        if "image" not in source.columns:
            return None
        return {f.uri: fingerprint(f) for f in expand_pattern(source.path,
                                                              source.follow_symlinks)
                if f.problem is None and _format(f.uri, source) is not None}

    def check_inputs(self, source: SourceConfig) -> None:
        pattern = is_pattern(source.path)
        if not pattern:  # a pattern is judged by what it matches
            require_exists(source)
        files = self._files(source)
        if not files:
            holds = "matches" if pattern else "holds"
            raise ConfigError(
                f"source {source.name!r}: path {source.path!r} {holds} no parquet, JSONL or "
                "CSV file (field sources[].path; set `format:` for other extensions)"
            )
        if not is_local_path(source.path):
            return
        readable = [f for f in files if f[2] is None]
        if not readable:
            return  # every file is a reject at read time
        uri, fmt = readable[0][:2]
        path = uri[len("file:"):]
        names = _peek_columns(path, fmt)
        if names is not None:
            check_mapped_columns(source, names, "table", os.path.basename(path))

    def lists_in_driver(self, source: SourceConfig,
                        skip: frozenset[str] = frozenset()) -> bool:
        left = [f for f in self._files(source) if f[0] not in skip]
        return (bool(skip) and not left) or _read_in_driver(left)

    def hints_records(self, source: SourceConfig) -> bool:
        return "image" in source.columns and is_local_path(source.path)

    def records_hint(self, source: SourceConfig,
                     skip: frozenset[str] = frozenset()) -> int | None:
        if not self.hints_records(source):
            return None
        files = [f for f in self._files(source) if f[0] not in skip]
        if not all(f[0].startswith("file:") and f[1] == "parquet" and f[2] is None
                   for f in files):
            return None
        return sum(_footer_rows(f[0]) for f in files)

    def read_arrow(self, source: SourceConfig, skip: frozenset[str] = frozenset()
                   ) -> pa.Table:
        return _read_in_process([f for f in self._files(source) if f[0] not in skip], source)

    def read(
        self, spark: SparkSession, source: SourceConfig, skip: frozenset[str] = frozenset(),
        version: int | None = None,
    ) -> DataFrame:
        files = [f for f in self._files(source) if f[0] not in skip]
        if _read_in_driver(files):
            # A small local table (a URL list): read here by the same function, handed
            # to Spark as local data -- no Spark job and no Python worker to list it.
            return spark.createDataFrame(_read_in_process(files, source), RAW_SCHEMA)
        units = [f[:4] for f in files]  # what `_read_unit` reads of each file
        return spark.createDataFrame(
            units, ", ".join(f"{n} string" for n in _UNIT_FIELDS)
        ).mapInArrow(functools.partial(_read_units, mapping=dict(source.columns),
                                       limits=RowLimits.of(source)), RAW_SCHEMA)


def _format(uri: str, source: SourceConfig) -> str | None:
    """The format a data file is read as; None for a file that is not one."""
    fmt = source.format or _EXT_FORMAT.get(os.path.splitext(uri)[1].lower())
    return "jsonl" if fmt == "json" else fmt


def _read_unit(uri: str, fmt: str, problem: str | None, problem_detail: str | None,
               mapping: dict[str, str], limits: RowLimits) -> Iterator[pa.RecordBatch]:
    """The rows of one data file (a :data:`_UNIT_FIELDS` row), as RAW_SCHEMA batches."""
    if problem is not None:  # never opened
        # A file not read: its records are unknown, so (as for any unreadable file) the
        # source removes nothing this run.
        name = uri.rsplit("/", 1)[-1]
        yield pa.RecordBatch.from_pylist(
            [_reject(f"{name}#unreadable", uri, "unreadable_file",
                     f"{problem}: {problem_detail}")], schema=RAW_ARROW_SCHEMA)
        return
    for rows in _read_file(uri, fmt, mapping, limits):
        if rows:
            yield pa.RecordBatch.from_pylist(rows, schema=RAW_ARROW_SCHEMA)


def _read_units(batches: Iterator[pa.RecordBatch], mapping: dict[str, str],
                limits: RowLimits) -> Iterator[pa.RecordBatch]:
    """A Spark task's :func:`_read_unit` over the :data:`_UNIT_FIELDS` rows it is given."""
    for batch in batches:
        for unit in batch.to_pylist():
            yield from _read_unit(*(unit[n] for n in _UNIT_FIELDS), mapping, limits)


def _read_in_process(files: list[tuple], source: SourceConfig) -> pa.Table:
    """Every row of `files`, read in this process (RAW_SCHEMA, as Arrow)."""
    mapping, limits = dict(source.columns), RowLimits.of(source)
    return pa.Table.from_batches(
        [b for f in files for b in _read_unit(*f[:4], mapping, limits)],
        schema=RAW_ARROW_SCHEMA)


# The columns of the file list `_read_units` reads (one row per data file).
_UNIT_FIELDS = ("uri", "format", "problem", "problem_detail")


def _read_in_driver(files: list[tuple]) -> bool:
    """Whether a table's files are read on the driver: all local, the JSONL and CSV
    files together within :data:`~etl.config.bounds.DRIVER_READ_BYTES`, the parquet
    files (listed by reference: no image carried) within
    :data:`~etl.config.bounds.DRIVER_REF_BYTES` and, by their footers, at most
    :data:`~etl.config.bounds.DRIVER_IDS` rows (a listing is Python work per row: a
    long URL list is faster in Spark's tasks, one per core)."""
    if not files or not all(f[0].startswith("file:") for f in files):
        return False
    parquet = [f for f in files if f[1] == "parquet" and f[2] is None]
    refs = sum(f[4] for f in parquet)
    if refs > DRIVER_REF_BYTES or sum(f[4] for f in files) - refs > DRIVER_READ_BYTES:
        return False
    return sum(_footer_rows(f[0]) for f in parquet) <= DRIVER_IDS


def _footer_rows(uri: str) -> int:
    """A local parquet file's rows by its footer; 0 when it cannot say (its read
    rejects it, as in the tasks)."""
    import pyarrow.parquet as pq

    try:
        with _open(uri) as fh:
            return pq.ParquetFile(fh).metadata.num_rows
    except (OSError, ValueError, pa.ArrowException):
        return 0


def _peek_columns(path: str, fmt: str) -> list[str] | None:
    """The columns of a local table file, read on the driver to check the mapping;
    None when the file cannot say (it becomes a reject at read time, not an error)."""
    try:
        with open_regular(path) as fh:
            if fmt == "parquet":
                import pyarrow.parquet as pq

                return list(pq.read_schema(fh).names)
            if fmt == "csv":
                head = fh.readline(MAX_LINE_BYTES)
                return next(csv.reader(io.StringIO(head.decode("utf-8"))), [])
            names: dict[str, None] = {}
            for _, line in zip(range(100), _lines(fh), strict=False):
                obj = None if isinstance(line, RecordError) else parse_json(line)
                if isinstance(obj, dict):
                    names.update(dict.fromkeys(obj))
            return list(names)
    except (OSError, ValueError, pa.ArrowException, csv.Error):
        return None


def _lines(fh) -> Iterator[bytes | RecordError]:
    """The lines of a binary stream, each at most MAX_LINE_BYTES (a longer one is a
    RecordError, its rest skipped without holding it in memory)."""
    while True:
        line = fh.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while True:
                rest = fh.readline(1 << 20)
                if not rest or rest.endswith(b"\n"):
                    break
            yield RecordError("malformed_row", f"a line over {MAX_LINE_BYTES} bytes")
            continue
        yield line


def _local(uri: str) -> str:
    return uri[len("file:"):] if uri.startswith("file:") else uri


def _open(uri: str, mode: str = "rb"):
    if uri.startswith("file:"):
        return open_regular(_local(uri))
    import fsspec

    return fsspec.open(uri, mode).open()


def _read_file(uri: str, fmt: str, mapping: dict[str, str],
               limits: RowLimits = RowLimits()) -> Iterator[list[dict]]:
    base = uri.rsplit("/", 1)[0]
    name = uri.rsplit("/", 1)[-1]
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(_open(uri))
            start = 0
            for i in range(pf.num_row_groups):
                n = pf.metadata.row_group(i).num_rows
                try:
                    records = pf.read_row_group(i).to_pylist()
                except Exception as exc:  # noqa: BLE001 - any decode error rejects the group
                    yield [_reject(f"{name}#rg{i}/row{j}", uri, "unreadable_row_group",
                                   f"{type(exc).__name__}: {exc}") for j in range(n)]
                else:
                    yield map_table_rows(records, mapping, uri, base, start, limits,
                                         by_reference=True)
                start += n
        elif fmt == "jsonl":
            records, bad = [], []
            with _open(uri) as fh:
                for lineno, raw in enumerate(_lines(fh), 1):
                    if isinstance(raw, bytes) and not raw.strip():
                        continue
                    obj = raw if isinstance(raw, RecordError) else parse_json(raw)
                    if isinstance(obj, dict):
                        records.append((lineno, obj))
                    else:
                        why = obj.detail if isinstance(obj, RecordError) else \
                            f"a JSON {type(obj).__name__}"
                        bad.append(_reject(f"{name}#line{lineno}", uri, "malformed_row",
                                           f"not a JSON object: {why}"))
            yield [row for lineno, rec in records
                   for row in map_table_rows([rec], mapping, uri, base, lineno, limits)] + bad
        else:
            import pyarrow.csv as pcsv

            bad = []

            def on_invalid(row) -> str:
                bad.append(_reject(f"{name}#row{row.number}", uri, "malformed_row",
                                   f"{row.actual_columns} fields, expected "
                                   f"{row.expected_columns}: {row.text[:200]}"))
                return "skip"

            with _open(uri) as fh:
                table = pcsv.read_csv(
                    fh,
                    read_options=pcsv.ReadOptions(block_size=_CSV_BLOCK, use_threads=False),
                    parse_options=pcsv.ParseOptions(invalid_row_handler=on_invalid),
                    convert_options=pcsv.ConvertOptions(strings_can_be_null=True),
                )
            yield map_table_rows(table.to_pylist(), mapping, uri, base, 0, limits) + bad
    except Exception as exc:  # noqa: BLE001 - the file is this record's outcome
        yield [_reject(f"{name}#unreadable", uri, "unreadable_file",
                       f"{type(exc).__name__}: {exc}")]


def _resolve_ref(ref: Any, base: str, limits: RowLimits) -> str | RecordError | None:
    """The reference a row names: absolute ones as written (the source's `allow_local`
    and `url_schemes` judge them when fetched), a relative one resolved against the
    table's own folder `base` -- and kept inside it."""
    if not isinstance(ref, str) or not ref.strip():
        return None
    ref = ref.strip()
    if "://" in ref or ref.startswith("file:") or os.path.isabs(ref):
        return ref
    rel = posixpath.normpath(ref)
    if rel == ".." or rel.startswith("../"):
        return RecordError("outside_source", "a relative path that leads out of the "
                           "table's folder")
    if not base.startswith("file:"):
        return f"{base}/{rel}"  # an object store: no links
    folder = base[len("file:"):]
    path = os.path.join(folder, rel)
    if limits.follow_symlinks != "anywhere":
        top = os.path.realpath(folder)
        real = os.path.realpath(path)
        if real != os.path.join(top, rel):  # a link on the way
            if limits.follow_symlinks is False:
                return RecordError("symlink", "a relative path through a symbolic link "
                                   "(the source's follow_symlinks is off)")
            if not real.startswith(top.rstrip(os.sep) + os.sep):
                return RecordError("outside_source", "a relative path whose symbolic "
                                   "link leads out of the table's folder")
    return path  # a path, read as written


def map_table_rows(records: list[Mapping[str, Any]], mapping: Mapping[str, str], uri: str,
                   base: str, start: int, limits: RowLimits = RowLimits(), *,
                   by_reference: bool = False) -> list[dict]:
    """RAW_SCHEMA rows for table records (row numbers from `start`, for keyless rows).
    `by_reference`: an embedded image is not carried but named by its file and row
    number (``image_ref`` = `uri`, ``image_offset`` = the row: a parquet file's rows,
    read again by :func:`udfs.fetch_table.read_table_row` where they are prepared)."""
    out = []
    name = uri.rsplit("/", 1)[-1]
    for i, rec in enumerate(records):
        fields = map_fields(rec, mapping, max_caption_chars=limits.max_caption_chars)
        key = lookup(rec, mapping["key"])
        status, reason = fields.pop("read_status"), fields.pop("read_reason")
        image = ref = offset = None
        if "image" in mapping:
            image = lookup(rec, mapping["image"])
            if isinstance(image, str):
                image = image.encode("latin-1", errors="replace")
            image = bytes(image) if isinstance(image, (bytes, bytearray, memoryview)) else None
            if by_reference and image is not None:
                image, ref, offset = None, uri, start + i
        else:
            ref = _resolve_ref(lookup(rec, mapping["url"]), base, limits)
        if key is MISSING or key is None or (isinstance(key, str) and not key.strip()):
            key, status, reason = f"null-key:{name}#{start + i}", "rejected", "missing_key"
        elif isinstance(ref, RecordError):
            if status == "ok":
                status, reason = "rejected", ref.reason
                fields["metadata_json"] = json.dumps({"detail": ref.detail})
        elif image is None and ref is None:
            status, reason = "rejected", "missing_image"
        if isinstance(ref, RecordError):
            ref = None
        out.append(raw_row(
            source_key=str(key),
            source_uri=ref if ref is not None and "://" in ref else uri,
            **fields, read_status=status, read_reason=reason,
            image_bytes=image, image_ref=ref, image_offset=offset,
        ))
    return out


def _reject(key: str, uri: str, reason: str, detail: str) -> dict:
    return raw_row(source_key=key, source_uri=uri, read_status="rejected",
                   read_reason=reason, metadata_json=json.dumps({"detail": detail}))
