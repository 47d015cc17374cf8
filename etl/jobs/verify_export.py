"""`lakeshard verify-export NAME`: check an MDS export end to end.

Reads the manifest and the root index, checks every shard's size and hashes and the
export checksum, decodes every image, compares sample counts with the manifest and
with the curated table (the version and predicate the manifest names), checks that no
exported sample is named by a takedown (the Delta ``takedowns`` table), and reads a
shuffled sample through ``streaming.StreamingDataset`` with several DataLoader workers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field

from etl.writers.mds import NOT_CHECKSUMMED, combine_digests

__all__ = ["VerifyReport", "verify_export", "taken_down_ids"]


@dataclass
class VerifyReport:
    path: str
    samples: int = 0
    shards: int = 0
    images_decoded: int = 0
    loader_samples: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _identity(batch):
    return batch


_PART_RE = re.compile(r"^part-(\d{5})(-t\d+)?$")


def partition_checksums(path: str, splits: list[str]) -> dict[int, str]:
    """Recompute each partition's checksum from the files on disk, wherever the layout
    put them (``part-N/``, ``<bucket>/part-N/``, ``[<bucket>/]<key>/part-N-tA/``)."""
    digests: dict[int, dict[str, str]] = {}
    for dirpath, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), path).split(os.sep)
            hit = [i for i, c in enumerate(rel[:-1]) if _PART_RE.match(c)]
            if not hit or name in NOT_CHECKSUMMED:
                continue
            i = hit[0]
            sub = rel[0] if rel[0] in splits and rel[0] else ""
            key = "/".join(p for p in [sub, *rel[i + 1:]] if p)
            digest = hashlib.sha256()
            with open(os.path.join(path, *rel), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            pid = int(_PART_RE.match(rel[i]).group(1))
            digests.setdefault(pid, {})[key] = digest.hexdigest()
    return {pid: combine_digests(d) for pid, d in digests.items()}


def taken_down_ids(cfg) -> frozenset[str] | None:
    """The sample ids the root's takedowns table names (given, by key, or matched), or
    None when the root has no takedowns table. Starts Spark only when there is one."""
    from etl import storage, tables

    path = tables.layout(cfg).takedowns
    if "://" not in path and not os.path.isdir(os.path.join(path, "_delta_log")):
        return None

    from etl.session import get_spark
    from etl.transforms.bronze import taken_down_ids

    spark = get_spark(cfg)
    table = storage.read_delta(spark, path)
    if table is None:
        return None
    return frozenset(r["sample_id"] for r in taken_down_ids(table).collect())


def verify_export(path: str, *, loader_workers: int = 2, loader_samples: int = 64,
                  taken_down: frozenset[str] | None = None) -> VerifyReport:
    """Verify the export at `path`; an ``s3://`` export is downloaded to a temporary
    folder first (verification reads every byte anyway). `taken_down`: sample ids no
    export may hold (:func:`taken_down_ids`)."""
    from etl.writers.remote import is_remote

    if not is_remote(path):
        return _verify_local(path, path, loader_workers, loader_samples, taken_down)
    import tempfile

    from etl.writers.remote import S3Store

    store = S3Store(path)
    with tempfile.TemporaryDirectory(prefix="lakeshard-verify-") as local:
        for rel in store.list():
            if rel.startswith("_lakeshard/"):
                continue
            os.makedirs(os.path.dirname(os.path.join(local, rel)), exist_ok=True)
            store.client.download_file(store.bucket, store._key(rel), os.path.join(local, rel))
        return _verify_local(local, path, loader_workers, loader_samples, taken_down)


def _in_child(fn, *args):
    """`fn(*args)` in a fresh (spawned) process.

    ``StreamingDataset`` never releases its shared memory before the process exits: every
    instance keeps its segments open, and opens (and keeps) every segment of the earlier
    instances it probes for a free name. A long-lived driver that verifies exports, or a
    test session, would run out of file descriptors; a child process returns them all
    when it ends, and its exit removes the segments it created.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # Not a multiprocessing.Pool: its workers are daemons, which cannot start the
    # DataLoader's workers.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _read_back(path: str, splits: list[str], counts: list[int], biggest: str,
               loader_workers: int, loader_samples: int, taken_down: frozenset[str] | None
               ) -> tuple[int, int, list[str]]:
    """Decode every image through ``StreamingDataset`` (and flag any sample a takedown
    names), then read the largest split through a shuffled multi-worker DataLoader as
    training does: (images decoded, samples the loader read, problems)."""
    import torch.utils.data
    from streaming import Stream, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    # One dataset over every split (a stream each): every StreamingDataset probes, and
    # keeps open, the shared memory of the ones before it, so one per bucket could run a
    # bucketed export out of file descriptors even here.
    clean_stale_shared_memory()
    dataset = StreamingDataset(streams=[Stream(local=path, split=split or None)
                                        for split in splits], shuffle=False, batch_size=1)
    decoded, problems, base = 0, [], 0
    for split, n in zip(splits, counts, strict=True):
        for j in range(min(n, len(dataset) - base)):
            try:
                sample = dataset[base + j]
                if taken_down and sample.get("sample_id") in taken_down:
                    problems.append(f"{split or 'sample'} {j}: sample {sample['sample_id']} is "
                                    "named by a takedown: export again to leave it out")
                image = sample["image"]
                image.load()
                if image.format != "JPEG":
                    raise ValueError(f"format {image.format}")
                decoded += 1
            except Exception as exc:  # noqa: BLE001 -- every failure is reported, not raised
                problems.append(f"{split or 'sample'} {j}: image does not decode: {exc}")
        base += n
    del dataset

    clean_stale_shared_memory()
    shuffled = StreamingDataset(
        local=path, split=biggest or None, shuffle=True, shuffle_seed=1, batch_size=8
    )
    loader = torch.utils.data.DataLoader(
        shuffled, batch_size=8, num_workers=loader_workers, collate_fn=_identity,
        # Workers start fresh, as training starts them (pylance is not fork-safe).
        multiprocessing_context="spawn" if loader_workers else None,
    )
    loaded = 0
    for batch in loader:
        loaded += len(batch)
        if loaded >= loader_samples:
            break
    return decoded, loaded, problems


