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

import json

import pandas as pd
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from etl import tables
from etl.config import Config
from etl.errors import ConfigError
from etl.lakehouse.counts import manifest_counts
from etl.runtime.stage import RunContext, StageResult
from etl.schema import REMOVED
from etl.transforms.bronze import takedown_identifiers
from etl.transforms.export import (
    export_columns,
    export_rows,
    ids_fingerprint,
    latent_export_columns,
)
from etl.writers.lance import ROW_ADDRESS
from etl.writers.mds import BlobSource, ExportResult, export_mds, mds_encoding, read_manifest
from etl.writers.remote import read_file, write_file

__all__ = ["export", "stage"]


def _taken_down(spark: SparkSession, cfg: Config) -> DataFrame | None:
    """``sample_id`` of every record a takedown names, or None without takedowns."""
    takedowns = tables.read_delta(spark, tables.layout(cfg).takedowns)
    if takedowns is None:
        return None
    return (takedown_identifiers(takedowns).where("kind = 'sample_id'")
            .select(F.col("value").alias("sample_id")).localCheckpoint(eager=True))


def _removals(spark: SparkSession, cfg: Config) -> dict:
    """Rows removals took out of the curated table (and so out of every export since):
    how many, by reason, and a fingerprint of their ids (so the export key changes)."""
    paths = tables.layout(cfg)
    out: dict = {"removed": 0, "by_reason": {}, "fingerprint": 0}
    counts = manifest_counts(paths)  # kept per data file: reads what changed
    manifest = tables.read_delta(spark, paths.manifest)
    if manifest is None:
        return out
    gone = manifest.where((F.col("status") == REMOVED) & (F.col("stage") == "curated"))
    if counts is None:  # a manifest delta-rs does not read
        by_reason = {r["reason"]: r["count"] for r in gone.groupBy("reason").count().collect()}
    else:
        mine = counts[(counts["status"] == REMOVED) & (counts["stage"] == "curated")]
        by_reason = {(None if pd.isna(r) else r): int(n) for r, n in mine.groupby(
            "reason", dropna=False)["count"].sum().items()}
    if by_reason:
        out.update(removed=sum(by_reason.values()), by_reason=dict(sorted(by_reason.items())),
                   fingerprint=ids_fingerprint(gone))
    return out


