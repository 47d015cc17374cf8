"""The outcome of a run: per stage its result and seconds, the report and the events
file, what was recovered or migrated first, and where it failed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from etl.runtime.stage import StageResult

__all__ = ["RunOutcome"]


@dataclass
class RunOutcome:
    run_id: str
    stages: list[str]
    results: dict[str, StageResult] = field(default_factory=dict)
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

    def detail(self, stage: str) -> Any:
        res = self.results.get(stage)
        return res.detail if res else None
