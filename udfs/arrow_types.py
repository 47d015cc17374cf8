"""The Spark types a Python UDF may declare for the Arrow batches it returns.

pyspark 4.0 builds a pandas UDF's result arrays (struct fields, list elements) as
nullable whatever the declared type says, and Spark 4.0 compares the batch's schema
with the declared one *including nullability* (``Invalid schema from arrow-enabled
Python UDTF: expected ... status StringType false ... got ... true``); Spark 4.1
compares types only. A UDF that declares its result nullable throughout is therefore
accepted by both. Non-null guarantees live where they are enforced: the table schemas
(:mod:`etl.schema`) the jobs cast into and the writers that check them.
"""

from __future__ import annotations

from pyspark.sql import types as T

__all__ = ["nullable_type"]


def nullable_type(dtype: T.DataType) -> T.DataType:
    """`dtype` with every struct field, array element and map value nullable (a new
    type; `dtype` is not changed)."""
    if isinstance(dtype, T.StructType):
        return T.StructType([
            T.StructField(f.name, nullable_type(f.dataType), True, f.metadata)
            for f in dtype.fields
        ])
    if isinstance(dtype, T.ArrayType):
        return T.ArrayType(nullable_type(dtype.elementType), True)
    if isinstance(dtype, T.MapType):
        return T.MapType(nullable_type(dtype.keyType), nullable_type(dtype.valueType), True)
    return dtype
