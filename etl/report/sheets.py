"""The report's contact sheets, composed with Pillow: thumbnails pasted on a canvas in a
grid, each under its label, drawn with ImageDraw in matplotlib's DejaVu Sans.

A grid of matplotlib axes with ``imshow`` cost about 50 ms an image (axes, ticks and
layout for each, drawn twice by ``bbox_inches="tight"``); pasting costs well under 1 ms.
Labels are source text drawn as plain text: ImageDraw lays out glyphs, nothing parses
markup or math, and a label is wrapped to :data:`WRAP` characters a line, at most
:data:`LABEL_LINES` lines, each shortened with an ellipsis to its cell's width.
"""

from __future__ import annotations

import functools
import io
import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

from etl.report.layout import thumb_file

__all__ = ["Cell", "THUMB", "COLUMNS", "WRAP", "LABEL_LINES", "thumbnails", "sheet",
           "clusters_sheet", "wrapped", "save_png"]

THUMB = 192  # a thumbnail's longer side (px), as saved under thumbs/ and pasted
COLUMNS = 6  # cells per row of the kept and flagged sheets
WRAP = 28  # characters per label line
LABEL_LINES = 3
_PAD = 8  # px around a cell's thumbnail and between its label and thumbnail
_LABEL_PX, _LINE_PX = 11, 13  # label font size and line height
_TITLE_PX = 17
_CELL_W = THUMB + 2 * _PAD
_TEXT = (34, 34, 34)
_CANONICAL, _DUPLICATE = (46, 125, 50), (93, 64, 55)  # #2e7d32, #5d4037
# zlib level 1: photos, which level 6 does not shrink (the sample run's kept sheet:
# 688 kB at 1, 680 kB at 6) at twice the time (61 vs 139 ms).
PNG_LEVEL = 1


@functools.lru_cache(maxsize=4)
def _font(px: int) -> ImageFont.FreeTypeFont:
    """DejaVu Sans, as matplotlib ships it (its data folder; pyplot is not imported),
    laid out glyph by glyph as matplotlib does: Pillow's basic layout, not libraqm,
    whose shaping fails on some text (a line separator, U+2028) and would fail the
    report."""
    import matplotlib

    path = os.path.join(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSans.ttf")
    return ImageFont.truetype(path, px, layout_engine=ImageFont.Layout.BASIC)


@dataclass(frozen=True)
class Cell:
    """One image of a sheet: its thumbnail, its label lines and their colour."""

    thumb: Image.Image
    lines: tuple[str, ...]
    color: tuple[int, int, int] = _TEXT


def _thumb(data: bytes, size: int = THUMB) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (size, size))
    im = im.convert("RGB")
    im.thumbnail((size, size))
    return im


def thumbnails(rows: list[dict], out_dir: str) -> list[dict]:
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


def wrapped(label: str) -> tuple[str, ...]:
    """A label's lines on a sheet: wrapped at :data:`WRAP` characters, the first
    :data:`LABEL_LINES` of them (textwrap turns newlines and tabs into spaces)."""
    return tuple(textwrap.wrap(label, WRAP)[:LABEL_LINES])


def _fit(text: str, font: ImageFont.FreeTypeFont, width: int) -> str:
    """`text`, shortened with an ellipsis until it is at most `width` px wide."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "\u2026") > width:
        text = text[:-1]
    return text + "\u2026"


def _filling(thumb: Image.Image) -> Image.Image:
    """`thumb` as large as fits a THUMB box: a smaller image (a tiny near duplicate)
    enlarged, pixels kept square (nearest neighbour), as imshow showed it."""
    w, h = thumb.size
    if max(w, h) >= THUMB or min(w, h) < 1:
        return thumb
    scale = THUMB / max(w, h)
    return thumb.resize((max(1, round(w * scale)), max(1, round(h * scale))),
                        Image.Resampling.NEAREST)


def _compose(title: str, rows: Sequence[Sequence[Cell]], columns: int, label_lines: int,
             empty: str) -> Image.Image:
    """The sheet: `title` on top, then a row of cells per entry of `rows` (each cell its
    label lines, bottom-aligned, above its thumbnail fitted and centred in a THUMB
    box); `empty` in place of the cells when there are none."""
    title_font, label_font = _font(_TITLE_PX), _font(_LABEL_PX)
    cell_h = label_lines * _LINE_PX + THUMB + 2 * _PAD
    top = _TITLE_PX + 3 * _PAD
    width = max(columns * _CELL_W, int(title_font.getlength(title)) + 4 * _PAD)
    height = top + max(1, len(rows)) * cell_h
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((width // 2, _PAD), title, fill=_TEXT, font=title_font, anchor="mt")
    if not any(rows):
        draw.text((_PAD, top + cell_h // 2), empty, fill=_TEXT, font=title_font, anchor="lm")
    x0 = (width - columns * _CELL_W) // 2
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            x, y = x0 + c * _CELL_W, top + r * cell_h
            first = y + _PAD + (label_lines - len(cell.lines)) * _LINE_PX
            for i, line in enumerate(cell.lines):
                draw.text((x + _CELL_W // 2, first + i * _LINE_PX),
                          _fit(line, label_font, _CELL_W - 2), fill=cell.color,
                          font=label_font, anchor="mt")
            box_y = y + _PAD + label_lines * _LINE_PX
            thumb = _filling(cell.thumb)
            tw, th = thumb.size
            canvas.paste(thumb, (x + _PAD + (THUMB - tw) // 2, box_y + (THUMB - th) // 2))
    return canvas


def save_png(im: Image.Image, out_dir: str, name: str) -> str:
    im.save(os.path.join(out_dir, name), "PNG", compress_level=PNG_LEVEL)
    return name


def sheet(items: list[dict], title: str) -> Image.Image:
    """The kept or flagged sheet: :data:`COLUMNS` images a row, each under its label."""
    cells = [Cell(it["thumb"], wrapped(it["label"])) for it in items]
    rows = [cells[i:i + COLUMNS] for i in range(0, len(cells), COLUMNS)]
    return _compose(title, rows, COLUMNS, LABEL_LINES, "none")


def clusters_sheet(clusters: list[list[dict]]) -> Image.Image:
    """The duplicates' sheet: a cluster a row, canonical member (green) first, each
    image under its kind and source."""
    rows = [[Cell(it["thumb"], (it["kind"], it["source"]),
                  _CANONICAL if it["kind"] == "canonical" else _DUPLICATE)
             for it in cluster] for cluster in clusters]
    columns = max((len(c) for c in clusters), default=1)
    return _compose("Duplicate clusters, one per row: canonical member (exported) first",
                    rows, columns, 2, "no duplicate clusters")
