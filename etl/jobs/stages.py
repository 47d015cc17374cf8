"""The stage registry: what `lakeshard run` executes, and in which order.

A stage is a name, a function ``(spark, cfg, ctx: RunContext) -> StageResult`` and a
one-line description. Stages run in registration order; `run.stages:` in the config,
``--only`` and ``--skip`` choose among them, never reorder them. Adding a stage is one
line, placed where it belongs in the order (the function is imported only when the
stage runs, so the registry stays cheap to import for config validation)::

    STAGES.add("dedup", "etl.jobs.dedup:run_stage", "near-duplicate clusters as columns")

The function does its own incremental check (only new or unfinished work) and returns
a :class:`StageResult`: counts in and out by status, the table versions it produced,
the export manifests it wrote, and ``note`` (e.g. ``"up to date"``) when it had
nothing to do. ``ctx.results`` holds the results of the stages before it in this run.
The orchestrator (:mod:`etl.jobs.run`) adds the lock, the ledger rows, timings,
progress, Spark job groups and the report around every stage.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StageResult", "RunContext", "Stage", "StageRegistry", "STAGES"]


@dataclass
class StageResult:
    # Counts by status: what the stage read, and what it produced.
    inputs: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, int] = field(default_factory=dict)
    # Table -> version this stage left ("lance:curated": 4, "delta:rejects": 2).
    table_versions: dict[str, int] = field(default_factory=dict)
    # Export name -> its manifest summary (path, samples, checksum, table version).
    manifests: dict[str, dict] = field(default_factory=dict)
    note: str | None = None
    # The stage's own result object (CurateResult, [ExportResult], …), for callers.
    detail: Any = None


@dataclass
class RunContext:
    run_id: str
    # Exports the export stage writes; None: every configured export.
    export_names: tuple[str, ...] | None = None
    results: dict[str, StageResult] = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    name: str
    target: str  # "module:function"
    description: str

    def load(self) -> Callable[..., StageResult]:
        module, _, func = self.target.partition(":")
        return getattr(importlib.import_module(module), func)


class StageRegistry:
    def __init__(self) -> None:
        self._stages: list[Stage] = []

    def add(self, name: str, target: str, description: str) -> None:
        if name in self.names():
            raise ValueError(f"stage {name!r} is registered twice")
        self._stages.append(Stage(name, target, description))

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._stages)

    def get(self, name: str) -> Stage:
        for s in self._stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def __iter__(self):
        return iter(self._stages)

    def select(self, configured: tuple[str, ...] | None, only: tuple[str, ...] = (),
               skip: tuple[str, ...] = ()) -> list[Stage]:
        """The stages to run, in registry order: config's list (or all), then --only,
        then --skip. Unknown names raise ValueError naming the flag."""
        for flag, names in (("--only", only), ("--skip", skip)):
            for n in names:
                if n not in self.names():
                    raise ValueError(
                        f"{flag}: unknown stage {n!r} (registered: {', '.join(self.names())})"
                    )
        chosen = set(configured) if configured is not None else set(self.names())
        if only:
            chosen = set(only)  # an explicit --only overrides the config's list
        chosen -= set(skip)
        return [s for s in self._stages if s.name in chosen]


# ----------------------------------------------------------------- built-in stages


def _delta_version(spark, path: str) -> int | None:
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, path):
        return None
    return DeltaTable.forPath(spark, path).history(1).collect()[0]["version"]


def curate_stage(spark, cfg, ctx: RunContext) -> StageResult:
    """ingest + prepare + write: sources -> Lance `curated` + Delta `rejects`."""
    from etl.jobs.curate import curate

    cur = curate(spark, cfg, ctx.run_id)
    inputs: dict[str, int] = {"seen": sum(c.seen for c in cur.counts)}
    outputs: dict[str, int] = {"accepted": 0, "rejected": 0, "flagged": 0}
    for c in cur.counts:
        inputs[f"seen:{c.source}"] = c.seen
        outputs["accepted"] += c.accepted
        outputs["rejected"] += c.rejected
        outputs["flagged"] += sum(c.filtered.values())
        for reason, n in c.reasons.items():
            outputs[f"rejected:{reason}"] = outputs.get(f"rejected:{reason}", 0) + n
        for reason, n in c.filtered.items():
            outputs[f"flagged:{reason}"] = outputs.get(f"flagged:{reason}", 0) + n
    versions = {"lance:curated": cur.curated_version}
    rejects_version = _delta_version(spark, cur.rejects_path)
    if rejects_version is not None:
        versions["delta:rejects"] = rejects_version
    return StageResult(inputs=inputs, outputs=outputs, table_versions=versions, detail=cur)


def _drop_stale_staging(export_dir: str) -> None:
    """Remove staging folders an interrupted export of other settings or another table
    version left next to `export_dir` (the current one was just swapped into place;
    the run lock guarantees no other export is writing)."""
    import glob
    import shutil

    parent, name = os.path.split(export_dir.rstrip("/"))
    for stale in glob.glob(os.path.join(parent, f".{name}.staging-*")) + glob.glob(
        os.path.join(parent, f".{name}.old-*")
    ):
        shutil.rmtree(stale, ignore_errors=True)


def _manifest(path: str) -> dict:
    if "://" in path:
        from etl.writers.remote import S3Store

        return S3Store(path).get_json("manifest.json") or {}
    with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def export_stage(spark, cfg, ctx: RunContext) -> StageResult:
    """curated Lance table -> every (or the chosen) MDS export."""
    from etl.jobs.export import export

    names = ctx.export_names if ctx.export_names is not None else tuple(
        e.name for e in cfg.exports
    )
    results, manifests = [], {}
    inputs: dict[str, int] = {}
    outputs: dict[str, int] = {"samples": 0, "shards": 0, "bytes": 0}
    up_to_date = 0
    for name in names:
        res = export(spark, cfg, name)
        results.append(res)
        manifest = _manifest(res.path)
        reused = res.resumed_partitions == manifest["partitions"]
        up_to_date += reused
        manifests[name] = {
            "path": res.path, "samples": res.samples, "shards": res.shards,
            "bytes": res.bytes, "checksum": res.checksum,
            "table_version": manifest.get("table_version"),
            "export_key": manifest.get("export_key"),
            "resumed_partitions": res.resumed_partitions,
        }
        if "://" not in res.path:
            _drop_stale_staging(res.path)
        inputs[f"rows:{name}"] = res.samples
        outputs["samples"] += res.samples
        outputs["shards"] += res.shards
        outputs["bytes"] += res.bytes
        outputs[f"samples:{name}"] = res.samples
    note = "up to date" if names and up_to_date == len(names) else None
    return StageResult(inputs=inputs, outputs=outputs, manifests=manifests, note=note,
                       detail=results)


def dedup_stage(spark, cfg, ctx: RunContext) -> StageResult:
    """exact + near duplicates of the curated table -> Delta `dedup` (new rows only)."""
    from etl.jobs.dedup import dedup

    if not cfg.dedup.enabled:
        return StageResult(note="disabled (dedup.enabled: false)")
    res = dedup(spark, cfg, ctx.run_id)
    outputs = {"changed": res.changed, "removed": res.removed, "clusters": res.clusters,
               "near_pairs": res.pairs}
    for c in res.counts:
        for key, value in vars(c).items():
            if isinstance(value, int) and key != "source":
                outputs[f"{key}:{c.source}"] = value
    return StageResult(
        inputs={"new_rows": res.new_rows}, outputs=outputs,
        table_versions={"delta:dedup": res.version},
        note="up to date" if res.new_rows == 0 and res.changed == 0 else None, detail=res,
    )


def caption_stage(spark, cfg, ctx: RunContext) -> StageResult:
    """the default caption version for rows lacking it (VLM; a no-op when none lack it)."""
    from etl.jobs.caption import caption, plan_caption

    if not cfg.caption.versions:
        return StageResult(note="no caption versions configured")
    plan = plan_caption(cfg, None)
    if plan.todo == 0:
        return StageResult(note="up to date", inputs={"rows": plan.table_rows})
    res = caption(spark, cfg, None)
    return StageResult(
        inputs={"rows": res.table_rows, "todo": res.todo},
        outputs={f"status:{k}": v for k, v in res.statuses.items()},
        table_versions={"lance:curated": res.version_after}, detail=res,
        note=f"{res.column}: untrained smoke-test model" if res.smoke_test_model else None,
    )


STAGES = StageRegistry()
# In order. ingest and prepare run inside `curate`.
STAGES.add("curate", "etl.jobs.stages:curate_stage",
           "ingest sources, prepare images, write Lance curated + Delta rejects")
STAGES.add("dedup", "etl.jobs.stages:dedup_stage",
           "annotate exact and near duplicates (Delta dedup; new rows against all)")
STAGES.add("caption", "etl.jobs.stages:caption_stage",
           "VLM captions of the default caption version for rows lacking them")
STAGES.add("export", "etl.jobs.stages:export_stage",
           "export the curated table to MDS shards (resumes, no-op when up to date)")
