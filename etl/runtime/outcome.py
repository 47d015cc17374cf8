"""The outcome of a run: per stage its result and seconds, the report and the events
file, what was recovered or migrated first, and where it failed. Beside the stage
results it collects (:mod:`etl.runtime.stage`), below everything that reads it: the
runner fills it, the console summary and the report draw it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from etl.runtime.stage import StageDetail, StageResult

__all__ = ["RunOutcome"]

_D = TypeVar("_D", bound=StageDetail)


@dataclass
class RunOutcome:
    run_id: str
    stages: list[str]
    # Per stage that finished, in the order they ran (the registry's).
    results: dict[str, StageResult[StageDetail]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    report: str | None = None
    recovered_run: str | None = None  # the crashed run whose stale lock this one took
    migrated: list[str] = field(default_factory=list)  # migrations applied first
    # Where and why the run failed (a stage over its failure budget, or an exception).
    failed_stage: str | None = None
    failure: str | None = None
    events: str | None = None  # <root>/reports/<run_id>/events.jsonl
    # The report could not be written (its error): logged and recorded, never a failed run.
    report_error: str | None = None

    @property
    def status(self) -> str:
        return "failed" if self.failed_stage else "ok"

    def details(self) -> list[StageDetail]:
        """The result objects of the stages that returned one, in the order they ran."""
        return [r.detail for r in self.results.values() if r.detail is not None]

    def detail(self, stage: str, kind: type[_D]) -> _D | None:
        """`stage`'s result object, None when it did not run or returned none; a
        TypeError when it is not a `kind` (the caller named the wrong stage or type)."""
        res = self.results.get(stage)
        if res is None or res.detail is None:
            return None
        if not isinstance(res.detail, kind):
            raise TypeError(f"stage {stage!r} returned a {type(res.detail).__name__}, "
                            f"not a {kind.__name__}")
        return res.detail
