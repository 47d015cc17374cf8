"""Failure budgets: when a stage's failed rows fail the stage and the run.

:func:`check_budget` compares a stage's :class:`~etl.runtime.stage.RowTally` with
``run.budgets`` and returns the first budget it exceeds, as a :class:`BudgetBreach`
whose message names the budget, the counts, a few example errors and what to do. The
runner checks it after the stage returned -- after its own commits, so what it wrote is
complete and consistent -- records the stage and the run ``failed`` and stops
(:mod:`etl.pipeline.runner`; docs/operations.md#failure-budgets).
"""

from __future__ import annotations

from dataclasses import dataclass

from etl.config import BudgetsConfig
from etl.runtime.stage import RowTally

__all__ = ["BudgetBreach", "check_budget"]

_WHAT_NOW = {
    "internal_error_rate": (
        "These rows failed on an exception in lakeshard's own code (or a library under "
        "it), not on bad data: the examples name the exception and where it was raised. "
        "Fix or roll back the code, then run again: the next run retries these rows."
    ),
    "failed_rate": (
        "The examples say why. The next run retries rows that failed this way "
        "(caption: status failed); if the cause is still there it fails again."
    ),
    "all_failed_min_rows": (
        "Not one row got through: more likely a broken model, library, mapping or "
        "source than bad data. See the examples."
    ),
}


@dataclass(frozen=True)
class BudgetBreach:
    stage: str
    budget: str  # the setting, e.g. "run.budgets.internal_error_rate"
    message: str  # budget, counts, examples, what to do


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f} %"


def check_budget(stage: str, tally: RowTally | None, budgets: BudgetsConfig
                 ) -> BudgetBreach | None:
    """The first budget `tally` exceeds (internal errors, then failures, then every row
    failed), or None."""
    if tally is None or tally.rows <= 0:
        return None
    n = tally.rows
    found: tuple[str, str, str] | None = None
    if tally.internal_errors / n > budgets.internal_error_rate:
        found = ("internal_error_rate", f"{tally.internal_errors} of {n} rows "
                 f"({_pct(tally.internal_errors, n)}) ended internal_error; at most "
                 f"{100 * budgets.internal_error_rate:.2f} % may", "internal_error_rate")
    limit = budgets.failed_rate.get(stage)
    if found is None and limit is not None and tally.failed / n > limit:
        found = (f"failed_rate.{stage}", f"{tally.failed} of {n} rows "
                 f"({_pct(tally.failed, n)}) ended {tally.failed_label}; at most "
                 f"{100 * limit:.2f} % may", "failed_rate")
    min_rows = budgets.all_failed_min_rows
    if found is None and min_rows and n >= min_rows and tally.ok == 0:
        found = ("all_failed_min_rows", f"none of its {n} rows got through "
                 f"({tally.failed} {tally.failed_label}, {tally.internal_errors} "
                 f"internal_error)", "all_failed_min_rows")
    if found is None:
        return None
    name, counts, kind = found
    budget = f"run.budgets.{name}"
    lines = [f"stage {stage} is over its failure budget {budget}: {counts}."]
    if tally.examples:
        lines.append("Examples:")
        lines += [f"  {e}" for e in tally.examples]
    lines.append(_WHAT_NOW[kind])
    return BudgetBreach(stage, budget, "\n".join(lines))
