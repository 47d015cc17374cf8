"""A nightly run's cost: a first run, a no-op rerun and a 1 % increment, side by side.

Generates `--n` distinct photos (crops of scikit-image's bundled sample photos, resized,
flipped at random, with Gaussian noise; a candidate whose dHash is within twice the
dedup threshold of one already kept is drawn again, so no two are near duplicates by
accident), then, in one process and one Spark session, times three `lakeshard run`s with
stages curate, dedup, export: the first, the same again on unchanged input, and one
after adding `--increment` (1 %) new photos. Per run: each stage's seconds and the time
outside the stages, from the run's own events (``stage_end`` seconds, ``run_end``), and
the wall time of the call; last, the two ratios (no-op / first, increment / first).
Spark's start-up is paid once, before the first run, and printed apart. The export has
N / 250 partitions (`--rows-per-partition`), so that a partition -- what a row leaving
the export costs to rewrite -- stays the same size as N grows. `--jobs` also lists the
increment's Spark jobs with their seconds (from Spark's event log).

`--cold` first runs the same three nights as a scheduler does: each its own `lakeshard
run` process (Spark start-up, cold Python workers, the report on), timed as the whole
command, with each stage's seconds (the run's events.jsonl), the time from the
process's start to the first stage (imports, Spark start-up, checks) and from the last
stage to the process's exit (report, ledger, summary), and beside them a bare Spark
start-up (a process that only starts the session and runs one job); then the warm
figures above, on a second copy of the same photos. The cold nights have a cache folder
of their own, as a fresh install's: first the install's first run (50 other photos, its
own root) writes the driver JVM's class archive (etl/runtime/jvm.py), as any install's
first run does, and its cost is printed apart; the three nights then map it, as every
later night does. `--plain-jvm` first runs the nights with the JVM's own defaults (no
class archive, full JIT), on the same photos (same seed), for a side-by-side figure.

    .venv/bin/python bench/nightly.py               # 2,000 photos
    .venv/bin/python bench/nightly.py --n 200       # a quick look
    .venv/bin/python bench/nightly.py --cold        # cold (one process a night), then warm
    .venv/bin/python bench/nightly.py --cold --cold-only --n 16000   # the cold nights only
    .venv/bin/python bench/nightly.py --cold --cold-only --plain-jvm # JVM defaults, then ours
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STAGES = ("curate", "dedup", "export")
# Sample photos bundled with scikit-image (no download).
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field",
          "immunohistochemistry", "camera", "coins", "moon", "page", "text", "horse",
          "clock", "grass", "gravel", "brick")


def _sources() -> list[np.ndarray]:
    import skimage.data

    out = []
    for name in PHOTOS:
        try:
            img = np.asarray(getattr(skimage.data, name)())
        except Exception:  # noqa: BLE001 -- a photo this install lacks (needs a download)
            continue
        if img.dtype == bool:
            img = img.astype(np.uint8) * 255
        if img.ndim == 2:
            img = np.stack([img] * 3, axis=-1)
        out.append(img[..., :3].astype(np.uint8))
    return out


def random_crop(sources: list[np.ndarray], rng, fraction: tuple[float, float],
                noise: float) -> np.ndarray:
    """A random crop of one of `sources` (each side `fraction` of the photo's), flipped
    at random, with Gaussian noise: uint8 RGB."""
    src = sources[rng.integers(len(sources))]
    h, w = src.shape[:2]
    ch, cw = int(h * rng.uniform(*fraction)), int(w * rng.uniform(*fraction))
    y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
    crop = src[y:y + ch, x:x + cw].astype(np.float32)
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    crop += rng.normal(0, noise, crop.shape)
    return np.clip(crop, 0, 255).astype(np.uint8)


def _dhash(img) -> int:
    """64-bit difference hash of a PIL image (9x8 grayscale, left > right)."""
    from PIL import Image

    g = np.asarray(img.convert("L").resize((9, 8), Image.Resampling.LANCZOS), dtype=np.int16)
    bits = (g[:, 1:] > g[:, :-1]).flatten()
    return int(sum(1 << i for i, b in enumerate(bits) if b))


class Photos:
    """Distinct generated photos written to a folder; `add(k)` writes k more."""

    def __init__(self, folder: Path, seed: int, min_distance: int):
        self.folder = folder
        self.rng = np.random.default_rng(seed)
        self.sources = _sources()
        self.kept = np.zeros(0, dtype=np.uint64)
        self.min_distance = min_distance
        self.count = 0
        self.redrawn = 0
        folder.mkdir(parents=True, exist_ok=True)

    def _candidate(self):
        from PIL import Image

        rng = self.rng
        crop = random_crop(self.sources, rng, (0.3, 0.7), noise=6)
        out = (int(rng.integers(256, 385)), int(rng.integers(256, 385)))
        return Image.fromarray(crop).resize(out)

    def add(self, k: int) -> None:
        added = 0
        while added < k:
            img = self._candidate()
            h = np.uint64(_dhash(img))
            if len(self.kept):
                dist = np.bitwise_count(self.kept ^ h)
                if int(dist.min()) <= self.min_distance:
                    self.redrawn += 1
                    continue
            self.kept = np.append(self.kept, h)
            img.save(self.folder / f"p{self.count:06d}.jpg", quality=90)
            self.count += 1
            added += 1


class Events(logging.Handler):
    """The runner's structured events (logger ``lakeshard.events``), kept in memory."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[dict] = []

    def emit(self, record):
        self.records.append(json.loads(record.getMessage()))


def _timed_run(cfg, events: Events, label: str) -> dict:
    from etl.pipeline.runner import run_pipeline

    events.records.clear()
    t0 = time.monotonic()
    out = run_pipeline(cfg, only=STAGES)
    wall = time.monotonic() - t0
    ev = events.records
    stages = {e["stage"]: e["seconds"] for e in ev if e["event"] == "stage_end"}
    start = next(e["ts"] for e in ev if e["event"] == "run_start")
    first = next(e["ts"] for e in ev if e["event"] == "stage_start")
    run_end = next(e for e in ev if e["event"] == "run_end")
    notes = {e["stage"]: e.get("note") for e in ev if e["event"] == "stage_end"}
    return {
        "label": label, "run_id": out.run_id, "wall": wall, "stages": stages, "notes": notes,
        "outside": wall - sum(stages.values()),
        "before": first - start, "report": out.seconds.get("report", 0.0),
        "run_end_seconds": run_end["seconds"],
        "accepted": out.results["curate"].outputs.get("accepted"),
    }


REPO = Path(__file__).resolve().parents[1]


def _spark_startup(conf: Path) -> float:
    """Seconds for a fresh process to import lakeshard and start its Spark session as a
    run does (format ``lance`` not registered yet), and run one job."""
    code = ("import sys, time; t = time.monotonic(); from etl.config import load_config; "
            "from etl.session import get_spark; "
            "s = get_spark(load_config(sys.argv[1]), lance_format=False); "
            "s.range(1).count(); print(time.monotonic() - t)")
    out = subprocess.run([sys.executable, "-c", code, str(conf)], check=True, cwd=REPO,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def lakeshard_command(conf: Path, run_id: str) -> list[str]:
    """A night as a scheduler starts it: `lakeshard run` of the bench's stages."""
    return [str(REPO / ".venv" / "bin" / "lakeshard"), "--conf", str(conf), "run",
            "--run-id", run_id, *(a for s in STAGES for a in ("--only", s))]


def night_events(root: Path, run_id: str, began: float, ended: float) -> dict:
    """A finished night's stage seconds (its events.jsonl ``stage_end``), and the time
    from the process's start (`began`, epoch s) to the first stage and from the last
    stage to its exit (`ended`)."""
    ev = [json.loads(line) for line in
          (root / "reports" / run_id / "events.jsonl").read_text().splitlines()]
    first = min(e["ts"] for e in ev if e["event"] == "stage_start")
    last = max(e["ts"] for e in ev if e["event"] == "stage_end")
    return {"stages": {e["stage"]: e["seconds"] for e in ev if e["event"] == "stage_end"},
            "before": first - began, "after": ended - last}


def _cold_run(conf: Path, root: Path, run_id: str, label: str) -> dict:
    """One night as a scheduler runs it: a fresh `lakeshard run` process."""
    t0, began = time.monotonic(), time.time()
    with open(root.parent / f"{run_id}.log", "wb") as log:
        subprocess.run(lakeshard_command(conf, run_id), check=True, stdout=log, stderr=log,
                       cwd=REPO)
    wall, ended = time.monotonic() - t0, time.time()
    return {"label": label, "wall": wall, **night_events(root, run_id, began, ended)}


def _print_runs(runs: list[dict], wall: str, extra: list[tuple[str, str]]) -> None:
    """One line per run: its wall time, each stage's seconds, then the `extra` columns
    (header, key)."""
    cols = [(wall, "wall"), *((f"{s} s", s) for s in STAGES), *extra]
    print(f"{'run':<14} " + " ".join(f"{h:>{max(9, len(h))}}" for h, _ in cols))
    print("-" * (15 + sum(max(9, len(h)) + 1 for h, _ in cols)))
    for r in runs:
        cells = []
        for h, key in cols:
            v = r["stages"].get(key, 0.0) if key in STAGES else r[key]
            cells.append(f"{v:>{max(9, len(h))}.1f}" if isinstance(v, float)
                         else f"{v!s:>{max(9, len(h))}}")
        print(f"{r['label']:<14} " + " ".join(cells))


# Photos of the install's first run, which writes the driver JVM's class archive.
_INSTALL_PHOTOS = 50


def _install_run(raw: dict, work: Path, seed: int, min_distance: int) -> str:
    """The first `lakeshard run` on this install (its own photos and root, the nights'
    cache and settings): it writes the class archive the nights then map, as every
    night after an install's first does. What it cost, as a line to print."""
    import yaml

    photos = Photos(work / "install-photos", seed + 1, min_distance)
    photos.add(_INSTALL_PHOTOS)
    conf = work / "install.yaml"
    conf.write_text(yaml.safe_dump({**raw, "storage": {**raw["storage"],
                                                       "root": str(work / "install-root")},
                                    "sources": [{"name": "photos", "kind": "image_folder",
                                                 "path": str(work / "install-photos")}]}))
    run = _cold_run(conf, work / "install-root", "install-first", "install")
    archive = sorted((work / "cache" / "jvm").glob("spark-*.jsa"))
    if not archive:
        return f"the install's first run ({run['wall']:.1f} s) wrote no class archive"
    return (f"the install's first run ({_INSTALL_PHOTOS} photos, {run['wall']:.1f} s, of "
            f"which {run['after']:.1f} s after its last stage) wrote the driver JVM's class "
            f"archive ({archive[0].stat().st_size / 1e6:.0f} MB); every night below maps it")


def _cold(raw: dict, work: Path, n: int, added: int, seed: int, min_distance: int) -> None:
    import yaml

    photos = Photos(work / "photos", seed, min_distance)
    photos.add(n)
    # A cache of its own, as a fresh install's (etl/runtime/jvm.py).
    raw = {**raw, "storage": {"root": str(work / "root"), "cache_dir": str(work / "cache")},
           "sources": [{"name": "photos", "kind": "image_folder", "path": str(work / "photos")}],
           "run": {**raw["run"], "report": True}}
    install = (_install_run(raw, work, seed, min_distance)
               if raw["spark"].get("driver_jvm", {}).get("class_archive", True) else None)
    conf = work / "conf.yaml"
    conf.write_text(yaml.safe_dump(raw))
    startup = _spark_startup(conf)
    runs = [_cold_run(conf, work / "root", "cold-first", "first")]
    runs.append(_cold_run(conf, work / "root", "cold-noop", "no-op rerun"))
    photos.add(added)
    runs.append(_cold_run(conf, work / "root", "cold-increment", f"+{added} photos"))
    print(f"\nCOLD: each night its own `lakeshard run` process, report on; {os.cpu_count()} "
          f"cores; load {os.getloadavg()[0]:.2f}")
    if install:
        print(install)
    print(f"Spark start-up in a fresh process (import + session + one job): {startup:.1f} s")
    _print_runs(runs, "command s", [("before 1st stage s", "before"),
                                    ("after last stage s", "after")])
    first = runs[0]["wall"]
    print(f"no-op rerun / first run : {runs[1]['wall'] / first:.2f}   "
          f"(no-op - Spark start-up: {runs[1]['wall'] - startup:.1f} s)")
    print(f"increment   / first run : {runs[2]['wall'] / first:.2f}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="photos in the first run")
    ap.add_argument("--increment", type=float, default=0.01, help="fraction added")
    ap.add_argument("--report", action="store_true", help="also write the HTML report")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows-per-partition", type=int, default=250,
                    help="export partitions = N / this (at least 2): a partition's size "
                         "stays put as N grows, as the scale plan sizes them")
    ap.add_argument("--work", default=None, help="folder for photos and tables, kept "
                    "afterwards (default: a temporary folder, removed at exit)")
    ap.add_argument("--cold", action="store_true",
                    help="first the three nights as a scheduler runs them: one `lakeshard "
                         "run` process each, the report on; then the warm figures")
    ap.add_argument("--plain-jvm", action="store_true",
                    help="with --cold: first the same cold nights with the driver JVM's "
                         "own defaults (no class archive, full JIT), on other photos")
    ap.add_argument("--cold-only", action="store_true",
                    help="with --cold: only the cold nights (no warm figures after them)")
    ap.add_argument("--jobs", action="store_true",
                    help="also print the Spark jobs of the increment run (from Spark's "
                         "event log) with their seconds")
    args = ap.parse_args()

    from etl.config import parse_config
    from etl.pipeline.preflight import check_config
    from etl.session import get_spark

    repo = Path(__file__).resolve().parents[1]
    work = Path(args.work or tempfile.mkdtemp(prefix="nightly-bench-"))
    if args.work is None:  # photos and tables of a temporary folder, removed at exit
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    raw = {
        "storage": {"root": str(work / "root")},
        # Driver memory as conf/local.yaml ships it (Spark's 1g default runs out of heap
        # persisting 16,000 prepared photos).
        "spark": {"master": "local[2]", "jars_dir": str(repo / ".jars"), "conf": {
            "spark.driver.memory": "4g",
            "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false"}},
        "sources": [{"name": "photos", "kind": "image_folder", "path": str(work / "photos")}],
        "exports": {"train": {"partitions": max(2, args.n // args.rows_per_partition)}},
        "run": {"report": args.report, "progress_interval_s": 0},
    }
    if args.jobs:
        (work / "eventlog").mkdir(parents=True, exist_ok=True)
        raw["spark"]["conf"].update({"spark.eventLog.enabled": "true",
                                     "spark.eventLog.dir": str(work / "eventlog"),
                                     "spark.eventLog.compress": "false",
                                     "spark.eventLog.rolling.enabled": "false"})
    cfg = check_config(parse_config(raw))
    added = max(1, round(args.n * args.increment))
    if args.cold:
        if args.plain_jvm:  # the same nights first with the JVM's own defaults
            print("PLAIN JVM: spark.driver_jvm class_archive and quick_jit off")
            _cold({**raw, "spark": {**raw["spark"], "driver_jvm": {
                "class_archive": False, "quick_jit": False}}}, work / "cold-plain", args.n,
                  added, args.seed, 2 * cfg.dedup.threshold)
            print("LAKESHARD'S DRIVER JVM SETTINGS (the default)")
        _cold(raw, work / "cold", args.n, added, args.seed, 2 * cfg.dedup.threshold)
        if args.cold_only:
            return
        print("WARM: one process, one Spark session, as below")

    t0 = time.monotonic()
    photos = Photos(work / "photos", args.seed, 2 * cfg.dedup.threshold)
    photos.add(args.n)
    print(f"{args.n} photos generated in {time.monotonic() - t0:.1f} s "
          f"({photos.redrawn} candidates redrawn as near duplicates), under {work}")

    events = Events()
    logging.getLogger("lakeshard.events").addHandler(events)
    logging.getLogger("lakeshard.events").setLevel(logging.INFO)
    t0 = time.monotonic()
    spark = get_spark(cfg)
    spark.sparkContext.setLogLevel("ERROR")
    startup = time.monotonic() - t0

    runs = [_timed_run(cfg, events, "first")]
    runs.append(_timed_run(cfg, events, "no-op rerun"))
    photos.add(added)
    marker = int(time.time() * 1000)  # jobs submitted from here on: the increment's
    runs.append(_timed_run(cfg, events, f"+{added} photos"))

    print(f"\nSpark start-up (once, not in the runs): {startup:.1f} s; {os.cpu_count()} cores; "
          f"load {os.getloadavg()[0]:.2f}")
    _print_runs(runs, "wall s", [("outside s", "outside"), ("before s", "before"),
                                 ("report s", "report"), ("accepted", "accepted")])
    for r in runs[1:]:
        notes = ", ".join(f"{s}: {n}" for s, n in r["notes"].items() if n)
        print(f"  {r['label']}: {notes or 'no stage notes'}")
    first = runs[0]["wall"]
    print(f"\nno-op rerun / first run : {runs[1]['wall'] / first:.2f}")
    print(f"increment   / first run : {runs[2]['wall'] / first:.2f}")
    if args.jobs:
        app = spark.sparkContext.applicationId
        spark.stop()
        _print_jobs(work / "eventlog", app, after=marker)
    else:
        spark.stop()


def _print_jobs(folder: Path, app: str, after: int) -> None:
    """Jobs submitted at or after `after` (epoch ms), from Spark's event log: id,
    seconds, description."""
    starts, rows = {}, []
    # One file, or (rolling logs, Spark 4's default) a folder of numbered parts.
    files = sorted(p for p in folder.rglob("*") if p.is_file() and app in str(p)
                   and "appstatus" not in p.name)
    lines = [line for f in files for line in f.read_text().splitlines()]
    for line in lines:
        ev = json.loads(line)
        kind = ev.get("Event")
        if kind == "SparkListenerJobStart" and ev["Submission Time"] >= after:
            props = ev.get("Properties") or {}
            starts[ev["Job ID"]] = (ev["Submission Time"],
                                    props.get("spark.job.description") or "")
        elif kind == "SparkListenerJobEnd" and ev["Job ID"] in starts:
            t0, desc = starts[ev["Job ID"]]
            rows.append((ev["Job ID"], (ev["Completion Time"] - t0) / 1000, desc))
    print(f"\nSpark jobs of the increment run: {len(rows)}, "
          f"{sum(r[1] for r in rows):.1f} s in all")
    for job, secs, desc in rows:
        print(f"  job {job:>4} {secs:>6.2f} s  {desc[:100]}")


if __name__ == "__main__":
    main()
