"""The MDS writer a task writes one partition (or one bucket of it) with.

A subclass of streaming's ``MDSWriter`` that takes samples already encoded by
:func:`etl.writers.mds.codec.encode_batch` (``jpeg`` columns as the stored JPEG bytes),
records the sha256 of every file it stores (the partition checksum, without reading
the files back) and writes uncompressed shards straight from its cached samples. Its
files and ``index.json`` are byte-for-byte those of a stock ``MDSWriter`` given the
same samples.

It overrides ``MDSWriter`` internals (``flush_shard``, ``_process_file``), so it is
tied to the streaming release pinned in ``constraints.txt``. Importing this module
imports ``streaming`` (and torch): only the writing tasks do.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np
from streaming.base.format.mds.writer import MDSWriter

__all__ = ["PassThroughMDSWriter"]


class PassThroughMDSWriter(MDSWriter):
    """``MDSWriter`` for pre-encoded samples (:meth:`write_encoded`), with file digests."""

    file_digests: dict[str, str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.file_digests = {}
        super().__init__(*args, **kwargs)

    def _process_file(self, raw_data, raw_basename, zip_basename):
        # Hash the stored file before it is uploaded (and, remotely, deleted).
        infos = super()._process_file(raw_data, raw_basename, zip_basename)
        if zip_basename is None:
            self.file_digests[raw_basename] = hashlib.sha256(raw_data).hexdigest()
        else:
            with open(os.path.join(self.local, zip_basename), "rb") as f:
                self.file_digests[zip_basename] = hashlib.sha256(f.read()).hexdigest()
        return infos

    def flush_shard(self) -> None:
        """The stock flush joins the cached samples into one shard in memory twice
        over, writes it, and (for our checksum) the file was read back to hash it.
        Uncompressed and without MDS hashes, the same bytes go straight from the
        cached samples to the file, hashed on the way: no shard-sized copy at all.
        """
        if self.compression or self.hashes:  # both need the whole shard in memory
            return super().flush_shard()
        basename, _ = self._name_next_shard()
        samples = self.new_samples
        offsets = np.array([0] + [len(x) for x in samples]).cumsum().astype(np.uint32)
        offsets += 4 + offsets.nbytes + len(self.config_data)  # as encode_joint_shard
        header = np.uint32(len(samples)).tobytes() + offsets.tobytes() + self.config_data
        digest = hashlib.sha256(header)
        with open(os.path.join(self.local, basename), "wb") as f:
            f.write(header)
            for x in samples:  # large buffers bypass the file's buffer: no copy
                digest.update(x)
                f.write(x)
        self.file_digests[basename] = digest.hexdigest()
        raw_info = {"basename": basename, "bytes": int(offsets[-1]), "hashes": {}}
        self.shards.append({"samples": len(samples), "raw_data": raw_info,
                            "zip_data": None, **self.get_config()})
        future = self.executor.submit(self.cloud_writer.upload_file, basename)
        future.add_done_callback(self.exception_callback)

    def flush_cached(self) -> None:
        """Write the cached samples as a shard now (bounds the memory of many writers)."""
        self.flush_shard()
        self._reset_cache()

    def write_encoded(self, data: bytes) -> None:
        """``write`` for a sample already encoded by ``encode_batch``."""
        if self.event.is_set():
            self.cancel_future_jobs()
            raise RuntimeError("an MDS upload thread failed; see the earlier traceback")
        size = len(data) + self.extra_bytes_per_sample
        if self.size_limit and self.size_limit < self.new_shard_size + size:
            self.flush_cached()
        self.new_samples.append(data)
        self.new_shard_size += size

    def index(self) -> dict:
        """The index.json this writer writes (call after `finish`)."""
        return {"version": 2, "shards": self.shards}

    def digests(self) -> dict[str, str]:
        """sha256 of every file written (call after `finish`), index.json included."""
        index = json.dumps(self.index(), sort_keys=True).encode()
        return {**self.file_digests, "index.json": hashlib.sha256(index).hexdigest()}
