"""The fetch + prepare step as Spark's tasks run it: one ``mapInArrow`` function per task,
in one Python worker, that fetches and prepares each Arrow batch of rows (the UDF body of
:mod:`udfs.ingest`) and, given a :class:`RowSink`, writes the rows it accepts where it
made them.

With a sink, an accepted row's JPEG never leaves the worker: the task builds the row the
table stores (:func:`etl.transforms.prepare.curated_columns`, here in Arrow) and hands
its rows to the sink's ``write`` (a Lance fragment writer: the caller's, this module
knows no table), and every row goes on without its image, with ``_written`` (whether it
was written) and, on the task's last row, what the sink returned (:data:`WRITTEN`). A
row is accepted when Spark's outcome columns will say ``ok``: prepared ``ok``, its source
bytes' and its JPEG's sha256 not named by a takedown (the sink's ``refused`` hashes).
The caller checks that ``_written`` agrees with the final ``status`` on every row, so
the two can never drift apart unnoticed.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from udfs.arrow_types import nullable_type
from udfs.images import PREPARED_TYPE
from udfs.ingest import FETCH_PREPARE_ARROW, FETCH_PREPARE_TYPE, fetch_prepare_batches

__all__ = ["ARGS", "FP_TYPE", "WRITTEN", "FLAG", "RowSink", "batch_args", "fp_struct",
           "stored_batch", "task_function"]

# What Spark computes for the batch function before the task: whether the row is
# processed, and the reference to fetch (null where the row carries its bytes or is not
# processed). The rest of its arguments are the row's own columns (batch_args).
ARGS = ("_fp_process", "_fp_ref")
# The result's type: nullable throughout (udfs/arrow_types.py), null where the row was
# not processed.
FP_TYPE = nullable_type(FETCH_PREPARE_TYPE)
# With a sink: whether the row was written (every row), and what the sink returned for
# the task's rows (on its last row; null elsewhere).
FLAG = "_written"
WRITTEN = "_sink_written"


@dataclass(frozen=True)
class RowSink:
    """Where each task writes the rows it accepts.

    `write` takes the task's rows (Arrow batches of `schema`; called once per task that
    accepts a row) and returns strings for the driver to commit them by. `schema`: the
    stored rows' columns, each one of the row's own (passed through), of the prepared
    image (:data:`~udfs.images.PREPARED_TYPE`) or ``image_size_bytes`` / ``run_id`` /
    ``ingested_at``. `ingested_at_us`: microseconds since the epoch, as Spark stores the
    run's timestamp literal. `refused`: a broadcast frozenset of the takedowns' sha256
    values (or None: none)."""

    write: Callable[[Iterator[pa.RecordBatch]], list[str]]
    schema: pa.Schema
    run_id: str
    ingested_at_us: int
    refused: object = None

    def hashes(self) -> frozenset[str]:
        return frozenset() if self.refused is None else self.refused.value


def batch_args(batch: pa.RecordBatch | pa.Table) -> tuple[pa.Array, ...]:
    """The batch function's arguments (process, source, ref, offset, length, image) of
    rows with the :data:`ARGS` columns: the image bytes only where processed, each
    crossing from the JVM once."""
    process = batch.column(ARGS[0])
    image = pc.if_else(pc.fill_null(process, False), batch.column("image_bytes"),
                       pa.nulls(len(process), batch.schema.field("image_bytes").type))
    return (process, batch.column("source"), batch.column(ARGS[1]),
            batch.column("image_offset"), batch.column("image_length"), image)


def fp_struct(batches: Sequence[pa.RecordBatch], processed: pa.Array) -> pa.StructArray:
    """The batch function's results (one record batch per input batch, in order) as one
    struct array of :data:`FP_TYPE`, null where `processed` is not true."""
    if len(batches) == 1:  # a task's batch: its arrays as they are (no copy of the JPEGs)
        arrays = batches[0].columns
    else:
        table = pa.Table.from_batches(batches, schema=FETCH_PREPARE_ARROW)
        arrays = [column.combine_chunks() for column in table.columns]
    return pa.StructArray.from_arrays(arrays, fields=list(FETCH_PREPARE_ARROW),
                                      mask=pc.invert(processed.fill_null(False)))


def _accepted(fp: pa.StructArray, refused: pa.Array | None) -> pa.BooleanArray:
    ok = pc.fill_null(pc.equal(fp.field("status"), "ok"), False)
    if refused is not None:
        for name in ("original_sha256", "image_sha256"):
            ok = pc.and_(ok, pc.invert(pc.is_in(fp.field(name), value_set=refused)))
    return ok


def _stored_rows(batch: pa.RecordBatch, fp: pa.StructArray, accepted: pa.BooleanArray,
                 sink: RowSink) -> pa.RecordBatch:
    """The rows to store of the accepted ones (:func:`stored_batch`)."""
    idx = pc.indices_nonzero(accepted)
    # The prepared fields are this batch's own arrays: all of them accepted, they are
    # stored as they are (no copy of the JPEGs).
    every = len(idx) == len(accepted)
    prepared = {name: fp.field(name) if every else fp.field(name).take(idx)
                for name in PREPARED_TYPE.fieldNames()}
    return stored_batch(batch, idx, prepared, sink.schema, sink.run_id, sink.ingested_at_us)


def stored_batch(rows: pa.RecordBatch | pa.Table, idx: pa.Array, prepared: Mapping[str, pa.Array],
                 schema: pa.Schema, run_id: str, ingested_at_us: int) -> pa.RecordBatch:
    """The curated table's rows of the rows `idx` of `rows`, whose prepared images'
    fields (:data:`~udfs.images.PREPARED_TYPE`) are `prepared` (already those rows'):
    `schema`'s columns, as :func:`etl.transforms.prepare.curated_columns` computes them
    in Spark. The row's own columns are taken (copied): they may be slices of the whole
    input batch as Spark sent it, which must not stay alive with them."""
    n = len(idx)
    computed = {
        "image_size_bytes": pc.binary_length(prepared["image"]).cast(pa.int64()),
        "run_id": pa.array([run_id] * n, pa.string()),
        "ingested_at": pa.array([ingested_at_us] * n, pa.int64()).cast(
            pa.timestamp("us", tz="UTC")),
    }
    arrays = []
    for field in schema:
        if field.name in computed:
            values = computed[field.name]
        elif field.name in prepared:
            values = prepared[field.name]
        else:
            values = rows.column(field.name).take(idx)
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        arrays.append(values if values.type == field.type else values.cast(field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def task_function(fetch, rules: Mapping, opts, sink: RowSink | None, out: pa.Schema):
    """The ``mapInArrow`` function: rows with the :data:`ARGS` columns -> the same rows
    without them, ``image_bytes`` null where processed (the bytes are in the result), and
    ``_fp`` (:data:`FP_TYPE`); with `sink`, ``_fp.image`` null and :data:`FLAG`,
    :data:`WRITTEN` added. `out`: that schema (Spark's declared one)."""
    keep = [f.name for f in out if f.name not in ("_fp", FLAG, WRITTEN)]

    def results(batches: Iterator[pa.RecordBatch]):
        pending: deque[pa.RecordBatch] = deque()

        def inputs():
            for batch in batches:
                pending.append(batch)
                yield batch_args(batch)

        for result in fetch_prepare_batches(inputs(), fetch, rules, opts):
            batch = pending.popleft()  # one result per batch, in order
            yield batch, fp_struct([result], batch.column(ARGS[0]))

    def columns(batch: pa.RecordBatch) -> list[pa.Array]:
        processed = batch.column(ARGS[0]).fill_null(False)
        cols = []
        for name in keep:
            values = batch.column(name)
            if name == "image_bytes":  # carried into the result: not sent back
                values = pc.if_else(processed, pa.nulls(len(values), values.type), values)
            cols.append(values)
        return cols

    def plain(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch, fp in results(batches):
            yield _batch([*columns(batch), fp], out)

    def writing(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        hashes = sink.hashes()
        refused = pa.array(sorted(hashes), pa.string()) if hashes else None
        # What goes on, kept until the task's rows are written: copies, so that no input
        # batch (and the image bytes in it) stays alive with them.
        done: list[tuple[list, pa.Array, pa.Array]] = []
        failed: list[BaseException] = []

        def stored():
            try:
                for batch, fp in results(batches):
                    accepted = _accepted(fp, refused)
                    done.append(([pa.concat_arrays([c]) for c in columns(batch)],
                                 _without_image(fp), accepted))
                    if accepted.true_count:
                        yield _stored_rows(batch, fp, accepted, sink)
            except BaseException as exc:  # raised through the writer: kept as it was
                failed.append(exc)
                raise

        rows = stored()
        first = next(rows, None)  # a task that accepts no row writes nothing
        try:
            written = sink.write(itertools.chain([first], rows)) if first is not None else []
        except Exception:
            if failed:  # our own failure, not the write's
                raise failed[0] from None
            raise
        last = max((k for k, d in enumerate(done) if len(d[2])), default=None)
        for k, (cols, fp, accepted) in enumerate(done):
            listed = [None] * len(accepted)
            if k == last and written:
                listed[-1] = written
            yield _batch([*cols, fp, accepted, pa.array(listed, pa.list_(pa.string()))], out)

    return plain if sink is None else writing


def _without_image(fp: pa.StructArray) -> pa.StructArray:
    fields = list(fp.type)
    arrays = [fp.field(f.name) if f.name != "image" else pa.nulls(len(fp), f.type)
              for f in fields]
    return pa.StructArray.from_arrays(arrays, fields=fields, mask=fp.is_null())


def _batch(arrays: list[pa.Array], schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [a if a.type == f.type else a.cast(f.type) for a, f in zip(arrays, schema,
                                                                    strict=True)],
        schema=schema)
