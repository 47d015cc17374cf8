"""What a stage (or a table-changing command) returns to the run that called it, and
what it gets from it. The orchestrator (:mod:`etl.pipeline.runner`) adds the lock, the
ledger rows, timings, progress and the report around every stage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from etl.runtime.metrics import Metrics

__all__ = ["RowTally", "StageResult", "RunContext", "Metrics"]


@dataclass(frozen=True)
class RowTally:
    """How the rows a stage processed this run ended: what its failure budgets
    (``run.budgets``, :mod:`etl.pipeline.budgets`) are checked against."""

    rows: int  # processed this run
    ok: int  # made it through (curate: accepted; caption: ok)
    failed: int = 0  # failed for a reason the row gives (curate: rejected; caption: failed)
    internal_errors: int = 0  # an unexpected exception in lakeshard's own code
    # A few of the errors, each saying which row and why (internal errors first).
    examples: tuple[str, ...] = ()
    # What `failed` means in this stage, for messages ("rejected", "caption failed").
    failed_label: str = "failed"


@dataclass
class StageResult:
    # What the stage read, and what it produced: totals, and breakdowns by reason,
    # source or export (a plain dict is taken as totals).
    inputs: Metrics = field(default_factory=Metrics)
    outputs: Metrics = field(default_factory=Metrics)
    # Table -> version this stage left ("lance:curated": 4, "delta:rejects": 2).
    table_versions: dict[str, int] = field(default_factory=dict)
    # Export name -> its manifest summary (path, samples, checksum, table version).
    manifests: dict[str, dict] = field(default_factory=dict)
    note: str | None = None
    # For stages that process rows: how they ended (checked against run.budgets).
    tally: RowTally | None = None
    # The stage's own result object (CurateResult, [ExportResult], …), for callers.
    detail: Any = None

    def __post_init__(self) -> None:
        self.inputs = Metrics.of(self.inputs)
        self.outputs = Metrics.of(self.outputs)


@dataclass
class RunContext:
    run_id: str
    # Exports the export stage writes; None: every configured export.
    export_names: tuple[str, ...] | None = None
    # The results of the stages before this one in this run.
    results: dict[str, StageResult] = field(default_factory=dict)
    # A command's own arguments (`lakeshard caption --version v --force`): stage -> dict.
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The run id was given (``--run-id``): this process may continue a run that earlier
    # processes (the job's previous tasks) recorded in the ledger.
    continued: bool = False

    def option(self, stage: str, name: str, default: Any = None) -> Any:
        return self.options.get(stage, {}).get(name, default)
