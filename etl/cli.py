"""The `lakeshard` command.

Every command loads the config and checks it against the registries before anything
else. Commands that change a table (`run`, `curate`, `export`, `dedup`, `caption`,
`latents`, `features add`, `embed`, `compact`, `forget`) run through
:mod:`etl.pipeline.runner`:
under the root's run lock, recorded in the run ledger. The others only read.

The console (:func:`etl.runtime.progress.console`): the command's summary on stdout;
stage and progress lines, warnings and errors on stderr (``-v``: every log record and
event; ``--log-format json``: events and log records as JSON lines, for log shippers).
Exit codes: 0 done; 1 a stage failed on an exception (traceback, with where it is
recorded); 2 bad configuration, arguments or a missing input, before any work;
3 another run holds the root's lock; 4 a stage exceeded its failure budget
(``run.budgets``); `verify-export` exits 1 when it finds a problem.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from etl.config import Config, load_config
from etl.errors import BudgetExceededError, ConfigError, JarsMissingError, RunLockedError
from etl.pipeline.stages import COMMANDS, STAGES, Stage
from etl.runtime.options import flag, flags, options_from, positive
from etl.runtime.progress import console, console_mode

__all__ = ["main", "parse", "build_parser", "Command", "commands"]


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


def _load(conf: str | None) -> Config:
    """The config, parsed and checked against the registries; errors name the file."""
    from etl.pipeline.preflight import check_config

    cfg = load_config(conf)
    try:
        return check_config(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{conf or 'embedded conf/local.yaml'}: {exc}") from None


# ------------------------------------------------------------------ table-changing


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

    render = stage.load_render()
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
    special: dict[str, tuple[Callable, type | None]] = {
        "export": (_export, ExportOptions), "features": (_features, None)}
    out = []
    for stage in sorted([*STAGES, *COMMANDS], key=lambda s: s.render is not None):
        default = (functools.partial(_stage_command, stage) if stage.render
                   else functools.partial(_pipeline_stage, stage.name))
        run, options = special.get(stage.name, (default, None))
        out.append(Command(stage.name, stage.description, run,
                           options or stage.load_options(), stage.details,
                           changes_tables=True))
    return out


# ------------------------------------------------------------------------ read-only


@dataclass(frozen=True)
class RunsOptions:
    limit: int = flag(10, "how many runs", type=positive)
    stages: bool = flag(False, "one line per stage too")


def _runs(cfg: Config, opts: RunsOptions, run_id: None) -> int:
    from etl import tables
    from etl.ledger import recent_runs, recent_runs_local
    from etl.pipeline.summary import format_runs

    path = tables.layout(cfg).runs
    rows = recent_runs_local(path, limit=opts.limit)  # no Spark session to start
    if rows is None:  # a ledger delta-rs does not read
        from etl.session import get_spark

        rows = recent_runs(get_spark(cfg), path, limit=opts.limit)
    print(format_runs(rows, path, stages=opts.stages))
    return 0


@dataclass(frozen=True)
class VerifyExportOptions:
    name: str | None = flag(None, "export name under `exports:`", positional=True)


def _verify_export(cfg: Config, opts: VerifyExportOptions, run_id: None) -> int:
    from etl import tables
    from etl.jobs.verify_export import taken_down_ids, verify_export

    path = tables.export_path(cfg, opts.name)
    if "://" not in path and not os.path.isdir(path):
        raise FileNotFoundError(f"no export at {path}: run `lakeshard export --name {opts.name}`")
    taken_down = taken_down_ids(cfg)
    report = verify_export(path, taken_down=taken_down)
    print(
        f"{path}: {report.samples} samples in {report.shards} shard(s); "
        f"{report.images_decoded} images decoded; {report.loader_samples} read through "
        "a shuffled DataLoader with 2 workers"
    )
    if taken_down is not None:
        print(f"takedowns: every sample checked against {len(taken_down)} taken-down id(s)")
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    print("OK" if report.ok else f"FAILED: {len(report.problems)} problem(s)")
    return 0 if report.ok else 1


def _samples(cfg: Config, opts: None, run_id: None) -> int:
    from etl.sample_sources import ensure_samples

    built = ensure_samples(cfg)
    for src in cfg.sources:
        if src.sample:
            state = "built" if src in built else "exists"
            print(f"{src.name:<20} {state:<7} {src.path}")
    return 0


@dataclass(frozen=True)
class JpegAuditOptions:
    source: str | None = flag(None, "configured source name", required=True)
    sample: int = flag(50, "images to audit", type=positive)
    generations: int = flag(5, "re-encodes in a row", type=positive)


def _jpeg_audit(cfg: Config, opts: JpegAuditOptions, run_id: None) -> int:
    from etl.jobs.jpeg_audit import format_audit, jpeg_audit
    from etl.sample_sources import ensure_samples
    from etl.session import get_spark
    from etl.sources import adapter_for

    src = cfg.source(opts.source)  # an unknown name, a missing path: fail before Spark
    ensure_samples(cfg)
    adapter_for(src.kind).check_inputs(src)
    summary, out_dir = jpeg_audit(
        get_spark(cfg), cfg, opts.source, sample=opts.sample, generations=opts.generations
    )
    print(format_audit(summary, out_dir))
    return 0


@dataclass(frozen=True)
class SqlOptions:
    query: str = flag("", positional=True)
    limit: int = flag(20, type=int)
    no_truncate: bool = flag(False)


def _sql(cfg: Config, opts: SqlOptions, run_id: None) -> int:
    from etl.lakehouse.readonly import refusal
    from etl.lakehouse.views import register_views
    from etl.session import get_spark

    spark = get_spark(cfg)
    refused = refusal(spark, opts.query)  # parsed, not run
    if refused is not None:
        return _fail(f"lakeshard sql: refused: the statement is {refused}, which is not "
                     "read-only; lakeshard sql runs a query, EXPLAIN, SHOW or DESCRIBE "
                     "only (docs/sql.md#read-only)", 2)
    views = register_views(spark, cfg)
    logging.getLogger("lakeshard").info("views: %s", ", ".join(views) or "none")
    spark.sql(opts.query).show(opts.limit, truncate=not opts.no_truncate)
    return 0


@dataclass(frozen=True)
class SearchOptions:
    query: str = flag("", positional=True)
    k: int = flag(10, "results", name="-k", type=positive)
    where: str | None = flag(None, "Lance SQL prefilter, e.g. keep")


def _search(cfg: Config, opts: SearchOptions, run_id: None) -> int:
    from etl import tables
    from etl.lakehouse.embeddings import search

    tables.open_curated(cfg)
    hits = search(tables.layout(cfg).curated, opts.query, cfg.lakehouse.embedding, k=opts.k,
                  where=opts.where)
    for rank, h in enumerate(hits, 1):
        text = (h.text or "").replace("\n", " ")
        print(f"{rank:>3}  {h.distance:.4f}  {h.sample_id}  {h.source:<16} {text[:100]}")
    if not hits:
        print("no matches (no embedded rows pass the filter)")
    return 0


def _versions(cfg: Config, opts: None, run_id: None) -> int:
    from etl import tables
    from etl.lakehouse.maintenance import table_versions

    tables.open_curated(cfg)
    print(f"{'version':>7}  {'timestamp (UTC)':<26} {'rows':>9} {'fragments':>9} {'bytes':>12}")
    for v in table_versions(tables.layout(cfg).curated):
        print(f"{v.version:>7}  {v.timestamp.isoformat():<26} {v.rows:>9} {v.fragments:>9} "
              f"{v.data_bytes:>12}")
    return 0


def commands() -> list[Command]:
    """Every subcommand, in the order `lakeshard --help` lists them."""
    return [
        Command("run", "the configured stages in order (default: all), under the run lock, "
                "into the ledger, then the report", _run, RunOptions, changes_tables=True),
        *_registered(),
        Command("runs", "recent runs from the run ledger (Delta `runs` table)", _runs,
                RunsOptions),
        Command("verify-export", "check an export: counts, hashes, every image",
                _verify_export, VerifyExportOptions),
        Command("samples", "build the bundled sample sources if missing", _samples),
        Command("jpeg-audit", "measure PSNR/SSIM of repeated JPEG re-encoding on a source "
                "sample", _jpeg_audit, JpegAuditOptions),
        Command("sql", "run a read-only Spark SQL statement (a query, EXPLAIN, SHOW, "
                "DESCRIBE) over the Lance tables (views by name)", _sql, SqlOptions),
        Command("search", "semantic search over caption embeddings", _search, SearchOptions),
        Command("versions", "list the curated table's versions (time travel)", _versions),
    ]


# --------------------------------------------------------------------------- parser


def _dest(field_name: str, how) -> str:
    """Where argparse puts a field's value: the flag's own name (``--url`` -> url)."""
    if how.positional or how.name is None:
        return how.name or field_name
    return how.name.lstrip("-").replace("-", "_")


def _add_flags(parser: argparse.ArgumentParser, options: type) -> None:
    """One argument per field of `options`: a switch, a repeatable flag, a value or a
    positional, as the field's default and :class:`~etl.runtime.options.Flag` say."""
    groups: dict[str, Any] = {}
    for field, how in flags(options):
        target = parser
        if how.group is not None:
            if how.group not in groups:
                groups[how.group] = parser.add_mutually_exclusive_group()
            target = groups[how.group]
        kw: dict[str, Any] = {k: v for k, v in (
            ("help", how.help), ("metavar", how.metavar), ("nargs", how.nargs),
            ("choices", list(how.choices) if how.choices else None), ("type", how.type),
        ) if v is not None}
        if how.positional:
            target.add_argument(how.name or field.name, **kw)
            continue
        if field.default is False:
            kw["action"] = "store_true"
        elif isinstance(field.default, tuple):
            kw.update(action="append", default=list(field.default))
        else:
            kw["default"] = field.default
        if how.required:
            kw["required"] = True
        target.add_argument(how.name or "--" + field.name.replace("_", "-"), **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lakeshard",
        description="Image-caption sources -> curated Lance table -> MDS shards.",
    )
    parser.add_argument(
        "--conf", help="YAML config (default: the embedded conf/local.yaml)", default=None
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show everything: debug logs and every event, with timestamps")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="json: every event and log record as one JSON object per line "
                        "on stderr (for log shippers); default: lines for people")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in commands():
        p = sub.add_parser(command.name, help=command.help, description=command.description)
        if command.options is not None:
            _add_flags(p, command.options)
        if command.changes_tables:
            p.add_argument("--run-id", default=None,
                           help="use this run id (e.g. the scheduler's) instead of a new one")
        # Accept the global options after the subcommand too: `lakeshard run --conf x.yaml`.
        p.add_argument("--conf", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
        p.add_argument("--log-format", choices=("text", "json"), default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
        p.set_defaults(handler=command)
    return parser


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, Command, Any]:
    """The parsed arguments, the command they name and its typed options (None for a
    command without any); argparse exits 2 on a bad flag."""
    args = build_parser().parse_args(argv)
    command: Command = args.handler
    if command.options is None:
        return args, command, None
    return args, command, options_from(command.options, {
        f.name: getattr(args, _dest(f.name, how)) for f, how in flags(command.options)})


def _fail(message: str, code: int) -> int:
    """An error for people (or, with --log-format json, as a JSON line); the exit code."""
    if console_mode().format == "json":
        print(json.dumps({"event": "error", "message": message, "exit_code": code}),
              file=sys.stderr, flush=True)
    else:
        print(message, file=sys.stderr, flush=True)
    return code


def _budget_message(exc: BudgetExceededError) -> str:
    out = exc.outcome
    lines = [f"lakeshard: run {out.run_id if out else '?'} FAILED: {exc}"]
    if out is not None:
        lines.append("Recorded as failed in the run ledger (`lakeshard runs --stages`)"
                     + (f"; report: {out.report}" if out.report else "")
                     + (f"; events: {out.events}" if out.events else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, command, options = parse(argv)
    with console(args.log_format, args.verbose):
        try:
            return command.run(_load(args.conf), options, getattr(args, "run_id", None))
        except ConfigError as exc:
            return _fail(f"lakeshard: config error: {exc}", 2)
        except (FileNotFoundError, JarsMissingError) as exc:
            return _fail(f"lakeshard: {exc}", 2)
        except RunLockedError as exc:
            return _fail(f"lakeshard: refused: {exc}", 3)
        except BudgetExceededError as exc:
            return _fail(_budget_message(exc), 4)
        except Exception as exc:
            if console_mode().format != "json":
                raise  # a bug or an outage: the traceback, with where the run is recorded
            import traceback

            return _fail("".join(traceback.format_exception(exc)).rstrip(), 1)


if __name__ == "__main__":
    sys.exit(main())
