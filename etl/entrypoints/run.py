"""spark-submit entrypoint: `lakeshard run` -- all configured stages (the nightly job)."""

from __future__ import annotations

import sys

from etl.entrypoints import entry


def main(argv: list[str] | None = None) -> int:
    return entry("run", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
