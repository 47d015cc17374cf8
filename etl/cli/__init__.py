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

The commands that change a table are in :mod:`etl.cli.commands` (`run`, and one per
entry of the stage registry), those that only read in :mod:`etl.cli.queries`; the
parser is built from them (:mod:`etl.cli.parser`).
"""

from __future__ import annotations

from etl.cli.commands import Command, fail, load
from etl.cli.parser import build_parser, commands, parse
from etl.errors import BudgetExceededError, ConfigError, JarsMissingError, RunLockedError
from etl.runtime.progress import console, console_mode

__all__ = ["main", "parse", "build_parser", "Command", "commands"]


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
            return command.run(load(args.conf), options, getattr(args, "run_id", None))
        except ConfigError as exc:
            return fail(f"lakeshard: config error: {exc}", 2)
        except (FileNotFoundError, JarsMissingError) as exc:
            return fail(f"lakeshard: {exc}", 2)
        except RunLockedError as exc:
            return fail(f"lakeshard: refused: {exc}", 3)
        except BudgetExceededError as exc:
            return fail(_budget_message(exc), 4)
        except Exception as exc:
            if console_mode().format != "json":
                raise  # a bug or an outage: the traceback, with where the run is recorded
            import traceback

            return fail("".join(traceback.format_exception(exc)).rstrip(), 1)

