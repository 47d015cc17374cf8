"""End to end: bundled sample sources -> Lance + Delta + MDS, read back three ways."""

from __future__ import annotations

import io
import json
import os

import lance
import pytest
from conftest import make_config, run_all
from PIL import Image

from etl import tables
from etl.lakehouse.views import register_views
from etl.sample_sources import FOLDER_BAD, FOLDER_FLAGGED, FOLDER_PHOTOS, TABLE_PHOTOS

pytestmark = pytest.mark.slow


def _cfg(root):
    return make_config(
        root,
        sources=[
            {"name": "photos", "kind": "image_folder", "path": str(root / "in" / "photos"),
             "sample": True},
            {"name": "alt", "kind": "table", "path": str(root / "in" / "alt.parquet"),
             "columns": {"key": "id", "image": "jpg", "caption": "alt_text"}, "sample": True},
        ],
        exports={"train": {"partitions": 3, "size_limit": 1 << 20}},
    )


def _snapshot(cfg):
    """Everything a rerun must reproduce: curated rows, rejects, export files."""
    table = lance.dataset(tables.layout(cfg).curated).to_table().sort_by("sample_id")
    export = tables.layout(cfg).export_dir("train")
    files = {}
    for dp, _, fs in os.walk(export):
        for f in fs:
            p = os.path.join(dp, f)
            files[os.path.relpath(p, export)] = open(p, "rb").read()
    # The manifest names the table version it exported: a rerun writes a new version
    # with the same rows, so only that field may differ.
    manifest = json.loads(files.pop("manifest.json"))
    manifest.pop("table_version"), manifest.pop("export_key")
    return table.to_pylist(), files, manifest


def test_pipeline_end_to_end_and_rerun_is_idempotent(spark, tmp_path):
    from mds_read import read_mds

    cfg = _cfg(tmp_path)
    run_id, cur, exports = run_all(cfg)

    # Accounting, from the sample definitions (not from the pipeline).
    counts = {c.source: c for c in cur.counts}
    n_folder = len(FOLDER_PHOTOS) + len(FOLDER_FLAGGED)
    assert (counts["photos"].seen, counts["photos"].accepted) == (
        n_folder + len(FOLDER_BAD), n_folder)
    assert counts["photos"].filtered == {"too_small": len(FOLDER_FLAGGED)}
    assert counts["photos"].reasons == {"empty": 1, "truncated": 1, "undecodable": 1}
    assert (counts["alt"].seen, counts["alt"].accepted) == (
        len(TABLE_PHOTOS) + 2, len(TABLE_PHOTOS))
    assert counts["alt"].reasons == {"missing_image": 1, "undecodable": 1}
    for c in cur.counts:
        assert c.seen == c.accepted + c.rejected

    # Lance via pylance.
    ds = lance.dataset(tables.layout(cfg).curated)
    n = n_folder + len(TABLE_PHOTOS)
    n_kept = n - len(FOLDER_FLAGGED)
    assert ds.count_rows() == n == cur.curated_rows
    flagged = ds.to_table(columns=["source_key", "filter_reason"], filter="NOT keep").to_pylist()
    assert flagged == [{"source_key": k, "filter_reason": "too_small"} for k in FOLDER_FLAGGED]
    meta = ds.to_table(columns=["sample_id", "source", "source_key", "caption_original",
                                "width", "height", "image"])
    rows = {r["source_key"]: r for r in meta.to_pylist()}
    assert rows["objects/rocket.jpg"]["caption_original"] == FOLDER_PHOTOS["rocket.jpg"][1]
    assert rows["graphics/logo.png"]["caption_original"] is None
    for r in rows.values():
        im = Image.open(io.BytesIO(r["image"]))
        assert im.format == "JPEG" and im.mode == "RGB" and im.size == (r["width"], r["height"])

    # Lance via Spark SQL.
    assert "curated" in register_views(spark, cfg)
    by_source = dict(spark.sql("SELECT source, count(*) FROM curated GROUP BY source").collect())
    assert by_source == {"photos": n_folder, "alt": len(TABLE_PHOTOS)}

    # Delta rejects.
    rejects = spark.read.format("delta").load(tables.layout(cfg).rejects)
    assert sorted((r.source, r.reason) for r in rejects.collect()) == sorted(
        [("photos", "empty"), ("photos", "truncated"), ("photos", "undecodable"),
         ("alt", "missing_image"), ("alt", "undecodable")])

    # MDS via StreamingDataset: every image decodes as JPEG; the kept rows of Lance.
    (exp,) = exports
    assert exp.samples == n_kept
    sds = read_mds(exp.path)
    assert len(sds) == n_kept
    seen = {}
    for s in sds:
        assert s["image"].format == "JPEG"
        s["image"].load()
        seen[s["sample_id"]] = s
    by_id = {r["sample_id"]: r for k, r in rows.items() if k not in FOLDER_FLAGGED}
    assert set(seen) == set(by_id)
    for sid, s in seen.items():
        assert s["caption"] == (by_id[sid]["caption_original"] or "")
        assert (s["width"], s["height"]) == (by_id[sid]["width"], by_id[sid]["height"])

    from etl.jobs.verify_export import verify_export

    report = verify_export(exp.path, loader_workers=2, loader_samples=8)
    assert report.ok, report.problems
    assert report.images_decoded == n_kept

    summary = json.load(open(os.path.join(tables.layout(cfg).reports_dir, run_id, "summary.json")))
    assert summary["curate"]["curated_rows"] == n

    # A second run on unchanged sources processes nothing (incremental): every record is
    # `unchanged`, the curated table gets no new version, the export is untouched.
    # Both stages see that from table logs and their derived state, without reading a
    # table through Spark.
    import etl.jobs.export as export_job
    import etl.lakehouse.source_diff as source_diff

    def not_on_a_quiet_night(*_a, **_k):
        raise AssertionError("read through Spark on a night with nothing new")

    before = _snapshot(cfg)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(source_diff, "list_sources", not_on_a_quiet_night)
        m.setattr(export_job, "_read_curated", not_on_a_quiet_night)
        _, cur2, exports2 = run_all(cfg)
    assert _snapshot(cfg) == before
    assert [(e.samples, e.checksum, e.unchanged) for e in exports2] == [
        (exp.samples, exp.checksum, True)]
    assert {c.source: (c.seen, c.unchanged) for c in cur2.counts} == {
        "photos": (0, counts["photos"].seen), "alt": (0, counts["alt"].seen)}
    assert lance.dataset(tables.layout(cfg).curated).version == ds.version
    assert spark.read.format("delta").load(tables.layout(cfg).rejects).count() == 5
    manifest = spark.read.format("delta").load(tables.layout(cfg).manifest)
    assert manifest.count() == counts["photos"].seen + counts["alt"].seen
