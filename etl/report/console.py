"""The run's accounting as the console shows it: one row per source and the total, the
sources whose removals were deferred, when removed rows' bytes leave storage, and the
records that failed on lakeshard's own code. ``CurateResult.summary_head`` puts it
under the run summary's first line; the report draws the same counts as a table."""

from __future__ import annotations

from collections.abc import Sequence

from etl.lakehouse.maintenance import PurgeResult
from etl.transforms.accounting import ALL_SOURCES, SourceCounts

__all__ = ["count_line", "accounting_lines"]

_HEADER = (
    f"{'source':<20} {'seen':>7} {'accepted':>9} {'rejected':>9} {'errors':>7} "
    f"{'flagged':>8} {'unchanged':>10} {'removed':>8}  "
    "reasons (rejected; flagged; removed)"
)


def count_line(c: SourceCounts, *, reasons: bool = True) -> str:
    """One row of the accounting table (the total row without reasons)."""
    r = c.row()
    line = (f"{r['source']:<20} {r['seen']:>7} {r['accepted']:>9} {r['rejected']:>9} "
            f"{r['errors']:>7} {r['flagged']:>8} {r['unchanged']:>10} {r['removed']:>8}")
    return line + (f"  {r['reasons'] or '-'}" if reasons else "")


def accounting_lines(counts: Sequence[SourceCounts], purge: PurgeResult | None,
                     examples: Sequence[str]) -> list[str]:
    """A blank line, the table, then what the counts alone do not say: removals
    deferred, the purge of removed rows' bytes, and internal errors with their
    examples (those of `examples` that are internal errors)."""
    lines = ["", _HEADER, "-" * len(_HEADER)]
    total = sum(counts, SourceCounts(ALL_SOURCES, 0, 0, 0))
    lines += [count_line(c) for c in counts]
    lines.append(count_line(total, reasons=False))
    for c in counts:
        if c.removal_scan and c.removal_scan.startswith("deferred"):
            lines.append(f"removals of {c.source} {c.removal_scan}")
    if purge is not None:
        lines.append(
            "removed rows' bytes: gone from storage" if purge.done else
            f"removed rows' bytes: held by curated versions before {purge.version} until "
            f"{purge.due:%Y-%m-%d %H:%M} UTC (lakehouse.removal_retention_hours)"
        )
    if total.internal_errors:
        lines += ["", f"errors          : {total.internal_errors} record(s) failed on "
                  "an exception in lakeshard's own code, not on bad data (rejects "
                  "table, reason internal_error, detail = the exception); the next run "
                  "retries them"]
        lines += [f"  {e}" for e in examples if " internal_error" in e]
    return lines
