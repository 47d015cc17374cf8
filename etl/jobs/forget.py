"""Forget: a takedown request (an opt-out, a licence withdrawn, a legal request) takes
every record it names out of every table, for good.

The request names records by sample id, source key (``SOURCE:KEY``), image URL or image
hash (sha256 of the source file or of the stored JPEG), given as arguments or in a
file. The job:

1. **matches** them against the manifest and the curated table
   (:func:`etl.transforms.bronze.match_takedowns`) and collects every identifier of
   each matched record -- its sample id, its own URL, both image hashes;
2. **records** the request (who, when, why, as given) and those identifiers in the
   Delta ``takedowns`` table, in one commit: from then on curate refuses any record
   they name, however it is called (a re-upload of the same bytes stays out);
3. **removes** the records from the curated table, the rejects and the manifest
   (:func:`etl.lakehouse.maintenance.remove_records`), re-elects the canonical members
   of the duplicate clusters they were in, counts them in the accounting;
4. **purges** their bytes: rewrites the curated fragments that held them and deletes
   the versions before that after ``lakehouse.takedown_retention_hours`` (at once by
   default), and removes their thumbnails from run reports;
5. marks the request applied, and says when the bytes are gone and which exports still
   hold the rows until they are exported again.

A request recorded but not applied (a run that died in step 3 or 4) is finished by the
next ``forget`` or nightly curate. Runs under the run lock, in the run ledger.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl import storage, tables
from etl.config import Config
from etl.errors import ConfigError
from etl.lakehouse.dedup_table import DedupTable
from etl.lakehouse.maintenance import (
    PurgeResult,
    current_version,
    mark_applied,
    remove_taken_down,
    run_due_purges,
    table_versions,
)
from etl.report import scrub_reports
from etl.runtime.faults import fault_point
from etl.runtime.options import flag, options_from
from etl.runtime.stage import Metrics, RunContext, StageDetail, StageResult
from etl.schema import TAKEDOWNS_SCHEMA, sample_id_of
from etl.transforms.accounting import removal_rows
from etl.transforms.bronze import (
    match_takedowns,
    matched_identifiers,
)
from etl.writers.delta import (
    merge_accounting,
    record_takedowns,
)
from etl.writers.lance import lance_reader
from etl.writers.mds import read_manifest

__all__ = [
    "Identifier",
    "TakedownRequest",
    "ForgetResult",
    "parse_identifier",
    "parse_request",
    "forget",
    "format_forget",
    "ForgetOptions",
    "stage",
    "check",
    "render",
]

log = logging.getLogger(__name__)

# What a request may name, as typed on the command line / in a file -> table kind.
KINDS = {"sample-id": "sample_id", "key": "key", "url": "url", "image-sha256": "image_sha256"}
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SOURCE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}$")
_SHOWN = 50  # matches a dry run lists
_REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/#-]{0,199}$")


@dataclass(frozen=True)
class Identifier:
    kind: str  # sample_id | key | url | image_sha256
    value: str  # as normalised (hashes lower case; a key as SOURCE:KEY)
    sample_id: str | None = None  # of a key
    source: str | None = None  # of a key


@dataclass(frozen=True)
class TakedownRequest:
    request_id: str | None  # None: the run id
    requested_by: str
    reason: str
    identifiers: tuple[Identifier, ...]


@dataclass(frozen=True)
class ForgetResult(StageDetail):
    request_id: str
    identifiers: int
    dry_run: bool
    # Records named (any manifest status, or in the curated table): (sample_id, source).
    matched: tuple[tuple[str, str], ...]
    # Removed now, by source, table left and reason (accounting rows).
    counts: tuple[dict, ...] = ()
    curated_deleted: int = 0
    curated_version: int | None = None
    purge: PurgeResult | None = None
    dedup_changed: int = 0
    stale_exports: tuple[str, ...] = ()
    thumbnails_removed: int = 0
    pending_finished: int = 0  # identifiers of earlier requests applied by this run
    notes: list[str] = field(default_factory=list)

    @property
    def removed(self) -> int:
        return sum(c["count"] for c in self.counts)

    def removed_from(self, table: str) -> int:
        return sum(c["count"] for c in self.counts if c["stage"] == table)


# ------------------------------------------------------------------------ the request


def parse_identifier(kind: str, raw: str, where: str, *, echo: bool = True) -> Identifier:
    """One identifier, checked; ConfigError naming `where` (an argument or a file line).
    `echo`: quote the value in the error (an argument typed); a line of a file is named
    by its number only, never quoted (the file could be anything, /etc/shadow too)."""
    def shown(value: str) -> str:
        return f"{value!r}" if echo else "the value"

    kind = kind.strip().lower().replace("_", "-")
    if kind not in KINDS:
        if echo:
            raise ConfigError(f"{where}: {kind!r} is not one of {', '.join(KINDS)}")
        raise ConfigError(f"{where}: the line does not start with a kind (one of "
                          f"{', '.join(KINDS)})")
    value = raw.strip()
    if not value:
        raise ConfigError(f"{where}: empty {kind}")
    if kind == "sample-id":
        if not _HEX32.fullmatch(value.lower()):
            raise ConfigError(f"{where}: {shown(value)} is not a sample id (32 hex digits)")
        return Identifier("sample_id", value.lower())
    if kind == "image-sha256":
        if not _HEX64.fullmatch(value.lower()):
            raise ConfigError(f"{where}: {shown(value)} is not a sha256 (64 hex digits)")
        return Identifier("image_sha256", value.lower())
    if kind == "url":
        if any(ch.isspace() for ch in value):
            raise ConfigError(f"{where}: {shown(value)}: a URL has no whitespace")
        return Identifier("url", value)
    source, sep, key = value.partition(":")
    if not sep or not _SOURCE.fullmatch(source) or not key.strip():
        raise ConfigError(f"{where}: {shown(value)} is not SOURCE:KEY (a source name, a "
                          "colon, the record's key in that source)")
    key = key.strip()
    return Identifier("key", f"{source}:{key}", sample_id_of(source, key), source)


_MAX_FILE_BYTES = 64 << 20


def _read_file(path: str) -> list[Identifier]:
    """``KIND VALUE`` per line (`#` comments and blank lines skipped). Errors name the
    file and the line number, and quote nothing from the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block us
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"forget --file {path}: not a regular file")
            if st.st_size > _MAX_FILE_BYTES:
                raise ConfigError(f"forget --file {path}: over {_MAX_FILE_BYTES} bytes")
            lines = fh.read().decode("utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"forget --file {path}: {exc.strerror or type(exc).__name__}"
                          ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"forget --file {path}: not UTF-8 text") from None
    out = []
    for no, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        kind, _, value = text.partition(" ")
        out.append(parse_identifier(kind, value, f"forget --file {path} line {no}",
                                    echo=False))
    return out


