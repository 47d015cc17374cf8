"""VLM re-captioning inside Spark tasks: rows by Lance row address in, caption rows out.

:func:`caption_mapper` builds the ``mapInArrow`` function of the caption stage. Its input
rows carry only their keys and their Lance row address; the task takes the image bytes
from the pinned table version itself, a window of rows at a time (the next window's
take runs while the current one generates), so image bytes never pass through the JVM
and the stage's Python work is this one function. Run it inside
:func:`udfs.worker.python_worker_pool`: then the stage's workers form a pool of their
own, one per task slot, and each loads the model once (:func:`udfs.captioner.get_captioner`,
a cache in an importable module) and keeps it for every later task of its slot.

Per row the output (:func:`output_schema`) is the caption, a ``status`` from
:data:`STATUSES` and an ``error``, caption-check ``flags``, generated tokens, the
row's image tokens and the padding its batch added, and where it ran: worker (host:pid),
executor (host:pid of the pool's Python daemon), device, task attempt, the model loads
that task did, and the worker-local number of its generate() call. The job reports loads
per worker and per executor and the padding share from these.

Generation itself -- decode, size-grouped batches, backends, OOM halving, per-row
errors -- is :mod:`udfs.captioner`, which imports no Spark.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator

import pyarrow as pa

from udfs.captioner import (
    BACKENDS,
    CHECK_FLAGS,
    STATUSES,
    Captioned,
    Captioner,
    CaptionSpec,
    Generated,
    TransformersCaptioner,
    VLLMCaptioner,
    caption_flags,
    caption_images,
    get_captioner,
    load_image,
    model_loads,
)

__all__ = [
    "BACKENDS",
    "STATUSES",
    "CHECK_FLAGS",
    "CaptionSpec",
    "Captioned",
    "Generated",
    "Captioner",
    "TransformersCaptioner",
    "VLLMCaptioner",
    "get_captioner",
    "model_loads",
    "load_image",
    "caption_flags",
    "caption_images",
    "window_rows",
    "output_schema",
    "caption_mapper",
]

# Per-row values, then where and how the row was captioned (the job's statistics).
_VALUES = [
    ("caption", pa.string()), ("status", pa.string()), ("error", pa.string()),
    ("flags", pa.string()), ("tokens", pa.int32()), ("image_tokens", pa.int32()),
    ("padding", pa.int32()),
]
_WHERE = [
    ("worker", pa.string()), ("executor", pa.string()), ("device", pa.string()),
    ("task", pa.int64()), ("model_loads", pa.int32()), ("batch", pa.int64()),
]


def window_rows(spec: CaptionSpec) -> int:
    """Rows taken from Lance and grouped by size together: 8 batches' worth (64-1024).

    Larger windows group sizes better; a window holds its encoded images in memory
    (~200 kB each for curated JPEGs) plus two decoded batches."""
    return max(64, min(1024, 8 * spec.settings.batch_size))


def output_schema(keys: pa.Schema) -> pa.Schema:
    """The mapper's output: `keys` (passed through), then the caption values and stats."""
    return pa.schema([*keys, *_VALUES, *_WHERE])


def _windows(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.Table]:
    """Regroup Arrow batches into tables of `rows` rows (the last one shorter)."""
    pending: list[pa.RecordBatch] = []
    count = 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        pending.append(batch)
        count += batch.num_rows
        while count >= rows:
            table = pa.Table.from_batches(pending)
            yield table.slice(0, rows)
            rest = table.slice(rows)
            pending, count = rest.to_batches(), rest.num_rows
    if count:
        yield pa.Table.from_batches(pending)


def _take_images(ds, window: pa.Table, row_address: str, image_column: str) -> list:
    """The window's image bytes, in its row order, taken from Lance by row address."""
    import numpy as np

    addrs = window.column(row_address).to_numpy()
    order = np.argsort(addrs, kind="stable")  # ascending addresses: sequential reads
    taken = ds._take_rows(addrs[order].tolist(), columns=[image_column])
    if taken.num_rows != len(addrs):
        raise RuntimeError(
            f"took {taken.num_rows} rows from {ds.uri} for {len(addrs)} row addresses"
        )
    images = taken.column(image_column).to_pylist()
    out: list = [None] * len(addrs)
    for pos, i in enumerate(order.tolist()):
        out[i] = images[pos]
    return out


def caption_mapper(
    spec: CaptionSpec, table_path: str, table_version: int, *, keys: list[str],
    row_address: str, image_column: str = "image", window: int | None = None,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function: rows with `keys` and `row_address` (of the Lance
    table at `table_path`, version `table_version`) -> :func:`output_schema` rows."""
    rows = window or window_rows(spec)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from concurrent.futures import ThreadPoolExecutor

        import lance
        from pyspark import TaskContext

        from udfs.console import show_once

        show_once("transformers")  # its notices once per executor, not once per worker
        ctx = TaskContext.get()
        task = ctx.taskAttemptId() if ctx is not None else -1
        host = socket.gethostname()
        worker, executor = f"{host}:{os.getpid()}", f"{host}:{os.getppid()}"
        loads_before = model_loads()
        ds = lance.dataset(table_path, version=table_version)

        def caption_window(window: pa.Table, images: list) -> pa.RecordBatch:
            res = caption_images(spec, images)
            n = window.num_rows
            values = {
                "caption": res.caption, "status": res.status, "error": res.error,
                "flags": res.flags, "tokens": res.tokens, "image_tokens": res.image_tokens,
                "padding": res.padding,
                "worker": [worker] * n, "executor": [executor] * n,
                "device": [res.device] * n, "task": [task] * n,
                "model_loads": [model_loads() - loads_before] * n, "batch": res.batch,
            }
            arrays = [window.column(k).combine_chunks() for k in keys]
            arrays += [pa.array(values[name], t) for name, t in [*_VALUES, *_WHERE]]
            schema = output_schema(pa.schema([window.schema.field(k) for k in keys]))
            return pa.RecordBatch.from_arrays(arrays, schema=schema)

        with ThreadPoolExecutor(1, thread_name_prefix="caption-take") as pool:
            pending = None
            for window in _windows(batches, rows):
                # Take the next window's bytes while the current one generates.
                taking = pool.submit(_take_images, ds, window, row_address, image_column)
                if pending is not None:
                    yield caption_window(pending[0], pending[1].result())
                pending = (window, taking)
            if pending is not None:
                yield caption_window(pending[0], pending[1].result())

    return run
