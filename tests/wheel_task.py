"""What a Databricks ``python_wheel_task`` does with a task, as a script: find the entry
point the installed package declares (``console_scripts``), put the task's parameters
in ``sys.argv``, call it -- and ignore what it returns. Only an exception or
``SystemExit`` fails the task, which is why lakeshard's entry points exit.

    python wheel_task.py <package_name> <entry_point> <parameters...>
    spark-submit … wheel_task.py lakeshard lakeshard-run --conf c.yaml --only curate
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points


def main() -> None:
    package, name, *parameters = sys.argv[1:]
    (ep,) = entry_points(group="console_scripts", name=name)
    if ep.dist is not None and ep.dist.name != package:
        raise SystemExit(f"entry point {name} belongs to {ep.dist.name}, not {package}")
    sys.argv = [name, *parameters]
    ep.load()()  # the return value is dropped, as the platform drops it


if __name__ == "__main__":
    main()
