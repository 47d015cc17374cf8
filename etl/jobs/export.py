"""Export: the curated Lance table (pinned version) -> an MDS export.

Reads the table's small columns with each row's Lance address, chooses the rows and
columns (:mod:`etl.transforms.export`), and hands them to the partition-wise MDS writer
(:func:`etl.writers.mds.export_mds`), which takes image bytes and latents from Lance by
address inside each task and skips the work when an export with the same key exists.

Removed records are no longer in the table, so no export written after their removal
holds them; the manifest says how many rows removals took out (``removals``), and a row
a takedown names is left out even if a run died before deleting it from the table.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession

from etl import storage, tables
from etl.config import Config
from etl.config.bounds import DRIVER_WRITE_ROWS
from etl.errors import ConfigError
from etl.lakehouse.catalog import Catalog
from etl.lakehouse.dedup_table import DEDUP_CURATED_VERSION, DedupTable
from etl.lakehouse.derived import DerivedState
from etl.lakehouse.lance_changes import fragment_rows, read_schema, row_changes, rows_by_id
from etl.ledger import code_version
from etl.runtime.local import local_arrow
from etl.runtime.stage import Metrics, RunContext, StageDetail, StageResult
from etl.transforms.export import (
    export_columns,
    export_rows,
    ids_fingerprint,
    latent_export_columns,
)
from etl.writers.lance import ROW_ADDRESS, lance_reader, read_local_table
from etl.writers.mds import (
    BlobSource,
    ExportResult,
    ExportSettings,
    export_mds,
    exported_of,
    mds_encoding,
    part_members,
    plan_changes,
    read_manifest,
    row_fingerprint,
    warm_for,
)

__all__ = ["ExportRun", "export", "stage"]

log = logging.getLogger(__name__)


def _removals(spark: SparkSession, cfg: Config) -> dict:
    """Rows removals took out of the curated table (and so out of every export since):
    how many, by reason, and a fingerprint of their ids (so the export key changes)."""
    out: dict = {"removed": 0, "by_reason": {}, "fingerprint": 0}
    gone, by_reason = Catalog.of(spark, cfg).manifest.removed_from_curated()
    if by_reason:
        out.update(removed=sum(by_reason.values()), by_reason=dict(sorted(by_reason.items())),
                   fingerprint=ids_fingerprint(gone))
    return out


class _Memo:
    """What the last export of a name counted from the dedup table (rows exported,
    duplicates left out, their fingerprint) and from the manifest (rows removed), each
    keyed by the versions it was counted at (:mod:`etl.lakehouse.derived`): a Delta
    version pins its content, so the same versions give the same figures and a rerun
    needs no Spark job to know its export key."""

    def __init__(self, cfg: Config, name: str):
        base = f"{tables.layout(cfg).meta_dir}/exports/{name}"
        self._dedup = DerivedState(f"{base}.dedup.json", "export_dedup")
        self._removals = DerivedState(f"{base}.removals.json", "export_removals")
        self._key = DerivedState(f"{base}.key.json", "export_key")
        self._changes = DerivedState(f"{base}.changes.json", "export_changes")

    def since(self, key: dict) -> dict | None:
        """The versions and figures the export in place was written at (its key in
        `key`), for an increment from what changed since (:func:`_from_changes`)."""
        return self._changes.load(key)

    def save_since(self, key: dict | None, payload: dict | None) -> None:
        """After an export committed: what the next increment starts from; forgotten
        when the export cannot say (dedup not covering the rows)."""
        if key is None or payload is None:
            self._changes.clear()
        else:
            self._changes.save(key, payload)

    def export_key(self, inputs: dict | None) -> str | None:
        """The export key last committed from `inputs` (see :func:`_quiet_inputs`)."""
        kept = self._key.load(inputs) if inputs is not None else None
        return None if kept is None else kept.get("export_key")

    def save_key(self, inputs: dict | None, out_dir: str) -> None:
        """After the export committed: the key its manifest names, keyed by `inputs`."""
        written = read_manifest(out_dir) if inputs is not None else None
        if written is not None and written.get("export_key"):
            self._key.save(inputs, {"export_key": written["export_key"]})

    def dedup(self, inputs: dict) -> tuple[int, int, int] | None:
        """(expected, excluded_duplicates, duplicates_fingerprint) counted at `inputs`."""
        kept = self._dedup.load(inputs)
        try:
            return None if kept is None else (int(kept["expected"]),
                                              int(kept["excluded_duplicates"]),
                                              int(kept["duplicates_fingerprint"]))
        except (KeyError, TypeError, ValueError):
            return None

    def removals(self, manifest_version: int | None) -> dict | None:
        if manifest_version is None:
            return None
        kept = self._removals.load({"manifest_version": manifest_version})
        return None if kept is None else dict(kept)

    def save(self, inputs: dict | None, expected: int, dedup: dict,
             manifest_version: int | None, removals: dict) -> None:
        """After the export it describes committed."""
        if inputs is not None:
            self._dedup.save(inputs, {"expected": expected, **{
                k: dedup[k] for k in ("excluded_duplicates", "duplicates_fingerprint")}})
        if manifest_version is not None:
            self._removals.save({"manifest_version": manifest_version}, removals)


def _latents(name: str, exp, table, mapping: dict) -> dict[str, str]:
    """Precomputed text latents (default: none, computed online): their columns added
    to `mapping`, their encodings; every exported row must have them."""
    extra, encodings, required = latent_export_columns(exp, table.schema)
    for out in extra:
        if out in mapping:
            raise ConfigError(f"exports.{name}.latents: {out!r} is already exported")
    mapping.update(extra)
    missing_filter = " OR ".join(f"{c} IS NULL" for c in required)
    if exp.where:
        missing_filter = f"({exp.where}) AND ({missing_filter})"
    missing = table.count_rows(filter=missing_filter)
    if missing:
        raise ConfigError(
            f"exports.{name}.latents: {missing} exported row(s) have no latents "
            f"({' or '.join(required)} is null): run `lakeshard latents --encoder "
            "NAME` (rows whose caption failed to encode have latent_error_* set)"
        )
    return encodings


@dataclass(frozen=True)
class _Curated:
    """Step "read": the chosen rows' small columns and row addresses at the pinned
    version, read once (the counts, an incremental export's diff and the write all scan
    them)."""
    frame: DataFrame  # persisted
    held: pa.Table | None = None  # the same rows, when the driver read them


def _read_curated(spark: SparkSession, curated_path: str, version: int, columns: list[str],
                  where: str | None, held: bool) -> _Curated:
    """Up to `driver.ids` rows (`held`) are read on the driver, as local data."""
    if held:
        table, schema = read_local_table(curated_path, version, columns, where,
                                         row_address=True)
        return _Curated(spark.createDataFrame(table, schema).persist(
            StorageLevel.MEMORY_AND_DISK), table)
    reader = (lance_reader(spark).option("version", str(version))
              .option("columns", ",".join(columns)).option("row_address", "true"))
    if where:
        reader = reader.option("filter", where)
    return _Curated(reader.load(curated_path).persist(StorageLevel.MEMORY_AND_DISK))


def _held_without(held: pa.Table, ids: list[str]) -> pa.Table:
    """The rows the driver holds, but those of `ids`."""
    return held.filter(pc.invert(pc.is_in(held.column("sample_id"),
                                          pa.array(ids, pa.string()))))


def _dedup_lineage(spark: SparkSession, cfg: Config, exp, version: int, curated: _Curated,
                   matching: int, memo: _Memo
                   ) -> tuple[DataFrame | None, list[str] | None, int, dict, dict | None]:
    """Non-canonical duplicates stay in the table; the export leaves them out. Returns
    them (and their ids when the driver read them: [] for none), the rows left, the
    dedup part of the lineage and the memo's inputs. What was
    left out is lineage as content (not as a Delta version): an unchanged dedup result
    keeps the export key, so a rerun stays a no-op; excluded_duplicates are rows
    matching `where` left out (verify-export subtracts them)."""
    lineage: dict = {"include_duplicates": exp.include_duplicates}
    if exp.include_duplicates:
        return None, [], matching, lineage, None
    found = DedupTable(spark, cfg).non_canonical(version)
    if found is None:
        return None, [], matching, lineage, None
    duplicates, listed = found
    inputs = {"table_version": version, "where": exp.where,
              "dedup_version": storage.delta_version(spark, tables.layout(cfg).dedup)}
    known = memo.dedup(inputs)  # the same versions: the same figures, no table read
    if known is None and curated.held is not None and listed is not None:
        # Rows and duplicates both on the driver: counted here (no Spark job).
        expected = _held_without(curated.held, listed).num_rows
        known = (expected, matching - expected, ids_fingerprint(listed))
    elif known is None:
        expected = curated.frame.select("sample_id").join(duplicates, "sample_id",
                                                          "left_anti").count()
        known = (expected, matching - expected, ids_fingerprint(duplicates))
    expected, excluded, fingerprint = known
    lineage.update(excluded_duplicates=excluded, duplicates_fingerprint=fingerprint)
    return duplicates, listed, expected, lineage, inputs


def _exclude_taken_down(spark: SparkSession, cfg: Config, curated: DataFrame,
                        duplicates: DataFrame | None, expected: int, removals: dict
                        ) -> tuple[DataFrame | None, int]:
    """Rows a takedown names that are still in the table (a run died before deleting
    them; normally none): left out too. Returns every id left out and the rows left."""
    taken_down = Catalog.of(spark, cfg).takedowns.taken_down_ids()
    if taken_down is None or taken_down.isEmpty():
        return duplicates, expected
    kept = curated.select("sample_id")
    if duplicates is not None:
        kept = kept.join(duplicates, "sample_id", "left_anti")
    remaining = kept.join(taken_down, "sample_id", "left_anti").count()
    removals["excluded_taken_down"] = expected - remaining
    left_out = taken_down if duplicates is None else duplicates.unionByName(taken_down)
    return left_out, remaining


@dataclass(frozen=True)
class _Columns:
    """Step "choose columns": the pinned table and what the export takes from it."""
    table: Any  # the curated Lance dataset at the version exported
    mapping: dict[str, str]  # export field -> table column
    matching: int  # rows matching `where`
    encodings: dict[str, str]  # latent fields -> their MDS encodings
    fetched: dict[str, str]  # fields whose bytes each task reads from Lance by address
    small: list[str]  # the columns read through Spark
    identity: str | None  # a row's image in an incremental export's diff
    driver_ids: int  # the driver.ids bound (etl.config.bounds)

    @property
    def held(self) -> bool:
        """The rows' small columns are read on the driver (:func:`_read_curated`), and
        the export's diff and a small write are made there too (`held`)."""
        return self.matching <= self.driver_ids


