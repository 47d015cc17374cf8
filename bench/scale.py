"""Cold nights at scale: a first, a no-op and a +1 % night over N records of a `table`
source with embedded JPEGs, checked exactly.

Generates `--records` small distinct 160x120 JPEGs with planted exact and near copies
(bench/scale_data.py: deterministic from `--seed`, streamed to parquet files of
`--file-rows` rows, never all in memory), then runs three nights, each a fresh `lakeshard
run --only curate --only dedup --only export` process as a scheduler starts it
(bench/nightly.py's command): the first, a no-op rerun, and one after a new file of 1 %
new records, some of them copies of old records. The driver bounds (`driver:`:
prepare_rows, plan_rows, ids, scan_rows) are lakeshard's defaults, as a user runs it
(`--bounds config`), or all 0 (`--bounds spark`), so that every Spark path of those
bounds runs whatever N is and its results are checked; the run's Spark settings are
conf/local.yaml's (`local[*]`, `spark.driver.memory` 4g unless `--driver-memory`).

Printed per night: the command's wall time, each stage's seconds (the run's
events.jsonl, `stage_end`), the time before the first and after the last stage, ms per
new record, the driver's peak memory -- the peak resident set of the run's JVM (the
`java` child of the `lakeshard` process, psutil, sampled every 0.5 s) and of the Python
driver -- and the ratios +1 %/first and no-op/first. Then the checks, each exact:

* accounting: every night, accepted + rejected = the records new that night, and
  accepted + rejected + unchanged = the records listed (the run's rows of the Delta
  `accounting` table); after the last, the manifest's keys = the generated keys;
* planted copies clustered: each copy in its original's cluster of the Delta `dedup`
  table; a cluster joining records not planted together is regenerated from
  (seed, index) and its members' dHashes measured: linked within dedup's threshold, it
  is a chance near-duplicate, reported (the generator's designed hashes make one
  impossible, so it would point at the hashing); otherwise a failure;
* the export: the samples of its MDS indexes = the kept canonical rows of dedup = the
  plain records generated (less the roots a chance near-duplicate merged).

With `--files DIR` the first night's files are generated once into DIR (with
scale-files.json: the parameters and each file's planted copies and worst near-copy
distance) and hard-linked into each later run's own folder for the same parameters; the
+1 % file is written into the run's folder only. `--generate-only` makes DIR's files and
exits.

    .venv/bin/python bench/scale.py --records 20000
    .venv/bin/python bench/scale.py --records 1000000 --files /data/scale-1m --generate-only
    .venv/bin/python bench/scale.py --records 1000000 --root /data/scale --keep --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import nightly  # noqa: E402 -- bench/nightly.py: the command, the run's events
import scale_data  # noqa: E402 -- bench/scale_data.py: the records

SOURCE = "scale"
BOUNDS_OFF = {"prepare_rows": 0, "plan_rows": 0, "ids": 0, "scan_rows": 0}


class PeakMemory:
    """``with PeakMemory(pid):`` -- the peak RSS of the process `pid` (the Python driver)
    and of its `java` descendant (Spark's driver JVM), sampled every `interval` s."""

    def __init__(self, pid: int, interval: float = 0.5):
        import psutil

        self.proc = psutil.Process(pid)
        self.interval = interval
        self.python = self.jvm = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        import psutil

        try:
            self.python = max(self.python, self.proc.memory_info().rss)
            for child in self.proc.children(recursive=True):
                if child.name().startswith("java"):
                    self.jvm = max(self.jvm, child.memory_info().rss)
        except psutil.Error:  # the process or a child ended between two calls
            pass

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _night(conf: Path, root: Path, run_id: str, label: str, new: int) -> dict:
    """One night: a fresh `lakeshard run` process, timed, its peak memory sampled."""
    t0, began = time.monotonic(), time.time()
    with open(root.parent / f"{run_id}.log", "wb") as log:
        proc = subprocess.Popen(nightly.lakeshard_command(conf, run_id), stdout=log,
                                stderr=log, cwd=REPO)
        with PeakMemory(proc.pid) as peak:
            rc = proc.wait()
    if rc:
        raise SystemExit(f"{label} night failed (exit {rc}): see {root.parent / run_id}.log")
    wall, ended = time.monotonic() - t0, time.time()
    return {"label": label, "run_id": run_id, "wall": wall, "new": new,
            "ms_per_new": 1000 * wall / new if new else None,
            "jvm_peak_mb": peak.jvm / 2**20, "python_peak_mb": peak.python / 2**20,
            **nightly.night_events(root, run_id, began, ended)}


def _config(work: Path, files: Path, driver_memory: str, partitions: int,
            bounds: str) -> Path:
    import yaml

    spark = yaml.safe_load((REPO / "conf" / "local.yaml").read_text())["spark"]
    spark["jars_dir"] = str(REPO / ".jars")
    spark["conf"]["spark.driver.memory"] = driver_memory
    raw = {"storage": {"root": str(work / "root")},  # the install's cache, as any night's
           "spark": spark,
           "sources": [{"name": SOURCE, "kind": "table", "format": "parquet",
                        "path": str(files / "part-*.parquet"),
                        "columns": {"key": "key", "image": "image", "caption": "caption"}}],
           "exports": {"train": {"partitions": partitions}}}
    if bounds == "spark":
        raw["driver"] = dict(BOUNDS_OFF)
    conf = work / "scale.yaml"
    conf.write_text(yaml.safe_dump(raw))
    return conf


def _copies(written: list[dict]) -> dict[str, list[list[int]]]:
    return {kind: [pair for w in written for pair in w["copies"][kind]]
            for kind in ("exact", "near")}


def _delta(path: Path, columns: list[str]):
    from deltalake import DeltaTable

    return DeltaTable(str(path)).to_pyarrow_table(columns=columns)


def _accounting(root: Path, run_id: str) -> dict[str, int]:
    table = _delta(root / "delta" / "accounting", ["run_id", "source", "status", "count"])
    out: dict[str, int] = {}
    for row in table.to_pylist():
        if row["run_id"] == run_id and row["source"] == SOURCE:
            out[row["status"]] = out.get(row["status"], 0) + row["count"]
    return out


def _export_samples(export_dir: Path) -> int:
    """Samples of the export's MDS indexes (the root index, else each bucket's)."""
    indexes = [export_dir / "index.json"] if (export_dir / "index.json").exists() else \
        sorted(export_dir.glob("*/index.json"))
    return sum(shard["samples"] for f in indexes
               for shard in json.loads(f.read_text())["shards"])


def _linked(hashes: list[int]) -> bool:
    """Whether the rows of these dHashes form one connected graph under dedup's rule (an
    edge between two hashes at most THRESHOLD bits apart), as dedup's clusters are."""
    reached, todo = {0}, [0]
    while todo:
        a = todo.pop()
        for b in range(len(hashes)):
            if b not in reached and (hashes[a] ^ hashes[b]).bit_count() <= scale_data.THRESHOLD:
                reached.add(b)
                todo.append(b)
    return len(reached) == len(hashes)


def _clusters(root: Path, total: int, copies: dict, record: Callable[[int], bytes]
              ) -> tuple[list[str], dict]:
    """The planted-cluster checks. Each planted copy must be in its original's cluster. A
    cluster joining records of different planted roots (an original and its copies) is
    verified from the generated bytes (`record` regenerates a record by index): if its
    members' dHashes link up within the threshold it is a chance near-duplicate,
    reported; otherwise a failure. Returns the failures and the report."""
    from etl.schema import sample_id_of

    dedup = _delta(root / "delta" / "dedup", ["sample_id", "dup_cluster_id", "is_canonical"])
    index_of = {sample_id_of(SOURCE, scale_data.key_of(i)): i for i in range(total)}
    cluster: dict[int, str] = {}
    members: dict[str, list[int]] = {}
    for sid, cid in zip(dedup["sample_id"].to_pylist(), dedup["dup_cluster_id"].to_pylist(),
                        strict=True):
        if sid in index_of:
            cluster[index_of[sid]] = cid
            members.setdefault(cid, []).append(index_of[sid])
    del index_of
    fails = []
    pairs = copies["exact"] + copies["near"]
    apart = [(c, o) for c, o in pairs if cluster.get(c) is None or cluster.get(c) != cluster.get(o)]
    if apart:
        fails.append(f"{len(apart)} planted copies not in their original's cluster, "
                     f"e.g. {apart[:3]}")
    root_of = {c: o for c, o in pairs}
    chance, wrong, merged = [], [], 0
    for rows in members.values():
        roots = {root_of.get(i, i) for i in rows}
        if len(roots) < 2:
            continue
        if len(rows) > 1000:  # no chance near-duplicate; measuring it would take hours
            wrong.append((sorted(rows)[:10], None))
            continue
        hashes = [scale_data.dhash_of(record(i)) for i in sorted(rows)]
        closest = min((a ^ b).bit_count() for k, a in enumerate(hashes) for b in hashes[k + 1:])
        linked = _linked(hashes)
        (chance if linked else wrong).append((sorted(rows), closest))
        merged += len(roots) - 1 if linked else 0
    if wrong:
        fails.append(f"{len(wrong)} clusters join records that were not planted together and "
                     f"whose generated dHashes are not within {scale_data.THRESHOLD} bits of "
                     f"each other, e.g. {wrong[:3]} (rows, closest bits)")
    canonical = sum(dedup["is_canonical"].to_pylist())
    return fails, {"canonical": canonical, "merged_roots": merged,
                   "chance_clusters": len(chance),
                   "chance_rows": sum(len(r) for r, _ in chance), "chance_examples": chance[:5]}


def check(root: Path, nights: list[dict], total: int, copies: dict,
          record: Callable[[int], bytes]) -> tuple[list[str], dict]:
    """The exact checks; returns the failures (empty: all hold) and the clusters' report
    (chance near-duplicates found among the generated records, verified)."""
    fails, listed = [], 0
    for night in nights:
        acc = _accounting(root, night["run_id"])
        listed += night["new"]
        new = acc.get("accepted", 0) + acc.get("rejected", 0)
        night["accounting"] = acc
        if new != night["new"]:
            fails.append(f"{night['label']}: accepted + rejected = {new}, "
                         f"{night['new']} new records")
        seen = new + acc.get("unchanged", 0)
        if acc and seen != listed:
            fails.append(f"{night['label']}: seen {seen}, {listed} records listed")
    manifest = _delta(root / "delta" / "manifest", ["source_key", "status"])
    keys = {k for k, s in zip(manifest["source_key"].to_pylist(),
                              manifest["status"].to_pylist(), strict=True) if s != "removed"}
    expected = {scale_data.key_of(i) for i in range(total)}
    if keys != expected:
        fails.append(f"manifest keys: {len(expected - keys)} generated keys missing, "
                     f"{len(keys - expected)} not generated")
    del keys, expected
    cluster_fails, report = _clusters(root, total, copies, record)
    fails += cluster_fails
    # Each planted root is one kept row, less those a verified chance cluster merged.
    kept = total - len(copies["exact"]) - len(copies["near"]) - report["merged_roots"]
    exported = _export_samples(root / "mds" / "train")
    if not exported == report["canonical"] == kept:
        fails.append(f"export {exported} samples, dedup {report['canonical']} canonical "
                     f"rows, {kept} planted roots (plain records, less chance merges)")
    return fails, report


def _print(nights: list[dict], summary: dict) -> None:
    cols = ("command s", *(f"{s} s" for s in nightly.STAGES), "before s", "after s",
            "ms/new", "JVM peak MB", "py peak MB")
    print(f"{'night':<12} " + " ".join(f"{c:>11}" for c in cols))
    for n in nights:
        cells = [n["wall"], *(n["stages"].get(s, 0.0) for s in nightly.STAGES), n["before"],
                 n["after"], n["ms_per_new"], n["jvm_peak_mb"], n["python_peak_mb"]]
        print(f"{n['label']:<12} " + " ".join(
            f"{'-':>11}" if c is None else f"{c:>11.1f}" for c in cells))
    print(f"+1 % / first: {summary['increment_ratio']:.3f}   "
          f"no-op / first: {summary['noop_ratio']:.3f}")


META = "scale-files.json"


def _params(args: argparse.Namespace) -> dict:
    """What the first night's files are made from (a --files folder is reused only for
    the same)."""
    return {"generator": scale_data.VERSION, "seed": args.seed, "records": args.records,
            "file_rows": args.file_rows, "copy_rate": args.copy_rate}


def _store(folder: Path, args: argparse.Namespace) -> dict:
    """The --files folder's record (parameters, per-file metadata), generating its files
    first if it has none; refuses one made with other parameters."""
    meta_path, params = folder / META, _params(args)
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta["params"] != params:
            raise SystemExit(f"{folder} holds files generated with {meta['params']}, not "
                             f"{params}: give the same parameters or another --files folder")
        missing = [w["path"] for w in meta["files"] if not (folder / w["path"]).is_file()]
        if missing:
            raise SystemExit(f"{folder}: files of {META} missing: {missing[:3]}")
        print(f"{args.records} records in {len(meta['files'])} parquet files reused from "
              f"{folder}", flush=True)
        return {**meta, "generate_s": None}
    t0 = time.monotonic()
    written = scale_data.write_files(folder, args.seed, 0, args.records, args.file_rows, 0,
                                     args.copy_rate, workers=args.workers)
    gen_s = time.monotonic() - t0
    meta = {"params": params, "generate_s": gen_s,
            "files": [{**w, "path": Path(w["path"]).name} for w in written]}
    meta_path.with_suffix(".tmp").write_text(json.dumps(meta))
    os.replace(meta_path.with_suffix(".tmp"), meta_path)
    size = sum(os.path.getsize(w["path"]) for w in written)
    print(f"{args.records} records in {len(written)} parquet files ({size / 1e9:.2f} GB) "
          f"generated in {gen_s:.1f} s under {folder}", flush=True)
    return meta


def _first_files(args: argparse.Namespace, files: Path) -> tuple[list[dict], float | None]:
    """The first night's files in the run's source folder `files`, and the seconds their
    generation took (None: reused). With --files they are made once there and linked in
    (hard links; copies where the file system refuses), else generated in place."""
    store = Path(args.files).resolve() if args.files else files
    meta = _store(store, args)
    if store != files:
        files.mkdir(parents=True)
        for w in meta["files"]:
            try:
                os.link(store / w["path"], files / w["path"])
            except OSError:
                shutil.copyfile(store / w["path"], files / w["path"])
    return [{**w, "path": str(files / Path(w["path"]).name)} for w in meta["files"]], \
        meta["generate_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=20_000, help="records of the first night")
    ap.add_argument("--file-rows", type=int, default=20_000, help="rows per parquet file")
    ap.add_argument("--increment", type=float, default=0.01, help="fraction added last")
    ap.add_argument("--copy-rate", type=float, default=0.01,
                    help="fraction of records that are planted copies (half exact, half near)")
    ap.add_argument("--root", default=None, help="folder for the run's files and tables "
                    "(default: a temporary folder, removed at exit unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the folder afterwards")
    ap.add_argument("--files", default=None, help="folder of the first night's files, "
                    "generated there once (with " + META + ") and hard-linked into each "
                    "run's folder by later runs of the same --seed, --records, --file-rows "
                    "and --copy-rate")
    ap.add_argument("--generate-only", action="store_true",
                    help="generate --files' files and exit")
    ap.add_argument("--driver-memory", default="4g", help="spark.driver.memory")
    ap.add_argument("--bounds", choices=("config", "spark"), default="config",
                    help="driver bounds: lakeshard's defaults (config), or all 0 so every "
                    "Spark path runs (spark)")
    ap.add_argument("--rows-per-partition", type=int, default=2500,
                    help="export partitions = records / this (at least 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=None, help="generator processes")
    ap.add_argument("--json", default=None, help="write the figures and checks here")
    args = ap.parse_args()

    if args.generate_only:
        if not args.files:
            raise SystemExit("--generate-only needs --files")
        meta = _store(Path(args.files).resolve(), args)
        print(f"near copies: at most "
              f"{max(w['worst_near_bits'] for w in meta['files'])} dHash bits from their "
              "originals")
        return 0
    work = Path(args.root or tempfile.mkdtemp(prefix="scale-bench-")).resolve()
    files = work / "files"
    if (work / "root").exists() or files.exists():
        raise SystemExit(f"{work} already holds a bench's files or tables: give another --root")
    n, added = args.records, max(2, round(args.records * args.increment))
    written, gen_s = _first_files(args, files)
    size = sum(os.path.getsize(w["path"]) for w in written)
    conf = _config(work, files, args.driver_memory, max(2, n // args.rows_per_partition),
                   args.bounds)
    bounds = (f"driver bounds all 0 ({', '.join(f'driver.{k}' for k in BOUNDS_OFF)}): "
              "every Spark path of those bounds runs" if args.bounds == "spark"
              else "driver bounds: lakeshard's defaults (etl/config/bounds.py)")
    print(f"{bounds}; spark.driver.memory {args.driver_memory}; {os.cpu_count()} cores",
          flush=True)
    nights = [_night(conf, work / "root", "scale-first", "first", n)]
    nights.append(_night(conf, work / "root", "scale-noop", "no-op", 0))
    # The new file's copies have originals among the first night's records: ~10 of them
    # at least (rate 10 / added, at most half), or the copy rate's share if more. It is
    # written into the run's own folder only, never into --files.
    more_rate = min(0.5, max(args.copy_rate, 10 / added))
    more = scale_data.write_files(files, args.seed, n, n + added, added, len(written),
                                  more_rate, old_below=n, old_rate=args.copy_rate, workers=1)
    nights.append(_night(conf, work / "root", "scale-increment", "+1 %", added))
    copies = _copies(written + more)

    def record(i: int) -> bytes:  # record i regenerated, as the files hold it
        return scale_data.record_bytes(args.seed, scale_data.plan(
            args.seed, i, args.copy_rate) if i < n else scale_data.plan(
            args.seed, i, more_rate, old_below=n, old_rate=args.copy_rate))

    fails, clusters = check(work / "root", nights, n + added, copies, record)
    old = sum(1 for pair in _copies(more)["exact"] + _copies(more)["near"] if pair[1] < n)
    summary = {
        "records": n, "added": added, "added_copies_of_old": old,
        "copies": {k: len(v) for k, v in copies.items()},
        "worst_near_bits": max(w["worst_near_bits"] for w in written + more),
        "parquet_bytes": size, "generate_s": gen_s, "files": args.files,
        "driver_memory": args.driver_memory, "bounds": args.bounds,
        "cores": os.cpu_count(), "load": os.getloadavg()[0],
        "increment_ratio": nights[2]["wall"] / nights[0]["wall"],
        "noop_ratio": nights[1]["wall"] / nights[0]["wall"],
        "nights": nights, "clusters": clusters, "failures": fails,
    }
    print(f"\nplanted: {summary['copies']['exact']} exact and {summary['copies']['near']} "
          f"near copies (near: at most {summary['worst_near_bits']} dHash bits from the "
          f"original); the +1 % file: {added} records, {old} of them copies of old records")
    if clusters["chance_clusters"]:
        print(f"chance near-duplicates (not planted, verified from the generated bytes to be "
              f"within {scale_data.THRESHOLD} bits): {clusters['chance_clusters']} clusters, "
              f"{clusters['chance_rows']} rows, e.g. {clusters['chance_examples'][:3]} "
              "(rows, closest bits)")
    _print(nights, summary)
    print("checks: " + ("all exact (accounting, manifest keys, planted clusters, export = "
                        "kept canonical rows)" if not fails else "FAILED"))
    for f in fails:
        print(f"  {f}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if fails else 0


if __name__ == "__main__":
    status = main()
    # After a bench's nights a native library aborts this process at interpreter exit
    # ("terminate called without an active exception", exit 134; seen at 300 and 20,000
    # records, not in any of its parts run alone): the figures and checks are out, so
    # the bench ends with its own status instead of the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
