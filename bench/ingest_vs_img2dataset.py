"""Ingest of web-sized images: lakeshard's curate against img2dataset, side by side.

Both tools do the same work on the same input, server and cores, in one run: fetch N
photo URLs from a real HTTP server on 127.0.0.1 and re-encode every image as JPEG q92,
no resize.

* photos  -- N distinct JPEGs (q90) of 0.3-0.8 MP (`--megapixels`), random crops of the
             photos scikit-image bundles, flipped and noised: what LAION-style URL lists
             mostly hold. Generated once per run into a temporary folder, removed at the
             end (`--work DIR` keeps photos and outputs there).
* server  -- nginx (one worker, access log off) serving that folder, when `nginx` is on
             PATH (`apt-get install nginx-light`); otherwise Python's ThreadingHTTPServer
             in its own process, and the bench says so (it costs more CPU per request).
* img2dataset -- installed on first use into a bench-only venv (`.bench/img2dataset`,
             git-ignored; never a lakeshard dependency): `--processes_count` x
             `--thread_count` (2 x 16 by default), parquet output, `resize_mode no`,
             `encode_quality 92`, `encode_format jpg`. Timed as the whole command.
* lakeshard -- a fresh `lakeshard run --only curate` process per round on a new root: a
             `table` source (parquet URL list) with `fetch.allow_networks: [127.0.0.1/32]`
             and `fetch.per_host` (`--per-host`, 16 by default, so one host may take as
             many requests as img2dataset's threads). Timed as the curate stage (from the
             run's events.jsonl) and as the whole command (Spark start-up, the report).

Under each lakeshard round, the wall time of each of curate's steps (its ``step_end``
events: listing and comparing, fetch + prepare, the Lance commit, the Delta bookkeeping).

Rounds alternate img2dataset, lakeshard, img2dataset, ... so drift on a noisy machine
hits both alike; each round's figures are printed, then the best of each and the ratio
lakeshard / img2dataset in images per second. Both sides must end with N images
written (img2dataset's `successes`, lakeshard's `accepted`), or the bench fails.
Beside the times, each round's CPU seconds of the whole command's process tree
(sampled from /proc every 0.1 s: img2dataset's processes; lakeshard's driver, JVM and
Python workers; not the server's) and per image: what each side costs whatever the
cores, and steadier than the wall clock on a machine whose speed drifts.

    .venv/bin/python bench/ingest_vs_img2dataset.py               # 2,000 URLs, 2 rounds
    .venv/bin/python bench/ingest_vs_img2dataset.py --n 200 --rounds 1   # a quick look
    .venv/bin/python bench/ingest_vs_img2dataset.py --jobs   # + Spark jobs per curate step
    .venv/bin/python bench/ingest_vs_img2dataset.py --fetch-cpu  # + the fetchers' CPU alone
    .venv/bin/python bench/ingest_vs_img2dataset.py \
        --variant spark.python.daemon.module=pyspark.daemon   # a setting against the default

`--variant KEY=VALUE` (repeatable) adds a third side to every round, `lakeshard*`: the
same run with those settings -- a Spark setting (`spark.` + its name) or a lakeshard
one (`section.key`, the value read as YAML: `--variant prepare.threads=2`) --, so that a
setting is measured against the defaults in the same rounds. `--code PATH` (repeatable)
adds a side per checkout of other code (a `git worktree` of an older commit), run with
that checkout first on the driver's and the Python workers' path, as
`bench/replay_night.py` does: a change measured against the code before it, and
against img2dataset, in the same rounds.

    git worktree add /tmp/lakeshard-base HEAD~1
    .venv/bin/python bench/ingest_vs_img2dataset.py --code /tmp/lakeshard-base
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BENCH_VENV = REPO / ".bench" / "img2dataset"
IMG2DATASET = "img2dataset==1.47.0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nightly import _sources, random_crop  # noqa: E402 -- the nightly bench's photos


def make_photos(folder: Path, n: int, megapixels: tuple[float, float], seed: int) -> int:
    """Write n JPEGs of `megapixels` (low, high) into folder; return their total bytes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    sources = _sources()
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for i in range(n):
        crop = random_crop(sources, rng, (0.4, 0.9), noise=4)
        ch, cw = crop.shape[:2]
        scale = (rng.uniform(*megapixels) * 1e6 / (cw * ch)) ** 0.5
        size = (max(1, round(cw * scale)), max(1, round(ch * scale)))
        img = Image.fromarray(crop).resize(size, Image.Resampling.BICUBIC)
        path = folder / f"p{i:06d}.jpg"
        img.save(path, quality=90)
        total += path.stat().st_size
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """nginx (or Python's ThreadingHTTPServer) serving `folder` on 127.0.0.1."""

    def __init__(self, folder: Path, work: Path):
        self.port = _free_port()
        nginx = shutil.which("nginx") or next(
            (p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
        if nginx:
            self.kind = "nginx"
            conf = work / "nginx.conf"
            conf.write_text(
                f"worker_processes 1; daemon off; pid {work}/nginx.pid;"
                f" error_log {work}/nginx-error.log;\n"
                "events { worker_connections 1024; }\n"
                "http { access_log off; sendfile on; keepalive_requests 100000;"
                f" client_body_temp_path {work}/tmp; proxy_temp_path {work}/tmp;"
                f" fastcgi_temp_path {work}/tmp; uwsgi_temp_path {work}/tmp;"
                f" scgi_temp_path {work}/tmp;"
                f" server {{ listen 127.0.0.1:{self.port}; root {folder}; }} }}\n")
            (work / "tmp").mkdir(exist_ok=True)
            cmd = [nginx, "-c", str(conf), "-p", str(work)]
        else:
            self.kind = "python http.server (nginx not found)"
            cmd = [sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1",
                   "--directory", str(folder)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.kind} did not start on 127.0.0.1:{self.port}")

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def img2dataset_bin() -> Path:
    """The bench-only venv's img2dataset, installed on first use."""
    exe = BENCH_VENV / "bin" / "img2dataset"
    if not exe.exists():
        print(f"installing {IMG2DATASET} into {BENCH_VENV} (bench only) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True)
        subprocess.run([str(BENCH_VENV / "bin" / "pip"), "install", "-q",
                        "--disable-pip-version-check", IMG2DATASET], check=True)
    return exe


def _tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of `root` and every process below it, by pid,
    from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone since the listing
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in cpu:
            out[pid] = cpu[pid]
            todo.extend(children.get(pid, ()))
    return out


def run_measured(cmd: list[str], **kwargs) -> tuple[float, float | None]:
    """Run `cmd` to its end: (wall seconds, CPU seconds of its whole process tree).

    The CPU is sampled from /proc every 0.1 s while it runs -- the last figure seen of
    each process below it (Spark's JVM is not reaped by lakeshard's driver, so the
    children's rusage would miss it and its Python workers); a process that lives less
    than 0.1 s is missed. None where there is no /proc."""
    seen: dict[int, float] = {}
    done = threading.Event()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, **kwargs)
    measure = os.path.isdir("/proc/self")

    def sample() -> None:
        while not done.wait(0.1):
            seen.update(_tree_cpu(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    if measure:
        sampler.start()
    try:
        rc = proc.wait()
    finally:
        done.set()
        if measure:
            sampler.join()
    wall = time.monotonic() - t0
    if rc:
        raise subprocess.CalledProcessError(rc, cmd)
    return wall, (sum(seen.values()) if measure else None)


def fetch_cpu(urls: list[str], passes: int = 3) -> dict[str, float]:
    """CPU milliseconds per URL of fetching `urls` in this process, best of `passes`
    alternating: lakeshard's fetcher (`udfs.fetch.fetch_many`, batches of 100 as a task's
    Arrow batches come, `fetch.threads` 16, the per-host limit 16, connections kept
    between requests as a Python worker keeps them) and urllib's `urlopen` on 16 threads,
    a new connection per URL (how img2dataset downloads)."""
    import resource
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from etl.config import FetchConfig, SourceConfig
    from udfs.fetch import fetch_many, rules_for

    opts = FetchConfig(allow_networks=["127.0.0.1/32"], per_host=16, threads=16)
    rules = rules_for(SourceConfig(name="web", kind="table", path=str(REPO), format="parquet",
                                   columns={"key": "key", "url": "url"}))

    def lakeshard() -> None:
        for i in range(0, len(urls), 100):
            batch = urls[i:i + 100]
            got = fetch_many(batch, [None] * len(batch), [None] * len(batch), opts,
                             [rules] * len(batch))
            assert all(r.status == "ok" for r in got), [r for r in got if r.status != "ok"][:1]

    def urllib_get(url: str) -> bytes:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.read()

    pool = ThreadPoolExecutor(16)
    sides = {"lakeshard fetcher": lakeshard,
             "urllib, 16 threads": lambda: list(pool.map(urllib_get, urls))}
    best = {name: float("inf") for name in sides}
    for _ in range(passes):
        for name, fn in sides.items():
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            fn()
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
            best[name] = min(best[name], cpu / len(urls) * 1e3)
    pool.shutdown()
    return best


def run_img2dataset(exe: Path, urls: Path, out: Path, args) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(exe), "--url_list", str(urls), "--input_format", "parquet",
           "--url_col", "url", "--caption_col", "caption", "--output_format", "parquet",
           "--output_folder", str(out), "--processes_count", str(args.processes),
           "--thread_count", str(args.threads), "--resize_mode", "no",
           "--encode_quality", "92", "--encode_format", "jpg", "--retries", "0",
           "--timeout", "10", "--number_sample_per_shard", "1000",
           "--distributor", "multiprocessing", "--enable_wandb", "False"]
    wall, cpu = run_measured(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "no_proxy": "127.0.0.1", "NO_PROXY": "127.0.0.1"})
    ok = sum(json.loads(p.read_text())["successes"] for p in out.glob("*_stats.json"))
    return {"wall": wall, "stage": wall, "images": ok, "cpu": cpu}


def lakeshard_config(urls: Path, root: Path, args) -> dict:
    return {
        "storage": {"root": str(root)},
        "spark": {"master": f"local[{args.cores}]", "jars_dir": str(REPO / ".jars"),
                  "conf": {"spark.driver.memory": "4g", "spark.ui.enabled": "false",
                           "spark.ui.showConsoleProgress": "false"}},
        "sources": [{"name": "web", "kind": "table", "path": str(urls), "format": "parquet",
                     "columns": {"key": "key", "url": "url", "caption": "caption"}}],
        "fetch": {"allow_networks": ["127.0.0.1/32"], "per_host": args.per_host,
                  "user_agent": "lakeshard-bench/0.1 (+http://127.0.0.1/ ingest benchmark)"},
        "run": {"progress_interval_s": 0},
    }


def _job_steps(folder: Path) -> list[tuple[str, int, float]]:
    """Spark's event log of one run, its jobs grouped by description: (step, jobs,
    seconds), in the order the steps started."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and "appstatus" not in p.name)
    starts, steps = {}, {}
    for line in (line for f in files for line in f.read_text().splitlines()):
        ev = json.loads(line)
        if ev.get("Event") == "SparkListenerJobStart":
            desc = (ev.get("Properties") or {}).get("spark.job.description") or "(none)"
            # Delta's own jobs: "Delta: <our step> - MERGE operation - ...": our step.
            desc = desc.removeprefix("Delta: ").split(" - ")[0]
            starts[ev["Job ID"]] = (ev["Submission Time"], desc)
        elif ev.get("Event") == "SparkListenerJobEnd" and ev["Job ID"] in starts:
            t0, desc = starts[ev["Job ID"]]
            n, secs = steps.get(desc, (0, 0.0))
            steps[desc] = (n + 1, secs + (ev["Completion Time"] - t0) / 1000)
    return [(desc, n, secs) for desc, (n, secs) in steps.items()]


def run_lakeshard(urls: Path, work: Path, rnd: int, args, spark_conf: dict | None = None,
                  tag: str = "", code: Path = REPO) -> dict:
    """One fresh `lakeshard run --only curate` on a new root; `spark_conf`: the variant's
    settings (Spark's, or lakeshard's as section.key); `code`: the checkout whose `etl`
    and `udfs` run (first on the driver's and the workers' path)."""
    import yaml

    root = work / f"lakeshard{tag}-{rnd}"
    conf = work / f"lakeshard{tag}-{rnd}.yaml"
    raw = lakeshard_config(urls, root, args)
    for key, value in (spark_conf or {}).items():
        if key.startswith("spark."):
            raw["spark"]["conf"][key] = value
        else:  # a lakeshard setting: section.key, the value as YAML
            section, _, name = key.partition(".")
            raw.setdefault(section, {})[name] = yaml.safe_load(value)
    events_dir = work / f"eventlog{tag}-{rnd}"
    if args.jobs:
        shutil.rmtree(events_dir, ignore_errors=True)
        events_dir.mkdir(parents=True)
        raw["spark"]["conf"].update({"spark.eventLog.enabled": "true",
                                     "spark.eventLog.dir": str(events_dir),
                                     "spark.eventLog.compress": "false",
                                     "spark.eventLog.rolling.enabled": "false"})
    env = dict(os.environ)
    if code != REPO:
        raw["spark"]["conf"]["spark.executorEnv.PYTHONPATH"] = str(code)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code), env.get("PYTHONPATH"))
                                            if p)
    conf.write_text(yaml.safe_dump(raw))
    with open(work / f"lakeshard{tag}-{rnd}.log", "wb") as log:
        wall, cpu = run_measured([str(REPO / ".venv" / "bin" / "python"), "-m", "etl.cli",
                                  "--conf", str(conf), "run", "--only", "curate"],
                                 stdout=log, stderr=log, cwd=work, env=env)
    (events,) = root.glob("reports/*/events.jsonl")
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    end = next(e for e in rows if e["event"] == "stage_end" and e["stage"] == "curate")
    summary = json.loads(events.with_name("summary.json").read_text())
    accepted = summary["curate"]["curated_rows"]  # a new root: every curated row is new
    shutil.rmtree(root, ignore_errors=True)
    if args.jobs:
        print(f"       Spark jobs of lakeshard{tag} round {rnd + 1}, by step:")
        for desc, n, secs in _job_steps(events_dir):
            print(f"         {secs:>6.1f} s {n:>3} jobs  {desc[:90]}")
    steps = [(e["step"], e["seconds"]) for e in rows if e["event"] == "step_end"]
    return {"wall": wall, "stage": end["seconds"], "images": accepted, "cpu": cpu,
            "steps": steps}


def _load() -> str:
    """The 1-, 5- and 15-minute load averages, as `uptime` prints them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="photo URLs")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each side, alternating")
    ap.add_argument("--megapixels", type=float, nargs=2, default=(0.3, 0.8))
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2,
                    help="lakeshard's local[N]; img2dataset's --processes default")
    ap.add_argument("--processes", type=int, default=None, help="img2dataset processes")
    ap.add_argument("--threads", type=int, default=16, help="img2dataset threads/process")
    ap.add_argument("--per-host", type=int, default=16, help="lakeshard fetch.per_host")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", action="store_true",
                    help="also print lakeshard's Spark jobs per curate step (event log)")
    ap.add_argument("--work", default=None, help="folder for photos and outputs, kept "
                    "afterwards (default: a temporary folder, removed at the end)")
    ap.add_argument("--fetch-cpu", action="store_true",
                    help="first, the CPU per URL of lakeshard's fetcher and of urllib "
                    "(img2dataset's), in this process, on the same server")
    ap.add_argument("--code", action="append", default=[], type=Path, metavar="PATH",
                    help="a checkout of other code (a git worktree) for another side, "
                    "lakeshard@<folder name>, in every round")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE",
                    help="a Spark setting (spark.*) or a lakeshard one (section.key, "
                    "a YAML value) for a third side, lakeshard*, in every round")
    args = ap.parse_args()
    args.processes = args.processes or args.cores
    variant = {}
    for item in args.variant:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or "." not in key.strip(" ."):
            ap.error(f"--variant {item!r}: expected KEY=VALUE, KEY spark.<setting> or "
                     "<section>.<key>")
        variant[key.strip()] = value

    import pyarrow as pa
    import pyarrow.parquet as pq

    exe = img2dataset_bin()
    work = Path(args.work or tempfile.mkdtemp(prefix="ingest-bench-"))
    if args.work is None:  # photos and outputs (~0.2 GB per 1,000 URLs), removed at exit
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o755)  # nginx's workers run as an unprivileged user
    t0 = time.monotonic()
    total = make_photos(work / "www", args.n, tuple(args.megapixels), args.seed)
    print(f"{args.n} photos, {args.megapixels[0]}-{args.megapixels[1]} MP, "
          f"{total / args.n / 1e3:.0f} kB mean, generated in {time.monotonic() - t0:.1f} s "
          f"under {work}")
    server = Server(work / "www", work)
    try:
        names = sorted(p.name for p in (work / "www").glob("*.jpg"))
        urls = work / "urls.parquet"
        pq.write_table(pa.table({"key": [n[:-4] for n in names],
                                 "url": [server.url(n) for n in names],
                                 "caption": [f"photo {n[:-4]}" for n in names]}), urls)
        print(f"server: {server.kind} on 127.0.0.1:{server.port}; {os.cpu_count()} cores; "
              f"img2dataset {args.processes} x {args.threads}; lakeshard local[{args.cores}]"
              f", fetch.per_host {args.per_host}; load {_load()} at the start")
        if args.fetch_cpu:
            cpu = fetch_cpu([server.url(n) for n in names])
            print("fetch only, CPU ms per URL in one process, best of 3: " + ", ".join(
                f"{name} {ms:.2f}" for name, ms in cpu.items()))
        if variant:
            settings = ", ".join(f"{k}={v}" for k, v in variant.items())
            print(f"lakeshard* = lakeshard with {settings}")
        print()
        # lakeshard's sides: their settings over the defaults, a file-name tag, the code.
        lakeshards = {"lakeshard": ({}, "", REPO),
                      **({"lakeshard*": (variant, "-variant", REPO)} if variant else {}),
                      **{f"lakeshard@{c.resolve().name}": ({}, f"-at-{c.resolve().name}",
                                                           c.resolve()) for c in args.code}}
        width = max(12, *(len(side) for side in lakeshards))
        print(f"{'round':<6} {'side':<{width}} {'stage s':>8} {'command s':>9} {'images':>7} "
              f"{'images/s (stage)':>17} {'CPU s':>6} {'CPU ms/image':>12}")
        sides = ("img2dataset", *lakeshards)
        results: dict[str, list[dict]] = {side: [] for side in sides}
        for rnd in range(args.rounds):
            for side in sides:
                if side == "img2dataset":
                    r = run_img2dataset(exe, urls, work / "i2d-out", args)
                else:
                    settings, tag, code = lakeshards[side]
                    r = run_lakeshard(urls, work, rnd, args, settings, tag, code)
                if r["images"] != args.n:
                    raise SystemExit(f"{side} wrote {r['images']} of {args.n} images")
                results[side].append(r)
                cpu = ("-", "-") if r["cpu"] is None else (
                    f"{r['cpu']:.1f}", f"{r['cpu'] / r['images'] * 1e3:.2f}")
                print(f"{rnd + 1:<6} {side:<{width}} {r['stage']:>8.1f} {r['wall']:>9.1f} "
                      f"{r['images']:>7} {r['images'] / r['stage']:>17.1f} {cpu[0]:>6} "
                      f"{cpu[1]:>12}", flush=True)
                if r.get("steps"):  # curate's own steps (step_end events)
                    print("       curate steps: " + "; ".join(
                        f"{name} {secs:.2f} s" for name, secs in r["steps"]), flush=True)
    finally:
        server.stop()
    best = {side: min(rs, key=lambda r: r["stage"]) for side, rs in results.items()}
    i2d, ls = (args.n / best[s]["stage"] for s in ("img2dataset", "lakeshard"))
    ls_cmd = args.n / best["lakeshard"]["wall"]
    print(f"\nbest of {args.rounds}: img2dataset {i2d:.1f} images/s (whole command); "
          f"lakeshard curate stage {ls:.1f} images/s, whole command {ls_cmd:.1f} images/s; "
          f"load {_load()} at the end")
    print(f"lakeshard / img2dataset: {ls / i2d:.2f} (curate stage), "
          f"{ls_cmd / i2d:.2f} (whole command)")
    if all(r["cpu"] is not None for rs in results.values() for r in rs):
        # CPU per image of the whole command (start-up included), the least of the rounds:
        # what each side costs on any number of cores, less swayed than the wall clock by
        # a machine whose speed drifts.
        print("CPU ms per image, whole command, least of the rounds: " + ", ".join(
            f"{side} {min(r['cpu'] for r in rs) / args.n * 1e3:.2f}"
            for side, rs in results.items()))
    for side in lakeshards:
        if side != "lakeshard":
            other = best[side]
            print(f"{side} / img2dataset: {args.n / other['stage'] / i2d:.2f} (curate stage), "
                  f"{args.n / other['wall'] / i2d:.2f} (whole command); best stage "
                  f"{other['stage']:.1f} s against lakeshard's "
                  f"{best['lakeshard']['stage']:.1f} s")


if __name__ == "__main__":
    main()
