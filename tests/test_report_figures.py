"""The report's figures without a run (no Spark): charts saved with their tight box
measured once are the pixels ``bbox_inches="tight"`` draws; contact sheets composed by
Pillow hold every thumbnail, a row per six images (or per cluster), labels as plain
text cut to their cell; the page escapes source text."""

from __future__ import annotations

import io
import json
import os

import matplotlib
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from etl.report import figures, sheets
from etl.report.data import DedupSummary, ReportData
from etl.report.html import page
from etl.runtime.outcome import RunOutcome

HOSTILE = "Earn $100 #1 tip $5 <script>alert(1)</script> & $x^2$ \\frac{1}{0}"


def _png(size, color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _data(kept=(), flagged=(), clusters=(), reasons=None, dedup=None) -> ReportData:
    rng = np.random.default_rng(0)
    meta = pd.DataFrame({
        "sample_id": [f"s{i}" for i in range(50)], "source": "pics",
        "width": rng.integers(64, 2000, 50), "height": rng.integers(64, 2000, 50),
        "keep": True, "caption_original": [f"a photo of {i} things" for i in range(50)],
    })
    status = pd.DataFrame({"kept": [40, 5], "flagged": [3, 0], "rejected": [2, 1],
                           "errors": [0, 1]}, index=["pics", "a-much-longer-source-name"])
    status["total"] = status.sum(axis=1)
    if reasons is None:
        reasons = pd.DataFrame({"kind": ["rejected", "flagged"],
                                "reason": ["undecodable", "too_small"], "count": [3, 3]})
    outcome = RunOutcome(run_id="r1", stages=["curate", "dedup"],
                         seconds={"curate": 12.5, "dedup": 3.25})
    return ReportData(
        run_id="r1", outcome=outcome, curated_path="/x/curated.lance",
        dedup_path="/x/dedup", curated_version=3, curated_rows=50, status=status,
        reasons=reasons, meta=meta, versions=["caption_original"], sampled=False,
        dedup=dedup, kept=list(kept), flagged=list(flagged), clusters=list(clusters),
        run_rows=[], stage_rows=[], exports=[], captions=[])


def _row(i, size=(400, 200), label="a caption", **kw):
    color = (10 + 20 * i, 200 - 15 * i, 90)
    return {"sample_id": f"id{i}", "source": "pics", "image": _png(size, color),
            "label": label, **kw}, color


def _pixels_of(im: Image.Image, color, tol=3) -> int:
    a = np.asarray(im.convert("RGB")).astype(int)
    return int((np.abs(a - np.array(color)).max(axis=2) <= tol).sum())


def _ink(a: np.ndarray) -> int:
    return int((a.min(axis=2) < 128).sum())


@pytest.mark.parametrize("reasons", [
    None,
    pd.DataFrame({"kind": ["rejected", "flagged", "error"],
                  "reason": ["x" * 120, HOSTILE, "internal_error"], "count": [2, 1, 1]}),
    pd.DataFrame(columns=["kind", "reason", "count"]),
])
def test_a_chart_measured_once_is_the_picture_tight_draws(tmp_path, reasons):
    """Every chart, cropped to the box measured beforehand, has the pixels of the same
    figure saved with bbox_inches="tight" (a 120-character reason runs off the
    figure's left edge: the box grows past it, as tight's does)."""
    dedup = DedupSummary(table_version=2, covered_version=3, coverage=None, clusters=1,
                         rows_in_clusters=2,
                         per_source=[{"source": "pics", "rows": 40, "canonical": 1,
                                      "exact": 1, "near": 0, "unique": 38,
                                      "exact_rate": 0.025, "near_rate": 0.0}])
    data = _data(reasons=reasons, dedup=dedup)
    with matplotlib.rc_context(figures.PLAIN_TEXT):
        for file, draw in figures.CHARTS.values():
            ours = figures.save_chart(draw(data), str(tmp_path), "ours-" + file)
            draw(data).savefig(tmp_path / ("tight-" + file), dpi=100, bbox_inches="tight")
            a = np.asarray(Image.open(tmp_path / ours).convert("RGBA"))
            b = np.asarray(Image.open(tmp_path / ("tight-" + file)).convert("RGBA"))
            assert a.shape == b.shape and (a == b).all(), file
    if reasons is not None and len(reasons):
        # The long reason widened the reasons chart past the figure's 7 inches.
        assert Image.open(tmp_path / "ours-reasons.png").size[0] > 7 * 100


def test_a_contact_sheet_holds_every_thumbnail_six_a_row(tmp_path):
    os.makedirs(tmp_path / "thumbs")
    heights = {}
    for n in (1, 6, 7, 13):
        rows, colors = zip(*[_row(i) for i in range(n)], strict=True)
        items = sheets.thumbnails(list(rows), str(tmp_path))
        im = sheets.sheet(items, "Random kept images")
        heights[n] = im.size[1]
        assert im.size[0] >= 6 * 192  # six cells a row, however few images
        for color in colors:  # each 400x200 photo at its thumbnail's size, 192x96
            assert abs(_pixels_of(im, color) - 192 * 96) < 192 * 4, (n, color)
        for r in rows:
            assert Image.open(tmp_path / "thumbs" / f"{r['sample_id']}.jpg").size == (192, 96)
    # A row per six: 1 and 6 one row, 7 two, 13 three, each row taller than a thumbnail.
    assert heights[1] == heights[6] < heights[7] < heights[13]
    assert heights[13] - heights[7] == heights[7] - heights[6] > 192
    empty = sheets.sheet([], "Flagged images and reasons")
    assert empty.size[1] == heights[1] and _ink(np.asarray(empty)) > 0  # title, "none"


def test_a_small_image_fills_its_cell_as_imshow_showed_it(tmp_path):
    os.makedirs(tmp_path / "thumbs")
    row, color = _row(0, size=(40, 30))
    im = sheets.sheet(sheets.thumbnails([row], str(tmp_path)), "t")
    assert _pixels_of(im, color) == 192 * 144  # 40x30 enlarged to 192x144, square pixels


def test_labels_are_plain_text_wrapped_and_cut_to_their_cell(tmp_path):
    os.makedirs(tmp_path / "thumbs")
    # The text as it is, newlines as spaces, wrapped at 28 characters.
    assert sheets.wrapped("$x^2$ \\frac{1}{0}\n<b>bold</b>") == (
        "$x^2$ \\frac{1}{0}", "<b>bold</b>")
    lines = sheets.wrapped("w " * 200)
    assert len(lines) == 3 and all(len(line) <= 28 for line in lines)

    def label_ink(label):
        row, _ = _row(0, label=label)
        im = np.asarray(sheets.sheet(sheets.thumbnails([row], str(tmp_path)), "t"))
        cell = im.shape[1] // 6
        band = im[30:130]  # below the title, above the (192x96) thumbnail
        return _ink(band[:, :cell]), _ink(band[:, cell:])

    # Dollar signs are drawn, not read as math: "$x$" inks more than "x" (math text
    # would draw an italic x and no dollars).
    assert label_ink("$x$")[0] > label_ink("x")[0] + 20
    # A line of wide glyphs is cut to its cell: nothing drawn in the next one.
    inside, outside = label_ink("W" * 28)
    assert inside > 0 and outside == 0


def test_any_text_a_source_holds_is_drawn_without_failing_the_sheet(tmp_path):
    """Control characters, NUL, line and paragraph separators (which libraqm's shaping
    refuses), bidi overrides, emoji, CJK, right-to-left, combining marks, a lone
    surrogate: each label is drawn, the sheet is made."""
    os.makedirs(tmp_path / "thumbs")
    labels = ["nul\x00byte \x05\x16 ctl", "x\u2028y\u2029z\x85w\x1c\x1d\x1e",
              "\u202e reversed \u202c", "emoji \U0001F600 \u4e2d\u6587 \u05e2\u05d1",
              "e\u0301\u0301\u0301", "\ud800 lone \ufeff\uffff", HOSTILE]
    rows = [_row(i, label=label)[0] for i, label in enumerate(labels)]
    im = np.asarray(sheets.sheet(sheets.thumbnails(rows, str(tmp_path)), "t"))
    cell = im.shape[1] // 6
    for i in range(6):  # every label of the first row inked its cell
        assert _ink(im[30:130, i * cell:(i + 1) * cell]) > 0, labels[i]


def test_a_clusters_sheet_is_a_row_per_cluster_canonical_first(tmp_path):
    os.makedirs(tmp_path / "thumbs")
    clusters, colors = [], []
    for c, n in enumerate((3, 2)):
        members = []
        for j in range(n):
            row, color = _row(10 * c + j, kind="canonical" if j == 0 else "exact",
                              cluster=f"c{c}")
            members.append({**row, "size": n})
            colors.append(color)
        clusters.append(sheets.thumbnails(members, str(tmp_path)))
    im = sheets.clusters_sheet(clusters)
    one = sheets.clusters_sheet(clusters[:1])
    assert im.size[0] == one.size[0] >= 3 * 192  # three columns: the largest cluster
    assert im.size[1] - one.size[1] > 192  # a row per cluster
    for color in colors:
        assert abs(_pixels_of(im, color) - 192 * 96) < 192 * 4
    assert _pixels_of(im, (46, 125, 50), tol=40) > 20  # the canonical members' labels
    assert _ink(np.asarray(sheets.clusters_sheet([]))) > 0


def test_draw_figures_and_the_page_without_a_run(tmp_path):
    kept = [_row(i, label=HOSTILE if i == 0 else f"caption {i}")[0] for i in range(8)]
    flagged = [_row(20, label="too_small")[0]]
    data = _data(kept=kept, flagged=flagged)
    with matplotlib.rc_context(figures.PLAIN_TEXT):
        drawn = figures.draw_figures(data, str(tmp_path))
    assert set(drawn.figures) == {*figures.CHARTS, "contact_kept", "contact_flagged",
                                  "contact_duplicates"}
    for name in drawn.figures.values():
        with Image.open(tmp_path / name) as im:
            assert im.format == "PNG" and min(im.size) > 100, name
    assert [it["sample_id"] for it in drawn.kept] == [r["sample_id"] for r in kept]
    for it in drawn.kept + drawn.flagged:
        assert os.path.isfile(tmp_path / it["file"])
    html = page(data, drawn)
    assert "<script>alert(1)</script>" not in html
    assert "Earn $100 #1 tip $5 &lt;script&gt;alert(1)&lt;/script&gt; &amp; $x^2$" in html
    json.dumps(drawn.figures)  # report.json's figures: file names
