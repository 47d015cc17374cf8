"""Bronze diffing, accounting and export-row selection on frames of a few rows."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa
import pytest
from pyspark.sql import Row

from etl.config import ExportConfig
from etl.errors import ConfigError
from etl.schema import MANIFEST_SCHEMA, SOURCE_SCHEMA
from etl.transforms.accounting import accounting_rows, source_counts
from etl.transforms.bronze import (
    manifest_rows,
    mark_duplicate_keys,
    mark_unchanged,
    unchanged_containers,
)
from etl.transforms.export import export_columns, export_rows, latent_export_columns

NOW = datetime(2026, 11, 30, 12, 0, 0)


def _listed(spark, rows):
    """Rows of the source schema from (sample_id, source_uri, fingerprint, read_status)."""
    names = SOURCE_SCHEMA.fieldNames()
    full = []
    for sid, uri, fp, status in rows:
        r = dict.fromkeys(names)
        r.update(sample_id=sid, source="s", source_key=sid, source_uri=uri, fingerprint=fp,
                 read_status=status, image_ref=uri)
        full.append(tuple(r[n] for n in names))
    return spark.createDataFrame(full, SOURCE_SCHEMA)


def _manifest(spark, rows):
    """Manifest rows from (sample_id, fingerprint, status, reason)."""
    names = MANIFEST_SCHEMA.fieldNames()
    full = []
    for sid, fp, status, reason in rows:
        r = dict.fromkeys(names)
        r.update(sample_id=sid, source="s", source_key=sid, fingerprint=fp, status=status,
                 reason=reason, run_id="r0", ingested_at=NOW)
        full.append(tuple(r[n] for n in names))
    return spark.createDataFrame(full, MANIFEST_SCHEMA)


def test_unchanged_is_same_id_same_fingerprint_and_not_a_transient_failure(spark):
    listed = _listed(spark, [
        ("same", "u1", "10:1", "ok"),
        ("changed", "u2", "10:2", "ok"),
        ("new", "u3", "10:3", "ok"),
        ("timed_out", "u4", "10:4", "ok"),
        ("server_error", "u5", "10:5", "ok"),
        ("bad_forever", "u6", "10:6", "ok"),
        ("keyed", "u7", None, "ok"),  # tables: no fingerprint, the key alone
    ])
    manifest = _manifest(spark, [
        ("same", "10:1", "accepted", None),
        ("changed", "10:1", "accepted", None),
        ("timed_out", "10:4", "rejected", "timeout"),
        ("server_error", "10:5", "rejected", "http_503"),
        ("bad_forever", "10:6", "rejected", "undecodable"),
        ("keyed", None, "accepted", None),
    ])
    got = {r.sample_id: r.unchanged for r in mark_unchanged(listed, manifest).collect()}
    assert got == {"same": True, "changed": False, "new": False, "timed_out": False,
                   "server_error": False, "bad_forever": True, "keyed": True}
    # No manifest yet: everything is new.
    assert {r.unchanged for r in mark_unchanged(listed, None).collect()} == {False}


def test_a_repeated_key_keeps_its_first_readable_copy(spark):
    listed = _listed(spark, [
        ("k", "b.tar", "1", "ok"),
        ("k", "a.tar", "1", "rejected"),  # unreadable copies sort after readable ones
        ("k", "c.tar", "1", "ok"),
        ("solo", "a.tar", "1", "ok"),
    ])
    marked = mark_duplicate_keys(mark_unchanged(listed, None)).collect()
    by = {(r.sample_id, r.source_uri): (r.occurrence, r.read_status, r.read_reason)
          for r in marked}
    assert by == {
        ("k", "b.tar"): (1, "ok", None),
        ("k", "c.tar"): (2, "rejected", "duplicate_key"),
        ("k", "a.tar"): (3, "rejected", None),  # already rejected for its own reason
        ("solo", "a.tar"): (1, "ok", None),
    }


def test_a_container_is_skipped_only_when_all_its_records_match():
    listed = {"s-0.tar": "100:1", "s-1.tar": "100:2", "s-2.tar": "100:3"}
    known = [
        {"source_uri": "s-0.tar", "fingerprint": "100:1", "count": 5},
        {"source_uri": "s-1.tar", "fingerprint": "100:2", "count": 3},
        {"source_uri": "s-1.tar", "fingerprint": "99:0", "count": 1},  # an older copy
        {"source_uri": "gone.tar", "fingerprint": "1:1", "count": 7},
    ]
    skip, records = unchanged_containers(listed, known)
    assert skip == {"s-0.tar"} and records == 5


def test_manifest_rows_are_the_first_copy_with_outcome(spark):
    prepared = spark.createDataFrame(
        [("a", "s", "ka", 1, "ok", "prepare", None),
         ("b", "s", "kb", 1, "rejected", "prepare", "truncated"),
         ("b", "s", "kb", 2, "rejected", "ingest", "duplicate_key"),
         ("c", "s", "kc", 1, "rejected", "fetch", None)],
        "sample_id string, source string, source_key string, occurrence int, status string, "
        "stage string, reason string",
    )
    for f in MANIFEST_SCHEMA.fields:
        if f.name not in prepared.columns:
            from pyspark.sql import functions as F

            prepared = prepared.withColumn(f.name, F.lit(None).cast(f.dataType))
    rows = {r.sample_id: r for r in manifest_rows(prepared, run_id="r1", ingested_at=NOW)
            .collect()}
    assert set(rows) == {"a", "b", "c"}
    assert (rows["a"].status, rows["a"].stage, rows["a"].reason) == ("accepted", None, None)
    assert (rows["b"].status, rows["b"].stage, rows["b"].reason) == (
        "rejected", "prepare", "truncated")
    assert rows["c"].reason == "unknown"
    assert {r.run_id for r in rows.values()} == {"r1"}


def test_source_counts_and_accounting_rows_agree(spark):
    outcome = spark.createDataFrame(
        [("a", "prepare", "ok", None, None, 5),
         ("a", "prepare", "ok", None, "too_small", 2),
         ("a", "prepare", "rejected", "truncated", None, 1),
         ("a", "fetch", "rejected", "http_404", None, 3),
         ("b", "ingest", "rejected", None, None, 1)],
        "source string, stage string, status string, reason string, filter_reason string, "
        "count long",
    )
    counts = {c.source: c for c in source_counts(outcome.collect(), ["a", "b", "c"],
                                                 {"a": 4, "c": 9})}
    a = counts["a"]
    assert (a.seen, a.accepted, a.rejected, a.unchanged) == (11, 7, 4, 4)
    assert a.reasons == {"http_404": 3, "truncated": 1} and a.filtered == {"too_small": 2}
    assert counts["b"].reasons == {"unknown": 1}
    assert (counts["c"].seen, counts["c"].unchanged) == (0, 9)

    rows = [Row(**r) for r in accounting_rows(outcome.collect(), {"a": 4, "c": 9, "d": 0},
                                              run_id="r1", run_at=NOW).to_pylist()]
    total = {}
    for r in rows:
        assert r.run_id == "r1" and r.run_at == NOW.replace(tzinfo=UTC)  # NOW: naive UTC
        total[(r.source, r.status)] = total.get((r.source, r.status), 0) + r["count"]
    assert total == {("a", "accepted"): 7, ("a", "rejected"): 4, ("b", "rejected"): 1,
                     ("a", "unchanged"): 4, ("c", "unchanged"): 9}
    flagged = [r for r in rows if r.filter_reason]
    assert [(r.status, r.filter_reason, r["count"]) for r in flagged] == [
        ("accepted", "too_small", 2)]


def test_export_rows_leave_out_duplicates_and_shape_captions(spark):
    curated = spark.createDataFrame(
        [(0, "a", "s", 64, 48, 64, 48, "a cat", None),
         (1, "b", "s", 32, 32, 40, 40, None, "alt b"),
         (2, "c", "s", 10, 10, 10, 10, "dup", None)],
        "_rowaddr long, sample_id string, source string, width int, height int, "
        "original_width int, original_height int, caption_original string, alt string",
    )
    exp = ExportConfig(name="t", captions={"caption": "caption_original", "alt": "alt"})
    mapping = export_columns(exp, curated.columns + ["image"])
    dups = spark.createDataFrame([("c",)], "sample_id string")
    rows = export_rows(curated, mapping, captions={"caption", "alt"}, fetched={"image"},
                       duplicates=dups, row_address="_rowaddr")
    assert "image" not in rows.columns and rows.schema["width"].dataType.simpleString() == "int"
    got = {r.sample_id: (r._rowaddr, r.caption, r.alt) for r in rows.collect()}
    assert got == {"a": (0, "a cat", ""), "b": (1, "", "alt b")}

    with pytest.raises(ConfigError, match="column 'nope' .* not in the curated table"):
        export_columns(ExportConfig(name="t", columns=("nope",)), curated.columns + ["image"])
    with pytest.raises(ConfigError, match="'width' is already exported"):
        export_columns(ExportConfig(name="t", columns=("width",)), curated.columns + ["image"])


def test_latent_export_columns_read_shapes_from_the_field_metadata():
    import json

    meta = {"lakeshard.latent": json.dumps({"encoder": "t5", "caption": "caption_original",
                                            "max_tokens": 8, "hidden_size": 4,
                                            "dtype": "bfloat16"})}
    schema = pa.schema([pa.field("latent_caption_original_t5", pa.binary(), metadata=meta)])
    exp = ExportConfig(name="t", latents=("t5",))
    mapping, encodings, required = latent_export_columns(exp, schema)
    assert mapping == {"latent_caption_t5": "latent_caption_original_t5",
                       "attention_mask_caption_t5": "attention_mask_caption_original_t5"}
    assert encodings == {"latent_caption_t5": "ndarray:uint16:8,4",
                         "attention_mask_caption_t5": "ndarray:uint8:8"}
    assert required == ["latent_caption_original_t5"]
    with pytest.raises(ConfigError, match="no latents of encoder 'clip'"):
        latent_export_columns(ExportConfig(name="t", latents=("clip",)), schema)


def test_a_runs_accounting_is_appended_once_and_merged_on_a_repeat(spark, tmp_path):
    """A run's first accounting write is one delta-rs append (no MERGE); writing the same
    run's rows again (a retried write) goes through the MERGE and adds nothing; times
    read back as written (UTC)."""
    from deltalake import DeltaTable

    from etl.schema import ACCOUNTING_SCHEMA
    from etl.writers.delta import merge_accounting

    path = str(tmp_path / "accounting")
    at = datetime(2026, 11, 30, 23, 5, 7)

    def rows(run_id, n):
        return spark.createDataFrame(
            [(run_id, at, "photos", "accepted", None, None, None, n),
             (run_id, at, "photos", "rejected", "prepare", "undecodable", None, 1)],
            ACCOUNTING_SCHEMA)

    merge_accounting(spark, rows("r1", 5), path)  # creates the table (Spark)
    merge_accounting(spark, rows("r2", 7), path)
    merge_accounting(spark, rows("r2", 7), path)  # the same run again
    # As an Arrow table built on the driver: a new run appended, a repeat MERGEd.
    merge_accounting(spark, rows("r3", 2).toArrow(), path)
    merge_accounting(spark, rows("r3", 2).toArrow(), path)
    history = DeltaTable(path).history()
    appends = [h for h in history if h["operation"] == "WRITE"
               and h.get("engineInfo", "").startswith("delta-rs")]
    assert len(appends) == 3  # r1, r2 and r3 once each; the repeats were not appended
    got = sorted((r.run_id, r.status, r["count"], r.run_at) for r in
                 spark.read.format("delta").load(path).collect())
    assert got == [("r1", "accepted", 5, at), ("r1", "rejected", 1, at),
                   ("r2", "accepted", 7, at), ("r2", "rejected", 1, at),
                   ("r3", "accepted", 2, at), ("r3", "rejected", 1, at)]


def _held_rows(with_sha: bool = True) -> pa.Table:
    """Prepared rows as the driver holds them after a night's job (Arrow, as ``toArrow``
    types them): every manifest column, plus occurrence and the outcome columns.
    (sample_id, occurrence, status, stage, reason)"""
    from pyspark.sql.pandas.types import to_arrow_schema

    outcomes = [("a", 1, "ok", "prepare", None),
                ("b", 1, "rejected", "prepare", "truncated"),
                ("b", 2, "rejected", "ingest", "duplicate_key"),  # a second copy: left out
                ("c", 1, "rejected", "fetch", None),               # no reason: "unknown"
                ("d", None, "ok", "prepare", None),                # no occurrence: left out
                ("e", 1, None, "prepare", "x")]                    # no status: rejected
    arrow = to_arrow_schema(MANIFEST_SCHEMA)
    n = len(outcomes)
    columns = {f.name: pa.nulls(n, f.type) for f in arrow}
    columns.update(
        sample_id=pa.array([o[0] for o in outcomes]), source=pa.array(["s"] * n),
        source_key=pa.array([f"k{o[0]}" for o in outcomes]),
        source_uri=pa.array([f"http://h/{o[0]}.jpg" for o in outcomes]),
        fingerprint=pa.array([None, "f1", "f1", None, None, None], pa.string()),
        occurrence=pa.array([o[1] for o in outcomes], pa.int32()),
        status=pa.array([o[2] for o in outcomes], pa.string()),
        stage=pa.array([o[3] for o in outcomes], pa.string()),
        reason=pa.array([o[4] for o in outcomes], pa.string()),
        run_id=pa.array(["old"] * n), detail=pa.array(["d"] * n))
    columns["original_sha256"] = pa.array(
        [f"{c * 64}" for c in "abcdef"], pa.string())
    if not with_sha:
        del columns["original_sha256"]
    return pa.table(columns)


def test_manifest_rows_held_here_are_the_rows_spark_tasks_build(spark):
    """The manifest rows curate builds on the driver from rows it holds: the same rows,
    values and types as the same rule run in Spark's tasks (``mapInArrow``) over the
    same rows as a frame, with or without the source bytes' hash."""
    for with_sha in (True, False):
        held = _held_rows(with_sha)
        mine = manifest_rows(held, run_id="r1", ingested_at=NOW)
        frame = manifest_rows(spark.createDataFrame(held), run_id="r1", ingested_at=NOW)
        # Spark reads the rule's timestamps back as the naive local time it was given.
        assert {r.ingested_at for r in frame.collect()} == {NOW}
        theirs = frame.toArrow()
        assert mine.column_names == MANIFEST_SCHEMA.fieldNames()
        assert [f.type for f in mine.schema] == [f.type for f in theirs.schema]
        key = [("sample_id", "ascending")]
        assert mine.sort_by(key).to_pylist() == theirs.sort_by(key).to_pylist()
        rows = {r["sample_id"]: r for r in mine.to_pylist()}
        assert {k: (r["status"], r["stage"], r["reason"]) for k, r in rows.items()} == {
            "a": ("accepted", None, None), "b": ("rejected", "prepare", "truncated"),
            "c": ("rejected", "fetch", "unknown"), "e": ("rejected", None, None)}
        assert {r["run_id"] for r in rows.values()} == {"r1"}
        assert {r["removed_at"] for r in rows.values()} == {None}
        assert rows["b"]["original_sha256"] == ("b" * 64 if with_sha else None)


