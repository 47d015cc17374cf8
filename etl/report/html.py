"""The report's page, ``index.html``: this run's accounting, stages and exports, then
the corpus as the run left it, the figures and the contact sheets. Every piece of text
from a source is HTML-escaped (:func:`html.escape`; tables with ``escape=True``)."""

from __future__ import annotations

import html

import pandas as pd

from etl.report.data import SOURCE_CAPTION, ReportData
from etl.report.figures import Drawn

__all__ = ["page", "dedup_json"]

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


def _fig(drawn: Drawn, key: str, alt: str) -> str:
    return f'<img class="fig" src="{drawn.figures[key]}" alt="{html.escape(alt)}">'


def _dedup_part(data: ReportData, drawn: Drawn) -> list[str]:
    dedup = data.dedup
    if dedup is None:
        return ["<p>dedup has not run (<code>lakeshard dedup</code>; in "
                "<code>lakeshard run</code> when <code>dedup.enabled</code>).</p>",
                _fig(drawn, "dedup", "duplicate rates per source")]
    cov = dedup.coverage
    per_source = pd.DataFrame([
        {**{k: r[k] for k in ("source", "rows", "canonical", "exact", "near")},
         "exact rate %": round(100 * r["exact_rate"], 2),
         "near rate %": round(100 * r["near_rate"], 2)}
        for r in dedup.per_source])
    part = [
        f"<p class='meta'>{html.escape(data.dedup_path)} version {dedup.table_version}, over "
        f"curated version {dedup.covered_version}: {dedup.clusters} cluster(s) of 2+ rows "
        f"holding {dedup.rows_in_clusters} rows. Exports keep each cluster's canonical "
        "member and leave out its exact duplicates (same bytes) and near duplicates "
        "(dHashes within dedup.threshold bits).</p>",
    ]
    if cov is not None and cov.stale:
        part.append(
            f"<p class='warn'>The curated table (version {cov.curated_version}) has "
            f"{cov.uncovered} row(s) added or changed since dedup ran and "
            f"{cov.removed} removed: run <code>lakeshard dedup</code>.</p>")
    return part + [_table(per_source), _fig(drawn, "dedup", "duplicate rates per source"),
                   f"<h3>The {len(drawn.clusters)} largest clusters, canonical member "
                   "first</h3>", _clusters_html(drawn.clusters)]


def dedup_json(data: ReportData, drawn: Drawn) -> dict | None:
    """report.json's ``dedup``: the dedup table's summary and the sheet's clusters."""
    dedup = data.dedup
    if dedup is None:
        return None
    cov = dedup.coverage
    return {
        "table_version": dedup.table_version, "covered_version": dedup.covered_version,
        "uncovered": cov.uncovered if cov else None,
        "removed": cov.removed if cov else None,
        "clusters": dedup.clusters, "rows_in_clusters": dedup.rows_in_clusters,
        "per_source": dedup.per_source,
        "contact_clusters": [[it["sample_id"] for it in c] for c in drawn.clusters],
    }


def _head(data: ReportData) -> list[str]:
    outcome, run_id = data.outcome, data.run_id
    sample_note = (f" (histograms from a random sample of {len(data.meta):,} rows)"
                   if data.sampled else "")
    failed = ""
    if getattr(outcome, "failed_stage", None):
        failed = (f"<div class='failed'><b>This run FAILED in stage "
                  f"{html.escape(outcome.failed_stage)}.</b>\n"
                  f"{html.escape(outcome.failure or '')}</div>")
    curated = (f" version {data.curated_version}, {data.curated_rows:,} rows"
               if data.curated_version is not None else "")
    return [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>lakeshard run {html.escape(run_id)}</title><style>{_CSS}</style></head><body>",
        f"<h1>lakeshard run {html.escape(run_id)}</h1>",
        failed,
        f"<p class='meta'>stages: {html.escape(', '.join(outcome.stages))} &middot; "
        f"curated table: {html.escape(data.curated_path)}{curated}{sample_note}</p>",
    ]


def _sheet_caption(caption_col: str | None) -> str:
    """Which captions the kept sheet's labels are (:attr:`ReportData.caption_col`)."""
    if caption_col is None:
        return "captions (none in the table)"
    which = "the source's" if caption_col == SOURCE_CAPTION else "the newest caption version"
    return f"captions: {html.escape(caption_col)} ({which})"


def page(data: ReportData, drawn: Drawn) -> str:
    """index.html of the report."""
    caption_col = data.caption_col
    return "\n".join([
        *_head(data),
        "<h2>This run</h2>",
        _table(pd.DataFrame(data.run_rows)) if data.run_rows else "<p>curate did not run.</p>",
        _table(pd.DataFrame(data.stage_rows)) if data.stage_rows else "",
        _table(pd.DataFrame(data.exports)) if data.exports else "",
        _fig(drawn, "timings", "stage timings"),
        "<h2>Records per source and status (whole corpus)</h2>",
        _table(data.status.reset_index(names="source")),
        _fig(drawn, "counts", "counts per source"),
        "<h2>Reject and filter reasons</h2>",
        _table(data.reasons) if len(data.reasons) else "<p>none</p>",
        _fig(drawn, "reasons", "reasons"),
        "<h2>Resolution and aspect ratio</h2>", _fig(drawn, "resolution", "resolution"),
        _fig(drawn, "aspect", "aspect ratio"),
        "<h2>Captions</h2>",
        _table(pd.DataFrame(data.captions)) if data.captions else "<p>no caption columns</p>",
        _fig(drawn, "captions", "caption lengths"),
        "<h2>Duplicates (Delta dedup table)</h2>",
        *_dedup_part(data, drawn),
        f"<h2>Random kept images ({len(drawn.kept)}) with their {_sheet_caption(caption_col)}"
        "</h2>",
        _sheet_html(drawn.kept),
        f"<h2>Flagged images ({len(drawn.flagged)}) with their reasons</h2>",
        _sheet_html(drawn.flagged),
        "</body></html>",
    ])