def parse_request(options: ForgetOptions | Mapping[str, Any]) -> TakedownRequest:
    """The request a `lakeshard forget` names (its options, or a mapping of their fields):
    every identifier checked, before Spark starts."""
    if not isinstance(options, ForgetOptions):
        options = options_from(ForgetOptions, options)
    ids: list[Identifier] = []
    for values, kind in ((options.sample_ids, "sample-id"), (options.keys, "key"),
                         (options.urls, "url"), (options.hashes, "image-sha256")):
        for raw in values:
            ids.append(parse_identifier(kind, raw, f"forget --{kind}"))
    if options.file:
        ids += _read_file(options.file)
    if not ids:
        raise ConfigError("forget: name at least one record (--sample-id, --key, --url, "
                          "--image-sha256 or --file)")
    by, why = (options.by or "").strip(), (options.reason or "").strip()
    if not by or not why:
        raise ConfigError("forget: --by (who asked) and --reason (why) are recorded with "
                          "the request and are required")
    request_id = options.request_id
    if request_id is not None and not _REQUEST_ID.fullmatch(request_id):
        raise ConfigError(f"forget --request-id: {request_id!r} is not a valid id "
                          "(letters, digits and . _ : / # -, up to 200)")
    return TakedownRequest(request_id, by, why, tuple(dict.fromkeys(ids)))


