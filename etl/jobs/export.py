"""Export job: the curated Lance table -> an MDS export under <root>/mds/<name>/."""

from __future__ import annotations

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from etl.config import Config, ConfigError, ExportConfig
from etl.jobs.curate import CURATED_TABLE
from etl.writers.lance import ROW_ADDRESS
from etl.writers.mds import FIXED_COLUMNS, BlobSource, ExportResult, export_mds, mds_encoding

__all__ = ["export", "export_columns"]


def export_columns(exp: ExportConfig, table_columns: list[str]) -> dict[str, str]:
    """MDS column -> curated column, checked against the table before any Spark job."""
    where = f"exports.{exp.name}"
    mapping = {c: c for c in FIXED_COLUMNS}
    for out, src in exp.captions.items():
        if out in mapping:
            raise ConfigError(f"{where}.captions: {out!r} clashes with the column {out!r}")
        mapping[out] = src
    for col in exp.columns:
        if col in mapping:
            raise ConfigError(f"{where}.columns: {col!r} is already exported")
        mapping[col] = col
    for out, src in mapping.items():
        if src not in table_columns:
            raise ConfigError(
                f"{where}: column {src!r} (for {out!r}) is not in the curated table "
                f"(its columns: {', '.join(table_columns)})"
            )
    return mapping


def export(spark: SparkSession, cfg: Config, name: str) -> ExportResult:
    exp = cfg.export(name)
    curated_path = cfg.storage.lance_table(CURATED_TABLE)
    import lance

    try:
        table = lance.dataset(curated_path)
    except (ValueError, OSError) as exc:
        raise FileNotFoundError(
            f"no curated table at {curated_path}: run `lakeshard curate` first"
        ) from exc
    mapping = export_columns(exp, table.schema.names)
    try:
        expected = table.count_rows(filter=exp.where)
    except (ValueError, OSError) as exc:  # a predicate Lance can't parse
        raise ConfigError(f"exports.{name}.where: {exp.where!r}: {exc}") from None
    encodings: dict[str, str] = {}
    if exp.latents:  # precomputed text latents (default: none, computed online)
        from etl.jobs.latents import latent_export_columns

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
    reader = (
        spark.read.format("lance")
        .option("version", str(table.version))
        .option("columns", ",".join(small))
        .option("row_address", "true")
    )
    if exp.where:
        reader = reader.option("filter", exp.where)
    curated = reader.load(curated_path)
    duplicates = None
    if not exp.include_duplicates:
        from etl.jobs.dedup import non_canonical_ids

        duplicates = non_canonical_ids(spark, cfg, table.version)
    dedup_manifest = {"include_duplicates": exp.include_duplicates}
    if duplicates is not None:
        # Non-canonical duplicates stay in the table; the export leaves them out.
        curated = curated.join(duplicates, "sample_id", "left_anti")
        ids = (
            spark.read.format("lance")
            .option("version", str(table.version))
            .option("columns", "sample_id")
        )
        if exp.where:
            ids = ids.option("filter", exp.where)
        matching = expected
        expected = ids.load(curated_path).join(duplicates, "sample_id", "left_anti").count()
        # What was left out, as content (not as a Delta version): an unchanged dedup
        # result keeps the export key, so a rerun stays a no-op.
        fp = duplicates.select(F.bit_xor(F.xxhash64("sample_id")).alias("h")).first()
        # excluded_duplicates: rows matching `where` left out (verify-export subtracts it).
        dedup_manifest.update(
            excluded_duplicates=matching - expected, duplicates_fingerprint=fp["h"] or 0
        )
    selected = [F.col(ROW_ADDRESS)]
    for out, src in mapping.items():
        if out in fetched:
            continue
        col = F.col(src)
        if out in exp.captions:
            # A sample without this caption trains as unconditional: "", not null.
            col = F.coalesce(col.cast("string"), F.lit(""))
        elif src in FIXED_COLUMNS and FIXED_COLUMNS[src] == "int32":
            col = col.cast("int")
        selected.append(col.alias(out))
    rows = curated.select(*selected)
    for f in rows.schema.fields:  # MDS encodings checked before the job starts
        if f.name != ROW_ADDRESS and f.name not in encodings:
            mds_encoding(f.dataType, f.name)

    result = export_mds(
        rows,
        cfg.export_path(name),
        partitions=exp.partitions,
        size_limit=exp.size_limit,
        compression=exp.compression,
        hashes=exp.hashes,
        seed=exp.seed,
        blobs=BlobSource(curated_path, table.version, fetched),
        buckets=exp.buckets,
        jpeg_quality=cfg.prepare.jpeg_quality,
        encodings=encodings or None,
        manifest={
            "name": name, "table": curated_path, "table_version": table.version,
            "where": exp.where, "sources": dict(mapping), "dedup": dedup_manifest,
        },
    )
    if result.samples != expected:
        raise RuntimeError(
            f"export {name!r} has {result.samples} samples, the table has {expected} "
            f"matching {exp.where!r}"
        )
    return result
