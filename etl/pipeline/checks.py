"""The checks of the two pipeline stages whose job module has none of its own (curate,
export), run before Spark starts (``check=`` in :mod:`etl.pipeline.stages`). Apart from
:mod:`etl.pipeline.preflight`, which checks the config against the registry and so
imports it."""

from __future__ import annotations

from etl.config import Config
from etl.runtime.stage import RunContext
from etl.sample_sources import ensure_samples
from etl.sources import adapter_for

__all__ = ["check_sources", "check_exports"]


def check_sources(cfg: Config, ctx: RunContext | None = None) -> None:
    """Sample sources built; every source's inputs there (paths, mapped columns)."""
    ensure_samples(cfg)
    for src in cfg.sources:
        adapter_for(src.kind).check_inputs(src)


def check_exports(cfg: Config, ctx: RunContext) -> None:
    """The exports named on the command line exist."""
    for name in ctx.export_names or ():
        cfg.export(name)