def _columns(name: str, exp, table, driver_ids: int) -> _Columns:
    mapping = export_columns(exp, table.schema.names)
    try:
        matching = table.count_rows(filter=exp.where)
    except (ValueError, OSError) as exc:  # a predicate Lance can't parse
        raise ConfigError(f"exports.{name}.where: {exp.where!r}: {exc}") from None
    encodings = _latents(name, exp, table, mapping) if exp.latents else {}
    # Image bytes (and latents) don't travel through Spark: rows carry their Lance row
    # address and each export task takes the bytes from the pinned version (BlobSource).
    fetched = {out: src for out, src in mapping.items() if out == "image" or out in encodings}
    small = sorted({src for out, src in mapping.items() if out not in fetched})
    identity = ("image_sha256" if exp.incremental and "image_sha256" in table.schema.names
                else None)
    if identity and identity not in small:
        small.append(identity)
    return _Columns(table, mapping, matching, encodings, fetched, small, identity,
                    driver_ids)


@dataclass(frozen=True)
class _Chosen:
    """Step "choose rows": what the export leaves out, and the lineage that says so."""
    left_out: DataFrame | None  # non-canonical duplicates and taken-down rows
    left_out_ids: list[str] | None  # their ids, when the driver holds them all
    expected: int  # the samples the export must hold
    dedup: dict  # lineage: the dedup part
    removals: dict  # lineage: rows removals took out (and takedowns left out)
    memo: tuple  # what the memo keeps once the export committed


