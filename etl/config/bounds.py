"""Where bookkeeping runs: every bound between the driver's process (Arrow, delta-rs,
pylance: no Spark job) and Spark, one per kind of work, in one place.

Up to a bound the work is done in the driver's process, which saves the Spark job (and
its ~0.5-2 s of planning and scheduling in a cold JVM, more for a first Python worker);
above it, Spark does it in tasks, which costs the job but keeps the driver's memory and
time flat as the work grows. Each pair of paths is tested equal on data that crosses its
bound.

The bounds of work whose owner is built from the config are fields of its ``driver:``
section (:class:`DriverBounds`), defaulting to the constant beside them: the ids a table
object handles in the driver (:class:`etl.lakehouse.catalog.Catalog`), a night's records
prepared there (:meth:`etl.lakehouse.catalog.Manifest.diff`), dedup's plan and scans
(:class:`etl.lakehouse.dedup_table.DedupTable`). Three are constants only, as the code
that applies them is handed no config: the local-data collect
(:func:`etl.runtime.local.local_arrow`), a local table's listing
(:mod:`etl.sources.file_table`) and the MDS writer's write in the driver
(:mod:`etl.writers.mds`).

The settings ``prepare.driver_rows`` and ``dedup.driver_max_rows`` of earlier releases
still work: they are read as ``driver.prepare_rows`` and ``driver.plan_rows``
(:func:`moved_bounds`); a config that sets both names of one bound is an error naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field

from etl.config.base import FieldError, Section

__all__ = [
    "DriverBounds",
    "LOCAL_COLLECT_ROWS",
    "DRIVER_PREPARE_ROWS",
    "DRIVER_WRITE_ROWS",
    "DRIVER_PLAN_ROWS",
    "DRIVER_IDS",
    "DRIVER_SCAN_ROWS",
    "DRIVER_READ_BYTES",
    "DRIVER_REF_BYTES",
    "moved_bounds",
]

# Rows of local data (a plan Spark folds into rows it holds) handed to Python by
# `collect` instead of `toArrow`'s job: `collect` hands rows to Python one by one, so past
# this many rows the job is the cheaper way (2,000 rows of 21 columns: ~0.1 s either way;
# 16,000: 0.46 s against 0.24 s by the job; 100,000: 2.7 s against 0.75 s).
LOCAL_COLLECT_ROWS = 4096
# New or changed records of sources the driver lists that are fetched, prepared and
# written to Lance in the driver's process: no Python worker starts (~1 s of a cold
# night), but their JPEGs are held in the driver's memory and prepared on its cores only.
DRIVER_PREPARE_ROWS = 256
# Rows of an MDS export the driver holds that the driver writes itself (a night's
# increment: a few new rows into one new partition); more are written by Spark tasks, one
# per partition, in parallel. A row costs the driver its image taken from Lance and its
# sample encoded (~1 ms for a 0.5 MP JPEG); a Spark write costs its job, a Python worker
# per slot and streaming's import in each (~2-3 s on a cold night: 1,200 small rows took
# 2.4 s as a Spark write and 0.6 s on the driver, bench/scale.py at 120,000 records).
DRIVER_WRITE_ROWS = 2048
# Dedup rows an increment touches (or a first run's whole table) planned in the driver:
# a few pylance/delta-rs reads instead of Spark's joins over the table, in the driver's
# memory (~200 bytes a row) and on one core.
DRIVER_PLAN_ROWS = 50_000
# Record ids (and the manifest's key columns) a run holds in the driver: a removal or
# rewrite's ids, the manifest rows a listing is compared with, the rows a night collects
# back from its fetch + prepare job -- a delta-rs read, a Lance merge-delete or an Arrow
# table instead of a Spark join, at ~100 bytes a row of driver memory.
DRIVER_IDS = 100_000
# Rows whose narrow columns (ids, hashes, cluster ids) pylance or delta-rs may read into
# the driver in one scan (~60 bytes a row): beyond it a Spark read, spread over tasks.
DRIVER_SCAN_ROWS = 2_000_000
# Bytes of local table files (a URL list of ~100,000 rows) a source's listing reads in the
# driver, handed to Spark as local data: no Python worker lists it, but the table passes
# through the driver's memory. Larger tables, and tables on object storage, are read by
# Spark tasks.
DRIVER_READ_BYTES = 16 << 20
# The same for local parquet files, whose listing never carries an image: a record names
# its image by file and row (read again where it is prepared), so the driver holds keys
# and references while it reads a row group at a time. 64 MiB: a night's new file of a
# few tens of thousands of small images (34 MB for 10,000 of the scale bench's, listed
# here in ~0.3 s against a ~2.8 s Spark job and the range partitioning of its rows).
DRIVER_REF_BYTES = 64 << 20

_Count = Annotated[int, Field(ge=0)]


class DriverBounds(Section):
    """The ``driver:`` section (0: always Spark)."""

    # DRIVER_PREPARE_ROWS (at most LOCAL_COLLECT_ROWS: the rows are collected as local data)
    prepare_rows: Annotated[int, Field(ge=0, le=LOCAL_COLLECT_ROWS)] = DRIVER_PREPARE_ROWS
    plan_rows: _Count = DRIVER_PLAN_ROWS  # DRIVER_PLAN_ROWS
    ids: _Count = DRIVER_IDS  # DRIVER_IDS
    scan_rows: _Count = DRIVER_SCAN_ROWS  # DRIVER_SCAN_ROWS


# Settings of earlier releases -> the field of `driver:` they are now.
_MOVED = {("prepare", "driver_rows"): "prepare_rows", ("dedup", "driver_max_rows"): "plan_rows"}


def moved_bounds(raw: Any) -> Any:
    """The raw config (a mapping, before validation) with the bounds earlier releases
    set in other sections moved into ``driver:``; a bound set under both names is a
    :class:`FieldError` naming the old one."""
    if not isinstance(raw, Mapping) or not any(
            isinstance(raw.get(section), Mapping) and old in raw[section]
            for section, old in _MOVED):
        return raw
    out = dict(raw)
    driver = dict(out.get("driver") or {})
    for (section, old), new in _MOVED.items():
        given = out.get(section)
        if not isinstance(given, Mapping) or old not in given:
            continue
        if new in driver:
            raise FieldError(f"{section}.{old}", f"is driver.{new} now, which is set too: "
                             f"keep driver.{new} alone")
        driver[new] = given[old]
        out[section] = {k: v for k, v in given.items() if k != old}
    out["driver"] = driver
    return out
