"""Tables written by lakeshard before the architecture refactor (commit e8761af; see
tests/data/legacy_v0/README.md) are read and migrated by the current code."""

from __future__ import annotations

import os
import shutil

import lance
import pytest
from conftest import REPO, make_config

from etl import tables
from etl.jobs.curate import CurateResult
from etl.jobs.dedup import DedupRun
from etl.jobs.export import ExportRun
from etl.lakehouse.dedup_table import DEDUP_PARAMS, DedupTable, dedup_params
from etl.migrations import CURATED_RENAMES

pytestmark = pytest.mark.slow

LEGACY = REPO / "tests" / "data" / "legacy_v0"


@pytest.fixture
def legacy_root(tmp_path):
    """A copy of the old root and its image folder, with the files' mtimes as the old
    run saw them (they are part of the manifest's fingerprints; git does not keep them)."""
    shutil.copytree(LEGACY / "root", tmp_path / "root")
    shutil.copytree(LEGACY / "source", tmp_path / "source")
    for i, p in enumerate(sorted((tmp_path / "source").iterdir())):
        os.utime(p, (1_700_000_000 + i, 1_700_000_000 + i))
    return tmp_path


def test_a_root_written_by_the_previous_release_is_migrated_and_read(spark, legacy_root):
    from etl.ledger import recent_runs
    from etl.pipeline.runner import run_pipeline

    cfg = make_config(
        legacy_root / "root",
        sources=[{"name": "photos", "kind": "image_folder",
                  "path": str(legacy_root / "source")}],
        exports={"train": {"partitions": 1}},
        run={"report": False},
    )
    paths = tables.layout(cfg)
    old = lance.dataset(paths.curated)
    assert set(CURATED_RENAMES) <= set(old.schema.names)  # the fixture is the old layout
    before = {r["sample_id"]: r for r in old.to_table().to_pylist()}
    old_dedup = {r.sample_id: r.asDict() for r in spark.read.format("delta")
                 .load(paths.dedup).collect()}
    assert "phash" in next(iter(old_dedup.values()))

    out = run_pipeline(cfg, only=("curate", "dedup", "export"))
    assert [m.split(":")[0] for m in out.migrated] == ["curated", "dedup", "manifest", "runs"]

    # Curated: columns renamed in place (no data file rewritten), values as they were.
    ds = lance.dataset(paths.curated)
    names = set(ds.schema.names)
    assert set(CURATED_RENAMES.values()) <= names and not set(CURATED_RENAMES) & names
    after = {r["sample_id"]: r for r in ds.to_table().to_pylist()}
    assert set(after) == set(before) and len(after) == 4
    for sid, row in before.items():
        for old_name, new_name in CURATED_RENAMES.items():
            assert after[sid][new_name] == row[old_name]
    old_files = {f.path for frag in old.get_fragments() for f in frag.metadata.files}
    assert old_files <= {f.path for frag in ds.get_fragments() for f in frag.metadata.files}

    # The old manifest moved; its records are recognised: nothing was processed again.
    assert not os.path.exists(paths.delta_table("samples"))
    assert spark.read.format("delta").load(paths.manifest).count() == 4
    (counts,) = out.detail("curate", CurateResult).counts
    assert (counts.seen, counts.unchanged) == (0, 4)

    # Dedup: the same assignments under the new column name, settings kept (so the run
    # was incremental, with nothing new).
    dedup = {r.sample_id: r.asDict() for r in spark.read.format("delta")
             .load(paths.dedup).collect()}
    assert {sid: r["dhash"] for sid, r in dedup.items()} == {
        sid: r["phash"] for sid, r in old_dedup.items()}
    assert {sid: r["dup_cluster_id"] for sid, r in dedup.items()} == {
        sid: r["dup_cluster_id"] for sid, r in old_dedup.items()}
    dedup_run = out.detail("dedup", DedupRun)
    assert dedup_run.mode == "incremental" and dedup_run.changed == 0
    assert DedupTable(spark, cfg).state()[DEDUP_PARAMS] == dedup_params(cfg.dedup)

    # The export reads the new names: the kept, canonical rows (a/b are one cluster).
    (exp,) = out.detail("export", ExportRun).exports
    assert exp.samples == 2

    # The old ledger's run is still listed, beside this run's stages.
    runs = {(r.run_id, r.stage): r.status for r in recent_runs(spark, paths.runs)}
    assert runs[(out.run_id, "run")] == "ok"
    old_runs = {k: v for k, v in runs.items() if k[0] != out.run_id}
    assert old_runs and set(old_runs.values()) <= {"ok", "skipped"}
    assert {s for _, s in old_runs} == {"run", "curate", "dedup", "caption", "export"}

    # Done once: the next run migrates nothing.
    again = run_pipeline(cfg, only=("curate",))
    assert again.migrated == []
