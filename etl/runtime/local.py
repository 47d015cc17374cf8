"""Frames of local data, brought back to the driver without a Spark job.

A small night's rows live on the driver (read, fetched and prepared there) and reach
Spark as local data (``createDataFrame`` of an Arrow table). Spark's optimizer folds a
projection or filter of local data into local data, and ``collect()`` of such a plan
reads it on the driver; ``toArrow()`` always runs a job (1-2 s for the first in a cold
driver JVM, for a handful of rows). :func:`local_arrow` is ``toArrow()`` that collects
where the plan folded, and converts the rows to Arrow by the frame's own schema.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import types as T
from pyspark.sql.pandas.types import to_arrow_schema

from etl.config.bounds import LOCAL_COLLECT_ROWS

__all__ = ["is_local", "local_arrow", "local_frame", "projected", "per_batch"]

_LOCAL_SCANS = ("LocalTableScanExec", "LocalTableScan")


def is_local(df: DataFrame) -> bool:
    """Whether `df`'s physical plan is a scan of local data (``collect`` runs no job);
    False where the plan cannot be asked (a Spark Connect frame has no JVM handle)."""
    jdf = getattr(df, "_jdf", None)
    if jdf is None:
        return False
    plan = jdf.queryExecution().executedPlan()
    return plan.getClass().getSimpleName() in _LOCAL_SCANS


def local_arrow(df: DataFrame) -> pa.Table:
    """``df.toArrow()``: the same table, collected without a Spark job where the plan is
    local data (:func:`is_local`) of at most
    :data:`~etl.config.bounds.LOCAL_COLLECT_ROWS` rows; by
    ``toArrow`` otherwise."""
    if not is_local(df) or _local_rows(df) > LOCAL_COLLECT_ROWS:
        return df.toArrow()
    return _arrow(df.collect(), df.schema)


def _local_rows(df: DataFrame) -> int:
    """How many rows the local data `df` plans to (:func:`is_local`): the scan's own
    count, asked of the driver JVM (no job)."""
    return int(df._jdf.queryExecution().executedPlan().rows().size())


def local_frame(spark, rows: list, schema: T.StructType) -> DataFrame:
    """``spark.createDataFrame(rows, schema)`` as local data: Python rows (tuples, a
    struct as a tuple, Row or dict) handed over as an Arrow table, so that projections
    and filters of it fold into local data (``createDataFrame`` of a Python list makes
    an RDD, which every later action scans in a job)."""
    return spark.createDataFrame(_arrow(rows, schema), schema)


def projected(table: pa.Table, schema: T.StructType,
              computed: Mapping[str, pa.Array | pa.ChunkedArray]) -> pa.Table:
    """A projection of rows this process holds to `schema`, built here: the Arrow table
    (as Spark's ``toArrow`` types it) whose columns are `computed`'s where it names them,
    else `table`'s of the same name -- what a ``select`` over `table` as local data
    would collect, without planning a Spark query (a few tenths of a second each in a
    cold driver JVM)."""
    arrow = to_arrow_schema(schema)
    columns = []
    for f in arrow:
        values = computed[f.name] if f.name in computed else table.column(f.name)
        if isinstance(values, pa.Array):
            values = pa.chunked_array([values], values.type)
        columns.append(values if values.type == f.type else values.cast(f.type))
    return pa.Table.from_arrays(columns, schema=arrow)


def per_batch(rows: DataFrame | pa.Table, rule: Callable[[pa.Table], pa.Table],
              schema: T.StructType, columns: Sequence[str],
              fold: Callable[[pa.Table], pa.Table] | None = None) -> DataFrame | pa.Table:
    """A rule written once as an Arrow batch function (Arrow in, Arrow of `schema` out)
    run where `rows` are: on an Arrow table this process holds, here; on a DataFrame, in
    Spark's tasks through ``mapInArrow``, given only the `columns` the rule reads (of
    those the frame has). A row-by-row rule needs nothing more. An aggregating rule
    (partial counts per batch) gives a `fold` that combines a task's outputs into one
    table of the same schema, so what reaches the driver grows with the tasks, not the
    batches. `rule` and `fold` travel to the tasks by pickle: module functions or
    ``functools.partial`` of them."""
    if isinstance(rows, pa.Table):
        return rule(rows)
    have = set(rows.columns)
    return rows.select(*[c for c in columns if c in have]).mapInArrow(
        _BatchRule(rule, fold), schema)


class _BatchRule:
    """`rule` over each Arrow batch of a Spark task, its outputs folded into one table
    at the task's end when a `fold` is given (picklable: no closure)."""

    def __init__(self, rule: Callable[[pa.Table], pa.Table],
                 fold: Callable[[pa.Table], pa.Table] | None = None) -> None:
        self.rule = rule
        self.fold = fold

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        if self.fold is None:
            for batch in batches:
                yield from self.rule(pa.Table.from_batches([batch])).to_batches()
            return
        outputs = [self.rule(pa.Table.from_batches([batch])) for batch in batches]
        if outputs:
            yield from self.fold(pa.concat_tables(outputs)).to_batches()


def _arrow(rows: list, schema: T.StructType) -> pa.Table:
    """Python rows of `schema` as the Arrow table Spark's ``toArrow`` gives for it."""
    arrow = to_arrow_schema(schema)
    columns = [pa.array([_plain(r[i], f.dataType) for r in rows], arrow.field(i).type)
               for i, f in enumerate(schema.fields)]
    return pa.Table.from_arrays(columns, schema=arrow)


def _plain(value: Any, dtype: T.DataType) -> Any:
    """A collected value as Arrow takes it for `dtype`: a struct's Row as a dict, a map
    as pairs, and a timestamp -- which ``collect`` gives as a naive datetime in this
    process's local time -- as the aware UTC instant it is."""
    if value is None:
        return None
    if isinstance(dtype, T.StructType):
        if isinstance(value, dict):
            return {f.name: _plain(value.get(f.name), f.dataType) for f in dtype.fields}
        return {f.name: _plain(value[i], f.dataType) for i, f in enumerate(dtype.fields)}
    if isinstance(dtype, T.ArrayType):
        return [_plain(v, dtype.elementType) for v in value]
    if isinstance(dtype, T.MapType):
        return [(_plain(k, dtype.keyType), _plain(v, dtype.valueType))
                for k, v in value.items()]
    if isinstance(dtype, T.TimestampType):
        return value.astimezone(dt.UTC)
    if isinstance(dtype, T.BinaryType):
        return bytes(value)
    return value
