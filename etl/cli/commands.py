"""The table-changing commands: `run`, and one per stage of the registry
(:mod:`etl.pipeline.stages`) -- its options, description and output are the stage's.
Each command is a :class:`Command`: its ``--help`` line, typed options and handler."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from etl.config import Config, load_config
from etl.errors import BudgetExceededError, ConfigError
from etl.pipeline.stages import COMMANDS, STAGES, Stage
from etl.runtime.options import flag
from etl.runtime.progress import console_mode

__all__ = ["Command", "RunOptions", "ExportOptions", "load", "fail", "table_commands"]


@dataclass(frozen=True)
class Command:
    """One subcommand: its ``--help`` line, its typed options (the flags), and what it
    does, ``run(cfg, options, run_id) -> exit status``."""

    name: str
    help: str
    run: Callable[[Config, Any, str | None], int]
    options: type | None = None
    description: str | None = None
    changes_tables: bool = False  # under the run lock, in the ledger: takes --run-id


def load(conf: str | None) -> Config:
    """The config, parsed and checked against the registries; errors name the file."""
    from etl.pipeline.preflight import check_config

    cfg = load_config(conf)
    try:
        return check_config(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{conf or 'embedded conf/local.yaml'}: {exc}") from None


def fail(message: str, code: int) -> int:
    """An error for people (or, with --log-format json, as a JSON line); the exit code."""
    if console_mode().format == "json":
        print(json.dumps({"event": "error", "message": message, "exit_code": code}),
              file=sys.stderr, flush=True)
    else:
        print(message, file=sys.stderr, flush=True)
    return code


@dataclass(frozen=True)
class RunOptions:
    export: tuple[str, ...] = flag((), "only this export (repeatable)")
    only: tuple[str, ...] = flag(
        (), "run only this stage (repeatable; overrides run.stages)", metavar="STAGE")
    skip: tuple[str, ...] = flag((), "skip this stage (repeatable)", metavar="STAGE")


@dataclass(frozen=True)
class ExportOptions:
    names: tuple[str, ...] = flag((), "export name (repeatable)", name="--name")


def _pipeline(cfg: Config, **kw) -> int:
    """A pipeline run and its summary -- printed also when a stage is over its failure
    budget (what was done up to there), before the error."""
    from etl.pipeline.runner import run_pipeline
    from etl.pipeline.summary import format_outcome

    try:
        out = run_pipeline(cfg, **kw)
    except BudgetExceededError as exc:
        if exc.outcome is not None:
            print(format_outcome(exc.outcome))
        raise
    print(format_outcome(out))
    return 0


def _run(cfg: Config, opts: RunOptions, run_id: str | None) -> int:
    return _pipeline(cfg, only=opts.only, skip=opts.skip, export_names=opts.export or None,
                     run_id=run_id)


def _pipeline_stage(name: str, cfg: Config, opts: None, run_id: str | None) -> int:
    return _pipeline(cfg, only=(name,), run_id=run_id)


def _export(cfg: Config, opts: ExportOptions, run_id: str | None) -> int:
    names = opts.names or tuple(cfg.exports)
    if not names:
        raise ConfigError("exports: no export configured (add one under `exports:`)")
    return _pipeline(cfg, only=("export",), export_names=names, run_id=run_id)


def _stage_command(stage: Stage, cfg: Config, opts: Any, run_id: str | None) -> int:
    """A registered stage as its own command, printing what its `render` says -- also
    when it is over its failure budget (what it did is committed), before the error."""
    from etl.pipeline.runner import run_command

    render = stage.printer()
    try:
        out = run_command(cfg, stage.name, opts, run_id=run_id)
    except BudgetExceededError as exc:
        done = exc.outcome.results.get(stage.name) if exc.outcome is not None else None
        if done is not None and done.detail is not None:
            print(render(cfg, opts, done))
        raise
    print(render(cfg, opts, out.results[stage.name]))
    return 0


def _features(cfg: Config, opts: Any, run_id: str | None) -> int:
    """`features list` reads the table's schema; `features add` is the stage."""
    if opts.action == "add":
        return _stage_command(COMMANDS.get("features"), cfg, opts, run_id)
    from etl import tables
    from etl.lakehouse.features import FEATURES

    have = set(tables.open_curated(cfg).schema.names)
    for f in FEATURES.values():
        state = "present" if f.name in have else "-"
        print(f"{f.name:<16} {f.spark_type:<8} {state:<8} {f.doc}")
    return 0


def _registered() -> list[Command]:
    """The registry's stages and commands, pipeline stages first (`curate`, `export`:
    a run of that stage, with the run's summary), then those printing their own."""
    # `export --name` chooses the run's exports (not options of the stage), and
    # `features list` only reads: their own handlers.
    special: dict[str, tuple[Callable, type | None]] = {
        "export": (_export, ExportOptions), "features": (_features, None)}
    out = []
    for stage in sorted([*STAGES, *COMMANDS], key=lambda s: s.render is not None):
        default = (functools.partial(_stage_command, stage) if stage.render
                   else functools.partial(_pipeline_stage, stage.name))
        run, options = special.get(stage.name, (default, None))
        out.append(Command(stage.name, stage.description, run,
                           options or stage.options, stage.details,
                           changes_tables=True))
    return out


def table_commands() -> list[Command]:
    """`run`, then the registry's stages and commands, in the order `--help` lists them."""
    return [
        Command("run", "the configured stages in order (default: all), under the run lock, "
                "into the ledger, then the report", _run, RunOptions, changes_tables=True),
        *_registered(),
    ]