def _choose_rows(spark: SparkSession, cfg: Config, exp, cols: _Columns, curated: _Curated,
                 memo: _Memo) -> _Chosen:
    version = cols.table.version
    duplicates, listed, after_dedup, dedup, inputs = _dedup_lineage(
        spark, cfg, exp, version, curated, cols.matching, memo)
    # Rows removals took out, as of the manifest's version (the memo's when the same).
    manifest_version = Catalog.of(spark, cfg).manifest.version()
    removals = memo.removals(manifest_version) or _removals(spark, cfg)
    kept = dict(removals)  # takedowns are applied afresh each time
    left_out, expected = _exclude_taken_down(spark, cfg, curated.frame, duplicates,
                                             after_dedup, removals)
    left_out_ids = listed if left_out is duplicates else None  # no takedown applied
    return _Chosen(left_out, left_out_ids, expected, dedup, removals,
                   (inputs, after_dedup, dedup, manifest_version, kept))


def _settings(cfg: Config, name: str, exp, cols: _Columns, dedup: dict, removals: dict,
              held: bool) -> ExportSettings:
    """The writer's settings and the lineage that make the export key: the same from
    a full diff and from what changed, so that both name the same export."""
    paths, version = tables.layout(cfg), cols.table.version
    return ExportSettings(
        partitions=exp.partitions, size_limit=exp.size_limit, compression=exp.compression,
        hashes=exp.hashes, seed=exp.seed,
        manifest={"name": name, "table": paths.curated, "where": exp.where,
                  "sources": dict(cols.mapping)},
        # What changes with the table's content: an incremental export diffs rows when
        # only this changed since the export in place.
        lineage={"table_version": version, "dedup": dedup, "removals": removals},
        blobs=BlobSource(paths.curated, version, cols.fetched), buckets=exp.buckets,
        jpeg_quality=cfg.prepare.jpeg_quality, encodings=cols.encodings,
        incremental=exp.incremental, identity="_identity" if cols.identity else None,
        held=held,
    )


