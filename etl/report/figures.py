"""The report's figures, as PNG files beside its page: counts per source and status,
reasons, resolution and aspect-ratio histograms, caption lengths, duplicate rates and
stage timings, drawn by matplotlib; and the contact sheets (:mod:`etl.report.sheets`,
composed by Pillow, with their thumbnails under ``thumbs/``).

Every text artist is drawn as plain text (:data:`PLAIN_TEXT`: no math text, no TeX),
so text from sources is never parsed as markup.

A chart is saved cropped to its artists, as ``bbox_inches="tight"`` crops it, but with
the box measured beforehand (:func:`tight_box`): ``"tight"`` runs a whole draw with
rendering off to lay the figure out, then measures and draws; measuring alone lays out
what it measures -- the same box, the same pixels (tests/test_report_figures.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

from etl.report import sheets
from etl.report.data import DedupSummary, ReportData
from etl.report.layout import THUMBS

__all__ = ["draw_figures", "draw_table_figures", "draw_run_figures", "Drawn", "PLAIN_TEXT",
           "CHARTS", "RUN_CHARTS", "tight_box", "save_chart"]

_COLORS = {"kept": "#2e7d32", "flagged": "#f9a825", "rejected": "#c62828",
           "errors": "#6a1b9a"}
# Every text artist is plain text: no math text ($...$), no TeX.
PLAIN_TEXT = {"text.parse_math": False, "text.usetex": False}
DPI = 100
PAD_INCHES = 0.1  # around the artists, as savefig's default pad_inches
# zlib level 1, as the contact sheets: for the charts ~13 ms less than the default 6
# over all seven, files ~8 % larger (tens of kB each).
_PNG = {"compress_level": sheets.PNG_LEVEL}


def tight_box(fig: Figure) -> Bbox:
    """The box (inches) ``bbox_inches="tight"`` would crop `fig` to at :data:`DPI`:
    its artists' extent padded by :data:`PAD_INCHES`, measured with the Agg renderer
    the PNG is drawn with (laid out, not drawn)."""
    fig.set_dpi(DPI)
    renderer = FigureCanvasAgg(fig).get_renderer()
    return fig.get_tightbbox(renderer).padded(PAD_INCHES)


def save_chart(fig: Figure, out_dir: str, name: str) -> str:
    """`fig` as ``<out_dir>/<name>`` (PNG), cropped to :func:`tight_box`."""
    fig.savefig(os.path.join(out_dir, name), dpi=DPI, bbox_inches=tight_box(fig),
                pil_kwargs=_PNG)
    return name


def _bar_counts(status: pd.DataFrame) -> Figure:
    fig = Figure(figsize=(7, 3.2))
    ax = fig.add_subplot()
    sources = list(status.index)
    left = np.zeros(len(sources))
    for col in ("kept", "flagged", "rejected", "errors"):
        vals = status[col].to_numpy() if col in status else np.zeros(len(sources))
        ax.barh(sources, vals, left=left, color=_COLORS[col], label=col)
        left += vals
    ax.set_xlabel("records")
    ax.set_title("Records per source and status")
    ax.legend(loc="lower right", fontsize=8)
    return fig


def _bar_reasons(reasons: pd.DataFrame) -> Figure:
    fig = Figure(figsize=(7, 0.4 * max(len(reasons), 3) + 1))
    ax = fig.add_subplot()
    if len(reasons):
        labels = [f"{r.kind}: {r.reason}" for r in reasons.itertuples()]
        colors = [_COLORS[{"rejected": "rejected", "error": "errors"}.get(r.kind, "flagged")]
                  for r in reasons.itertuples()]
        ax.barh(labels, reasons["count"], color=colors)
        ax.invert_yaxis()
    else:
        ax.text(0.5, 0.5, "no rejected or flagged records", ha="center", va="center")
    ax.set_xlabel("records")
    ax.set_title("Reject reasons (red), internal errors (purple), filter reasons (amber)")
    return fig


def _hist_resolution(meta: pd.DataFrame) -> Figure:
    fig = Figure(figsize=(10, 3.2))
    ax1, ax2 = fig.subplots(1, 2)
    if len(meta):
        mp = meta["width"] * meta["height"] / 1e6
        ax1.hist(mp, bins=30, color="#1565c0")
        short = np.minimum(meta["width"], meta["height"])
        ax2.hist(short, bins=30, color="#6a1b9a")
    ax1.set_xlabel("megapixels (stored)")
    ax1.set_ylabel("images")
    ax1.set_title("Resolution")
    ax2.set_xlabel("shorter side (px)")
    ax2.set_title("Shorter side")
    return fig


def _hist_aspect(meta: pd.DataFrame) -> Figure:
    fig = Figure(figsize=(7, 3.2))
    ax = fig.add_subplot()
    if len(meta):
        ratios = meta["width"] / meta["height"]
        ax.hist(np.log2(ratios), bins=30, color="#00838f")
        ticks = [-2, -1, 0, 1, 2]
        ax.set_xticks(ticks, [f"{2.0 ** t:g}" for t in ticks])
    ax.set_xlabel("aspect ratio width/height (log scale)")
    ax.set_ylabel("images")
    ax.set_title("Aspect ratio")
    return fig


def _hist_captions(meta: pd.DataFrame, versions: list[str]) -> Figure:
    fig = Figure(figsize=(7, 3.2))
    ax = fig.add_subplot()
    for col in versions:
        words = meta[col].dropna().map(lambda s: len(str(s).split()))
        if len(words):
            ax.hist(words, bins=20, alpha=0.6, label=f"{col} ({len(words)} captions)")
    if not versions or ax.get_legend_handles_labels()[0] == []:
        ax.text(0.5, 0.5, "no captions", ha="center", va="center")
    else:
        ax.legend(fontsize=8)
    ax.set_xlabel("caption length (words)")
    ax.set_ylabel("images")
    ax.set_title("Caption length per caption version")
    return fig


def _bar_dedup(dedup: DedupSummary | None) -> Figure:
    rows = [r for r in (dedup.per_source if dedup else []) if r["rows"]]
    fig = Figure(figsize=(7, 0.45 * max(len(rows), 2) + 1.2))
    ax = fig.add_subplot()
    if rows:
        names = [r["source"] for r in rows]
        exact = np.array([100 * r["exact_rate"] for r in rows])
        near = np.array([100 * r["near_rate"] for r in rows])
        ax.barh(names, exact, color="#5d4037", label="exact (same bytes as canonical)")
        ax.barh(names, near, left=exact, color="#bcaaa4", label="near (similar dHash)")
        ax.invert_yaxis()
        ax.set_xlim(0, max(5.0, float((exact + near).max()) * 1.2))
        ax.legend(loc="lower right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "dedup has not run" if dedup is None else "no rows",
                ha="center", va="center")
    ax.set_xlabel("% of the source's rows left out of exports as duplicates")
    ax.set_title("Duplicates per source (Delta dedup table)")
    return fig


def _bar_timings(seconds: dict[str, float]) -> Figure:
    fig = Figure(figsize=(7, 0.45 * max(len(seconds), 2) + 1))
    ax = fig.add_subplot()
    ax.barh(list(seconds), list(seconds.values()), color="#455a64")
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title("Stage timings")
    return fig

# The charts: report.json's figure key -> (file, how it is drawn from the report's data).
CHARTS = {
    "counts": ("counts.png", lambda d: _bar_counts(d.status)),
    "reasons": ("reasons.png", lambda d: _bar_reasons(d.reasons)),
    "resolution": ("resolution.png", lambda d: _hist_resolution(d.meta)),
    "aspect": ("aspect.png", lambda d: _hist_aspect(d.meta)),
    "captions": ("captions.png", lambda d: _hist_captions(d.meta, d.versions)),
    "dedup": ("dedup.png", lambda d: _bar_dedup(d.dedup)),
    "timings": ("timings.png",
                lambda d: _bar_timings(dict(d.outcome.seconds) or {"(none)": 0.0})),
}


@dataclass(frozen=True)
class Drawn:
    """The figures' file names by key, and the contact sheets' items (thumbnails)."""

    figures: dict[str, str]
    kept: list[dict]
    flagged: list[dict]
    clusters: list[list[dict]]


# The charts drawn from this run's outcome (its stages' timings); the others, and the
# contact sheets, are drawn from the tables alone (draw_table_figures).
RUN_CHARTS = ("timings",)


def draw_table_figures(data: ReportData, out_dir: str) -> Drawn:
    """The figures of `data` that the tables alone decide -- every chart but
    :data:`RUN_CHARTS`, the contact sheets -- into `out_dir` (thumbnails into its
    ``thumbs/``)."""
    os.makedirs(os.path.join(out_dir, THUMBS), exist_ok=True)
    figures = {key: save_chart(draw(data), out_dir, name)
               for key, (name, draw) in CHARTS.items() if key not in RUN_CHARTS}
    kept = sheets.thumbnails(data.kept, out_dir)
    flagged = sheets.thumbnails(data.flagged, out_dir)
    clusters = [sheets.thumbnails(c, out_dir) for c in data.clusters]
    figures["contact_kept"] = sheets.save_png(
        sheets.sheet(kept, "Random kept images"), out_dir, "contact_kept.png")
    figures["contact_flagged"] = sheets.save_png(
        sheets.sheet(flagged, "Flagged images and reasons"), out_dir, "contact_flagged.png")
    figures["contact_duplicates"] = sheets.save_png(
        sheets.clusters_sheet(clusters), out_dir, "contact_duplicates.png")
    return Drawn(figures, kept, flagged, clusters)


def draw_run_figures(data: ReportData, out_dir: str, drawn: Drawn) -> Drawn:
    """`drawn` (:func:`draw_table_figures`) with the :data:`RUN_CHARTS` of `data`'s
    outcome, every chart in :data:`CHARTS` order, then the contact sheets."""
    run = {key: save_chart(CHARTS[key][1](data), out_dir, CHARTS[key][0])
           for key in RUN_CHARTS}
    figures = {key: run[key] if key in run else drawn.figures[key] for key in CHARTS}
    figures.update((k, v) for k, v in drawn.figures.items() if k not in CHARTS)
    return Drawn(figures, drawn.kept, drawn.flagged, drawn.clusters)


def draw_figures(data: ReportData, out_dir: str) -> Drawn:
    """Every figure of `data` into `out_dir` (thumbnails into its ``thumbs/``)."""
    return draw_run_figures(data, out_dir, draw_table_figures(data, out_dir))
