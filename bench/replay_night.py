"""One cold night, replayed from a saved state with two versions of the code, side by side.

`bench/nightly.py --cold` times a first, a no-op and a +1 % night once each; a change
to the code is then compared with figures taken at another hour. This bench keeps the
state the +1 % night starts from -- N photos after their first and no-op nights -- and
replays that night from a fresh copy of it as many times as asked, alternating between
checkouts of the code (`--code`, e.g. this repo and a `git worktree` of an older
commit), each night a fresh `lakeshard run --only curate --only dedup --only export`
process with the report on, as a scheduler runs it. It prints each night's command
seconds, its stages', and the time before the first stage and after the last.

A checkout other than this repo runs with this repo's venv (the pins are the same) and
its own code first on the path: the driver's ``PYTHONPATH`` and, for Spark's Python
workers, ``spark.executorEnv.PYTHONPATH``.

    git worktree add /tmp/lakeshard-base <commit>
    .venv/bin/python bench/replay_night.py setup --work /tmp/replay --n 2000
    .venv/bin/python bench/replay_night.py trial --work /tmp/replay \\
        --code /tmp/lakeshard-base --code . --rounds 4 [--jobs]

`setup` runs the first and no-op nights with the first `--code` (default: this repo)
and generates the increment's photos (`--added`, default 1 %, another seed: new photos,
some of which may be near duplicates of photos already exported). `--jobs` also lists
each night's Spark jobs (Spark's event log).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import nightly  # noqa: E402 -- bench/nightly.py: the photos, the job listing

STAGES = ("curate", "dedup", "export")


def _conf(work: Path, code: Path, eventlog: bool) -> Path:
    import yaml

    spark_conf = {"spark.driver.memory": "4g", "spark.ui.enabled": "false",
                  "spark.ui.showConsoleProgress": "false"}
    if code != REPO:
        spark_conf["spark.executorEnv.PYTHONPATH"] = str(code)
    if eventlog:
        spark_conf.update({"spark.eventLog.enabled": "true",
                           "spark.eventLog.dir": str(work / "eventlog"),
                           "spark.eventLog.compress": "false",
                           "spark.eventLog.rolling.enabled": "false"})
    raw = {"storage": {"root": str(work / "root"), "cache_dir": str(work / "cache")},
           "spark": {"master": "local[2]", "jars_dir": str(REPO / ".jars"),
                     "conf": spark_conf},
           "sources": [{"name": "photos", "kind": "image_folder",
                        "path": str(work / "photos")}],
           "exports": {"train": {"partitions": max(2, _photos(work) // 250)}},
           "run": {"report": True, "progress_interval_s": 0}}
    path = work / f"conf-{abs(hash((str(code), eventlog)))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _photos(work: Path) -> int:
    return len(list((work / "photos.snap").glob("*.jpg"))) or len(
        list((work / "photos").glob("*.jpg")))


def _night(work: Path, code: Path, run_id: str, eventlog: bool = False) -> dict:
    """One night: a fresh `lakeshard run` process with `code` first on the path."""
    conf = _conf(work, code, eventlog)
    env = dict(os.environ)
    if code != REPO:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code), env.get("PYTHONPATH"))
                                            if p)
    cmd = [str(REPO / ".venv" / "bin" / "python"), "-m", "etl.cli", "--conf", str(conf),
           "run", "--run-id", run_id, *(a for s in STAGES for a in ("--only", s))]
    t0, began = time.monotonic(), time.time()
    with open(work / f"{run_id}.log", "wb") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=log, cwd=code, env=env)
    wall, ended = time.monotonic() - t0, time.time()
    return {"wall": wall, **nightly.night_events(work / "root", run_id, began, ended)}


def setup(work: Path, n: int, added: int, code: Path, seed: int) -> None:
    work.mkdir(parents=True, exist_ok=True)
    photos = nightly.Photos(work / "photos", seed, 8)
    photos.add(n)
    for run_id in ("first", "noop"):
        r = _night(work, code, run_id)
        print(f"{run_id}: {r['wall']:.1f} s  {r['stages']}")
    shutil.copytree(work / "root", work / "root.snap")
    shutil.copytree(work / "photos", work / "photos.snap")
    extra = nightly.Photos(work / "extra", seed + 7, 8)
    extra.count = n  # file names after the first night's
    extra.add(added)
    print(f"state saved under {work}; {added} photos for the increment in {work / 'extra'}")


def trial(work: Path, codes: list[Path], rounds: int, jobs: bool) -> None:
    print(f"{'round':<6} {'code':<28} {'command s':>9} " + " ".join(
        f"{s + ' s':>9}" for s in STAGES) + f" {'before s':>9} {'after s':>9}")
    for i in range(1, rounds + 1):
        for code in codes:
            for d in ("root", "photos"):
                shutil.rmtree(work / d, ignore_errors=True)
                shutil.copytree(work / f"{d}.snap", work / d)
            for f in (work / "extra").iterdir():
                shutil.copy(f, work / "photos" / f.name)
            shutil.rmtree(work / "eventlog", ignore_errors=True)
            if jobs:
                (work / "eventlog").mkdir()
            r = _night(work, code, f"increment-{i}-{int(time.time())}", eventlog=jobs)
            print(f"{i:<6} {str(code)[-28:]:<28} {r['wall']:>9.1f} " + " ".join(
                f"{r['stages'].get(s, 0.0):>9.1f}" for s in STAGES)
                + f" {r['before']:>9.1f} {r['after']:>9.1f}", flush=True)
            if jobs:
                app = next(p.name for p in (work / "eventlog").iterdir())
                nightly._print_jobs(work / "eventlog", app.split(".")[0], after=0)
    print(f"load {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("setup", "trial"))
    ap.add_argument("--work", required=True, help="folder of the saved state")
    ap.add_argument("--n", type=int, default=2000, help="photos of the first night")
    ap.add_argument("--added", type=int, default=None, help="photos added (default 1 %%)")
    ap.add_argument("--code", action="append", default=None,
                    help="a checkout of lakeshard (repeat: alternated); default this repo")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", action="store_true", help="list each night's Spark jobs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    codes = [Path(c).resolve() for c in (args.code or [str(REPO)])]
    work = Path(args.work).resolve()
    if args.mode == "setup":
        setup(work, args.n, args.added or max(1, args.n // 100), codes[0], args.seed)
    else:
        trial(work, codes, args.rounds, args.jobs)


if __name__ == "__main__":
    main()