def _write(cfg: Config, name: str, exp, cols: _Columns, curated: _Curated,
           chosen: _Chosen) -> ExportResult:
    """Step "write": the partition-wise MDS writer, then the closing count."""
    frame, left_out = curated.frame, chosen.left_out
    if curated.held is not None and chosen.left_out_ids is not None:
        # The rows and those left out, both on the driver: left out here, so that the
        # rows stay local data (the writer collects them without a Spark job).
        kept = _held_without(curated.held, chosen.left_out_ids)
        frame, left_out = frame.sparkSession.createDataFrame(kept, frame.schema), None
    rows = export_rows(frame, cols.mapping, captions=set(exp.captions),
                       fetched=set(cols.fetched), duplicates=left_out,
                       row_address=ROW_ADDRESS, identity=cols.identity)
    for f in rows.schema.fields:  # MDS encodings checked before the job starts
        if f.name not in (ROW_ADDRESS, "_identity") and f.name not in cols.encodings:
            mds_encoding(f.dataType, f.name)
    settings = _settings(cfg, name, exp, cols, chosen.dedup, chosen.removals, cols.held)
    result = export_mds(rows, tables.export_path(cfg, name), settings)
    if result.samples != chosen.expected:
        raise RuntimeError(
            f"export {name!r} has {result.samples} samples, the table has "
            f"{chosen.expected} matching {exp.where!r}"
        )
    return result


