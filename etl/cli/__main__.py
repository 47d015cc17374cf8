"""`python -m etl.cli`: the `lakeshard` command."""

import sys

from etl.cli import main

sys.exit(main())
