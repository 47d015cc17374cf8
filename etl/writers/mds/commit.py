"""The driver-side commit of an export: from the tasks' reported partitions to a whole,
readable export, behind one interface (:class:`ExportCommit`) with two implementations.

* :class:`LocalCommit` -- the tasks wrote ``part-NNNNN`` folders into a staging folder
  beside the export (``.<name>.staging-<key>``, named by the :func:`export_key`). The
  commit merges their indexes into the root ``index.json`` (one per bucket, after moving
  ``part-N/<bucket>`` to ``<bucket>/part-N``), writes ``manifest.json`` and swaps the
  staging folder into place by rename: a reader never sees a half-written export, and
  the previous export disappears only once the new one is whole.
* :class:`S3Commit` -- object stores have no rename: each task's shards stay where its
  attempt wrote them (``[<bucket>/]<key>/<attempt>/``). The root indexes list only the
  attempts that finished (one per partition, from the tasks' done-markers), the
  manifest is written last, and then everything else under the export -- failed
  attempts, an older export -- is deleted.

Both merge partition indexes with :func:`merge_indexes` and build the manifest with
:func:`build_manifest`; both read an existing manifest, so an export whose key matches
is not written again.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from etl.runtime.faults import fault_point
from etl.writers.mds.task import state_prefix
from etl.writers.remote import S3Store, is_remote

__all__ = [
    "ExportResult",
    "export_key",
    "merge_indexes",
    "merge_partition_indexes",
    "build_manifest",
    "part_record",
    "ExportCommit",
    "LocalCommit",
    "S3Commit",
    "remote_indexes",
    "open_commit",
]

# One task's result row (etl.writers.mds.task.RESULT_DDL) as a dict.
TaskResult = Mapping[str, Any]


@dataclass(frozen=True)
class ExportResult:
    path: str
    samples: int
    shards: int
    bytes: int
    checksum: str
    resumed_partitions: int = 0
    # The export in place already had this key: nothing was written or committed.
    unchanged: bool = False
    # Partitions an incremental export kept from the export in place, as they were.
    kept_partitions: int = 0

    @classmethod
    def from_manifest(cls, path: str, manifest: Mapping[str, Any], resumed: int,
                      unchanged: bool = False, kept: int = 0) -> ExportResult:
        return cls(
            path=path, samples=manifest["samples"], shards=manifest["shards"],
            bytes=manifest["bytes"], checksum=manifest["checksum"], resumed_partitions=resumed,
            unchanged=unchanged, kept_partitions=kept,
        )


def export_key(settings: Mapping[str, Any]) -> str:
    """A short, stable id of everything that determines an export's bytes."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def merge_indexes(parts: Iterable[tuple[str, Mapping[str, Any]]]) -> dict:
    """One index over partition indexes: the shards of each ``(prefix, index)`` in
    order, their file names (``basename``) taken relative to the prefix's folder."""
    shards = []
    for prefix, index in parts:
        for shard in index["shards"]:
            shard = copy.deepcopy(shard)
            for key in ("raw_data", "zip_data"):
                if shard.get(key):
                    shard[key]["basename"] = f"{prefix}/{shard[key]['basename']}"
            shards.append(shard)
    return {"version": 2, "shards": shards}


def merge_partition_indexes(export_dir: str, parts: list[str]) -> dict:
    """Root index over the shards of `parts` (sub-directories of `export_dir`)."""

    def load(part: str) -> dict:
        with open(os.path.join(export_dir, part, "index.json"), encoding="utf-8") as f:
            return json.load(f)

    return merge_indexes((part, load(part)) for part in sorted(parts))


def build_manifest(
    settings: Mapping[str, Any],
    key: str,
    results: Sequence[TaskResult],
    indexes: Mapping[str, Mapping[str, Any]],
    bucketed: bool,
    remote: bool = False,
) -> dict:
    """``manifest.json``: the settings, counts, bytes and checksums of a finished export
    whose root indexes (sub-folder -> index; "" without buckets) are `indexes`."""
    shards = [s for index in indexes.values() for s in index["shards"]]
    extra = {}
    if bucketed:
        extra["bucket_samples"] = {
            sub: sum(s["samples"] for s in index["shards"]) for sub, index in indexes.items()
        }
    return {
        **settings, **extra, "export_key": key,
        "samples": sum(s["samples"] for s in shards), "shards": len(shards),
        "bytes": sum((s.get("zip_data") or s["raw_data"])["bytes"] for s in shards),
        "checksum": hashlib.sha256("".join(r["checksum"] for r in results).encode()).hexdigest(),
        "part_checksums": [r["checksum"] for r in results],
        "part_ids": [r["partition"] for r in results],
        "parts": [part_record(r, key if remote else None) for r in results],
    }


