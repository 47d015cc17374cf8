"""What the report shows, read from the tables: corpus-wide counts, a sample of the
metadata columns, the dedup table's summary, the rows of the contact sheets, and this
run's accounting and stages.

Counts come from what :mod:`etl.lakehouse.counts` keeps per Lance fragment and Delta
data file (pylance and delta-rs in this process, reading only what changed), the
duplicates from the stats the dedup run recorded and one filtered delta-rs read of the
largest clusters; Spark only when delta-rs cannot read a table (a feature it does not
implement) or the dedup stats no longer describe the dedup table. So a report over
tables the driver can read starts no Spark job.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from etl import storage, tables
from etl.columns import caption_columns
from etl.config import Config
from etl.lakehouse.counts import delta_counts, lance_counts
from etl.lakehouse.dedup_table import DEDUP_CURATED_VERSION, DedupTable
from etl.runtime.outcome import RunOutcome
from udfs.outcomes import INTERNAL_ERROR

__all__ = ["ReportData", "DedupSummary", "read_report", "read_tables", "with_run",
           "caption_versions", "sheet_caption",
           "dedup_summary", "largest_clusters", "LABEL_CHARS", "SOURCE_CAPTION", "STATUSES"]

_META = ["sample_id", "source", "width", "height", "aspect_ratio", "keep", "filter_reason"]
# Corpus-wide counts: curated rows by source and status, rejects by source and reason.
_STATUS_COLUMNS = ("source", "keep", "filter_reason")
_REJECT_COLUMNS = ("source", "reason")
STATUSES = ("kept", "flagged", "rejected", "errors")
# The caption a source gave (etl.schema's curated table), the first caption version.
SOURCE_CAPTION = "caption_original"
# The longest text a label shows (a caption on a contact sheet).
LABEL_CHARS = 300
# Clusters on the duplicates' contact sheet, and members shown per cluster.
_SHEET_CLUSTERS = 6
_SHEET_MEMBERS = 6
_SHEET_COLUMNS = ["dup_cluster_id", "sample_id", "source", "dup_kind", "is_canonical",
                  "cluster_size"]


def _version_text(name: str, names: set[str]) -> bool:
    """Whether column `name` is the caption of a version the caption stage wrote: for
    some version ``v`` (a suffix of `name` after an ``_``) it is the caption column of
    :func:`etl.columns.caption_columns` ``(v)`` (its first) and the table holds all of
    that version's columns -- so ``caption_v_params`` is provenance, not a version ``v_params``."""
    for i, ch in enumerate(name):
        if ch == "_":
            columns = caption_columns(name[i + 1:])
            if next(iter(columns)) == name and names.issuperset(columns):
                return True
    return False


def caption_versions(schema) -> list[str]:
    """The caption versions of the curated table, oldest first: the source caption
    (:data:`SOURCE_CAPTION`), then the caption column of each version the caption stage
    wrote, in the table's column order (a version's columns are appended when it is first
    written) -- never its provenance columns (status, error, flags, model, params...)."""
    import pyarrow as pa

    names = set(schema.names)
    return [f.name for f in schema
            if (pa.types.is_string(f.type) or pa.types.is_large_string(f.type))
            and (f.name == SOURCE_CAPTION or _version_text(f.name, names))]


def sheet_caption(versions: list[str]) -> str | None:
    """The caption the kept images' contact sheet shows: the newest caption version's,
    else the source caption (None without either)."""
    return versions[-1] if versions else None


def _shown(text: str) -> str:
    """Source text as a label: at most LABEL_CHARS characters."""
    return text if len(text) <= LABEL_CHARS else text[:LABEL_CHARS - 1] + "\u2026"


def _quoted(ids: list[str]) -> str:
    return ", ".join("'" + sid.replace("'", "''") + "'" for sid in ids)


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


def _delta_rs_dataset(path: str):
    """The Delta table at `path` as a pyarrow dataset read by delta-rs; None when there
    is no table; ``False`` when delta-rs cannot read it (ask Spark)."""
    from deltalake.exceptions import DeltaError

    from etl.writers.remote import subtree

    try:
        table = storage.delta_rs_table(path)
        if table is None:
            return None
        if "deletionVectors" in (table.protocol().reader_features or []):
            return False
        return table.to_pyarrow_dataset(filesystem=subtree(storage.object_url(path)))
    except DeltaError as exc:
        if storage.delta_rs_unsupported(exc):
            return False
        raise


