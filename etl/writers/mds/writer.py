"""The MDS writer a task (or the driver) writes one partition, or one bucket of it, with.

:class:`PassThroughMDSWriter` writes streaming's MDS format (version 2): shard files
``shard.NNNNN.mds`` (and ``.mds.<ext>`` compressed) and an ``index.json``, byte for
byte what a stock ``streaming.MDSWriter`` writes given the same samples (the test
suite checks it against the stock writer, with and without compression and hashes).
It takes samples already encoded by :func:`etl.writers.mds.codec.encode_batch` (``jpeg``
columns as the stored JPEG bytes), writes an uncompressed shard straight from its cached
samples (no shard-sized copy), records the sha256 of every file it stores (the
partition's checksum, without reading files back), and uploads through lakeshard's own
:class:`~etl.writers.remote.S3Store`.

Why not a subclass of the stock writer: importing ``streaming.MDSWriter`` imports torch
(``streaming.base.util`` imports ``torch.distributed``), ~2-3.5 s of one core in a fresh
process -- paid by each writing task's Python worker and, for an export the driver
writes, by the driver while it prepares the night's images. This module imports only
streaming's torch-free modules: the sample encodings' sizes
(``streaming.base.format.mds.encodings``), compression and hashing, under the bare
packages of :func:`etl.writers.mds.lean.lean_streaming`, which it registers first
(importing it is the warm-up, :func:`etl.writers.mds.task.warm_writer`). The format is
the stock writer's; the ``constraints.txt`` pin of mosaicml-streaming is the release it
is checked against.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from etl.writers.mds.lean import lean_streaming

lean_streaming()  # streaming's packages bare: their __init__ would import torch
from streaming.base.compression import (  # noqa: E402
    compress,
    get_compression_extension,
    is_compression,
)
from streaming.base.format.mds.encodings import (  # noqa: E402
    get_mds_encoded_size,
    get_mds_encodings,
    is_mds_encoding,
)
from streaming.base.hashing import get_hash, is_hash  # noqa: E402

__all__ = ["PassThroughMDSWriter", "INDEX"]

INDEX = "index.json"  # streaming's get_index_basename()
_UPLOAD_THREADS = 4


class PassThroughMDSWriter:
    """Writes pre-encoded MDS samples (:meth:`write_encoded`) into `local`, a folder it
    empties first, as shards of at most `size_limit` bytes; with `upload` (a function of
    a file's name and local path, e.g. an S3 upload under the attempt's prefix) every file
    is uploaded once written, then deleted, and the local folder is removed at
    :meth:`finish` (or on an exception).

    `columns` and `compression` / `hashes` are the stock writer's (names of streaming's
    encodings, compression and hash algorithms): the same shard header, index and file
    names."""

    format = "mds"
    extra_bytes_per_sample = 4  # the sample's offset in the shard header

    def __init__(self, *, local: str, columns: Mapping[str, str], size_limit: int | None,
                 compression: str | None = None, hashes: list[str] | tuple[str, ...] = (),
                 upload: Callable[[str, str], None] | None = None) -> None:
        compression = compression or None
        if compression and not is_compression(compression):
            raise ValueError(f"Invalid compression: {compression}.")
        hashes = list(hashes or [])
        if hashes != sorted(hashes):  # as the stock writer checks them
            raise ValueError("Hashes must be unique and in sorted order.")
        for algo in hashes:
            if not is_hash(algo):
                raise ValueError(f"Invalid hash: {algo}.")
        if size_limit is not None and not 0 <= size_limit < 2 ** 32:
            raise ValueError(f"size_limit must be in [0, 2**32), got {size_limit}")
        self.local = local
        self.compression = compression
        self.hashes = hashes
        self.size_limit = size_limit or None
        self.column_names = sorted(columns)
        for name in self.column_names:
            if not is_mds_encoding(columns[name]):
                raise TypeError(f"column {name!r}: encoding {columns[name]!r} is not one of "
                                f"MDS's {get_mds_encodings()}")
        self.column_encodings = [columns[n] for n in self.column_names]
        self.column_sizes = [get_mds_encoded_size(e) for e in self.column_encodings]
        self.config_data = json.dumps(self.get_config(), sort_keys=True).encode("utf-8")
        self.extra_bytes_per_shard = 4 + 4 + len(self.config_data)
        self.shards: list[dict] = []
        self.file_digests: dict[str, str] = {}
        self.upload = upload
        self._uploads: list[Future] = []
        self._failed = threading.Event()  # set by the first upload that fails
        self._executor = ThreadPoolExecutor(_UPLOAD_THREADS) if upload else None
        if os.path.exists(local):
            shutil.rmtree(local)
        os.makedirs(local)
        self._reset_cache()

    def get_config(self) -> dict[str, Any]:
        """The shard-writing configuration, as the stock writer records it in every
        shard's header and index entry."""
        return {"version": 2, "format": self.format, "compression": self.compression,
                "hashes": self.hashes, "size_limit": self.size_limit,
                "column_names": self.column_names, "column_encodings": self.column_encodings,
                "column_sizes": self.column_sizes}

    def _reset_cache(self) -> None:
        self.new_samples: list[bytes] = []
        self.new_shard_size = self.extra_bytes_per_shard

    def write_encoded(self, data: bytes) -> None:
        """Cache one sample encoded by ``encode_batch``; flushes a shard first when the
        sample would take the cached one past `size_limit` (as the stock ``write``)."""
        self._raise_failed_upload()
        size = len(data) + self.extra_bytes_per_sample
        if self.size_limit and self.size_limit < self.new_shard_size + size:
            self.flush_cached()
        self.new_samples.append(data)
        self.new_shard_size += size

    def flush_cached(self) -> None:
        """Write the cached samples as a shard now (bounds the memory of many writers)."""
        self.flush_shard()
        self._reset_cache()

    def _header(self) -> bytes:
        samples = self.new_samples
        offsets = np.array([0] + [len(x) for x in samples]).cumsum().astype(np.uint32)
        offsets += 4 + offsets.nbytes + len(self.config_data)
        return np.uint32(len(samples)).tobytes() + offsets.tobytes() + self.config_data

    def flush_shard(self) -> None:
        """Write the cached samples as the next shard file: uncompressed and without
        MDS hashes straight from the cached samples, hashed on the way; else joined,
        hashed and compressed as the stock writer does."""
        raw_name = f"shard.{len(self.shards):05}.{self.format}"
        header = self._header()
        if not self.compression and not self.hashes:
            digest = hashlib.sha256(header)
            with open(os.path.join(self.local, raw_name), "wb") as f:
                f.write(header)
                for x in self.new_samples:  # large buffers bypass the file's buffer
                    digest.update(x)
                    f.write(x)
            raw_info = {"basename": raw_name, "bytes": int(len(header) + sum(
                len(x) for x in self.new_samples)), "hashes": {}}
            self._stored(raw_name, digest.hexdigest())
            zip_info = None
        else:
            raw_info, zip_info = self._joint_shard(raw_name, header)
        self.shards.append({"samples": len(self.new_samples), "raw_data": raw_info,
                            "zip_data": zip_info, **self.get_config()})

    def _joint_shard(self, raw_name: str, header: bytes) -> tuple[dict, dict | None]:
        raw = header + b"".join(self.new_samples)
        raw_info = self._file_info(raw, raw_name)
        if not self.compression:
            data, name, zip_info = raw, raw_name, None
        else:
            name = f"{raw_name}.{get_compression_extension(self.compression)}"
            data = compress(self.compression, raw)
            zip_info = self._file_info(data, name)
        with open(os.path.join(self.local, name), "wb") as f:
            f.write(data)
        self._stored(name, hashlib.sha256(data).hexdigest())
        return raw_info, zip_info

    def _file_info(self, data: bytes, name: str) -> dict:
        return {"basename": name, "bytes": len(data),
                "hashes": {algo: get_hash(algo, data) for algo in self.hashes}}

    def _stored(self, name: str, digest: str) -> None:
        """Record a written file's digest; with `upload`, queue its upload (from the
        file: no shard is held in memory for it)."""
        self.file_digests[name] = digest
        if self._executor is not None:
            future = self._executor.submit(self._upload_file, name)
            future.add_done_callback(self._note_failure)
            self._uploads.append(future)

    def _upload_file(self, name: str) -> None:
        path = os.path.join(self.local, name)
        self.upload(name, path)
        os.remove(path)  # a worker's disk holds what is not uploaded yet

    def _note_failure(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            self._failed.set()

    def _raise_failed_upload(self) -> None:
        if not self._failed.is_set():
            return
        for future in self._uploads:
            if future.done() and not future.cancelled() and future.exception() is not None:
                raise RuntimeError(f"an MDS upload failed: {future.exception()}") \
                    from future.exception()

    def index(self) -> dict:
        """The index.json this writer writes (call after `finish`)."""
        return {"version": 2, "shards": self.shards}

    def digests(self) -> dict[str, str]:
        """sha256 of every file written (call after `finish`), index.json included."""
        return dict(self.file_digests)

    def finish(self) -> None:
        """Flush the last shard, write index.json; with `upload`, wait for every
        upload (raising the first that failed) and remove the local folder, also when
        one failed."""
        if self.new_samples:
            self.flush_cached()
        text = json.dumps(self.index(), sort_keys=True)
        with open(os.path.join(self.local, INDEX), "w") as f:
            f.write(text)
        self._stored(INDEX, hashlib.sha256(text.encode()).hexdigest())
        if self._executor is None:
            return
        try:
            for future in self._uploads:
                future.result()
        finally:
            self._close()

    def _close(self) -> None:
        """Uploads not started are cancelled, those running waited for; the local
        folder (a scratch copy of what was uploaded) removed."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.local, ignore_errors=True)

    def __enter__(self) -> PassThroughMDSWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        elif self._executor is not None:
            self._close()