def part_record(result: TaskResult, key: str | None) -> dict:
    """What the manifest keeps of a partition, so a later incremental export can keep
    it: id, samples, checksum, its folder (``dir``) and, on S3 (`key` given), the key
    prefix its files are under (the export key it was written with, and its attempt)."""
    out = {k: result[k] for k in ("partition", "samples", "checksum")}
    out["dir"] = result.get("dir") or f"part-{result['partition']:05d}"
    if key is not None:
        out["prefix"] = result.get("prefix") or "/".join(p for p in (key, result["dir"]) if p)
    return out


def _check_samples(indexes: Mapping[str, Mapping[str, Any]], results: Sequence[TaskResult]):
    samples = sum(s["samples"] for index in indexes.values() for s in index["shards"])
    if samples != sum(r["samples"] for r in results):
        raise RuntimeError(f"MDS index has {samples} samples, tasks reported otherwise")


class ExportCommit(ABC):
    """Where an export's tasks write, and how the driver turns what they reported into
    the export. `staging` is the local folder tasks write partitions into ("" when they
    upload), `remote` the ``s3://`` folder they upload to (None locally)."""

    staging: str
    remote: str | None

    def __init__(self, out_dir: str, key: str) -> None:
        self.out_dir = out_dir
        self.key = key

    def drop_leftovers(self) -> None:  # noqa: B027 -- a hook: most commits leave nothing
        """Remove what interrupted exports of other settings left (default: nothing;
        an object-store commit deletes stale objects as it commits)."""

    @abstractmethod
    def read_manifest(self) -> dict | None:
        """The manifest of the export now at `out_dir`, if there is a readable one."""

    @abstractmethod
    def prepare(self) -> None:
        """Make what the tasks need before they start."""

    @abstractmethod
    def commit(
        self, results: Sequence[TaskResult], settings: Mapping[str, Any], bucketed: bool,
        kept: Sequence[Mapping[str, Any]] = (),
    ) -> dict:
        """Make the partitions in `results` (sorted by partition), together with the
        partitions `kept` from the export now in place (its manifest's ``parts``
        records; an incremental export), the export; returns its manifest."""