def _quiet_inputs(spark: SparkSession, cfg: Config, name: str, version: int) -> dict | None:
    """Everything an export's key depends on, read from table logs and metadata (no
    Spark job): lakeshard's version, the export's settings, the curated version, the
    dedup, manifest and takedowns versions. None when dedup does not cover the curated
    rows (the full path then warns about it, every time)."""
    exp = cfg.export(name)
    dedup = DedupTable(spark, cfg)
    if not exp.include_duplicates:
        state = dedup.state()
        if state is None or not dedup.covers_rows(
                int(state.get(DEDUP_CURATED_VERSION, -1)), version):
            return None
    cat = Catalog.of(spark, cfg)
    return {"code": code_version(), "export": exp.model_dump(mode="json"), "version": version,
            "jpeg_quality": cfg.prepare.jpeg_quality, "dedup": dedup.version(),
            "manifest": cat.manifest.version(), "takedowns": cat.takedowns.version()}


def _in_place(cfg: Config, name: str, key: str | None) -> ExportResult | None:
    """The export in place when it was written with `key`."""
    out = tables.export_path(cfg, name)
    current = read_manifest(out) if key else None
    if current is None or current.get("export_key") != key:
        return None
    return ExportResult.from_manifest(out, current, resumed=cfg.export(name).partitions,
                                      unchanged=True)


def export(spark: SparkSession, cfg: Config, name: str) -> ExportResult:
    """Choose the columns and rows of export `name` at the curated table's version,
    write them, and remember what was counted (:class:`_Memo`) once it committed. When
    nothing it depends on changed since the export in place was written, that is all."""
    exp = cfg.export(name)
    cols = _columns(name, exp, tables.open_curated(cfg), cfg.driver.ids)
    memo = _Memo(cfg, name)
    inputs = _quiet_inputs(spark, cfg, name, cols.table.version)
    quiet = _in_place(cfg, name, memo.export_key(inputs))
    if quiet is not None:
        return quiet
    since_key = _since_key(cfg, name, read_manifest(tables.export_path(cfg, name)))
    done = _from_changes(spark, cfg, name, exp, cols, memo, since_key)
    if done is not None:
        return done
    if cols.held:
        warm_for(tables.export_path(cfg, name), cols.matching)
    curated = _read_curated(spark, tables.layout(cfg).curated, cols.table.version,
                            cols.small, exp.where, cols.held)
    try:
        chosen = _choose_rows(spark, cfg, exp, cols, curated, memo)
        result = _write(cfg, name, exp, cols, curated, chosen)
        memo.save(*chosen.memo)
        memo.save_key(inputs, tables.export_path(cfg, name))
        memo.save_since(_since_key(cfg, name, read_manifest(tables.export_path(cfg, name))),
                        _since(spark, cfg, cols, chosen.dedup, chosen.removals, inputs))
        return result
    finally:
        curated.frame.unpersist()



# ---------------------------------------------------------------- increment from changes
#
# A night's export follows what changed since the export in place, not the table: the
# curated rows appended or deleted since the version it was written at (Lance fragment
# metadata: :mod:`etl.lakehouse.lance_changes`), the dedup rows whose canonical flag
# changed since the dedup version it was written at (the Delta files added and removed
# since), and the ids the export holds of those rows (its partitions' ids, filtered).
# The plan is the one a diff of every row would make (:func:`plan_changes`), and the
# export key is the same. The whole diff runs instead whenever the memo can't be
# trusted; see docs/exports.md ("Increments from what changed").


def _since_key(cfg: Config, name: str, current: dict | None) -> dict | None:
    """What the memo of changes is keyed by: lakeshard's version, the export's settings
    and the export in place (its key): another of any of them, and the memo is stale."""
    if current is None or not current.get("export_key"):
        return None
    return {"code": code_version(), "export": cfg.export(name).model_dump(mode="json"),
            "jpeg_quality": cfg.prepare.jpeg_quality, "export_key": current["export_key"]}


def _since(spark: SparkSession, cfg: Config, cols: _Columns, dedup: dict, removals: dict,
           inputs: dict | None) -> dict | None:
    """The memo of changes for the export just committed: the versions it was written
    at and the figures the next increment carries forward; None when dedup does not
    cover the rows (`inputs` None), or rows a takedown names were still in the table."""
    if inputs is None or removals.get("excluded_taken_down"):
        return None
    return {"version": cols.table.version, "dedup_version": inputs["dedup"],
            "takedowns": inputs["takedowns"], "duplicates_fingerprint":
            dedup.get("duplicates_fingerprint"), "taken_down": "excluded_taken_down" in removals}


