"""The run report: ``<root>/reports/<run_id>/index.html`` and the same figures as PNG.

What it shows: whether the run failed, where and why (a stage over its failure budget);
this run's accounting (seen / accepted / rejected / internal errors / flagged /
removed per source) and stage timings; the corpus as the run left it -- rows per source
and status (internal errors apart from rejects), reject and filter reasons, resolution and
aspect-ratio histograms, caption length per caption version (the source caption and
the caption column of each version the caption stage wrote; not their provenance
columns), duplicates as the Delta ``dedup`` table records them
(clusters, exact and near duplicates and their rates per source, whether it covers the
curated table's rows) with a contact sheet of the largest clusters, canonical member
first; and contact sheets of random kept images with their captions (the newest caption
version's, else the source's) and of flagged images with their reasons.

Three parts: :mod:`etl.report.data` reads the tables -- corpus-wide counts kept per Lance
fragment and Delta data file (:mod:`etl.lakehouse.counts`), the dedup run's recorded
stats, histograms from up to ``run.report_max_rows`` rows sampled by pylance, images only
for the sheets; Spark only where delta-rs cannot read a table or the dedup stats are
stale, so a report over tables the driver can read starts no Spark job --,
:mod:`etl.report.figures` draws the charts (matplotlib) and :mod:`etl.report.sheets`
composes the contact sheets (Pillow), :mod:`etl.report.html` writes the page.
:mod:`etl.report.layout` owns the report's files, and :func:`scrub_reports` takes
samples out of written reports (`forget`).

Text from sources (captions, keys, reasons) is data: figures draw it as plain text
(matplotlib's math text and TeX off, so ``Earn $100 … $5`` is not parsed as math; the
sheets' labels drawn by Pillow's ImageDraw, which parses nothing) and the HTML escapes
it; a label is cut to :data:`LABEL_CHARS` characters, so a long caption never swells
the report.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import TYPE_CHECKING

from etl import tables
from etl.config import Config
from etl.report.data import (
    LABEL_CHARS,
    DedupSummary,
    ReportData,
    caption_versions,
    dedup_summary,
    read_tables,
    with_run,
)
from etl.report.layout import INDEX, scrub_reports, write_meta
from etl.runtime.outcome import RunOutcome

if TYPE_CHECKING:
    from etl.report.figures import Drawn

__all__ = ["write_report", "ReportDraft", "scrub_reports", "caption_versions", "dedup_summary",
           "DedupSummary", "LABEL_CHARS"]


def write_report(spark, cfg: Config, outcome: RunOutcome, out_dir: str | None = None,
                 draft: ReportDraft | None = None) -> str:
    """Write the report of the run `outcome` into `out_dir`
    (default ``<root>/reports/<run_id>``, a local path); returns its index.html. Every
    figure is drawn with source text as plain text. `draft`: its table part, read and
    drawn already (into the same folder) while the run's last stage ran."""
    import matplotlib

    from etl.report.figures import PLAIN_TEXT, draw_run_figures, draw_table_figures
    from etl.report.html import dedup_json, page

    out_dir = out_dir or tables.layout(cfg).report_dir(outcome.run_id)
    if draft is not None and draft.out_dir == out_dir:
        part, table_figures = draft.result()
    else:
        part = read_tables(spark, cfg, outcome)
        with matplotlib.rc_context(PLAIN_TEXT):
            table_figures = draw_table_figures(part, out_dir)
    data = with_run(part, outcome)
    with matplotlib.rc_context(PLAIN_TEXT):
        drawn = draw_run_figures(data, out_dir, table_figures)
    index = os.path.join(out_dir, INDEX)
    with open(index, "w", encoding="utf-8") as f:
        f.write(page(data, drawn))
    write_meta(out_dir, _meta(data, drawn, dedup_json(data, drawn)))
    return index


class ReportDraft:
    """The report's table part -- its data read from the tables and the figures they
    alone decide (:func:`~etl.report.figures.draw_table_figures`) -- made on a thread
    while the run's last stages run, when they leave the tables the report reads as
    they are (the export writes only its MDS folder): what :func:`write_report` then
    adds is the run's own part (its stages, timings and exports). `group`: the Spark
    job group of whatever Spark job the read needs (a table delta-rs cannot read)."""

    def __init__(self, spark, cfg: Config, outcome: RunOutcome, out_dir: str,
                 group: tuple[str, str]) -> None:
        self.out_dir = out_dir
        self._result: tuple[ReportData, Drawn] | None = None
        self._error: BaseException | None = None

        def run() -> None:
            import matplotlib

            from etl.report.figures import PLAIN_TEXT, draw_table_figures

            if spark is not None:
                spark.sparkContext.setJobGroup(*group)
            try:
                part = read_tables(spark, cfg, outcome)
                with matplotlib.rc_context(PLAIN_TEXT):
                    self._result = part, draw_table_figures(part, out_dir)
            except BaseException as exc:  # noqa: BLE001 -- raised again by result()
                self._error = exc

        self._thread = threading.Thread(target=run, name="lakeshard-report-draft",
                                        daemon=True)
        self._thread.start()

    def discard(self) -> None:
        """No report after all (the run failed): wait for the thread, then remove its
        folder."""
        self._thread.join()
        shutil.rmtree(self.out_dir, ignore_errors=True)

    def result(self) -> tuple[ReportData, Drawn]:
        """The table part, once made; what the thread raised, raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def _meta(data: ReportData, drawn, dedup: dict | None) -> dict:
    """report.json: the figures' data."""
    outcome = data.outcome
    return {
        "run_id": data.run_id, "figures": drawn.figures,
        "status": data.status.reset_index(names="source").to_dict("records"),
        "status_of_run": outcome.status,
        "failed_stage": outcome.failed_stage,
        "reasons": data.reasons.to_dict("records"), "dedup": dedup,
        "captions": data.captions, "seconds": outcome.seconds,
        "contact_kept": [it["sample_id"] for it in drawn.kept],
        "contact_flagged": [it["sample_id"] for it in drawn.flagged],
        "sampled": data.sampled,
    }
