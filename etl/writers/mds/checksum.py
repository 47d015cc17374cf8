"""Partition checksums: the one a writing task computes from its files' digests as it
writes them, and the same one recomputed from a partition folder on disk.

A partition's checksum is the sha256 of its files' sorted ``relative path, sha256``
lines; the export's checksum (in ``manifest.json``) chains the partitions' checksums.
Kept apart from the writer so that verifying an export does not import
``streaming`` (and with it torch).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

__all__ = ["PART_META", "PART_IDS", "NOT_CHECKSUMMED", "combine_digests", "part_checksum"]

# A finished local partition's record (samples, checksum, indexes); not checksummed.
PART_META = "_part.json"
# A partition's sample ids and row fingerprints (parquet), what the next export diffs
# against to write only what changed; not checksummed (not part of the MDS data).
PART_IDS = "ids.parquet"  # no leading "_": Spark skips such files
NOT_CHECKSUMMED = frozenset({PART_META, PART_IDS})


def combine_digests(digests: Mapping[str, str]) -> str:
    """A partition's checksum from its files' sha256 digests (relative path -> hex)."""
    lines = "".join(f"{rel}\0{digests[rel]}\n" for rel in sorted(digests))
    return hashlib.sha256(lines.encode()).hexdigest()


def part_checksum(part_dir: str) -> str:
    """Checksum of a partition folder's index and shard files (all levels): equal to
    what the writing task computed as it wrote them (:func:`combine_digests`)."""
    digests = {}
    for dirpath, _, files in os.walk(part_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), part_dir)
            if rel in NOT_CHECKSUMMED:
                continue
            digest = hashlib.sha256()
            with open(os.path.join(part_dir, rel), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            digests[rel] = digest.hexdigest()
    return combine_digests(digests)