def check(cfg: Config, ctx: RunContext) -> None:
    """Before Spark: the request parses (identifiers, who, why)."""
    parse_request(ctx.options_for(ForgetOptions))


# ------------------------------------------------------------------------------- job


def _given(spark: SparkSession, request: TakedownRequest, request_id: str) -> DataFrame:
    """``request_id, kind, value`` to match: a key by its sample id."""
    rows = [(request_id, "sample_id" if i.kind == "key" else i.kind,
             i.sample_id if i.kind == "key" else i.value) for i in request.identifiers]
    return spark.createDataFrame(rows, "request_id string, kind string, value string")


def _rows(spark: SparkSession, request: TakedownRequest, request_id: str, run_id: str,
          now: datetime, derived: DataFrame) -> DataFrame:
    """The takedowns rows of the request: as given, and every matched identifier."""
    given = spark.createDataFrame(
        [(i.kind, i.value, "given", i.sample_id, i.source) for i in request.identifiers],
        "kind string, value string, origin string, sample_id string, source string",
    )
    found = derived.select("kind", "value", F.lit("matched").alias("origin"), "sample_id",
                           "source")
    meta = {
        "request_id": F.lit(request_id), "requested_at": F.lit(now),
        "requested_by": F.lit(request.requested_by),
        "request_reason": F.lit(request.reason), "run_id": F.lit(run_id),
    }
    out = given.unionByName(found).withColumns(meta)
    for f in TAKEDOWNS_SCHEMA.fields:
        if f.name not in out.columns:
            out = out.withColumn(f.name, F.lit(None).cast(f.dataType))
    return out.select(*TAKEDOWNS_SCHEMA.fieldNames())


def _curated_hashes(spark: SparkSession, path: str) -> DataFrame | None:
    if not storage.lance_exists(path):
        return None
    return (lance_reader(spark).option("columns", "sample_id,source,image_sha256")
            .load(path))


def _rededup(spark: SparkSession, cfg: Config, run_id: str) -> int:
    """Re-elect the canonical members of clusters that lost rows, through the dedup
    job's own entry point (:meth:`DedupTable.update`); with settings changed since the
    last dedup, only the rows gone leave and the full run is left to the next dedup.
    Returns rows changed or removed (0 when dedup never ran)."""
    table = DedupTable(spark, cfg)
    if table.state() is None:
        return 0
    res = table.update(run_id, new_settings="defer")
    return res.changed + res.removed


def _stale_exports(cfg: Config, before: int | None) -> tuple[str, ...]:
    """Exports written from a curated version before the removal."""
    if before is None:
        return ()
    stale = []
    for name in cfg.exports:
        manifest = read_manifest(tables.export_path(cfg, name))
        if manifest is not None and int(manifest.get("table_version", -1)) <= before:
            stale.append(name)
    return tuple(stale)


