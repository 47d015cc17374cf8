"""What executor code reports when it fails on a row through no fault of the data.

A UDF keeps data failures as per-row reasons of its own (a reject reason, a fetch
status, a caption status). An unexpected exception -- lakeshard's own code, or a library
under it, misbehaving -- is reason :data:`INTERNAL_ERROR` instead, with
:func:`internal_detail` saying what was raised and where: the accounting counts it
apart, the stage's failure budget counts it, and the next run retries the record.
"""

from __future__ import annotations

import os
import traceback

__all__ = ["INTERNAL_ERROR", "internal_detail"]

INTERNAL_ERROR = "internal_error"


def _ours(filename: str) -> bool:
    return os.sep + "udfs" + os.sep in filename or os.sep + "etl" + os.sep in filename


def internal_detail(exc: BaseException, limit: int = 500) -> str:
    """``Type: message (at file:line in function <- …)``: the innermost frame, then the
    innermost frames of lakeshard's own code that led there."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames[:-1] if _ours(f.filename)]
    where = [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
             for f in [*frames[-1:], *reversed(ours[-2:])]]
    at = f" (at {' <- '.join(where)})" if where else ""
    text = f"{type(exc).__name__}: {exc}"
    return text[: max(0, limit - len(at))] + at