class LocalCommit(ExportCommit):
    """A staging folder beside the export, swapped into place by rename."""

    remote = None

    def __init__(self, out_dir: str, key: str) -> None:
        super().__init__(out_dir, key)
        self.name = out_dir.rstrip("/").rsplit("/", 1)[-1]
        self.parent = os.path.dirname(os.path.abspath(out_dir))
        self.staging = os.path.join(self.parent, f".{self.name}.staging-{key}")

    def drop_leftovers(self) -> None:
        """Remove staging folders an interrupted export of other settings or another
        table version left beside this one (the run lock guarantees no other export is
        writing)."""
        for entry in os.listdir(self.parent) if os.path.isdir(self.parent) else ():
            if entry.startswith((f".{self.name}.staging-", f".{self.name}.old-")):
                shutil.rmtree(os.path.join(self.parent, entry), ignore_errors=True)

    def read_manifest(self) -> dict | None:
        try:
            with open(os.path.join(self.out_dir, "manifest.json"), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def prepare(self) -> None:
        os.makedirs(os.path.join(self.staging, "_attempts"), exist_ok=True)

    def commit(
        self, results: Sequence[TaskResult], settings: Mapping[str, Any], bucketed: bool,
        kept: Sequence[Mapping[str, Any]] = (),
    ) -> dict:
        shutil.rmtree(os.path.join(self.staging, "_attempts"), ignore_errors=True)
        subs = self._bucket_folders() if kept else []
        for record in kept:
            self._link_kept(f"part-{record['partition']:05d}", subs)
        results = sorted([*kept, *results], key=lambda r: r["partition"])
        parts = [f"part-{r['partition']:05d}" for r in results]
        if bucketed:
            indexes = self._merge_bucket_indexes(parts)
        else:
            indexes = {"": merge_partition_indexes(self.staging, parts)}
        _check_samples(indexes, results)
        for sub, index in indexes.items():
            with open(os.path.join(self.staging, sub, "index.json"), "w", encoding="utf-8") as f:
                json.dump(index, f, sort_keys=True)
        manifest = build_manifest(settings, self.key, results, indexes, bucketed)
        with open(os.path.join(self.staging, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
        fault_point("export:staged")
        self._swap()
        self.drop_leftovers()
        return manifest

    def _bucket_folders(self) -> list[str]:
        """The export in place's bucket folders (none without buckets), listed once for
        every partition a commit links."""
        return sorted(sub for sub in os.listdir(self.out_dir)
                      if not sub.startswith(("part-", "_", "."))
                      and os.path.isdir(os.path.join(self.out_dir, sub)))

    def _link_kept(self, part: str, subs: Sequence[str]) -> None:
        """Hard-link a partition of the export in place into staging (no data copied),
        with its bucket folders (``<bucket>/part-N``, `subs`: :meth:`_bucket_folders`)
        when the export has buckets. Idempotent: a folder already linked by an
        interrupted commit is left as is."""
        for sub in ["", *subs]:
            src = os.path.join(self.out_dir, sub, part)
            dst = os.path.join(self.staging, sub, part)
            if not os.path.isdir(src):
                continue
            if not os.path.exists(dst):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                tmp = dst + ".linking"
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.copytree(src, tmp, copy_function=os.link)
                os.replace(tmp, dst)

    def _merge_bucket_indexes(self, parts: list[str]) -> dict[str, dict]:
        """Move ``part-N/<bucket>`` to ``<bucket>/part-N`` and index each bucket.

        Idempotent, so a run that died half-way through it finishes it: a bucket folder
        already moved is left where it is (a rewritten partition replaces it)."""
        staging = self.staging
        for part in parts:
            for sub in os.listdir(os.path.join(staging, part)):
                src = os.path.join(staging, part, sub)
                if not os.path.isdir(src):
                    continue
                dst = os.path.join(staging, sub, part)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.rmtree(dst, ignore_errors=True)
                os.replace(src, dst)
        buckets = sorted(
            sub for sub in os.listdir(staging)
            if os.path.isdir(os.path.join(staging, sub)) and not sub.startswith(("part-", "_"))
        )
        return {
            b: merge_partition_indexes(
                os.path.join(staging, b),
                [p for p in parts if os.path.isdir(os.path.join(staging, b, p))],
            )
            for b in buckets
        }

    def _swap(self) -> None:
        """Staging into place; the previous export (if any) goes only once this is whole."""
        trash = os.path.join(self.parent, f".{self.name}.old-{self.key}")
        shutil.rmtree(trash, ignore_errors=True)
        if os.path.exists(self.out_dir):
            os.replace(self.out_dir, trash)
        os.replace(self.staging, self.out_dir)
        shutil.rmtree(trash, ignore_errors=True)


def remote_indexes(
    key: str, results: Sequence[TaskResult], bucketed: bool
) -> tuple[dict[str, dict], set[str]]:
    """The root indexes of an S3 export (sub-folder -> index) over the attempts in
    `results`, and the key prefixes of those attempts (everything to keep)."""
    by_sub: dict[str, list[tuple[str, dict]]] = {}
    keep: set[str] = set()
    for r in results:
        prefix = r.get("prefix") or "/".join(p for p in (key, r["dir"]) if p)
        keep.add(prefix + "/")  # the attempt's own files (its ids) beside bucket folders
        for sub, index in json.loads(r["indexes"]).items():
            keep.add("/".join(p for p in (sub, prefix) if p) + "/")
            by_sub.setdefault(sub, []).append((prefix, index))
    if not bucketed:
        by_sub.setdefault("", [])
    return {sub: merge_indexes(parts) for sub, parts in sorted(by_sub.items())}, keep


class S3Commit(ExportCommit):
    """Attempt folders left in place; indexes and manifest written last, then cleanup."""

    staging = ""

    def __init__(self, out_dir: str, key: str) -> None:
        super().__init__(out_dir, key)
        self.remote = out_dir.rstrip("/")
        self.store = S3Store(self.remote)

    def read_manifest(self) -> dict | None:
        return self.store.get_json("manifest.json")

    def prepare(self) -> None:
        pass  # tasks upload under their own attempt prefixes: nothing to make first

    def commit(
        self, results: Sequence[TaskResult], settings: Mapping[str, Any], bucketed: bool,
        kept: Sequence[Mapping[str, Any]] = (),
    ) -> dict:
        subs = settings.get("bucket_names") or [""]
        carried = [{**record, "indexes": json.dumps(self._part_indexes(record["prefix"], subs))}
                   for record in kept]
        results = sorted([*carried, *results], key=lambda r: r["partition"])
        indexes, keep = remote_indexes(self.key, results, bucketed)
        _check_samples(indexes, results)
        for sub, index in indexes.items():
            self.store.put_json(f"{sub}/index.json" if sub else "index.json", index)
        manifest = build_manifest(settings, self.key, results, indexes, bucketed, remote=True)
        self.store.put_json("manifest.json", manifest)
        tops = {"manifest.json", "index.json"} | {f"{sub}/index.json" for sub in indexes}
        stale = [
            k for k in self.store.list()
            if k not in tops
            and not k.startswith(state_prefix(self.key))
            and not any(k.startswith(p) for p in keep)
        ]
        self.store.delete(stale)
        return manifest

    def _part_indexes(self, prefix: str, subs: Sequence[str]) -> dict[str, dict]:
        """A kept partition's index.json per sub-folder (the buckets it has rows in)."""
        out = {}
        for sub in subs:
            index = self.store.get_json("/".join(p for p in (sub, prefix, "index.json") if p))
            if index is not None:
                out[sub] = index
        return out


def open_commit(out_dir: str, key: str) -> ExportCommit:
    """The commit for an export at `out_dir` (``s3://`` or a local path)."""
    return S3Commit(out_dir, key) if is_remote(out_dir) else LocalCommit(out_dir, key)