def forget(spark: SparkSession, cfg: Config, run_id: str, request: TakedownRequest, *,
           dry_run: bool = False) -> ForgetResult:
    sc = spark.sparkContext
    paths = tables.layout(cfg)
    now = datetime.now(UTC).replace(tzinfo=None)
    request_id = request.request_id or run_id

    sc.setJobDescription("lakeshard forget: match the request")
    manifest = storage.read_delta(spark, paths.manifest)
    if manifest is not None:
        manifest = manifest.localCheckpoint(eager=True)
    curated = _curated_hashes(spark, paths.curated)
    matches = match_takedowns(_given(spark, request, request_id), manifest, curated
                              ).localCheckpoint(eager=True)
    matched = tuple(sorted((r.sample_id, r.source) for r in matches.collect()))
    if dry_run:
        return ForgetResult(request_id, len(request.identifiers), True, matched)

    sc.setJobDescription("lakeshard forget: record the request")
    derived = matched_identifiers(matches, manifest, curated)
    record_takedowns(spark, _rows(spark, request, request_id, run_id, now, derived),
                     paths.takedowns)
    fault_point("forget:recorded")

    # Every record a pending request names (this one, and any a dead run left).
    sc.setJobDescription("lakeshard forget: remove from every table")
    takedowns = spark.read.format("delta").load(paths.takedowns)
    pending = takedowns.where(F.col("applied_at").isNull())
    earlier = pending.where(F.col("request_id") != request_id).count()
    removal = None
    before = current_version(paths.curated) if curated is not None else None
    if manifest is not None:
        removal = remove_taken_down(spark, cfg, manifest, pending, run_id=run_id, now=now)
        if removal.counts:
            merge_accounting(spark, removal_rows(spark, removal.counts, run_id=run_id,
                                                 run_at=now), paths.accounting)
    fault_point("forget:removed")

    purge = removal.purge if removal is not None else None
    oldest = None
    if storage.lance_exists(paths.curated):
        run_due_purges(paths.curated, now)  # earlier removals whose retention has passed
        oldest = min(v.version for v in table_versions(paths.curated))
    dedup_changed = 0
    if removal is not None and removal.curated_deleted:
        # Last, at the version the table is left at: dedup then covers it.
        sc.setJobDescription("lakeshard forget: re-elect duplicate clusters")
        dedup_changed = _rededup(spark, cfg, run_id)

    sc.setJobDescription("lakeshard forget: mark the request applied")
    mark_applied(spark, paths.takedowns, removal, now=now, oldest_version=oldest)

    removed_ids = {sid for sid, _ in matched}
    thumbs = scrub_reports(cfg, removed_ids) if removed_ids else 0
    sc.setJobDescription(None)
    return ForgetResult(
        request_id, len(request.identifiers), False, matched,
        counts=removal.counts if removal else (),
        curated_deleted=removal.curated_deleted if removal else 0,
        curated_version=current_version(paths.curated) if curated is not None else None,
        purge=purge, dedup_changed=dedup_changed,
        stale_exports=_stale_exports(cfg, before) if removal and removal.curated_deleted
        else (),
        thumbnails_removed=thumbs, pending_finished=earlier,
    )


def format_forget(res: ForgetResult) -> str:
    """What `lakeshard forget` prints: what matched, what left which table, when the
    bytes are gone, what still holds them."""
    if res.dry_run:
        lines = [f"forget (dry run) {res.request_id}: {res.identifiers} identifier(s) match "
                 f"{len(res.matched)} record(s); nothing changed"]
        lines += [f"  {source:<20} {sid}" for sid, source in res.matched[:_SHOWN]]
        if len(res.matched) > _SHOWN:
            lines.append(f"  ... and {len(res.matched) - _SHOWN} more")
        return "\n".join(lines)
    lines = [
        f"takedown {res.request_id}: {res.identifiers} identifier(s) matched "
        f"{len(res.matched)} record(s); recorded in the takedowns table (later runs refuse "
        "them by key, URL and image hash)",
        f"removed         : {res.removed} record(s): {res.removed_from('curated')} from "
        f"the curated table, {res.removed_from('rejects')} from rejects; manifest rows "
        f"marked removed; dedup rows changed: {res.dedup_changed}",
    ]
    by_source: dict[str, int] = {}
    for c in res.counts:
        by_source[c["source"]] = by_source.get(c["source"], 0) + c["count"]
    if by_source:
        lines.append("by source       : " + ", ".join(f"{k}={v}" for k, v in
                                                     sorted(by_source.items())))
    if res.pending_finished:
        lines.append(f"also applied    : {res.pending_finished} identifier(s) of earlier "
                     "requests a run had left unapplied")
    p = res.purge
    if p is None:
        lines.append("image bytes     : no curated row held them")
    elif p.done:
        lines.append(f"image bytes     : gone from storage now ({p.fragments_rewritten} "
                     f"fragment(s) rewritten, {p.versions_removed} older version(s) "
                     f"deleted); curated versions before {p.version} can no longer be read")
    else:
        lines.append(f"image bytes     : out of the current version (fragments rewritten); "
                     f"versions before {p.version} still hold them until "
                     f"{p.due:%Y-%m-%d %H:%M} UTC, deleted by the first run, forget or "
                     "compact after that (lakehouse.takedown_retention_hours)")
    if res.thumbnails_removed:
        lines.append(f"reports         : {res.thumbnails_removed} thumbnail(s) removed")
    for name in res.stale_exports:
        lines.append(f"export {name:<9}: written before this takedown, still holds the "
                     f"rows until `lakeshard export --name {name}` (verify-export fails "
                     "until then)")
    return "\n".join(lines)