@dataclass(frozen=True)
class _Changed:
    """The rows an increment looks at: `members` (in the selection now, their small
    columns and row addresses) and `touched` (every id that may have joined or left)."""
    members: pa.Table
    touched: set[str]
    duplicates_fingerprint: int | None
    fresh: frozenset[str] = frozenset()  # of `touched`, ids the curated table gained


def _from_changes(spark: SparkSession, cfg: Config, name: str, exp, cols: _Columns,
                  memo: _Memo, key: dict | None) -> ExportResult | None:
    """The export written from what changed since the export in place, or None for the
    whole diff: no memo for the export in place (its key, settings, lakeshard's
    version), takedowns recorded since, latents exported, the memo's curated version
    cleaned up, dedup not covering the rows or its changes unreadable, more ids touched
    than ``driver.ids``, or a plan that rewrites the export."""
    since = memo.since(key) if key is not None and exp.incremental else None
    why = ("no memo of changes for the export in place" if since is None else
           "latents exported" if cols.encodings else
           "takedowns recorded since" if Catalog.of(spark, cfg).takedowns.version()
           != since["takedowns"] else None)
    changed = _changed(spark, cfg, exp, cols, since) if why is None else None
    if why is None and changed is None:
        why = "the changes since its version cannot be read"
    elif changed is not None and len(changed.touched) > cfg.driver.ids:
        why = f"{len(changed.touched):,} ids touched, more than driver.ids"
    done = _write_changes(spark, cfg, name, exp, cols, memo, since, changed) \
        if why is None else None
    if why is None and done is None:
        why = "the plan rewrites the export"
    if why is not None:
        log.info("export %s: the whole diff with the export in place: %s", name, why)
    return done


def _changed(spark: SparkSession, cfg: Config, exp, cols: _Columns,
             since: dict) -> _Changed | None:
    """The rows of the curated fragments appended or written again since the memo's
    version, the ids deleted since, and the rows whose canonical flag changed since its
    dedup version, with their membership now."""
    path, version = tables.layout(cfg).curated, cols.table.version
    rows = row_changes(path, since["version"], version)
    if rows is None:
        return None
    now, then, same = {}, {}, None
    if not exp.include_duplicates:
        dedup = DedupTable(spark, cfg)
        state = dedup.state()
        if state is None or not dedup.covers_rows(int(state.get(DEDUP_CURATED_VERSION, -1)),
                                                  version):
            return None
        found = dedup.canonical_changes(since["dedup_version"])
        if found is None:
            return None
        now, then, same = found
    _, schema = read_schema(path, version, cols.small)
    ds = cols.table
    appended = fragment_rows(ds, rows.appended, cols.small, exp.where, schema)
    flipped = {i for i in set(now) | set(then) if (now.get(i) is False) != (then.get(i) is False)}
    present = pa.concat_tables([appended, rows_by_id(
        ds, sorted(flipped - rows.arrived - rows.deleted), cols.small, exp.where, schema)])
    ids = present.column("sample_id").to_pylist()
    if not exp.include_duplicates:
        unknown = [i for i in ids if i not in now]
        if unknown and same is not None and same.num_rows:
            # Rows of a rewritten dedup file whose status did not change.
            hit = same.filter(pc.is_in(same.column("sample_id"), pa.array(unknown, pa.string())))
            now = {**now, **dict(zip(hit.column(0).to_pylist(), hit.column(1).to_pylist(),
                                     strict=True))}
            unknown = [i for i in ids if i not in now]
        looked_up = DedupTable(spark, cfg).canonical_of(unknown)
        if looked_up is None:
            return None
        status = {**looked_up, **now}
        left_out = {i for i in ids if status.get(i) is False}
        present = _held_without(present, sorted(left_out))
    fingerprint = since["duplicates_fingerprint"]
    if fingerprint is not None and flipped:
        fingerprint ^= ids_fingerprint(sorted(flipped))
    return _Changed(present, set(ids) | rows.arrived | rows.deleted | flipped, fingerprint,
                    rows.fresh)


