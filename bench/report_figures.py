"""What writing the run report costs, and the figures module of a base commit beside
the working tree's, on the same report data.

Reads the report's data once from a root a `lakeshard run` left (``--conf``: its config;
the outcome's run id and stage seconds from the root's latest ``summary.json``), then:

* ``draw``: :func:`etl.report.figures.draw_figures` of the base commit (``--base``, its
  ``etl/report/figures.py`` loaded as a module of its own) and of the working tree,
  alternating, ``--repeat`` times each, a fresh folder each time; the best and median
  of each, and each chart's pixels compared between the two (the contact sheets are
  composed differently and only listed with their sizes);
* ``whole``: the wall time of a whole ``write_report`` (data read, matplotlib import,
  figures, page, report.json) in a fresh process per try, the base's figures module
  put in place of the working tree's for the base, alternating; the process first
  imports what a run has imported by the time its report is written (the pipeline,
  the jobs, pyspark, pylance, delta-rs), not matplotlib.

    .venv/bin/python bench/report_figures.py --conf /tmp/r/conf.yaml --base 5c61bc9
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def _outcome(cfg):
    from etl.runtime.outcome import RunOutcome

    summaries = sorted(glob.glob(os.path.join(cfg.storage.root, "reports", "*",
                                              "summary.json")), key=os.path.getmtime)
    if not summaries:
        raise SystemExit(f"no run report under {cfg.storage.root}: run `lakeshard run` first")
    s = json.load(open(summaries[-1]))
    events = os.path.join(os.path.dirname(summaries[-1]), "events.jsonl")
    seconds = {}
    for line in open(events):
        e = json.loads(line)
        if e.get("event") == "stage_end":
            seconds[e["stage"]] = e.get("seconds", 0.0)
    return RunOutcome(run_id=s["run_id"], stages=list(seconds) or ["curate"],
                      seconds=seconds)


def _base_module(base: str):
    src = subprocess.run(["git", "show", f"{base}:etl/report/figures.py"], check=True,
                         capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="report-base-"), "figures_base.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("figures_base", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["figures_base"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod, path


def _same_pixels(a: str, b: str) -> str:
    from PIL import Image

    x, y = np.asarray(Image.open(a).convert("RGBA")), np.asarray(Image.open(b).convert("RGBA"))
    if x.shape != y.shape:
        return f"DIFFERENT size {x.shape[1]}x{x.shape[0]} vs {y.shape[1]}x{y.shape[0]}"
    diff = int((x != y).any(axis=2).sum())
    return "same pixels" if diff == 0 else f"DIFFERENT: {diff} pixels"


def draw(cfg, base: str, repeat: int) -> None:
    import matplotlib

    from etl.report import figures
    from etl.report.data import read_report

    data = read_report(None, cfg, _outcome(cfg))
    old, _ = _base_module(base)
    work = tempfile.mkdtemp(prefix="report-draw-")
    times: dict[str, list[float]] = {"base": [], "now": []}
    dirs = {}
    for i in range(repeat + 1):  # the first round warms fonts and caches, untimed
        for name, mod in (("base", old), ("now", figures)):
            out = os.path.join(work, f"{name}-{i}")
            with matplotlib.rc_context(figures.PLAIN_TEXT):
                t = time.perf_counter()
                mod.draw_figures(data, out)
                dt = time.perf_counter() - t
            if i:
                times[name].append(dt)
            dirs[name] = out
    print(f"draw_figures, {len(data.kept)} kept, {len(data.flagged)} flagged, "
          f"{len(data.clusters)} clusters, {len(data.meta)} rows, {len(data.versions)} "
          f"caption column(s); {repeat} alternating tries each after one untimed round")
    for name, ts in times.items():
        print(f"  {name:5s} best {min(ts):.3f} s  median {statistics.median(ts):.3f} s  "
              f"({', '.join(f'{t:.3f}' for t in ts)})")
    for file, _ in figures.CHARTS.values():
        a, b = os.path.join(dirs["base"], file), os.path.join(dirs["now"], file)
        print(f"  {file:24s} {_same_pixels(a, b):30s} {os.path.getsize(a):>8} -> "
              f"{os.path.getsize(b):>8} bytes")
    for file in ("contact_kept.png", "contact_flagged.png", "contact_duplicates.png"):
        a, b = os.path.join(dirs["base"], file), os.path.join(dirs["now"], file)
        from PIL import Image

        print(f"  {file:24s} {'x'.join(map(str, Image.open(a).size)):>10} -> "
              f"{'x'.join(map(str, Image.open(b).size)):10s} {os.path.getsize(a):>8} -> "
              f"{os.path.getsize(b):>8} bytes")
    print(f"  outputs: {dirs['base']} {dirs['now']}")


_CHILD = """
import sys, time, json
t0 = time.perf_counter()
import etl.pipeline.runner, etl.jobs.curate, etl.jobs.dedup, etl.jobs.export  # a run's imports
import lance, deltalake, pyspark.sql
from etl.config import load_config
sys.path.insert(0, {bench!r})
from report_figures import _outcome
if {base!r}:  # write_report's own import of etl.report.figures finds the base's file
    import importlib.abc, importlib.util

    class Base(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "etl.report.figures":
                return importlib.util.spec_from_file_location(name, {base!r})
            return None

    sys.meta_path.insert(0, Base())
assert "matplotlib" not in sys.modules
cfg = load_config({conf!r})
out = _outcome(cfg)
from etl.report import write_report
t = time.perf_counter()
write_report(None, cfg, out, {out_dir!r})
print(json.dumps({{"write_report": time.perf_counter() - t,
                  "figures": sys.modules["etl.report.figures"].__file__}}))
"""


def whole(conf: str, base: str, repeat: int) -> None:
    _, base_path = _base_module(base)
    work = tempfile.mkdtemp(prefix="report-whole-")
    bench = os.path.dirname(os.path.abspath(__file__))
    times: dict[str, list[float]] = {"base": [], "now": []}
    for i in range(repeat):
        for name, path in (("base", base_path), ("now", "")):
            code = _CHILD.format(bench=bench, base=path, conf=conf,
                                 out_dir=os.path.join(work, f"{name}-{i}"))
            res = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                 text=True)
            if res.returncode:
                raise SystemExit(f"{name}: write_report failed:\n{res.stderr[-3000:]}")
            got = json.loads(res.stdout.strip().splitlines()[-1])
            assert (got["figures"] == path) == bool(path), got  # the base's module, or ours
            times[name].append(got["write_report"])
    print(f"write_report in a fresh process (after a run's imports), {repeat} alternating "
          "tries each")
    for name, ts in times.items():
        print(f"  {name:5s} best {min(ts):.3f} s  median {statistics.median(ts):.3f} s  "
              f"({', '.join(f'{t:.3f}' for t in ts)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conf", required=True, help="config of a root a run left")
    ap.add_argument("--base", default="HEAD", help="commit whose figures.py to compare")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=["draw", "whole"])
    args = ap.parse_args()
    from etl.config import load_config

    cfg = load_config(args.conf)
    if args.only in (None, "draw"):
        draw(cfg, args.base, args.repeat)
    if args.only in (None, "whole"):
        whole(args.conf, args.base, args.repeat)


if __name__ == "__main__":
    main()
