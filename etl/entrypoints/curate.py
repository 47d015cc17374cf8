"""spark-submit entrypoint: `lakeshard curate` -- ingest, prepare, write curated + rejects."""

from __future__ import annotations

import sys

from etl.entrypoints import entry


def main(argv: list[str] | None = None) -> int:
    return entry("curate", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
