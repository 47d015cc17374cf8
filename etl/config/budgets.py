"""`run.budgets:` -- how many rows a stage may lose before the stage, and the run, fail.

A stage that processes rows (curate: records; caption: rows to caption) reports how
they ended. Bad data is expected and stays data (a reject reason, a caption status);
these limits say when the failures are no longer "some bad rows" but a broken run:

* ``internal_error_rate``: the share of a stage's rows that may end ``internal_error``
  (an unexpected exception in lakeshard's own code, or a library under it);
* ``failed_rate``: per stage, the share of its rows that may fail for other reasons
  (caption: ``failed``, generation raised; curate: ``rejected``) -- stages not listed
  have no such limit;
* ``all_failed_min_rows``: a stage that processed at least this many rows and got not
  one through fails, whatever the rates say.

A limit is exceeded when the share is strictly above it: with the default 0.001, one
internal error in 1,000 rows passes and one in 999 fails. Stage names are checked
against the registry before Spark starts (:mod:`etl.pipeline.preflight`).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from etl.config.base import Section

__all__ = ["BudgetsConfig"]

Share = Annotated[float, Field(ge=0, le=1)]


class BudgetsConfig(Section):
    """`run.budgets:` -- failure budgets per stage (docs/operations.md#failure-budgets)."""

    # Internal errors may be at most this share of a stage's rows (0.1 %; 0: none).
    internal_error_rate: Share = 0.001
    # Stage -> the share of its rows that may fail (caption: status `failed`).
    failed_rate: dict[str, Share] = Field(default_factory=lambda: {"caption": 0.05})
    # A stage that processed at least this many rows, none of them successfully, fails
    # (0: never for this reason alone).
    all_failed_min_rows: Annotated[int, Field(ge=0)] = 10
    # Example errors named in the ledger, the console and the report.
    examples: Annotated[int, Field(ge=1, le=50)] = 5
