"""The run report: ``<root>/reports/<run_id>/index.html`` and the same figures as PNG.

What it shows: whether the run failed, where and why (a stage over its failure budget);
this run's accounting (seen / accepted / rejected / internal errors / flagged /
removed per source) and stage timings; the corpus as the run left it -- rows per source
and status (internal errors apart from rejects), reject and filter reasons, resolution and
aspect-ratio histograms, caption length per caption version (every ``caption*`` string
column of the curated table), duplicates as the Delta ``dedup`` table records them
(clusters, exact and near duplicates and their rates per source, whether it covers the
curated table's rows) with a contact sheet of the largest clusters, canonical member
first; and contact sheets of random kept images with their captions and of flagged
images with their reasons. Counts come from Spark over the whole tables; histograms
from up to ``run.report_max_rows`` rows sampled by pylance; images are read only for
the sheets.

Text from sources (captions, keys, reasons) is data: figures draw it as plain text
(matplotlib's math text and TeX off, so ``Earn $100 … $5`` is not parsed as math) and
the HTML escapes it; a label is cut to :data:`LABEL_CHARS` characters, so a long
caption never swells the report.
"""

from __future__ import annotations

import hashlib
import html
import io
import json
import os
import random
import textwrap
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from PIL import Image

from etl import tables
from etl.config import Config
from etl.lakehouse.counts import delta_counts, lance_counts
from etl.lakehouse.dedup_table import DEDUP_CURATED_VERSION, DedupTable
from udfs.outcomes import INTERNAL_ERROR

__all__ = ["write_report", "caption_versions", "dedup_summary", "DedupSummary"]

_META = ["sample_id", "source", "width", "height", "aspect_ratio", "keep", "filter_reason",
         "image_sha256", "dhash"]
_COLORS = {"kept": "#2e7d32", "flagged": "#f9a825", "rejected": "#c62828",
           "errors": "#6a1b9a"}
# Corpus-wide counts: curated rows by source and status, rejects by source and reason.
_STATUS_COLUMNS = ("source", "keep", "filter_reason")
_REJECT_COLUMNS = ("source", "reason")
# The longest text a label shows (a caption on a contact sheet).
LABEL_CHARS = 300
# Every text artist is plain text: no math text ($...$), no TeX.
_PLAIN_TEXT = {"text.parse_math": False, "text.usetex": False}
# Clusters on the duplicates' contact sheet, and members shown per cluster.
_SHEET_CLUSTERS = 6
_SHEET_MEMBERS = 6


def caption_versions(schema) -> list[str]:
    """The caption versions of the curated table: its string columns named caption*."""
    import pyarrow as pa

    return [f.name for f in schema if f.name.startswith("caption")
            and (pa.types.is_string(f.type) or pa.types.is_large_string(f.type))]


@dataclass(frozen=True)
class DedupSummary:
    """The Delta dedup table, summarised for the report."""

    table_version: int | None  # Delta version read
    covered_version: int | None  # curated version dedup last ran over
    coverage: Any  # etl.lakehouse.dedup_table.DedupCoverage at the curated table's current version
    clusters: int  # clusters of 2+ rows
    rows_in_clusters: int
    # Per source: rows, canonical, exact, near, unique, exact_rate, near_rate.
    per_source: list[dict] = field(default_factory=list)
    # The largest clusters, each a list of members (canonical first): sample_id,
    # source, dup_kind, cluster id and size.
    sheet: list[list[dict]] = field(default_factory=list)


