"""`lakeshard <args>` as a spark-submit application file (the platform stand-ins run
`verify-export` and `runs` through spark-submit, with the JARs of the runtime)."""

from __future__ import annotations

import sys

from etl.cli import main

if __name__ == "__main__":
    sys.exit(main())