def _verify_local(path: str, shown: str, loader_workers: int, loader_samples: int,
                  taken_down: frozenset[str] | None = None) -> VerifyReport:
    """Verify the export in local folder `path` (reported as `shown`): the checks in
    order, each adding its problems to one report."""
    report = VerifyReport(shown)
    try:
        manifest, indexes = _read_layout(path)
    except (OSError, ValueError, KeyError) as exc:
        report.problems.append(f"cannot read manifest/index: {exc}")
        return report
    counts = {split: _samples(index) for split, index in indexes.items()}
    report.shards = sum(len(index["shards"]) for index in indexes.values())
    report.samples = sum(counts.values())
    report.problems.extend(_check_shards(path, manifest, indexes))
    if report.samples != manifest["samples"]:
        report.problems.append(
            f"indexes have {report.samples} samples, manifest {manifest['samples']}"
        )
    report.problems.extend(_check_checksums(path, manifest, list(indexes)))
    report.problems.extend(_check_table(manifest, report.samples))

    splits = list(indexes)
    biggest = max(splits, key=lambda sp: counts[sp])
    expected = min(loader_samples, counts[biggest])
    decoded, loaded, problems = _in_child(_read_back, path, splits,
                                          [counts[sp] for sp in splits], biggest,
                                          loader_workers, loader_samples, taken_down)
    report.images_decoded += decoded
    report.loader_samples += loaded
    report.problems.extend(problems)
    if report.loader_samples < expected:
        report.problems.append(
            f"DataLoader read {report.loader_samples} samples, expected at least {expected}"
        )
    return report


def _read_layout(path: str) -> tuple[dict, dict[str, dict]]:
    """The manifest and each split's ``index.json`` (``""``: the root, without
    buckets), splits in name order."""
    with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    splits = sorted(manifest.get("bucket_samples") or {"": manifest["samples"]})
    indexes = {}
    for split in splits:
        with open(os.path.join(path, split, "index.json"), encoding="utf-8") as f:
            indexes[split] = json.load(f)
    return manifest, indexes


def _samples(index: dict) -> int:
    """The samples an ``index.json`` lists."""
    return sum(s["samples"] for s in index["shards"])


def _check_shards(path: str, manifest: dict, indexes: dict[str, dict]) -> list[str]:
    """Per bucket, its sample count against the manifest's; per shard file, its size
    and hashes against its index."""
    from streaming.base.hashing import get_hash

    problems = []
    for split, index in indexes.items():
        n = _samples(index)
        if split and n != manifest["bucket_samples"][split]:
            want = manifest["bucket_samples"][split]
            problems.append(f"bucket {split}: index has {n} samples, manifest {want}")
        for shard in index["shards"]:
            for key in ("raw_data", "zip_data"):
                info = shard.get(key)
                if not info:
                    continue
                try:
                    data = open(os.path.join(path, split, info["basename"]), "rb").read()
                except OSError:
                    problems.append(f"missing shard file {split}/{info['basename']}")
                    continue
                if len(data) != info["bytes"]:
                    problems.append(
                        f"{info['basename']}: {len(data)} bytes, index says {info['bytes']}"
                    )
                for algo, expected in (info.get("hashes") or {}).items():
                    if get_hash(algo, data) != expected:
                        problems.append(f"{info['basename']}: {algo} hash mismatch")
    return problems


def _check_checksums(path: str, manifest: dict, splits: list[str]) -> list[str]:
    """Each partition's checksum, and the export's, recomputed from the files."""
    found = partition_checksums(path, splits)
    # An export written incrementally keeps some partitions of earlier runs: its
    # manifest lists the partition ids it is made of.
    part_ids = manifest.get("part_ids") or range(manifest.get("partitions", len(found)))
    part_sums = [found.get(pid, "") for pid in part_ids]
    problems = []
    if part_sums != manifest.get("part_checksums"):
        problems.append("partition checksums differ from the manifest")
    checksum = hashlib.sha256("".join(part_sums).encode()).hexdigest()
    if checksum != manifest.get("checksum"):
        problems.append("export checksum differs from the manifest")
    return problems


def _check_table(manifest: dict, samples: int) -> list[str]:
    """The export's `samples` against the rows of the curated table version and
    predicate the manifest names (less what the export left out on purpose)."""
    table = manifest.get("table")
    if not table:
        return []
    import lance

    try:
        ds = lance.dataset(table, version=manifest["table_version"])
    except (ValueError, OSError) as exc:
        try:
            gone = lance.dataset(table).version > manifest["table_version"]
        except (ValueError, OSError):
            gone = False
        return [
            f"table {table} v{manifest['table_version']} no longer exists (its versions "
            "were cleaned after a removal): export again" if gone else
            f"cannot read table {table}: {exc}"
        ]
    rows = ds.count_rows(filter=manifest.get("where"))
    # Non-canonical duplicates dedup marked are left out by the export, and so
    # are rows a takedown names that were still in the table.
    rows -= (manifest.get("dedup") or {}).get("excluded_duplicates", 0)
    rows -= (manifest.get("removals") or {}).get("excluded_taken_down", 0)
    if rows != samples:
        return [
            f"table {table} v{manifest['table_version']} has {rows} rows matching "
            f"{manifest.get('where')!r}, export has {samples}"
        ]
    return []