def dedup_summary(spark, cfg: Config, curated_version: int | None) -> DedupSummary | None:
    """Counts per source and kind, clusters, and the members of the largest clusters,
    from the Delta dedup table; None when dedup never ran.

    The counts come from the stats the dedup run recorded in the table's properties
    when they still describe it (no table read); the largest clusters from one filtered
    read, ``cluster_size >=`` the size of the smallest of them (from the recorded
    clusters per size), which Delta's per-file statistics can skip files with. Without
    usable stats (a table `forget` wrote to since), the table is counted."""
    from pyspark.sql import functions as F

    path = tables.layout(cfg).dedup
    table = tables.read_delta(spark, path)
    if table is None:
        return None
    dedup_table = DedupTable(spark, cfg)
    state = dedup_table.state() or {}
    stats = dedup_table.stats(state)
    if stats is not None:
        counts = stats["by"]
        sizes = {int(k): n for k, n in stats["sizes"].items()}
    else:
        counts = {}
        for r in table.groupBy("source", "dup_kind").count().collect():
            counts.setdefault(r["source"], {})[r["dup_kind"]] = r["count"]
        sizes = {r["cluster_size"]: r["count"] for r in table.where("cluster_size > 1")
                 .select("dup_cluster_id", "cluster_size").distinct()
                 .groupBy("cluster_size").count().collect()}
    order = [s.name for s in cfg.sources] + sorted(set(counts) - {s.name for s in cfg.sources})
    per_source = []
    for name in order:
        c = counts.get(name, {})
        rows = sum(c.values())
        per_source.append({
            "source": name, "rows": rows, "canonical": c.get("canonical", 0),
            "exact": c.get("exact", 0), "near": c.get("near", 0), "unique": c.get("unique", 0),
            "exact_rate": c.get("exact", 0) / rows if rows else 0.0,
            "near_rate": c.get("near", 0) / rows if rows else 0.0,
        })
    sheet = []
    if sizes:
        # The size of the _SHEET_CLUSTERS-th largest cluster: no smaller one is shown.
        smallest, seen = 2, 0
        for size in sorted(sizes, reverse=True):
            smallest, seen = size, seen + sizes[size]
            if seen >= _SHEET_CLUSTERS:
                break
        grouped = table.where(F.col("cluster_size") >= smallest)
        largest = [r["dup_cluster_id"] for r in grouped.select(
            "dup_cluster_id", "cluster_size").distinct().orderBy(
            F.col("cluster_size").desc(), "dup_cluster_id").limit(_SHEET_CLUSTERS).collect()]
        members = (grouped.where(F.col("dup_cluster_id").isin(largest))
                   .select("dup_cluster_id", "sample_id", "source", "dup_kind", "is_canonical",
                           "cluster_size").collect())
        for cid in largest:
            mine = sorted((m.asDict() for m in members if m["dup_cluster_id"] == cid),
                          key=lambda m: (not m["is_canonical"], m["dup_kind"], m["sample_id"]))
            sheet.append(mine[:_SHEET_MEMBERS])
    covered = state.get(DEDUP_CURATED_VERSION)
    coverage = (dedup_table.coverage(curated_version)
                if curated_version is not None else None)
    return DedupSummary(
        table_version=tables.delta_version(spark, path),
        covered_version=int(covered) if covered is not None else None,
        coverage=coverage, clusters=sum(sizes.values()),
        rows_in_clusters=sum(size * n for size, n in sizes.items()),
        per_source=per_source, sheet=sheet,
    )


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
        items.append({"sample_id": sid, "source": r["source"], "label": _shown(text),
                      "thumb": im,
                      "file": f"thumbs/{sid}.jpg"})
    return items


def _cluster_items(ds, dedup: DedupSummary | None, thumbs_dir: str) -> list[list[dict]]:
    """The duplicates' contact sheet: per cluster of :attr:`DedupSummary.sheet`, its
    members' thumbnails, canonical first, labelled with their kind and source."""
    wanted = [m["sample_id"] for cluster in (dedup.sheet if dedup else []) for m in cluster]
    if ds is None or not wanted:
        return []
    ids = ", ".join("'" + sid.replace("'", "''") + "'" for sid in wanted)
    rows = {r["sample_id"]: r for r in ds.to_table(
        columns=["sample_id", "image", "width", "height"],
        filter=f"sample_id IN ({ids})").to_pylist()}
    out = []
    for cluster in dedup.sheet:
        items = []
        for m in cluster:
            r = rows.get(m["sample_id"])
            if r is None:  # no longer in the curated table (dedup not rerun since)
                continue
            im = _thumb(r["image"])
            im.save(os.path.join(thumbs_dir, f"{m['sample_id']}.jpg"), "JPEG", quality=85)
            items.append({"sample_id": m["sample_id"], "source": m["source"],
                          "kind": m["dup_kind"], "cluster": m["dup_cluster_id"],
                          "size": m["cluster_size"], "thumb": im,
                          "file": f"thumbs/{m['sample_id']}.jpg",
                          "label": f"{m['dup_kind']} {r['width']}x{r['height']}"})
        if items:
            out.append(items)
    return out


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


