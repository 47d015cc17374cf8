"""What a stage (or a table-changing command) returns to the run that called it, and
what it gets from it. The orchestrator (:mod:`etl.pipeline.runner`) adds the lock, the
ledger rows, timings, progress and the report around every stage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from etl.runtime.metrics import Metrics
from etl.runtime.options import flags, is_options

__all__ = ["RowTally", "StageDetail", "StageResult", "RunContext", "Metrics"]

_O = TypeVar("_O")


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


class StageDetail:
    """The base of each stage's own result object (``CurateResult``, ``ExportRun``, …,
    what :attr:`StageResult.detail` holds): what it shows of itself in the run's console
    summary, ``summary.json`` and report, so that none of those looks a result up by its
    stage's name. Each part is empty unless the result has something to say there."""

    def summary_head(self) -> list[str]:
        """Lines under the summary's first line, in stage order: the accounting table and
        where outputs landed (curate's tables, each export)."""
        return []

    def summary_section(self) -> str | None:
        """A paragraph after those lines (dedup's per-source table, what caption did)."""
        return None

    def summary_json(self) -> dict[str, Any]:
        """This result's entries in the run's ``summary.json``."""
        return {}

    def source_rows(self) -> list[dict[str, Any]]:
        """Per source, what this run did with its records (curate's accounting rows,
        ``SourceCounts.row``): the report's table of this run."""
        return []


D = TypeVar("D", bound=StageDetail, covariant=True)


@dataclass(frozen=True)
class StageResult(Generic[D]):
    """What a stage did, for the ledger (metrics, versions, manifests), the failure
    budgets (`tally`) and what prints it (`detail`, the stage's own result type)."""

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
    # The stage's own result object (CurateResult, ExportRun, …); None when the stage
    # had nothing to do that it reports (disabled, nothing configured).
    detail: D | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", Metrics.of(self.inputs))
        object.__setattr__(self, "outputs", Metrics.of(self.outputs))

    def made(self) -> D:
        """The stage's result object, for what prints it (a command's `render`); a
        stage that returned none has nothing to print: a RuntimeError, a bug."""
        if self.detail is None:
            raise RuntimeError(f"this stage returned no result object ({self.note or 'no note'})")
        return self.detail


@dataclass
class RunContext:
    run_id: str
    # Exports the export stage writes; None: every configured export.
    export_names: tuple[str, ...] | None = None
    # The results of the stages before this one in this run.
    results: dict[str, StageResult[StageDetail]] = field(default_factory=dict)
    # A command's own arguments (`lakeshard caption --version v --force`), each a typed
    # options object (:mod:`etl.runtime.options`); a stage without one gets its defaults.
    options: tuple[Any, ...] = ()
    # The run id was given (``--run-id``): this process may continue a run that earlier
    # processes (the job's previous tasks) recorded in the ledger.
    continued: bool = False
    # The run is one command (`lakeshard dedup`), not a stage of `lakeshard run`.
    command: bool = False
    # What :meth:`changes_ahead` starts (the runner's: later stages' warm-up); once.
    on_changes: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    # How many new records the running stage said it will write (changes_ahead), if it
    # said: a later stage's warm-up may size itself by it.
    new_records: int | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.options = tuple(self.options)
        kinds = [type(o) for o in self.options]
        for opts in self.options:
            if not is_options(opts):
                raise TypeError(f"RunContext options: {opts!r} is not a typed options "
                                "object (a frozen dataclass, etl.runtime.options)")
        if len(set(kinds)) != len(kinds):
            raise TypeError("RunContext options: "
                            f"{', '.join(k.__name__ for k in kinds)} holds one twice")

    def changes_ahead(self, new_records: int | None = None) -> None:
        """The running stage knows it will change tables (a night with new records, not
        a no-op; `new_records` of them when it can tell): what later stages will need
        may start warming now, on threads, while it works
        (:attr:`etl.pipeline.stages.Stage.warm`). Once per run; nothing outside a run."""
        if self.new_records is None:
            self.new_records = new_records
        hook, self.on_changes = self.on_changes, None
        if hook is not None:
            hook()

    def options_for(self, cls: type[_O]) -> _O:
        """The options of type `cls` this run was given, else `cls`'s defaults."""
        flags(cls)  # a frozen options dataclass, or TypeError
        for opts in self.options:
            if type(opts) is cls:
                return opts
        return cls()
