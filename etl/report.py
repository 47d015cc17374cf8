"""The run report: ``<root>/reports/<run_id>/index.html`` and the same figures as PNG.

What it shows: this run's accounting (seen / accepted / rejected / flagged / removed per
source) and stage timings; the corpus as the run left it -- rows per source and status, reject
and filter reasons, resolution and aspect-ratio histograms, caption length per caption
version (every ``caption*`` string column of the curated table), duplicate rates (same
``image_sha256``, same ``dhash``, and any ``*dup*`` column a dedup stage added); and
contact sheets of random kept images with their captions and of flagged images with
their reasons. Counts come from Spark over the whole tables; histograms from up to
``run.report_max_rows`` rows sampled by pylance; images are read only for the sheets.
"""

from __future__ import annotations

import hashlib
import html
import io
import json
import os
import random
import textwrap
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from PIL import Image

from etl import tables
from etl.config import Config

__all__ = ["write_report", "caption_versions", "dedup_rates"]

_META = ["sample_id", "source", "width", "height", "aspect_ratio", "keep", "filter_reason",
         "image_sha256", "dhash"]
_COLORS = {"kept": "#2e7d32", "flagged": "#f9a825", "rejected": "#c62828"}


def caption_versions(schema) -> list[str]:
    """The caption versions of the curated table: its string columns named caption*."""
    import pyarrow as pa

    return [f.name for f in schema if f.name.startswith("caption")
            and (pa.types.is_string(f.type) or pa.types.is_large_string(f.type))]


def dedup_rates(meta: pd.DataFrame) -> dict[str, float]:
    """Share of rows that repeat an earlier row's image (exact) or dHash (near), and of
    rows a dedup stage marked (boolean ``*dup*`` columns true, other ones non-null)."""
    n = len(meta)
    if not n:
        return {}
    rates = {
        "exact (same image_sha256)": 1 - meta["image_sha256"].nunique() / n,
        "near (same dhash)": 1 - meta["dhash"].nunique() / n,
    }
    for col in meta.columns:
        if "dup" in col.lower():
            s = meta[col]
            rates[f"{col} (dedup stage)"] = float(s.astype(bool).mean() if s.dtype == bool
                                                  else s.notna().mean())
    return rates


def _save(fig: Figure, out_dir: str, name: str) -> str:
    fig.savefig(os.path.join(out_dir, name), dpi=100, bbox_inches="tight")
    return name


def _bar_counts(status: pd.DataFrame, out_dir: str) -> str:
    fig = Figure(figsize=(7, 3.2))
    ax = fig.add_subplot()
    sources = list(status.index)
    left = np.zeros(len(sources))
    for col in ("kept", "flagged", "rejected"):
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
        colors = [_COLORS["rejected" if r.kind == "rejected" else "flagged"]
                  for r in reasons.itertuples()]
        ax.barh(labels, reasons["count"], color=colors)
        ax.invert_yaxis()
    else:
        ax.text(0.5, 0.5, "no rejected or flagged records", ha="center", va="center")
    ax.set_xlabel("records")
    ax.set_title("Reject reasons (red) and filter reasons (amber)")
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


def _bar_dedup(rates: dict[str, float], out_dir: str) -> str:
    fig = Figure(figsize=(7, 0.45 * max(len(rates), 2) + 1))
    ax = fig.add_subplot()
    if rates:
        ax.barh(list(rates), [100 * v for v in rates.values()], color="#5d4037")
        ax.invert_yaxis()
        ax.set_xlim(0, max(5, 100 * max(rates.values()) * 1.2))
    ax.set_xlabel("% of rows")
    ax.set_title("Duplicate rates")
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


def _contact_items(ds, meta: pd.DataFrame, caption_col: str | None, n: int, seed: int,
                   kept: bool, thumbs_dir: str) -> list[dict]:
    pool = meta[meta["keep"] == kept]["sample_id"].tolist()
    chosen = random.Random(seed).sample(sorted(pool), min(n, len(pool)))
    if not chosen:
        return []
    cols = ["sample_id", "source", "image", "filter_reason"] + (
        [caption_col] if caption_col else [])
    ids = ", ".join(f"'{s}'" for s in chosen)
    rows = {r["sample_id"]: r for r in
            ds.to_table(columns=cols, filter=f"sample_id IN ({ids})").to_pylist()}
    items = []
    for sid in chosen:
        r = rows[sid]
        im = _thumb(r["image"])
        path = os.path.join(thumbs_dir, f"{sid}.jpg")
        im.save(path, "JPEG", quality=85)
        if kept:
            text = (r.get(caption_col) if caption_col else None) or "(no caption)"
        else:
            text = r["filter_reason"] or "(no reason)"
        items.append({"sample_id": sid, "source": r["source"], "label": text, "thumb": im,
                      "file": f"thumbs/{sid}.jpg"})
    return items


