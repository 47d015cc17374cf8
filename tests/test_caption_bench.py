"""`bench/caption_throughput.py --bare` runs where only torch, transformers, Pillow and
numpy are installed: no pyspark, pydantic, pandas, pyarrow, pylance or scikit-image, no
project install. A subprocess hides those packages from the import system (as if they
were not installed) and runs the bare bench end to end with the tiny model on CPU.

torchvision stays visible: transformers 4.57 loads Qwen2.5-VL's processor only with it
(its video processor imports it), so any box running these models through transformers
has it, installed with torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HIDDEN = ("pyspark", "py4j", "pydantic", "pydantic_core", "pandas", "pyarrow", "lance",
          "skimage", "streaming", "delta")

# Installed before anything else runs: a meta-path finder in front of the standard one
# that finds none of HIDDEN (so `import pandas` fails and find_spec says "not
# installed"), and no editable install of lakeshard.
_RUN = f"""
import importlib.machinery, runpy, sys
HIDDEN = {HIDDEN!r}

class Hide(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

sys.meta_path[:] = [Hide if f is importlib.machinery.PathFinder else f
                    for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
try:
    import pandas
except ImportError:
    pass
else:
    raise SystemExit("the import guard does not work")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
loaded = sorted({{m.partition(".")[0] for m in sys.modules}} & set(HIDDEN))
print("hidden modules imported:", loaded or "none")
"""


def test_bare_bench_runs_without_spark_pydantic_pandas_or_the_project(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-c", _RUN, str(REPO / "bench" / "caption_throughput.py"),
           "--bare", "--arch", "tiny", "--device", "cpu", "--images", "4",
           "--batch-sizes", "2", "--max-new-tokens", "3", "--max-pixels", "3136",
           "--variants", "hand,table,plain,fast", "--repeats", "2",
           "--workdir", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "4 synthetic images (scikit-image not installed" in out
    for row in ("hand loop (table order)", "caption_images, table order",
                "caption_images, grouped by size", "+ static, ahead, compiled (cuda) [fast]"):
        assert row in out, out
    assert "{'ok': 4}" in out
    assert "hidden modules imported: none" in out
    # The greedy tokens of the fast path are plain generate's.
    assert "tokens fast vs plain: 2 of 2 rows identical" in out, out  # the warm-up batch
    # Where the time went, per pass: 2 batches of 2 images, each 3 new tokens = the
    # prefill's token, a first decode step and one later one.
    passes = [line for line in out.splitlines() if line.strip().startswith("pass ")]
    assert len(passes) == 3 * 2, out  # table, plain, fast; 2 repeats each (hand: none)
    assert all("2 later steps" in line and "ms/step" in line for line in passes), passes
    batches = [line.split() for line in out.splitlines()
               if line.strip()[:1].isdigit() and len(line.split()) == 11]
    assert len(batches) == 6 * 2 and all(b[1] == "2" and b[6] == "3" for b in batches), out