@dataclass(frozen=True)
class ForgetOptions:
    """`lakeshard forget`'s flags: the identifiers of a takedown request, who asked and
    why."""

    sample_ids: tuple[str, ...] = flag((), "a record's sample id (repeatable)",
                                       name="--sample-id", metavar="ID")
    keys: tuple[str, ...] = flag(
        (), "a record's key in a source, e.g. photos:2024/a.jpg (repeatable)",
        name="--key", metavar="SOURCE:KEY")
    urls: tuple[str, ...] = flag((), "the image's URL or file URI (repeatable)", name="--url")
    hashes: tuple[str, ...] = flag(
        (), "sha256 of the image file, or of the stored JPEG (repeatable)",
        name="--image-sha256", metavar="HASH")
    file: str | None = flag(None, "more identifiers, one `KIND VALUE` a line")
    by: str | None = flag(None, "who asked (recorded with the request)", required=True)
    reason: str | None = flag(None, "why (recorded with the request)", required=True)
    request_id: str | None = flag(
        None, "the request's id, e.g. a ticket number (default: the run id)")
    dry_run: bool = flag(False, "list what the request matches; change nothing")


def stage(spark: SparkSession, cfg: Config, ctx: RunContext) -> StageResult[ForgetResult]:
    """A takedown request out of every table (see the module docstring)."""
    opts = ctx.options_for(ForgetOptions)
    res = forget(spark, cfg, ctx.run_id, parse_request(opts), dry_run=opts.dry_run)
    removed_in: dict[str, int] = {}
    for c in res.counts:
        removed_in[c["source"]] = removed_in.get(c["source"], 0) + c["count"]
    outputs = Metrics({"matched": len(res.matched), "removed": res.removed}, by={
        "removed": {"curated": res.removed_from("curated"),
                    "rejects": res.removed_from("rejects")},
        "removed_in": removed_in})
    versions: dict[str, int] = {}
    if res.curated_version is not None:
        versions["lance:curated"] = res.curated_version
    td = storage.delta_version(spark, tables.layout(cfg).takedowns)
    if td is not None:
        versions["delta:takedowns"] = td
    note = "dry run" if res.dry_run else None
    if res.purge is not None and not res.purge.done:
        note = (f"bytes held by versions before {res.purge.version} until "
                f"{res.purge.due:%Y-%m-%d %H:%M} UTC")
    return StageResult(inputs={"identifiers": res.identifiers}, outputs=outputs,
                       table_versions=versions, note=note, detail=res)


def render(cfg: Config, opts: ForgetOptions, result: StageResult[ForgetResult]) -> str:
    """What `lakeshard forget` prints."""
    return format_forget(result.made())
