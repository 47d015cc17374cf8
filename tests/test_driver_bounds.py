"""Driver or Spark (``etl/config/bounds.py``): the same curate nights, once within its
bounds (the driver compares, prepares, counts and writes the bookkeeping) and once past
each (``driver:`` all 0 -- Spark's join with the manifest, fetch + prepare in Spark's
tasks, outcome counts, manifest and rejects rows by the Arrow rules in those tasks,
Spark MERGEs), leave the same tables. The expectations are the other path's tables and
what the test does to the folder."""

from __future__ import annotations

import lance
import pytest
from conftest import make_config
from support import photo, photo_folder

from etl import tables
from etl.jobs.curate import curate
from etl.pipeline.checks import check_sources

pytestmark = pytest.mark.slow

_PAST = {"prepare_rows": 0, "ids": 0, "plan_rows": 0, "scan_rows": 0}


def _tables(spark, cfg) -> dict:
    """Every bookkeeping table's rows, without the columns a run stamps (its id, when)."""
    paths = tables.layout(cfg)

    def delta(path, drop):
        df = spark.read.format("delta").load(path).drop(*drop)
        return sorted(tuple(str(v) for v in r) for r in df.collect())

    curated = lance.dataset(paths.curated).to_table(
        columns=["sample_id", "source_key", "image_sha256", "width", "height",
                 "caption_original", "keep"])
    return {
        "manifest": delta(paths.manifest, ["run_id", "ingested_at", "removed_at"]),
        "rejects": delta(paths.rejects, ["run_id"]),
        "accounting": delta(paths.accounting, ["run_id", "run_at"]),
        "curated": sorted(tuple(r.values()) for r in curated.to_pylist()),
    }


def test_nights_past_every_bound_leave_the_tables_of_nights_within_them(spark, tmp_path):
    folder = photo_folder(tmp_path / "photos", 6)  # bad.jpg: rejected as undecodable
    source = [{"name": "photos", "kind": "image_folder", "path": str(folder)}]
    within = make_config(tmp_path / "within", source)
    past = make_config(tmp_path / "past", source, driver=_PAST)
    assert past.driver.ids == 0 and within.driver.ids == 100_000
    check_sources(within)

    def night(run_id):
        got = {}
        for name, cfg in (("within", within), ("past", past)):
            counts = curate(spark, cfg, run_id).counts
            got[name] = ({(c.source, c.seen, c.accepted, c.rejected, c.unchanged,
                           c.removed_total) for c in counts}, _tables(spark, cfg))
        return got

    first = night("night-1")
    assert first["within"] == first["past"]
    assert first["past"][0] == {("photos", 7, 6, 1, 0, 0)}

    (folder / "p6.jpg").write_bytes(photo(6))  # new
    (folder / "p2.jpg").write_bytes(photo(12))  # changed: another size
    (folder / "p3.jpg").unlink()  # left the source
    second = night("night-2")
    assert second["within"] == second["past"]
    assert second["past"][0] == {("photos", 2, 2, 0, 5, 1)}
    manifest = second["past"][1]["manifest"]
    assert len(manifest) == 8 and len(second["past"][1]["curated"]) == 6
