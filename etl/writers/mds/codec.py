"""MDS sample encoding: which MDS encoding a Spark column gets, and Arrow batches encoded
into sample bytes.

:func:`encode_batch` turns a whole Arrow batch into MDS samples straight from the Arrow
buffers instead of row by row through Python objects; its output is byte-for-byte what
``MDSWriter.encode_sample`` produces, except that `jpeg` columns take the stored JPEG
bytes as they are (the stock encoding takes a PIL image and re-encodes it: lossy and
slow; reading `jpeg` back is just ``Image.open`` of those bytes).
"""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa
from pyspark.sql import types as T

__all__ = ["mds_encoding", "encode_batch"]

_ENCODINGS = {
    T.StringType: "str",
    T.IntegerType: "int32",
    T.LongType: "int64",
    T.ShortType: "int16",
    T.FloatType: "float32",
    T.DoubleType: "float64",
}

_FIXED_NUMPY = {
    "int8": "<i1", "int16": "<i2", "int32": "<i4", "int64": "<i8",
    "uint8": "<u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8",
    "float16": "<f2", "float32": "<f4", "float64": "<f8",
}


def mds_encoding(dtype: T.DataType, column: str) -> str:
    """The MDS encoding for a Spark column type; a clear error for unsupported ones."""
    for spark_type, encoding in _ENCODINGS.items():
        if isinstance(dtype, spark_type):
            return encoding
    raise ValueError(
        f"column {column!r} has type {dtype.simpleString()}, which has no MDS encoding here "
        f"(supported: {', '.join(sorted(t.typeName() for t in _ENCODINGS))})"
    )


def _var_chunks(arr: pa.Array) -> tuple[list, list[int]]:
    """Zero-copy views of each value of a string/binary array, and their lengths."""
    import numpy as np

    if pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type):
        otype, width = np.int64, 8
    else:
        otype, width = np.int32, 4
    bufs = arr.buffers()
    offs = np.frombuffer(bufs[1], dtype=otype, count=len(arr) + 1, offset=arr.offset * width)
    data = memoryview(bufs[2]) if bufs[2] is not None else memoryview(b"")
    o = offs.tolist()
    return [data[o[i]:o[i + 1]] for i in range(len(arr))], np.diff(offs).tolist()


def encode_batch(batch: pa.RecordBatch, columns: Mapping[str, str]) -> list[bytes]:
    """MDS sample bytes for every row of `batch` (columns in `columns` order), equal to
    ``MDSWriter.encode_sample``; `jpeg` columns take stored JPEG bytes as they are."""
    import numpy as np
    from streaming.base.format.mds.encodings import get_mds_encoded_size, mds_encode

    n = batch.num_rows
    per_column, var_lengths = [], []
    for name in sorted(columns):  # MDSWriter orders columns by name
        enc = columns[name]
        arr = batch.column(batch.schema.get_field_index(name))
        if arr.null_count:
            raise ValueError(f"column {name!r}: null values cannot be written to MDS")
        size = get_mds_encoded_size(enc)
        is_var = size is None
        binary = (
            pa.types.is_binary(arr.type) or pa.types.is_string(arr.type)
            or pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type)
        )
        if binary and (enc in ("str", "bytes", "jpeg") or enc.startswith("ndarray:")):
            # ndarray: raw array bytes (stored latents); a fixed-shape ndarray's encoding is
            # exactly its values' bytes, so only the size needs checking.
            chunks, lengths = _var_chunks(arr)
            if enc == "jpeg" and any(bytes(c[:2]) != b"\xff\xd8" for c in chunks):
                raise ValueError(f"column {name!r}: bytes are not a JPEG")
            if size is not None and any(n != size for n in lengths):
                raise ValueError(f"column {name!r}: values are not {size} bytes ({enc})")
        elif enc in _FIXED_NUMPY:
            raw = np.asarray(arr.to_numpy(zero_copy_only=False)).astype(_FIXED_NUMPY[enc])
            k, buf = raw.itemsize, raw.tobytes()
            chunks, lengths = [buf[i * k:(i + 1) * k] for i in range(n)], None
        else:  # any other MDS encoding: the stock per-value encoder
            chunks = [mds_encode(enc, v) for v in arr.to_pylist()]
            lengths = [len(c) for c in chunks]
        per_column.append(chunks)
        if is_var:
            var_lengths.append(lengths)
    heads = (
        np.array(var_lengths, dtype="<u4").T if var_lengths else np.zeros((n, 0), "<u4")
    )
    return [
        b"".join([heads[i].tobytes(), *(col[i] for col in per_column)]) for i in range(n)
    ]
