"""The stage registry: what `lakeshard run` executes and in which order, and the other
table-changing commands, which run the same way (lock, ledger, progress).

A stage is declared once, here: a name, a function ``(spark, cfg, ctx: RunContext) ->
StageResult`` named by ``"module:function"`` (imported only when the stage runs, so
checking names against config stays cheap), a one-line description (the command's
``--help`` line), and optionally a check ``(cfg, ctx) -> None`` that runs before Spark
starts, its typed options (``"module:Class"``, a frozen dataclass beside the stage whose
fields are the command's flags, :mod:`etl.runtime.options`), and what the command prints
(``"module:function"``, ``(cfg, options, StageResult) -> str``; none: a pipeline command,
which prints the run's summary), and what it warms (``"module:function"``, ``(cfg, ctx)
-> None``: imports the stage will need, started on a thread once an earlier stage of the
run says it will change tables, :meth:`RunContext.changes_ahead`, or before Spark
starts when the stage runs first). The CLI builds its subcommands from these entries.
`run.stages:` in the config, ``--only`` and ``--skip`` choose among :data:`STAGES`, never
reorder them. Adding a stage is one entry, placed where it belongs in the order.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from etl.runtime.options import is_options, options_from
from etl.runtime.stage import StageResult

__all__ = ["Stage", "StageRegistry", "STAGES", "COMMANDS"]


def _load(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Stage:
    name: str
    target: str  # "module:function"
    description: str  # one line; the command's --help line
    check: str | None = None  # "module:function", run before Spark
    options: str | None = None  # "module:Class", the command's typed options
    render: str | None = None  # "module:function", what the command prints
    details: str | None = None  # the command's --help paragraph, where one line is not enough
    warm: str | None = None  # "module:function", (cfg, ctx) -> None: imports the
    # stage will need, started on a thread (etl.runtime.warm; when: the runner's _warm)


    def load(self) -> Callable[..., StageResult]:
        return _load(self.target)

    def load_check(self) -> Callable | None:
        return _load(self.check) if self.check else None

    def load_warm(self) -> Callable | None:
        return _load(self.warm) if self.warm else None

    def load_options(self) -> type | None:
        return _load(self.options) if self.options else None

    def load_render(self) -> Callable[[Any, Any, StageResult], str]:
        if self.render is None:
            raise ValueError(f"stage {self.name!r} prints the run's summary, not its own")
        return _load(self.render)

    def make_options(self, given: Any = None) -> Any:
        """This stage's typed options from `given`: its options object, a mapping of its
        fields (a key no field names is a TypeError), or None (the defaults); None for a
        stage without options, which then takes none."""
        cls = self.load_options()
        if cls is None:
            if given:
                raise TypeError(f"stage {self.name!r} takes no options, got {given!r}")
            return None
        if given is None or isinstance(given, Mapping):
            return options_from(cls, given)
        if not (is_options(given) and type(given) is cls):
            raise TypeError(f"stage {self.name!r} takes {cls.__name__}, got {given!r}")
        return given


class StageRegistry:
    def __init__(self) -> None:
        self._stages: list[Stage] = []

    def add(self, name: str, target: str, description: str, **more: Any) -> None:
        """One stage: see :class:`Stage` for `more` (check, options, render, details)."""
        if name in self.names():
            raise ValueError(f"stage {name!r} is registered twice")
        self._stages.append(Stage(name, target, description, **more))

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
# In order. ingest and prepare run inside `curate`. Without `render`, `lakeshard curate`
# and `lakeshard export` are runs of the pipeline with that stage only.
STAGES.add("curate", "etl.jobs.curate:stage",
           "ingest sources, prepare images, write Lance + rejects",
           check="etl.pipeline.preflight:check_sources")
STAGES.add("dedup", "etl.jobs.dedup:stage",
           "annotate exact and near duplicates of the curated table (Delta dedup)",
           check="etl.jobs.dedup:check", options="etl.jobs.dedup:DedupOptions",
           render="etl.jobs.dedup:render")
STAGES.add("caption", "etl.jobs.caption:stage",
           "add a caption version (VLM re-captioning) to the curated table",
           check="etl.jobs.caption:check", options="etl.jobs.caption:CaptionOptions",
           render="etl.jobs.caption:render")
STAGES.add("export", "etl.jobs.export:stage", "export the curated table to MDS",
           check="etl.pipeline.preflight:check_exports", warm="etl.jobs.export:warm")

# Commands that change the curated table outside `lakeshard run`.
COMMANDS = StageRegistry()
COMMANDS.add("latents", "etl.jobs.latents:stage",
             "precompute a text encoder's latents per caption into the curated table",
             check="etl.jobs.latents:check", options="etl.jobs.latents:LatentsOptions",
             render="etl.jobs.latents:render")
COMMANDS.add("features", "etl.jobs.lakehouse:features_stage",
             "list or add feature columns (no image rewrite)",
             check="etl.jobs.lakehouse:check_features",
             options="etl.jobs.lakehouse:FeaturesOptions",
             render="etl.jobs.lakehouse:render_features")
COMMANDS.add("embed", "etl.jobs.lakehouse:embed_stage",
             "embed captions into the vector column + vector index",
             check="etl.jobs.lakehouse:require_curated",
             options="etl.jobs.lakehouse:EmbedOptions", render="etl.jobs.lakehouse:render_embed")
COMMANDS.add("compact", "etl.jobs.lakehouse:compact_stage",
             "compact fragments, clean versions past retention",
             check="etl.jobs.lakehouse:require_curated",
             render="etl.jobs.lakehouse:render_compact")
COMMANDS.add("forget", "etl.jobs.forget:stage",
             "a takedown request: remove the records it names from every table and refuse "
             "them from then on",
             check="etl.jobs.forget:check", options="etl.jobs.forget:ForgetOptions",
             render="etl.jobs.forget:render",
             details="Remove every record the identifiers name from the curated, dedup, "
             "rejects and manifest tables, purge their image bytes, and record the request "
             "in the Delta takedowns table so that later runs refuse them (by key, URL and "
             "image hash). A --file holds one `KIND VALUE` per line (KIND: sample-id, key, "
             "url, image-sha256; # comments).")
