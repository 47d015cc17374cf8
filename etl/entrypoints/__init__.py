"""spark-submit entrypoints: one module per command, each with ``main()``.

``spark-submit … etl/entrypoints/run.py --conf conf/emr.yaml`` (the file, on EMR), or
the console scripts ``lakeshard-run``, ``lakeshard-curate``, ``lakeshard-export`` that
the wheel installs (Databricks ``python_wheel_task`` entry points). Every entrypoint
takes the same flags as its ``lakeshard`` subcommand (``--conf``, ``--run-id``, …) and
exits with its status. A new stage adds a module here that calls
``entry("<subcommand>")`` or ``entry("run", "--only", "<stage>")``.
"""

from __future__ import annotations

import sys

__all__ = ["entry"]


def entry(*prefix: str, argv: list[str] | None = None) -> int:
    """`lakeshard <prefix…> <argv…>`; argv defaults to the process's arguments."""
    from etl.cli import main

    return main([*prefix, *(sys.argv[1:] if argv is None else argv)])
