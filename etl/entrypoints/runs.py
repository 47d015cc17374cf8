"""spark-submit entrypoint: `lakeshard runs` -- list recent runs from the ledger."""

from __future__ import annotations

import sys

from etl.entrypoints import entry


def main(argv: list[str] | None = None) -> int:
    return entry("runs", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
