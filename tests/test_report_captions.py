"""The report's caption versions, read from a curated Lance table written here (no Spark):
the source caption and each caption version's caption column, never the provenance
columns the caption stage writes beside it; the kept images' sheet labelled with the
newest version's captions."""

from __future__ import annotations

import io
import json
from datetime import datetime

import lance
import matplotlib
import pyarrow as pa
import pytest
from conftest import make_config
from PIL import Image

from etl import tables
from etl.report import data as report_data
from etl.report import figures
from etl.report.html import page
from etl.runtime.outcome import RunOutcome

ROWS = 6  # the first four kept, the last two flagged
PARAMS = json.dumps({"backend": "transformers", "max_new_tokens": 32, "temperature": 1.0})


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (30 * i, 100, 200 - 20 * i)).save(buf, format="JPEG")
    return buf.getvalue()


def _version(name: str, captions: list[str]) -> dict[str, pa.Array]:
    """A caption version's columns as the caption stage names them, written out."""
    s = pa.string()
    return {
        f"caption_{name}": pa.array(captions, s),
        f"caption_{name}_status": pa.array(["ok"] * ROWS, s),
        f"caption_{name}_error": pa.array([None] * ROWS, s),
        f"caption_{name}_flags": pa.array([""] * ROWS, s),
        f"caption_{name}_tokens": pa.array([7] * ROWS, pa.int32()),
        f"caption_{name}_model": pa.array(["tiny-qwen2_5_vl"] * ROWS, s),
        f"caption_{name}_prompt_sha256": pa.array(["ab" * 32] * ROWS, s),
        f"caption_{name}_params": pa.array([PARAMS] * ROWS, s),
        f"caption_{name}_at": pa.array([datetime(2024, 5, 1)] * ROWS, pa.timestamp("us")),
    }


def _curated(path: str) -> None:
    ids = [f"s{i}" for i in range(ROWS)]
    base = {
        "sample_id": pa.array(ids), "source": pa.array(["pics"] * ROWS),
        "caption_original": pa.array([f"source caption {i}" for i in range(ROWS)]),
        "image": pa.array([_jpeg(i) for i in range(ROWS)], pa.binary()),
        "width": pa.array([64] * ROWS, pa.int32()), "height": pa.array([48] * ROWS, pa.int32()),
        "aspect_ratio": pa.array([64 / 48] * ROWS, pa.float32()),
        "keep": pa.array([True] * 4 + [False] * 2),
        "filter_reason": pa.array([None] * 4 + ["too_small"] * 2, pa.string()),
        "image_sha256": pa.array([f"{i:064x}" for i in range(ROWS)]),
        "dhash": pa.array(list(range(ROWS)), pa.int64()),
        # A string column named caption* that no caption version wrote.
        "caption_notes": pa.array(["a note"] * ROWS),
    }
    older = _version("hq_v2", [f"older caption {i}" for i in range(ROWS)])
    newest = _version("smoke", [f"a smoke caption of image {i}" for i in range(ROWS)])
    lance.write_dataset(pa.table({**base, **older, **newest}), path)


def test_caption_versions_are_the_source_and_each_versions_caption_column():
    s = pa.string()
    schema = pa.schema([
        ("sample_id", s), ("caption_original", s), ("caption_notes", s),
        ("caption_smoke", s), ("caption_smoke_status", s), ("caption_smoke_error", s),
        ("caption_smoke_flags", s), ("caption_smoke_tokens", pa.int32()),
        ("caption_smoke_model", s), ("caption_smoke_prompt_sha256", s),
        ("caption_smoke_params", s), ("caption_smoke_at", pa.timestamp("us")),
    ])
    assert report_data.caption_versions(schema) == ["caption_original", "caption_smoke"]
    # Without its provenance columns a caption_* column is not a version.
    assert report_data.caption_versions(pa.schema([("caption_original", s),
                                                   ("caption_smoke", s)])) == [
        "caption_original"]


def test_the_report_plots_real_versions_and_labels_kept_images_with_captions(
        tmp_path, monkeypatch):
    cfg = make_config(tmp_path, run={"report_samples": 4})
    _curated(tables.layout(cfg).curated)
    # No rejects table here; the real helper would ask Spark whether there is one.
    monkeypatch.setattr(report_data, "_rejects_counts", lambda *a: None)
    outcome = RunOutcome(run_id="r1", stages=["curate", "caption"])

    data = report_data.read_report(None, cfg, outcome)

    assert data.versions == ["caption_original", "caption_hq_v2", "caption_smoke"]
    assert [c["version"] for c in data.captions] == data.versions
    assert data.caption_col == "caption_smoke"
    assert sorted(it["sample_id"] for it in data.kept) == ["s0", "s1", "s2", "s3"]
    for it in data.kept:
        assert it["label"] == f"a smoke caption of image {it['sample_id'][1:]}"
    assert [it["label"] for it in data.flagged] == ["too_small", "too_small"]

    out = tmp_path / "report"
    out.mkdir()
    with matplotlib.rc_context(figures.PLAIN_TEXT):
        drawn = figures.draw_figures(data, str(out))
    html = page(data, drawn)
    assert "with their captions: caption_smoke (the newest caption version)</h2>" in html
    assert "a smoke caption of image 0" in html
    assert "max_new_tokens" not in html and "caption_smoke_params" not in html


@pytest.mark.parametrize("columns, shown", [
    (["sample_id", "caption_original"], "captions: caption_original (the source's)"),
    (["sample_id"], "captions (none in the table)"),
])
def test_without_a_caption_version_the_sheet_shows_the_source_caption(columns, shown):
    schema = pa.schema([(c, pa.string()) for c in columns])
    versions = report_data.caption_versions(schema)
    assert report_data.sheet_caption(versions) == (
        "caption_original" if "caption_original" in columns else None)
    from etl.report.html import _sheet_caption

    assert _sheet_caption(report_data.sheet_caption(versions)) == shown


def test_a_report_drafted_while_the_export_runs_is_the_report_written_after_it(
        tmp_path, monkeypatch):
    """The runner starts the report's table part on a thread while a last stage that
    keeps the tables runs (the export), and adds the run's part once it has ended: the
    page, report.json and the figures are those of a report written in one go."""
    from etl.report import ReportDraft, write_report

    cfg = make_config(tmp_path, run={"report_samples": 4})
    _curated(tables.layout(cfg).curated)
    monkeypatch.setattr(report_data, "_rejects_counts", lambda *a: None)
    outcome = RunOutcome(run_id="r1", stages=["curate", "export"])
    drafted, whole = tmp_path / "drafted", tmp_path / "whole"
    draft = ReportDraft(None, cfg, outcome, str(drafted), ("g", "report"))
    outcome.seconds.update({"curate": 3.0, "export": 1.5})  # the export ran meanwhile
    write_report(None, cfg, outcome, str(drafted), draft)
    write_report(None, cfg, outcome, str(whole))
    assert (drafted / "index.html").read_text() == (whole / "index.html").read_text()
    meta = json.loads((drafted / "report.json").read_text())
    assert meta == json.loads((whole / "report.json").read_text())
    assert list(meta["figures"])[:7] == list(figures.CHARTS)
    assert sorted(p.name for p in drafted.rglob("*")) == sorted(p.name for p in whole.rglob("*"))
    assert meta["seconds"] == {"curate": 3.0, "export": 1.5}
