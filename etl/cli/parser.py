"""The `lakeshard` argument parser, built from the commands: each command's typed
options (:mod:`etl.runtime.options`) become its flags, and the parsed flags become the
options again (:func:`parse`)."""

from __future__ import annotations

import argparse
from typing import Any

from etl.cli.commands import Command, table_commands
from etl.cli.queries import QUERIES
from etl.runtime.options import Flag, flags, options_from

__all__ = ["commands", "build_parser", "parse"]


def commands() -> list[Command]:
    """Every subcommand, in the order `lakeshard --help` lists them."""
    return [*table_commands(), *QUERIES]


def _dest(field_name: str, how: Flag) -> str:
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
