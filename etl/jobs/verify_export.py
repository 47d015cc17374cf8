"""`lakeshard verify-export NAME`: check an MDS export end to end.

Reads the manifest and the root index, checks every shard's size and hashes and the
export checksum, decodes every image, compares sample counts with the manifest and
with the curated table (the version and predicate the manifest names), and reads a
shuffled sample through ``streaming.StreamingDataset`` with several DataLoader workers.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from etl.writers.mds import PART_META, part_checksum

__all__ = ["VerifyReport", "verify_export"]


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


def verify_export(path: str, *, loader_workers: int = 2, loader_samples: int = 64) -> VerifyReport:
    from streaming import StreamingDataset
    from streaming.base.hashing import get_hash
    from streaming.base.util import clean_stale_shared_memory

    report = VerifyReport(path)
    try:
        with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
        with open(os.path.join(path, "index.json"), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as exc:
        report.problems.append(f"cannot read manifest/index: {exc}")
        return report

    report.shards = len(index["shards"])
    report.samples = sum(s["samples"] for s in index["shards"])
    if report.samples != manifest["samples"]:
        report.problems.append(
            f"index has {report.samples} samples, manifest {manifest['samples']}"
        )
    for shard in index["shards"]:
        for key in ("raw_data", "zip_data"):
            info = shard.get(key)
            if not info:
                continue
            file = os.path.join(path, info["basename"])
            try:
                data = open(file, "rb").read()
            except OSError:
                report.problems.append(f"missing shard file {info['basename']}")
                continue
            if len(data) != info["bytes"]:
                report.problems.append(
                    f"{info['basename']}: {len(data)} bytes, index says {info['bytes']}"
                )
            for algo, expected in (info.get("hashes") or {}).items():
                if get_hash(algo, data) != expected:
                    report.problems.append(f"{info['basename']}: {algo} hash mismatch")

    parts = sorted(d for d in os.listdir(path) if d.startswith("part-"))
    part_sums = [part_checksum(os.path.join(path, p)) for p in parts]
    if part_sums != manifest.get("part_checksums"):
        report.problems.append("partition checksums differ from the manifest")
    checksum = hashlib.sha256("".join(part_sums).encode()).hexdigest()
    if checksum != manifest.get("checksum"):
        report.problems.append("export checksum differs from the manifest")
    for p in parts:
        if not os.path.exists(os.path.join(path, p, PART_META)):
            report.problems.append(f"{p}: no {PART_META}")

    table = manifest.get("table")
    if table:
        import lance

        try:
            ds = lance.dataset(table, version=manifest["table_version"])
            rows = ds.count_rows(filter=manifest.get("where"))
            # Non-canonical duplicates dedup marked are left out by the export.
            rows -= (manifest.get("dedup") or {}).get("excluded_duplicates", 0)
            if rows != report.samples:
                report.problems.append(
                    f"table {table} v{manifest['table_version']} has {rows} rows matching "
                    f"{manifest.get('where')!r}, export has {report.samples}"
                )
        except (ValueError, OSError) as exc:
            report.problems.append(f"cannot read table {table}: {exc}")

    clean_stale_shared_memory()
    dataset = StreamingDataset(local=path, shuffle=False, batch_size=1)
    for i in range(len(dataset)):
        try:
            image = dataset[i]["image"]
            image.load()
            if image.format != "JPEG":
                raise ValueError(f"format {image.format}")
            report.images_decoded += 1
        except Exception as exc:  # noqa: BLE001 -- every failure is reported, not raised
            report.problems.append(f"sample {i}: image does not decode: {exc}")
    del dataset

    import torch.utils.data

    clean_stale_shared_memory()
    shuffled = StreamingDataset(local=path, shuffle=True, shuffle_seed=1, batch_size=8)
    loader = torch.utils.data.DataLoader(
        shuffled, batch_size=8, num_workers=loader_workers, collate_fn=_identity,
        # pylance (imported above) is not fork-safe: start workers fresh, as training does.
        multiprocessing_context="spawn" if loader_workers else None,
    )
    for batch in loader:
        report.loader_samples += len(batch)
        if report.loader_samples >= loader_samples:
            break
    expected = min(loader_samples, report.samples)
    if report.loader_samples < expected:
        report.problems.append(
            f"DataLoader read {report.loader_samples} samples, expected at least {expected}"
        )
    return report