def _write_changes(spark: SparkSession, cfg: Config, name: str, exp, cols: _Columns,
                   memo: _Memo, since: dict, changed: _Changed) -> ExportResult | None:
    """Plan the increment from `changed` (:func:`plan_changes`), read the rows of the
    partitions it rewrites, and write; None when the plan rewrites the export."""
    out, version = tables.export_path(cfg, name), cols.table.version
    current = read_manifest(out)
    schema, _ = read_schema(tables.layout(cfg).curated, version, cols.small)
    members = changed.members
    rows = _export_frame(spark, exp, cols, members, schema)
    fps = local_arrow(rows.select("sample_id", row_fingerprint(
        rows, exclude=(ROW_ADDRESS,)).alias("_fp")))
    # Ids new to the curated table since the export's version: it cannot hold them.
    old = exported_of(out, current, changed.touched - changed.fresh)
    member_ids = set(members.column("sample_id").to_pylist())
    plan = plan_changes(fps, old, changed.touched - member_ids, current, exp.partitions)
    if not plan.incremental:
        return None
    unchanged = set(part_members(out, current, plan.rewritten)) - changed.touched
    others = rows_by_id(cols.table, sorted(unchanged), cols.small, exp.where,
                        members.schema)
    if others.num_rows != len(unchanged):
        return None  # a row of a rewritten partition left the selection unseen
    rewritten = set(plan.rewritten)
    held = {i: (f, p) for i, f, p in zip(old["sample_id"].to_pylist(),
                                          old["_old_fp"].to_pylist(),
                                          old["_part"].to_pylist(), strict=True)}
    fp = dict(zip(fps["sample_id"].to_pylist(), fps["_fp"].to_pylist(), strict=True))
    stay = [i for i in member_ids if i in held and held[i][1] not in rewritten
            and held[i][0] == fp[i]]
    write = pa.concat_tables([_held_without(members, stay), others])
    expected = current["samples"] + plan.added - plan.departed
    return _commit_changes(spark, cfg, name, exp, cols, memo, since, changed,
                           (_export_frame(spark, exp, cols, write, schema), plan, expected))


def _export_frame(spark: SparkSession, exp, cols: _Columns, table: pa.Table, schema):
    """Curated rows the driver read, as the export's rows (:func:`export_rows`)."""
    return export_rows(spark.createDataFrame(table, schema), cols.mapping,
                       captions=set(exp.captions), fetched=set(cols.fetched),
                       duplicates=None, row_address=ROW_ADDRESS, identity=cols.identity)


def _commit_changes(spark: SparkSession, cfg: Config, name: str, exp, cols: _Columns,
                    memo: _Memo, since: dict, changed: _Changed,
                    written: tuple) -> ExportResult | None:
    """Write the increment with the lineage a full diff would give it, check its
    count, and remember where the next one starts."""
    rows, plan, expected = written
    dedup: dict = {"include_duplicates": exp.include_duplicates}
    if not exp.include_duplicates:
        dedup.update(excluded_duplicates=cols.matching - expected,
                     duplicates_fingerprint=changed.duplicates_fingerprint)
    manifest_version = Catalog.of(spark, cfg).manifest.version()
    removals = memo.removals(manifest_version) or _removals(spark, cfg)
    kept = dict(removals)
    if since["taken_down"]:
        removals["excluded_taken_down"] = 0
    settings = _settings(cfg, name, exp, cols, dedup, removals,
                         held=plan.to_write <= cfg.driver.ids)
    out = tables.export_path(cfg, name)
    result = export_mds(rows, out, settings, planned=plan)
    if result is None:
        return None
    if result.samples != expected:
        raise RuntimeError(f"export {name!r} has {result.samples} samples after an "
                           f"increment, expected {expected}")
    inputs = _quiet_inputs(spark, cfg, name, cols.table.version)
    memo.save(inputs, expected, dedup, manifest_version, kept)
    memo.save_key(inputs, out)
    memo.save_since(_since_key(cfg, name, read_manifest(out)),
                    _since(spark, cfg, cols, dedup, removals, inputs))
    return result


