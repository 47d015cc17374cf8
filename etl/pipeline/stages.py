"""The stage registry: what `lakeshard run` executes and in which order, and the other
table-changing commands, which run the same way (lock, ledger, progress).

A stage is a name, a function ``(spark, cfg, ctx: RunContext) -> StageResult`` named by
``"module:function"`` (imported only when the stage runs, so checking names against
config stays cheap), a one-line description, and optionally a check
``(cfg, ctx) -> None`` that runs before Spark starts. `run.stages:` in the config,
``--only`` and ``--skip`` choose among :data:`STAGES`, never reorder them. Adding a stage
is one line, placed where it belongs in the order.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from etl.runtime.stage import StageResult

__all__ = ["Stage", "StageRegistry", "STAGES", "COMMANDS"]


def _load(target: str) -> Callable:
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


@dataclass(frozen=True)
class Stage:
    name: str
    target: str  # "module:function"
    description: str
    check: str | None = None  # "module:function", run before Spark

    def load(self) -> Callable[..., StageResult]:
        return _load(self.target)

    def load_check(self) -> Callable | None:
        return _load(self.check) if self.check else None


class StageRegistry:
    def __init__(self) -> None:
        self._stages: list[Stage] = []

    def add(self, name: str, target: str, description: str, check: str | None = None) -> None:
        if name in self.names():
            raise ValueError(f"stage {name!r} is registered twice")
        self._stages.append(Stage(name, target, description, check))

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


STAGES = StageRegistry()
# In order. ingest and prepare run inside `curate`.
STAGES.add("curate", "etl.jobs.curate:stage",
           "ingest sources, prepare images, write Lance curated + Delta rejects",
           check="etl.pipeline.preflight:check_sources")
STAGES.add("dedup", "etl.jobs.dedup:stage",
           "annotate exact and near duplicates (Delta dedup; new rows against all)",
           check="etl.jobs.dedup:check")
STAGES.add("caption", "etl.jobs.caption:stage",
           "VLM captions of the default caption version for rows lacking them",
           check="etl.jobs.caption:check")
STAGES.add("export", "etl.jobs.export:stage",
           "export the curated table to MDS shards (resumes, no-op when up to date)",
           check="etl.pipeline.preflight:check_exports")

# Commands that change the curated table outside `lakeshard run`.
COMMANDS = StageRegistry()
COMMANDS.add("latents", "etl.jobs.latents:stage",
             "precompute a text encoder's latents per caption", check="etl.jobs.latents:check")
COMMANDS.add("features", "etl.jobs.lakehouse:features_stage",
             "add feature columns (no image rewrite)", check="etl.jobs.lakehouse:check_features")
COMMANDS.add("embed", "etl.jobs.lakehouse:embed_stage",
             "embed captions into the vector column + vector index",
             check="etl.jobs.lakehouse:require_curated")
COMMANDS.add("compact", "etl.jobs.lakehouse:compact_stage",
             "compact fragments, clean versions past retention",
             check="etl.jobs.lakehouse:require_curated")
COMMANDS.add("forget", "etl.jobs.forget:stage",
             "a takedown request: its records out of every table, refused from then on",
             check="etl.jobs.forget:check")
