"""The stage registry: what `--only`/`--skip`/`run.stages` select, always in the
registry's order, an unknown name refused with the flag that named it, and every
registered stage importable."""

from __future__ import annotations

import pytest


def test_stage_selection_keeps_registry_order():
    from etl.pipeline.stages import STAGES

    names = list(STAGES.names())
    assert names[:1] == ["curate"] and names[-1] == "export"
    pick = lambda *a, **k: [s.name for s in STAGES.select(*a, **k)]  # noqa: E731
    assert pick(None) == names
    assert pick(("export", "curate")) == ["curate", "export"]
    assert pick(None, skip=("curate",)) == [n for n in names if n != "curate"]
    assert pick(("curate",), only=("export",)) == ["export"]
    with pytest.raises(ValueError, match="--skip: unknown stage 'dedupe'"):
        STAGES.select(None, skip=("dedupe",))
    for stage in STAGES:  # every registered target imports and is callable
        assert callable(stage.load())