def _table(df: pd.DataFrame) -> str:
    return df.to_html(index=False, border=0, classes="t", escape=True)


def _sheet_html(items: list[dict]) -> str:
    if not items:
        return "<p>none</p>"
    cells = [
        f'<figure><img src="{html.escape(it["file"])}" alt="{html.escape(it["sample_id"])}">'
        f"<figcaption><b>{html.escape(it['source'])}</b> {html.escape(it['label'])}"
        "</figcaption></figure>"
        for it in items
    ]
    return '<div class="sheet">' + "".join(cells) + "</div>"


_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1280px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table.t{border-collapse:collapse;font-size:13px}table.t td,table.t th{padding:3px 10px;
border-bottom:1px solid #eee;text-align:right}table.t th{background:#f4f4f4}
img.fig{max-width:100%;border:1px solid #eee;margin:6px 0}
.sheet{display:grid;grid-template-columns:repeat(auto-fill,minmax(200px,1fr));gap:10px}
.sheet figure{margin:0;background:#fafafa;border:1px solid #eee;padding:4px}
.sheet img{width:100%;height:180px;object-fit:contain;background:#fff}
.sheet figcaption{font-size:12px;line-height:1.3;max-height:4em;overflow:hidden}
.meta{color:#555;font-size:13px}
"""


def write_report(spark, cfg: Config, outcome: Any, out_dir: str | None = None) -> str:
    """Write the report of `outcome` (an :class:`etl.pipeline.outcome.RunOutcome`) into `out_dir`
    (default ``<root>/reports/<run_id>``, a local path); returns its index.html."""
    import lance
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    run_id = outcome.run_id
    paths = tables.layout(cfg)
    out_dir = out_dir or paths.report_dir(run_id)
    thumbs_dir = os.path.join(out_dir, "thumbs")
    os.makedirs(thumbs_dir, exist_ok=True)
    curated_path, rejects_path = paths.curated, paths.rejects
    seed = int(hashlib.sha256(run_id.encode()).hexdigest()[:8], 16)

    try:
        ds = lance.dataset(curated_path)
    except (ValueError, OSError):
        ds = None
    # Counts over the whole tables (Spark), by source and status / reason.
    status = pd.DataFrame({"kept": pd.Series(dtype="int64"),
                           "flagged": pd.Series(dtype="int64")})
    reasons = pd.DataFrame(columns=["kind", "reason", "count"])
    if ds is not None:
        cur = (spark.read.format("lance").option("columns", "source,keep,filter_reason")
               .load(curated_path).groupBy("source", "keep", "filter_reason").count()
               .toPandas())
        kept = cur[cur["keep"]].groupby("source")["count"].sum()
        flagged = cur[~cur["keep"]].groupby("source")["count"].sum()
        status = pd.DataFrame({"kept": kept, "flagged": flagged})
        fr = cur[~cur["keep"]].groupby("filter_reason")["count"].sum().reset_index()
        reasons = pd.concat([reasons, pd.DataFrame(
            {"kind": "flagged", "reason": fr["filter_reason"], "count": fr["count"]})])
    if DeltaTable.isDeltaTable(spark, rejects_path):
        rej = (spark.read.format("delta").load(rejects_path)
               .groupBy("source", "reason").agg(F.count("*").alias("count")).toPandas())
        status = status.join(rej.groupby("source")["count"].sum().rename("rejected"),
                             how="outer")
        rr = rej.groupby("reason")["count"].sum().reset_index()
        reasons = pd.concat([pd.DataFrame({"kind": "rejected", "reason": rr["reason"],
                                           "count": rr["count"]}), reasons])
    for col in ("kept", "flagged", "rejected"):
        status[col] = status[col].fillna(0).astype(int) if col in status else 0
    status = status.sort_index()
    status["total"] = status[["kept", "flagged", "rejected"]].sum(axis=1)
    reasons = reasons.sort_values(["kind", "count"], ascending=[False, False])

    # Per-row figures from (a sample of) the metadata columns: never the image bytes.
    versions: list[str] = []
    meta = pd.DataFrame(columns=_META)
    sampled = False
    if ds is not None:
        versions = caption_versions(ds.schema)
        dup_cols = [f.name for f in ds.schema if "dup" in f.name.lower()]
        cols = _META + versions + dup_cols
        n_rows = ds.count_rows()
        if n_rows > cfg.run.report_max_rows:
            meta = ds.sample(cfg.run.report_max_rows, columns=cols).to_pandas()
            sampled = True
        else:
            meta = ds.to_table(columns=cols).to_pandas()
    rates = dedup_rates(meta)
    figures = {
        "counts": _bar_counts(status, out_dir),
        "reasons": _bar_reasons(reasons, out_dir),
        "resolution": _hist_resolution(meta, out_dir),
        "aspect": _hist_aspect(meta, out_dir),
        "captions": _hist_captions(meta, versions, out_dir),
        "dedup": _bar_dedup(rates, out_dir),
        "timings": _bar_timings(dict(outcome.seconds) or {"(none)": 0.0}, out_dir),
    }
    caption_col = versions[-1] if versions else None
    n = cfg.run.report_samples
    kept_items = flagged_items = []
    if ds is not None and n:
        kept_items = _contact_items(ds, meta, caption_col, n, seed, True, thumbs_dir)
        flagged_items = _contact_items(ds, meta, None, n, seed, False, thumbs_dir)
    figures["contact_kept"] = _sheet_png(kept_items, "Random kept images", out_dir,
                                         "contact_kept.png")
    figures["contact_flagged"] = _sheet_png(flagged_items, "Flagged images and reasons",
                                            out_dir, "contact_flagged.png")

    # This run's accounting and stages.
    run_rows = []
    if outcome.detail("curate") is not None:
        for c in outcome.detail("curate").counts:
            run_rows.append({"source": c.source, "seen": c.seen, "accepted": c.accepted,
                             "rejected": c.rejected, "flagged": sum(c.filtered.values()),
                             "removed": sum(c.removed.values()),
                             "reasons": ", ".join(f"{k}={v}" for k, v in
                                                  {**c.reasons, **c.filtered,
                                                   **c.removed}.items())})
    stage_rows = [
        {"stage": name, "seconds": round(outcome.seconds.get(name, 0.0), 1),
         "note": (res.note or ""),
         "outputs": ", ".join(f"{k}={v}" for k, v in res.outputs.items()
                              if ":" not in k),
         "versions": ", ".join(f"{k}={v}" for k, v in res.table_versions.items())}
        for name, res in outcome.results.items()
    ]
    caption_rows = [
        {"version": c, "captions": int(meta[c].notna().sum()),
         "empty": int(meta[c].isna().sum()),
         "mean words": round(float(meta[c].dropna().map(lambda s: len(str(s).split()))
                                   .mean()), 1) if meta[c].notna().any() else 0.0}
        for c in versions
    ]
    exports = [{"export": name, **{k: m[k] for k in ("samples", "shards", "table_version",
                                                     "checksum")}}
               for res in outcome.results.values() for name, m in res.manifests.items()]

    def fig(key: str, alt: str) -> str:
        return f'<img class="fig" src="{figures[key]}" alt="{html.escape(alt)}">'

    sample_note = (f" (histograms from a random sample of {len(meta):,} rows)" if sampled
                   else "")
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>lakeshard run {html.escape(run_id)}</title><style>{_CSS}</style></head><body>",
        f"<h1>lakeshard run {html.escape(run_id)}</h1>",
        f"<p class='meta'>stages: {html.escape(', '.join(outcome.stages))} &middot; "
        f"curated table: {html.escape(curated_path)}"
        + (f" version {ds.version}, {ds.count_rows():,} rows" if ds is not None else "")
        + f"{sample_note}</p>",
        "<h2>This run</h2>",
        _table(pd.DataFrame(run_rows)) if run_rows else "<p>curate did not run.</p>",
        _table(pd.DataFrame(stage_rows)) if stage_rows else "",
        _table(pd.DataFrame(exports)) if exports else "",
        fig("timings", "stage timings"),
        "<h2>Records per source and status (whole corpus)</h2>",
        _table(status.reset_index(names="source")), fig("counts", "counts per source"),
        "<h2>Reject and filter reasons</h2>",
        _table(reasons) if len(reasons) else "<p>none</p>", fig("reasons", "reasons"),
        "<h2>Resolution and aspect ratio</h2>", fig("resolution", "resolution"),
        fig("aspect", "aspect ratio"),
        "<h2>Captions</h2>",
        _table(pd.DataFrame(caption_rows)) if caption_rows else "<p>no caption columns</p>",
        fig("captions", "caption lengths"),
        "<h2>Duplicates</h2>",
        _table(pd.DataFrame([{"kind": k, "% of rows": round(100 * v, 2)}
                             for k, v in rates.items()])) if rates else "",
        fig("dedup", "duplicate rates"),
        f"<h2>Random kept images ({len(kept_items)}) with their "
        f"{html.escape(caption_col or 'captions')}</h2>",
        _sheet_html(kept_items),
        f"<h2>Flagged images ({len(flagged_items)}) with their reasons</h2>",
        _sheet_html(flagged_items),
        "</body></html>",
    ]
    index = os.path.join(out_dir, "index.html")
    with open(index, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump({
            "run_id": run_id, "figures": figures,
            "status": status.reset_index(names="source").to_dict("records"),
            "reasons": reasons.to_dict("records"), "dedup_rates": rates,
            "captions": caption_rows, "seconds": outcome.seconds,
            "contact_kept": [it["sample_id"] for it in kept_items],
            "contact_flagged": [it["sample_id"] for it in flagged_items],
            "sampled": sampled,
        }, f, indent=2, default=str)
    return index