def _clusters_html(clusters: list[list[dict]]) -> str:
    if not clusters:
        return "<p>no duplicate clusters</p>"
    parts = []
    for cluster in clusters:
        head = cluster[0]
        parts.append(f"<p class='meta'>cluster {html.escape(head['cluster'])}: "
                     f"{head['size']} rows</p>")
        parts.append(_sheet_html([{**it, "label": it["label"]} for it in cluster]))
    return "".join(parts)


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
.failed{background:#fdecea;border:1px solid #c62828;padding:8px 12px;white-space:pre-wrap}
.warn{background:#fff8e1;border:1px solid #f9a825;padding:6px 12px}
"""


def _shown(text: str) -> str:
    """Source text as a label: at most LABEL_CHARS characters."""
    return text if len(text) <= LABEL_CHARS else text[:LABEL_CHARS - 1] + "\u2026"


def write_report(spark, cfg: Config, outcome: Any, out_dir: str | None = None) -> str:
    """Write the report of `outcome` (an :class:`etl.pipeline.outcome.RunOutcome`) into `out_dir`
    (default ``<root>/reports/<run_id>``, a local path); returns its index.html. Every
    figure is drawn with source text as plain text."""
    import matplotlib

    with matplotlib.rc_context(_PLAIN_TEXT):
        return _write_report(spark, cfg, outcome, out_dir)


def _write_report(spark, cfg: Config, outcome: Any, out_dir: str | None) -> str:
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
    # Counts over the whole tables, by source and status / reason: kept per Lance
    # fragment and Delta file (etl.lakehouse.counts), so only what changed is read.
    status = pd.DataFrame({"kept": pd.Series(dtype="int64"),
                           "flagged": pd.Series(dtype="int64")})
    reasons = pd.DataFrame(columns=["kind", "reason", "count"])
    if ds is not None:
        cur = lance_counts(ds, _STATUS_COLUMNS, paths.counts_cache("curated"))
        keep = cur["keep"].eq(True)
        kept = cur[keep].groupby("source")["count"].sum()
        flagged = cur[~keep].groupby("source")["count"].sum()
        status = pd.DataFrame({"kept": kept, "flagged": flagged})
        fr = cur[~keep].groupby("filter_reason")["count"].sum().reset_index()
        reasons = pd.concat([reasons, pd.DataFrame(
            {"kind": "flagged", "reason": fr["filter_reason"], "count": fr["count"]})])
    rej = delta_counts(rejects_path, _REJECT_COLUMNS, paths.counts_cache("rejects"))
    if rej is None and DeltaTable.isDeltaTable(spark, rejects_path):
        # A rejects table delta-rs does not read: count it with Spark.
        rej = (spark.read.format("delta").load(rejects_path)
               .groupBy(*_REJECT_COLUMNS).agg(F.count("*").alias("count")).toPandas())
    if rej is not None:
        internal = rej["reason"] == INTERNAL_ERROR
        status = status.join(
            rej[~internal].groupby("source")["count"].sum().rename("rejected"), how="outer"
        ).join(rej[internal].groupby("source")["count"].sum().rename("errors"), how="outer")
        rr = rej.groupby("reason")["count"].sum().reset_index()
        kind = np.where(rr["reason"] == INTERNAL_ERROR, "error", "rejected")
        reasons = pd.concat([pd.DataFrame({"kind": kind, "reason": rr["reason"],
                                           "count": rr["count"]}), reasons])
    for col in ("kept", "flagged", "rejected", "errors"):
        status[col] = status[col].fillna(0).astype(int) if col in status else 0
    status = status.sort_index()
    status["total"] = status[["kept", "flagged", "rejected", "errors"]].sum(axis=1)
    reasons["kind"] = pd.Categorical(reasons["kind"], ["error", "rejected", "flagged"])
    reasons = reasons.sort_values(["kind", "count"], ascending=[True, False])
    reasons["kind"] = reasons["kind"].astype(str)

    # Per-row figures from (a sample of) the metadata columns: never the image bytes.
    versions: list[str] = []
    meta = pd.DataFrame(columns=_META)
    sampled = False
    if ds is not None:
        versions = caption_versions(ds.schema)
        cols = _META + versions
        n_rows = ds.count_rows()
        if n_rows > cfg.run.report_max_rows:
            meta = ds.sample(cfg.run.report_max_rows, columns=cols).to_pandas()
            sampled = True
        else:
            meta = ds.to_table(columns=cols).to_pandas()
    dedup = dedup_summary(spark, cfg, ds.version if ds is not None else None)
    figures = {
        "counts": _bar_counts(status, out_dir),
        "reasons": _bar_reasons(reasons, out_dir),
        "resolution": _hist_resolution(meta, out_dir),
        "aspect": _hist_aspect(meta, out_dir),
        "captions": _hist_captions(meta, versions, out_dir),
        "dedup": _bar_dedup(dedup, out_dir),
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
    cluster_items = _cluster_items(ds, dedup, thumbs_dir)
    figures["contact_duplicates"] = _clusters_png(cluster_items, out_dir)

    # This run's accounting and stages.
    run_rows = []
    if outcome.detail("curate") is not None:
        for c in outcome.detail("curate").counts:
            run_rows.append({"source": c.source, "seen": c.seen, "accepted": c.accepted,
                             "rejected": c.rejected, "errors": c.internal_errors,
                             "flagged": sum(c.filtered.values()),
                             "removed": sum(c.removed.values()),
                             "reasons": ", ".join(f"{k}={v}" for k, v in
                                                  {**c.reasons, **c.filtered,
                                                   **c.removed}.items())})
    stage_rows = [
        {"stage": name, "status": "failed" if name == outcome.failed_stage else "ok",
         "seconds": round(outcome.seconds.get(name, 0.0), 1),
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
    failed = ""
    if getattr(outcome, "failed_stage", None):
        failed = (f"<div class='failed'><b>This run FAILED in stage "
                  f"{html.escape(outcome.failed_stage)}.</b>\n"
                  f"{html.escape(outcome.failure or '')}</div>")
    dedup_json = None
    if dedup is None:
        dedup_part = ["<p>dedup has not run (<code>lakeshard dedup</code>; in "
                      "<code>lakeshard run</code> when <code>dedup.enabled</code>).</p>",
                      fig("dedup", "duplicate rates per source")]
    else:
        cov = dedup.coverage
        per_source = pd.DataFrame([
            {**{k: r[k] for k in ("source", "rows", "canonical", "exact", "near")},
             "exact rate %": round(100 * r["exact_rate"], 2),
             "near rate %": round(100 * r["near_rate"], 2)}
            for r in dedup.per_source])
        dedup_part = [
            f"<p class='meta'>{html.escape(paths.dedup)} version {dedup.table_version}, over "
            f"curated version {dedup.covered_version}: {dedup.clusters} cluster(s) of 2+ rows "
            f"holding {dedup.rows_in_clusters} rows. Exports keep each cluster's canonical "
            "member and leave out its exact duplicates (same bytes) and near duplicates "
            "(dHashes within dedup.threshold bits).</p>",
        ]
        if cov is not None and cov.stale:
            dedup_part.append(
                f"<p class='warn'>The curated table (version {cov.curated_version}) has "
                f"{cov.uncovered} row(s) added or changed since dedup ran and "
                f"{cov.removed} removed: run <code>lakeshard dedup</code>.</p>")
        dedup_part += [_table(per_source), fig("dedup", "duplicate rates per source"),
                       f"<h3>The {len(cluster_items)} largest clusters, canonical member "
                       "first</h3>", _clusters_html(cluster_items)]
        dedup_json = {
            "table_version": dedup.table_version, "covered_version": dedup.covered_version,
            "uncovered": cov.uncovered if cov else None,
            "removed": cov.removed if cov else None,
            "clusters": dedup.clusters, "rows_in_clusters": dedup.rows_in_clusters,
            "per_source": dedup.per_source,
            "contact_clusters": [[it["sample_id"] for it in c] for c in cluster_items],
        }
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>lakeshard run {html.escape(run_id)}</title><style>{_CSS}</style></head><body>",
        f"<h1>lakeshard run {html.escape(run_id)}</h1>",
        failed,
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
        "<h2>Duplicates (Delta dedup table)</h2>",
        *dedup_part,
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
            "status_of_run": getattr(outcome, "status", "ok"),
            "failed_stage": getattr(outcome, "failed_stage", None),
            "reasons": reasons.to_dict("records"), "dedup": dedup_json,
            "captions": caption_rows, "seconds": outcome.seconds,
            "contact_kept": [it["sample_id"] for it in kept_items],
            "contact_flagged": [it["sample_id"] for it in flagged_items],
            "sampled": sampled,
        }, f, indent=2, default=str)
    return index