def largest_clusters(spark, path: str, smallest: int, dataset=None) -> list[list[dict]]:
    """The members of the :data:`_SHEET_CLUSTERS` largest clusters of the dedup table at
    `path` (size >= `smallest`; the largest first, then by cluster id), canonical member
    first: one filtered read, by delta-rs from `dataset` when given, else by Spark."""
    from pyspark.sql import functions as F

    if dataset is not None:
        import pyarrow.dataset as pds

        rows = dataset.to_table(columns=_SHEET_COLUMNS,
                                filter=pds.field("cluster_size") >= smallest).to_pylist()
    else:
        rows = [r.asDict() for r in spark.read.format("delta").load(path)
                .where(F.col("cluster_size") >= smallest).select(*_SHEET_COLUMNS).collect()]
    ids = sorted({(r["cluster_size"], r["dup_cluster_id"]) for r in rows},
                 key=lambda c: (-c[0], c[1]))[:_SHEET_CLUSTERS]
    sheet = []
    for _, cid in ids:
        mine = sorted((m for m in rows if m["dup_cluster_id"] == cid),
                      key=lambda m: (not m["is_canonical"], m["dup_kind"], m["sample_id"]))
        sheet.append(mine[:_SHEET_MEMBERS])
    return sheet


def _per_source(cfg: Config, counts: dict[str, dict[str, int]]) -> list[dict]:
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
    return per_source


def _smallest_shown(sizes: dict[int, int]) -> int:
    """The size of the _SHEET_CLUSTERS-th largest cluster: no smaller one is shown."""
    smallest, seen = 2, 0
    for size in sorted(sizes, reverse=True):
        smallest, seen = size, seen + sizes[size]
        if seen >= _SHEET_CLUSTERS:
            break
    return smallest


def dedup_summary(spark, cfg: Config, curated_version: int | None) -> DedupSummary | None:
    """Counts per source and kind, clusters, and the members of the largest clusters,
    from the Delta dedup table; None when dedup never ran.

    The counts come from the stats the dedup run recorded in the table's properties
    when they still describe it (no table read); the largest clusters from one filtered
    read, ``cluster_size >=`` the size of the smallest of them (from the recorded
    clusters per size), which Delta's per-file statistics can skip files with -- by
    delta-rs, or Spark when delta-rs cannot read the table. Without usable stats (a
    table `forget` wrote to since), Spark counts the table."""
    table = DedupTable(spark, cfg)
    dataset = _delta_rs_dataset(table.path)
    if dataset is None:
        return None
    state = table.state() or {}
    stats = table.current_stats(state)  # as recorded, or counted by Spark
    sizes = {int(k): n for k, n in stats["sizes"].items()}
    driver = dataset if dataset is not False else None
    sheet = (largest_clusters(spark, table.path, _smallest_shown(sizes), driver)
             if sizes else [])
    covered = state.get(DEDUP_CURATED_VERSION)
    coverage = table.coverage(curated_version) if curated_version is not None else None
    return DedupSummary(
        table_version=table.version(),
        covered_version=int(covered) if covered is not None else None,
        coverage=coverage, clusters=sum(sizes.values()),
        rows_in_clusters=sum(size * n for size, n in sizes.items()),
        per_source=_per_source(cfg, stats["by"]), sheet=sheet,
    )