def export(spark: SparkSession, cfg: Config, name: str) -> ExportResult:
    exp = cfg.export(name)
    table = tables.open_curated(cfg)
    curated_path = tables.layout(cfg).curated
    mapping = export_columns(exp, table.schema.names)
    try:
        expected = table.count_rows(filter=exp.where)
    except (ValueError, OSError) as exc:  # a predicate Lance can't parse
        raise ConfigError(f"exports.{name}.where: {exp.where!r}: {exc}") from None
    encodings: dict[str, str] = {}
    if exp.latents:  # precomputed text latents (default: none, computed online)
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

    # Image bytes don't travel through Spark: rows carry their Lance row address and
    # each export task takes the bytes from the pinned table version (BlobSource).
    # Latents (fixed-shape ndarray bytes, tens of kB per sample) are taken the same way.
    fetched = {out: src for out, src in mapping.items() if out == "image" or out in encodings}
    small = sorted({src for out, src in mapping.items() if out not in fetched})
    # A row's image, in its fingerprint (an incremental export's diff), by its hash.
    identity = ("image_sha256" if exp.incremental and "image_sha256" in table.schema.names
                else None)
    if identity and identity not in small:
        small.append(identity)

    def read(columns: list[str]):
        reader = (
            spark.read.format("lance")
            .option("version", str(table.version))
            .option("columns", ",".join(columns))
        )
        if exp.where:
            reader = reader.option("filter", exp.where)
        return reader

    # Read from Lance once: the counts below, the diff of an incremental export and the
    # write all scan these rows (small columns and row addresses, no image bytes).
    curated = read(small).option("row_address", "true").load(curated_path).persist(
        StorageLevel.MEMORY_AND_DISK)
    try:
        duplicates = None
        if not exp.include_duplicates:
            duplicates = tables.non_canonical_ids(spark, cfg, table.version)
        dedup_manifest: dict = {"include_duplicates": exp.include_duplicates}
        memo = _read_memo(cfg, name) or {}
        memo_inputs = None
        if duplicates is not None:
            # Non-canonical duplicates stay in the table; the export leaves them out.
            # What was left out, as content (not as a Delta version): an unchanged dedup
            # result keeps the export key, so a rerun stays a no-op.
            # excluded_duplicates: rows matching `where` left out (verify-export subtracts it).
            memo_inputs = {"table_version": table.version, "where": exp.where,
                           "dedup_version": tables.delta_version(spark, tables.layout(cfg).dedup)}
            if memo.get("inputs") == memo_inputs:
                # The same table versions: the same figures, without reading either table.
                expected, excluded, fingerprint = (
                    memo["expected"], memo["excluded_duplicates"], memo["duplicates_fingerprint"])
            else:
                matching = expected
                expected = curated.select("sample_id").join(
                    duplicates, "sample_id", "left_anti"
                ).count()
                excluded, fingerprint = matching - expected, ids_fingerprint(duplicates)
            dedup_manifest.update(excluded_duplicates=excluded,
                                  duplicates_fingerprint=fingerprint)
        after_dedup = expected  # what the memo keeps: takedowns are applied afresh each time
        # Removals: rows that left the table, and (normally none) rows a takedown names that
        # are still in it because a run died before deleting them.
        # The removal figures as of the manifest's version: the same version, the same
        # figures (from the memo, without a Spark job over the manifest).
        manifest_version = tables.delta_version(spark, tables.layout(cfg).manifest)
        if manifest_version is not None and memo.get("manifest_version") == manifest_version:
            removals = dict(memo["removals"])
        else:
            removals = _removals(spark, cfg)
        memo_removals = dict(removals)
        taken_down = _taken_down(spark, cfg)
        left_out = duplicates
        if taken_down is not None and not taken_down.isEmpty():
            kept = curated.select("sample_id")
            if duplicates is not None:
                kept = kept.join(duplicates, "sample_id", "left_anti")
            remaining = kept.join(taken_down, "sample_id", "left_anti").count()
            removals["excluded_taken_down"] = expected - remaining
            expected = remaining
            left_out = taken_down if duplicates is None else duplicates.unionByName(taken_down)
        rows = export_rows(
            curated, mapping, captions=set(exp.captions), fetched=set(fetched),
            duplicates=left_out, row_address=ROW_ADDRESS, identity=identity,
        )
        for f in rows.schema.fields:  # MDS encodings checked before the job starts
            if f.name not in (ROW_ADDRESS, "_identity") and f.name not in encodings:
                mds_encoding(f.dataType, f.name)

        result = export_mds(
            rows,
            tables.export_path(cfg, name),
            partitions=exp.partitions,
            size_limit=exp.size_limit,
            compression=exp.compression,
            hashes=exp.hashes,
            seed=exp.seed,
            blobs=BlobSource(curated_path, table.version, fetched),
            buckets=exp.buckets,
            jpeg_quality=cfg.prepare.jpeg_quality,
            encodings=encodings or None,
            manifest={"name": name, "table": curated_path, "where": exp.where,
                      "sources": dict(mapping)},
            # What changes with the table's content: an incremental export diffs rows when
            # only this changed since the export in place.
            lineage={"table_version": table.version, "dedup": dedup_manifest,
                     "removals": removals},
            incremental=exp.incremental,
            identity="_identity" if identity else None,
        )
        if result.samples != expected:
            raise RuntimeError(
                f"export {name!r} has {result.samples} samples, the table has {expected} "
                f"matching {exp.where!r}"
            )
        new_memo = {"inputs": memo_inputs, "expected": after_dedup,
                    "manifest_version": manifest_version, "removals": memo_removals,
                    **{k: dedup_manifest.get(k) for k in (
                        "excluded_duplicates", "duplicates_fingerprint")}}
        if new_memo != memo:
            _write_memo(cfg, name, new_memo)
        return result

    finally:
        curated.unpersist()

def _memo_path(cfg: Config, name: str) -> str:
    return f"{tables.layout(cfg).meta_dir}/exports/{name}.json"


def _read_memo(cfg: Config, name: str) -> dict | None:
    """What the last export of `name` counted from the dedup table (rows exported,
    duplicates left out, their fingerprint) and from the manifest (rows removed), and at
    which curated, dedup and manifest versions: a Delta version pins its content, so the
    same versions give the same figures and a rerun needs no Spark job to know its
    export key."""
    body = read_file(_memo_path(cfg, name))
    return None if body is None else json.loads(body)


def _write_memo(cfg: Config, name: str, memo: dict) -> None:
    write_file(_memo_path(cfg, name), json.dumps(memo, sort_keys=True).encode())


def stage(spark: SparkSession, cfg: Config, ctx: RunContext) -> StageResult:
    """curated Lance table -> every (or the chosen) MDS export."""
    names = ctx.export_names if ctx.export_names is not None else tuple(cfg.exports)
    results, manifests = [], {}
    inputs: dict[str, int] = {}
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
        inputs[f"rows:{name}"] = res.samples
        outputs["samples"] += res.samples
        outputs["shards"] += res.shards
        outputs["bytes"] += res.bytes
        outputs[f"samples:{name}"] = res.samples
    note = "up to date" if names and up_to_date == len(names) else "; ".join(increments) or None
    return StageResult(inputs=inputs, outputs=outputs, manifests=manifests, note=note,
                       detail=results)
