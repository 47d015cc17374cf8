"""The report's figures, as PNG files beside its page: counts per source and status,
reasons, resolution and aspect-ratio histograms, caption lengths, duplicate rates,
stage timings, and the contact sheets (with their thumbnails under ``thumbs/``).

Every text artist is drawn as plain text (:data:`PLAIN_TEXT`: no math text, no TeX),
so text from sources is never parsed as markup.
"""

from __future__ import annotations

import io
import os
import textwrap
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from PIL import Image

from etl.report.data import DedupSummary, ReportData
from etl.report.layout import THUMBS, thumb_file

__all__ = ["draw_figures", "Drawn", "PLAIN_TEXT"]

_COLORS = {"kept": "#2e7d32", "flagged": "#f9a825", "rejected": "#c62828",
           "errors": "#6a1b9a"}
# Every text artist is plain text: no math text ($...$), no TeX.
PLAIN_TEXT = {"text.parse_math": False, "text.usetex": False}


def _save(fig: Figure, out_dir: str, name: str) -> str:
    fig.savefig(os.path.join(out_dir, name), dpi=100, bbox_inches="tight")
    return name


def _bar_counts(status: pd.DataFrame, out_dir: str) -> str:
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
    return _save(fig, out_dir, "counts.png")


def _bar_reasons(reasons: pd.DataFrame, out_dir: str) -> str:
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
    return _save(fig, out_dir, "reasons.png")


def _hist_resolution(meta: pd.DataFrame, out_dir: str) -> str:
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
    return _save(fig, out_dir, "resolution.png")


def _hist_aspect(meta: pd.DataFrame, out_dir: str) -> str:
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
    return _save(fig, out_dir, "aspect.png")


def _hist_captions(meta: pd.DataFrame, versions: list[str], out_dir: str) -> str:
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
    return _save(fig, out_dir, "captions.png")


def _bar_dedup(dedup: DedupSummary | None, out_dir: str) -> str:
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
    return _save(fig, out_dir, "dedup.png")


def _bar_timings(seconds: dict[str, float], out_dir: str) -> str:
    fig = Figure(figsize=(7, 0.45 * max(len(seconds), 2) + 1))
    ax = fig.add_subplot()
    ax.barh(list(seconds), list(seconds.values()), color="#455a64")
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title("Stage timings")
    return _save(fig, out_dir, "timings.png")

def _thumb(data: bytes, size: int = 192) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (size, size))
    im = im.convert("RGB")
    im.thumbnail((size, size))
    return im


def _thumbnails(rows: list[dict], out_dir: str) -> list[dict]:
    """`rows` with their thumbnail (saved as ``thumbs/<sample_id>.jpg``) instead of
    their image bytes."""
    items = []
    for r in rows:
        im = _thumb(r["image"])
        file = thumb_file(r["sample_id"])
        im.save(os.path.join(out_dir, file), "JPEG", quality=85)
        items.append({**{k: v for k, v in r.items() if k != "image"}, "thumb": im,
                      "file": file})
    return items


def _sheet_png(items: list[dict], title: str, out_dir: str, name: str) -> str:
    cols = 6
    rows = max(1, -(-len(items) // cols))
    fig = Figure(figsize=(cols * 2.2, rows * 2.7))
    fig.suptitle(title)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, item in zip(axes.flat, items, strict=False):
        ax.imshow(np.asarray(item["thumb"]))
        ax.set_title("\n".join(textwrap.wrap(item["label"], 28)[:3]), fontsize=7)
    if not items:
        axes[0, 0].text(0, 0.5, "none", fontsize=12)
    return _save(fig, out_dir, name)


def _clusters_png(clusters: list[list[dict]], out_dir: str) -> str:
    cols = max((len(c) for c in clusters), default=1)
    fig = Figure(figsize=(cols * 2.2, max(1, len(clusters)) * 2.7))
    fig.suptitle("Duplicate clusters, one per row: canonical member (exported) first")
    axes = fig.subplots(max(1, len(clusters)), cols, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for row, cluster in zip(axes, clusters, strict=False):
        for ax, item in zip(row, cluster, strict=False):
            ax.imshow(np.asarray(item["thumb"]))
            ax.set_title(f"{item['kind']}\n{item['source']}", fontsize=7,
                         color="#2e7d32" if item["kind"] == "canonical" else "#5d4037")
    if not clusters:
        axes[0, 0].text(0, 0.5, "no duplicate clusters", fontsize=12)
    return _save(fig, out_dir, "contact_duplicates.png")


@dataclass(frozen=True)
class Drawn:
    """The figures' file names by key, and the contact sheets' items (thumbnails)."""

    figures: dict[str, str]
    kept: list[dict]
    flagged: list[dict]
    clusters: list[list[dict]]


def draw_figures(data: ReportData, out_dir: str) -> Drawn:
    """Every figure of `data` into `out_dir` (thumbnails into its ``thumbs/``)."""
    os.makedirs(os.path.join(out_dir, THUMBS), exist_ok=True)
    meta = data.meta
    figures = {
        "counts": _bar_counts(data.status, out_dir),
        "reasons": _bar_reasons(data.reasons, out_dir),
        "resolution": _hist_resolution(meta, out_dir),
        "aspect": _hist_aspect(meta, out_dir),
        "captions": _hist_captions(meta, data.versions, out_dir),
        "dedup": _bar_dedup(data.dedup, out_dir),
        "timings": _bar_timings(dict(data.outcome.seconds) or {"(none)": 0.0}, out_dir),
    }
    kept = _thumbnails(data.kept, out_dir)
    flagged = _thumbnails(data.flagged, out_dir)
    figures["contact_kept"] = _sheet_png(kept, "Random kept images", out_dir,
                                         "contact_kept.png")
    figures["contact_flagged"] = _sheet_png(flagged, "Flagged images and reasons",
                                            out_dir, "contact_flagged.png")
    clusters = [_thumbnails(c, out_dir) for c in data.clusters]
    figures["contact_duplicates"] = _clusters_png(clusters, out_dir)
    return Drawn(figures, kept, flagged, clusters)