def _rejects_counts(spark, path: str, cache: str) -> pd.DataFrame | None:
    """Rejects by source and reason: kept per data file, or counted by Spark when
    delta-rs cannot read the table; None without a table."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    rej = delta_counts(path, _REJECT_COLUMNS, cache)
    if rej is None and DeltaTable.isDeltaTable(spark, path):
        rej = (spark.read.format("delta").load(path)
               .groupBy(*_REJECT_COLUMNS).agg(F.count("*").alias("count")).toPandas())
    return rej


def corpus_counts(spark, cfg: Config, ds) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Records per source and status (kept, flagged, rejected, errors, total) and per
    reason (kind error / rejected / flagged), over the whole curated and rejects
    tables."""
    paths = tables.layout(cfg)
    status = pd.DataFrame({"kept": pd.Series(dtype="int64"),
                           "flagged": pd.Series(dtype="int64")})
    reasons = pd.DataFrame(columns=["kind", "reason", "count"])
    if ds is not None:
        cur = lance_counts(ds, _STATUS_COLUMNS, paths.counts_cache("curated"))
        keep = cur["keep"].eq(True)
        status = pd.DataFrame({"kept": cur[keep].groupby("source")["count"].sum(),
                               "flagged": cur[~keep].groupby("source")["count"].sum()})
        fr = cur[~keep].groupby("filter_reason")["count"].sum().reset_index()
        reasons = pd.concat([reasons, pd.DataFrame(
            {"kind": "flagged", "reason": fr["filter_reason"], "count": fr["count"]})])
    rej = _rejects_counts(spark, paths.rejects, paths.counts_cache("rejects"))
    if rej is not None:
        internal = rej["reason"] == INTERNAL_ERROR
        status = status.join(
            rej[~internal].groupby("source")["count"].sum().rename("rejected"), how="outer"
        ).join(rej[internal].groupby("source")["count"].sum().rename("errors"), how="outer")
        rr = rej.groupby("reason")["count"].sum().reset_index()
        kind = np.where(rr["reason"] == INTERNAL_ERROR, "error", "rejected")
        reasons = pd.concat([pd.DataFrame({"kind": kind, "reason": rr["reason"],
                                           "count": rr["count"]}), reasons])
    for col in STATUSES:
        status[col] = status[col].fillna(0).astype(int) if col in status else 0
    status = status.sort_index()
    status["total"] = status[list(STATUSES)].sum(axis=1)
    reasons["kind"] = pd.Categorical(reasons["kind"], ["error", "rejected", "flagged"])
    reasons = reasons.sort_values(["kind", "count"], ascending=[True, False])
    reasons["kind"] = reasons["kind"].astype(str)
    return status, reasons


def sample_meta(ds, max_rows: int) -> tuple[pd.DataFrame, list[str], bool]:
    """The metadata columns (never the image bytes) and caption versions of (a random
    sample of at most `max_rows` of) the curated rows; whether it is a sample."""
    if ds is None:
        return pd.DataFrame(columns=_META), [], False
    versions = caption_versions(ds.schema)
    cols = _META + versions
    if ds.count_rows() > max_rows:
        return ds.sample(max_rows, columns=cols).to_pandas(), versions, True
    return ds.to_table(columns=cols).to_pandas(), versions, False


def contact_rows(ds, meta: pd.DataFrame, caption_col: str | None, n: int, seed: int,
                 kept: bool) -> list[dict]:
    """Up to `n` random kept (or flagged) rows -- sample_id, source, image, label (the
    caption, or the filter reason) -- chosen with `seed`."""
    pool = meta[meta["keep"] == kept]["sample_id"].tolist()
    chosen = random.Random(seed).sample(sorted(pool), min(n, len(pool)))
    if not chosen:
        return []
    cols = ["sample_id", "source", "image", "filter_reason"] + (
        [caption_col] if caption_col else [])
    rows = {r["sample_id"]: r for r in
            ds.to_table(columns=cols, filter=f"sample_id IN ({_quoted(chosen)})").to_pylist()}
    out = []
    for sid in chosen:
        r = rows[sid]
        if kept:
            text = (r.get(caption_col) if caption_col else None) or "(no caption)"
        else:
            text = r["filter_reason"] or "(no reason)"
        out.append({"sample_id": sid, "source": r["source"], "image": r["image"],
                    "label": _shown(text)})
    return out


def cluster_rows(ds, dedup: DedupSummary | None) -> list[list[dict]]:
    """The duplicates' contact sheet: per cluster of :attr:`DedupSummary.sheet` its
    members still in the curated table, with their image, kind, source and size."""
    wanted = [m["sample_id"] for cluster in (dedup.sheet if dedup else []) for m in cluster]
    if ds is None or not wanted:
        return []
    rows = {r["sample_id"]: r for r in ds.to_table(
        columns=["sample_id", "image", "width", "height"],
        filter=f"sample_id IN ({_quoted(wanted)})").to_pylist()}
    out = []
    for cluster in dedup.sheet:
        items = []
        for m in cluster:
            r = rows.get(m["sample_id"])
            if r is None:  # no longer in the curated table (dedup not rerun since)
                continue
            items.append({"sample_id": m["sample_id"], "source": m["source"],
                          "kind": m["dup_kind"], "cluster": m["dup_cluster_id"],
                          "size": m["cluster_size"], "image": r["image"],
                          "label": f"{m['dup_kind']} {r['width']}x{r['height']}"})
        if items:
            out.append(items)
    return out


# This run's tables: per source (curate's tally), per stage, per export.
_RUN_COLUMNS = ("source", "seen", "accepted", "rejected", "errors", "flagged", "removed",
                "reasons")