def warm(cfg: Config, ctx: RunContext) -> None:
    """The stage's warm-up (:attr:`etl.pipeline.stages.Stage.warm`): when the driver
    will likely write an export's rows -- the curated table's rows few enough for it to
    hold, or an export in place that a night of a few new records
    (:attr:`RunContext.new_records`, within :data:`DRIVER_WRITE_ROWS`) adds to -- start
    importing the MDS writer on a thread (:func:`warm_for`), so that it overlaps the
    stages before the export instead of the export itself."""
    path = tables.layout(cfg).curated
    if not _names(cfg, ctx) or not storage.lance_exists(path):
        return
    rows = tables.open_curated(cfg).count_rows()
    few = ctx.new_records is not None and ctx.new_records <= DRIVER_WRITE_ROWS
    for name in _names(cfg, ctx):
        if rows <= cfg.driver.ids or (few and cfg.export(name).incremental):
            warm_for(tables.export_path(cfg, name), rows)


def _names(cfg: Config, ctx: RunContext) -> tuple[str, ...]:
    return ctx.export_names if ctx.export_names is not None else tuple(cfg.exports)


@dataclass(frozen=True)
class ExportRun(StageDetail):
    """The exports one run of the stage wrote (or found up to date), in order."""

    exports: tuple[ExportResult, ...] = ()

    def summary_head(self) -> list[str]:
        """One line per export: where it is, what it holds, what was reused."""
        return [_summary_line(e) for e in self.exports]

    def summary_json(self) -> dict[str, Any]:
        return {"exports": [asdict(e) for e in self.exports]}


def _summary_line(e: ExportResult) -> str:
    resumed = ""
    if e.unchanged:
        resumed = ", up to date"
    elif e.kept_partitions:
        resumed = f", {e.kept_partitions} partition(s) kept as they were"
    elif e.resumed_partitions:
        resumed = f", {e.resumed_partitions} partition(s) reused"
    return (f"export (MDS)    : {e.path}  {e.samples} samples in {e.shards} shard(s), "
            f"{e.bytes / 1e6:.2f} MB{resumed}")


def stage(spark: SparkSession, cfg: Config, ctx: RunContext) -> StageResult[ExportRun]:
    """curated Lance table -> every (or the chosen) MDS export."""
    names = _names(cfg, ctx)
    results: list[ExportResult] = []
    manifests: dict[str, dict] = {}
    rows: dict[str, int] = {}
    outputs: dict[str, int] = {"samples": 0, "shards": 0, "bytes": 0}
    up_to_date = 0
    increments = []
    for name in names:
        res = export(spark, cfg, name)
        results.append(res)
        manifest = read_manifest(res.path) or {}
        inc = manifest.get("increment") or {}
        if res.unchanged:
            up_to_date += 1
        elif inc.get("mode") == "incremental":
            increments.append(
                f"{name} incremental (+{inc['added']} -{inc['departed']} "
                f"~{inc['changed']} rows: {inc['written_samples']} written, "
                f"{len(inc['kept_parts'])} partition(s) kept)")
        manifests[name] = {
            "path": res.path, "samples": res.samples, "shards": res.shards,
            "bytes": res.bytes, "checksum": res.checksum,
            "table_version": manifest.get("table_version"),
            "export_key": manifest.get("export_key"),
            "resumed_partitions": res.resumed_partitions,
            "removed": (manifest.get("removals") or {}).get("removed", 0),
        }
        rows[name] = res.samples
        outputs["samples"] += res.samples
        outputs["shards"] += res.shards
        outputs["bytes"] += res.bytes
    note = "up to date" if names and up_to_date == len(names) else "; ".join(increments) or None
    return StageResult(inputs=Metrics(by={"rows": rows}),
                       outputs=Metrics(outputs, by={"samples": rows}), manifests=manifests,
                       note=note, detail=ExportRun(tuple(results)))
