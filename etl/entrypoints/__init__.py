"""spark-submit entrypoints: one module per command, each with ``main()``.

``spark-submit … etl/entrypoints/run.py --conf conf/emr.yaml`` (the file, on EMR), or
the console scripts ``lakeshard-run``, ``lakeshard-curate``, ``lakeshard-export`` that
the wheel installs (Databricks ``python_wheel_task`` entry points). Every entrypoint
takes the same flags as its ``lakeshard`` subcommand (``--conf``, ``--run-id``, …).

A failure *exits the process* (``SystemExit`` with the subcommand's status: 2 bad config,
3 refused by the run lock, 4 over a failure budget, 1 a crashed stage): Databricks'
``python_wheel_task`` calls the entry point and ignores what it returns, and a
``spark-submit``ted file's return value is lost too, so a status that is only returned
would mark a failed run as a succeeded task. Success returns 0 (no ``sys.exit(0)``, which
some notebook-style launchers report as an exception).

A new stage adds a module here that calls ``entry("<subcommand>")`` or
``entry("run", "--only", "<stage>")``.
"""

from __future__ import annotations

import sys

__all__ = ["entry"]


def entry(*prefix: str, argv: list[str] | None = None) -> int:
    """`lakeshard <prefix…> <argv…>`; argv defaults to the process's arguments. Returns 0;
    any other status exits the process with it."""
    from etl.cli import main

    status = main([*prefix, *(sys.argv[1:] if argv is None else argv)])
    if status:
        sys.exit(status)
    return 0