def test_rows_built_on_the_driver_are_appended_and_merged_as_a_frames_are(spark, tmp_path):
    """Manifest and rejects rows given as Arrow tables: a first batch appended by
    delta-rs, then records the table holds upserted -- by Spark's MERGE where no driver
    bound is given (the Arrow rows as the MERGE's source), and by delta-rs."""
    from etl.transforms.prepare import rejected_rows
    from etl.writers.delta import merge_manifest, merge_rejects

    manifest, rejects = str(tmp_path / "manifest"), str(tmp_path / "rejects")
    held = _held_rows()
    merge_manifest(spark, manifest_rows(held, run_id="r1", ingested_at=NOW), manifest,
                   driver_bound=100)
    merge_rejects(spark, rejected_rows(held, run_id="r1"), rejects, driver_bound=100)
    # e has no status: the manifest calls it rejected; the rejects table leaves it out,
    # as Spark's filter does.
    # The next night: c fetched this time (accepted), a new record f rejected.
    again = pa.table({
        **{n: held.column(n).take([3, 3]) for n in held.column_names},
        "sample_id": pa.array(["c", "f"]), "status": pa.array(["ok", "rejected"]),
        "reason": pa.array([None, "too_large_bytes"], pa.string()),
        "occurrence": pa.array([1, 1], pa.int32())})
    for bound in (0, 100):  # Spark's MERGE, then delta-rs's (the same rows: no change)
        merge_manifest(spark, manifest_rows(again, run_id="r2", ingested_at=NOW),
                       manifest, driver_bound=bound)
        merge_rejects(spark, rejected_rows(again, run_id="r2"), rejects,
                      driver_bound=bound)
        got = {r.sample_id: (r.status, r.reason, r.run_id)
               for r in spark.read.format("delta").load(manifest).collect()}
        assert got == {"a": ("accepted", None, "r1"), "b": ("rejected", "truncated", "r1"),
                       "c": ("accepted", None, "r2"), "e": ("rejected", None, "r1"),
                       "f": ("rejected", "too_large_bytes", "r2")}
        got = sorted((r.sample_id, r.stage, r.reason, r.run_id)
                     for r in spark.read.format("delta").load(rejects).collect())
        assert got == [("b", "ingest", "duplicate_key", "r1"),
                       ("b", "prepare", "truncated", "r1"),
                       ("c", "fetch", "unknown", "r1"),
                       ("f", "fetch", "too_large_bytes", "r2")]
