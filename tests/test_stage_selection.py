"""The stage registry: what `--only`/`--skip`/`run.stages` select, always in the
registry's order, an unknown name refused with the flag that named it, and every
registered stage a function."""

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
    for stage in STAGES:  # every registered stage is a function
        assert callable(stage.run)


def test_a_stages_warm_imports_run_on_a_thread_and_leave_failures_to_the_importer():
    """What a stage warms before Spark starts (``Stage.warm``): imports on a daemon
    thread, in a fresh process; an import that fails there is raised, as usual, by the
    code that imports the module itself."""
    import subprocess
    import sys

    from etl.pipeline.stages import STAGES

    assert STAGES.get("export").warm.__name__ == "warm"
    assert STAGES.get("curate").warm is None
    code = """
import sys, threading
from etl.runtime.warm import import_in_background
t = import_in_background("colorsys", "no_such_module_here", "wave", name="w")
assert t.daemon and t.name == "w" and t is not threading.current_thread()
t.join()
assert "colorsys" in sys.modules and "wave" not in sys.modules  # stopped at the failure
assert import_in_background("colorsys") is None  # all imported: no thread
try:
    import no_such_module_here
except ImportError:
    print("raised where imported")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "raised where imported", out.stderr


def test_changes_ahead_starts_the_later_stages_warm_up_once():
    """A stage that knows the night is not a no-op says so once; the runner's hook (the
    later stages' warm-up) runs then, and only once."""
    from etl.runtime.stage import RunContext

    calls = []
    ctx = RunContext(run_id="r", on_changes=lambda: calls.append(1))
    ctx.changes_ahead()
    ctx.changes_ahead()
    assert calls == [1]
    RunContext(run_id="r").changes_ahead()  # outside a run's hook: nothing