def run_tables(outcome: RunOutcome) -> tuple[list[dict], list[dict], list[dict]]:
    """This run's accounting per source, its stages (status, seconds, note, totals,
    versions) and its exports."""
    run_rows = [{k: row[k] for k in _RUN_COLUMNS}
                for detail in outcome.details() for row in detail.source_rows()]
    stage_rows = [
        {"stage": name, "status": "failed" if name == outcome.failed_stage else "ok",
         "seconds": round(outcome.seconds.get(name, 0.0), 1),
         "note": (res.note or ""),
         "outputs": ", ".join(f"{k}={v}" for k, v in res.outputs.items()),
         "versions": ", ".join(f"{k}={v}" for k, v in res.table_versions.items())}
        for name, res in outcome.results.items()
    ]
    exports = [{"export": name, **{k: m[k] for k in ("samples", "shards", "table_version",
                                                     "checksum")}}
               for res in outcome.results.values() for name, m in res.manifests.items()]
    return run_rows, stage_rows, exports


def caption_rows(meta: pd.DataFrame, versions: list[str]) -> list[dict]:
    """Per caption version: captions, empty rows, mean words (of the sampled rows)."""
    return [
        {"version": c, "captions": int(meta[c].notna().sum()),
         "empty": int(meta[c].isna().sum()),
         "mean words": round(float(meta[c].dropna().map(lambda s: len(str(s).split()))
                                   .mean()), 1) if meta[c].notna().any() else 0.0}
        for c in versions
    ]


@dataclass
class ReportData:
    """Everything the figures and the page are drawn from."""

    run_id: str
    outcome: RunOutcome
    curated_path: str
    dedup_path: str
    curated_version: int | None  # None: no curated table yet
    curated_rows: int
    status: pd.DataFrame  # per source: kept, flagged, rejected, errors, total
    reasons: pd.DataFrame  # kind, reason, count
    meta: pd.DataFrame  # metadata columns of (a sample of) the curated rows
    versions: list[str]  # caption versions (caption_versions): source first, newest last
    sampled: bool
    dedup: DedupSummary | None
    kept: list[dict]  # contact sheet rows (with their image bytes)
    flagged: list[dict]
    clusters: list[list[dict]]
    run_rows: list[dict]
    stage_rows: list[dict]
    exports: list[dict]
    captions: list[dict]

    @property
    def caption_col(self) -> str | None:
        """The caption version the kept images' sheet is labelled with."""
        return sheet_caption(self.versions)


def read_report(spark, cfg: Config, outcome: RunOutcome) -> ReportData:
    """The report's data for the run `outcome` (the tables as the run left them)."""
    return with_run(read_tables(spark, cfg, outcome), outcome)


def read_tables(spark, cfg: Config, outcome: RunOutcome) -> ReportData:
    """The report's data that the tables decide (`outcome`: the run, for its id; its
    stages' results are read by :func:`with_run`): readable while a last stage that
    leaves those tables as they are (the export) still runs."""
    import lance

    paths = tables.layout(cfg)
    try:
        ds = lance.dataset(paths.curated)
    except (ValueError, OSError):
        ds = None
    status, reasons = corpus_counts(spark, cfg, ds)
    meta, versions, sampled = sample_meta(ds, cfg.run.report_max_rows)
    dedup = dedup_summary(spark, cfg, ds.version if ds is not None else None)
    seed = int(hashlib.sha256(outcome.run_id.encode()).hexdigest()[:8], 16)
    n = cfg.run.report_samples
    caption_col = sheet_caption(versions)
    kept = flagged = []
    if ds is not None and n:
        kept = contact_rows(ds, meta, caption_col, n, seed, True)
        flagged = contact_rows(ds, meta, None, n, seed, False)
    return ReportData(
        run_id=outcome.run_id, outcome=outcome, curated_path=paths.curated,
        dedup_path=paths.dedup, curated_version=ds.version if ds is not None else None,
        curated_rows=ds.count_rows() if ds is not None else 0, status=status,
        reasons=reasons, meta=meta, versions=versions, sampled=sampled, dedup=dedup,
        kept=kept, flagged=flagged, clusters=cluster_rows(ds, dedup), run_rows=[],
        stage_rows=[], exports=[], captions=caption_rows(meta, versions))


def with_run(data: ReportData, outcome: RunOutcome) -> ReportData:
    """`data` (:func:`read_tables`) with the run's own tables from `outcome`, as the run
    ended: its accounting per source, its stages and its exports."""
    run_rows, stage_rows, exports = run_tables(outcome)
    return replace(data, outcome=outcome, run_rows=run_rows, stage_rows=stage_rows,
                   exports=exports)
