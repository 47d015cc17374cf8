"""spark-submit entrypoint: `lakeshard export` -- the export stage: curated table -> MDS."""

from __future__ import annotations

import sys

from etl.entrypoints import entry


def main(argv: list[str] | None = None) -> int:
    return entry("export", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
