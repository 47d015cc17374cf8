"""The stage registry: what `lakeshard run` executes and in which order, and the other
table-changing commands, which run the same way (lock, ledger, progress).

A stage is declared once, here, by the functions that make it: its function
``(spark, cfg, ctx: RunContext) -> StageResult[D]``, a one-line description (the
command's ``--help`` line), and optionally a check ``(cfg, ctx) -> None`` that runs
before Spark starts, its typed options (a frozen dataclass beside the stage whose fields
are the command's flags, :mod:`etl.runtime.options`), what the command prints
(``(cfg, options, StageResult[D]) -> str``; none: a pipeline command, which prints the
run's summary), and what it warms (``(cfg, ctx) -> None``: imports the stage will need,
started on a thread once an earlier stage of the run says it will change tables,
:meth:`RunContext.changes_ahead`, or before Spark starts when the stage runs first).
:meth:`StageRegistry.add` ties the stage's result type `D` to its `render` and its
options type to `render`'s options, so a type checker follows each call. The CLI builds
its subcommands from these entries. `run.stages:` in the config, ``--only`` and
``--skip`` choose among :data:`STAGES`, never reorder them. Adding a stage is one entry,
placed where it belongs in the order.

The job modules are imported with this one: the parser needs every command's options
anyway (they are its flags), and those live in the job modules; the two jobs without
options (curate, export) add about 0.1 s to a command's start and nothing to a run,
which imports them anyway (docs/development.md, "Commands declared once").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from etl.config import Config
from etl.jobs import caption, curate, dedup, export, forget, lakehouse, latents
from etl.pipeline.checks import check_exports, check_sources
from etl.runtime.options import is_options, options_from
from etl.runtime.stage import RunContext, StageDetail, StageResult

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["Stage", "StageRegistry", "STAGES", "COMMANDS"]

D = TypeVar("D", bound=StageDetail)
Opts = TypeVar("Opts")  # the stage's options type

# A stage's check or warm-up, (cfg, ctx) -> None, both run before the stage.
Hook = Callable[[Config, RunContext], None]


@dataclass(frozen=True)
class Stage(Generic[D, Opts]):
    """One registered stage or command: the functions that make it (see the module)."""

    name: str
    run: Callable[[SparkSession, Config, RunContext], StageResult[D]]
    description: str  # one line; the command's --help line
    check: Hook | None = None  # run before Spark
    options: type[Opts] | None = None  # the command's typed options
    render: Callable[[Config, Opts, StageResult[D]], str] | None = None  # what the command
    # prints; None: the run's summary
    details: str | None = None  # the command's --help paragraph, where one line is not enough
    warm: Hook | None = None  # imports the stage will need, started on a thread
    # (etl.runtime.warm; when: the runner's _warm)
    keeps_tables: bool = False  # leaves the tables the run's report reads (curated,
    # rejects, dedup) as they are: the report's table part is made while it runs

    def printer(self) -> Callable[[Config, Opts, StageResult[D]], str]:
        """What the command prints (`render`); a ValueError for a pipeline stage."""
        if self.render is None:
            raise ValueError(f"stage {self.name!r} prints the run's summary, not its own")
        return self.render

    def make_options(self, given: Any = None) -> Opts | None:
        """This stage's typed options from `given`: its options object, a mapping of its
        fields (a key no field names is a TypeError), or None (the defaults); None for a
        stage without options, which then takes none."""
        cls = self.options
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
        self._stages: list[Stage[Any, Any]] = []

    def add(self, name: str,
            run: Callable[[SparkSession, Config, RunContext], StageResult[D]],
            description: str, *, check: Hook | None = None,
            options: type[Opts] | None = None,
            render: Callable[[Config, Opts, StageResult[D]], str] | None = None,
            details: str | None = None, warm: Hook | None = None,
            keeps_tables: bool = False) -> None:
        """One stage (see :class:`Stage`)."""
        if name in self.names():
            raise ValueError(f"stage {name!r} is registered twice")
        self._stages.append(Stage(name, run, description, check, options, render, details,
                                  warm, keeps_tables))

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._stages)

    def get(self, name: str) -> Stage[Any, Any]:
        for s in self._stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def __iter__(self) -> Iterator[Stage[Any, Any]]:
        return iter(self._stages)

    def select(self, configured: tuple[str, ...] | None, only: tuple[str, ...] = (),
               skip: tuple[str, ...] = ()) -> list[Stage[Any, Any]]:
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
STAGES.add("curate", curate.stage,
           "ingest sources, prepare images, write Lance + rejects", check=check_sources)
STAGES.add("dedup", dedup.stage,
           "annotate exact and near duplicates of the curated table (Delta dedup)",
           check=dedup.check, options=dedup.DedupOptions, render=dedup.render)
STAGES.add("caption", caption.stage,
           "add a caption version (VLM re-captioning) to the curated table",
           check=caption.check, options=caption.CaptionOptions, render=caption.render)
STAGES.add("export", export.stage, "export the curated table to MDS",
           check=check_exports, warm=export.warm, keeps_tables=True)

# Commands that change the curated table outside `lakeshard run`.
COMMANDS = StageRegistry()
COMMANDS.add("latents", latents.stage,
             "precompute a text encoder's latents per caption into the curated table",
             check=latents.check, options=latents.LatentsOptions, render=latents.render)
COMMANDS.add("features", lakehouse.features_stage,
             "list or add feature columns (no image rewrite)",
             check=lakehouse.check_features, options=lakehouse.FeaturesOptions,
             render=lakehouse.render_features)
COMMANDS.add("embed", lakehouse.embed_stage,
             "embed captions into the vector column + vector index",
             check=lakehouse.require_curated, options=lakehouse.EmbedOptions,
             render=lakehouse.render_embed)
COMMANDS.add("compact", lakehouse.compact_stage,
             "compact fragments, clean versions past retention",
             check=lakehouse.require_curated, render=lakehouse.render_compact)
COMMANDS.add("forget", forget.stage,
             "a takedown request: remove the records it names from every table and refuse "
             "them from then on",
             check=forget.check, options=forget.ForgetOptions, render=forget.render,
             details="Remove every record the identifiers name from the curated, dedup, "
             "rejects and manifest tables, purge their image bytes, and record the request "
             "in the Delta takedowns table so that later runs refuse them (by key, URL and "
             "image hash). A --file holds one `KIND VALUE` per line (KIND: sample-id, key, "
             "url, image-sha256; # comments).")
