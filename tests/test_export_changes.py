"""An export's increment planned from what changed (the curated table's appended and
deleted rows since the version it was written at, dedup's changed rows since its
version) against the same increment planned by a diff of every row: a night of an add,
a removal and a dedup role change gives the same manifest both ways (key, lineage,
partitions, checksums) and the same ids in every partition; after a takedown the whole
diff runs; what is read back is the set of pictures the test placed and expects."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from mds_read import read_mds
from PIL import Image
from support import make_config

from etl import tables
from etl.schema import sample_id_of


def _picture(i: int) -> bytes:
    """Picture `i`: random pixels (its own dHash, far from the others')."""
    pixels = np.random.default_rng(i).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=85)
    return out.getvalue()


def _place(folder: Path, names: dict[str, int]) -> None:
    for name, i in names.items():
        (folder / name).write_bytes(_picture(i))


def _parts(out: str) -> dict[int, set[str]]:
    manifest = json.loads((Path(out) / "manifest.json").read_text())
    return {p["partition"]: set(pq.read_table(Path(out) / p["dir"] / "ids.parquet")
                                .column("sample_id").to_pylist())
            for p in manifest["parts"]}


def _manifest(out: str) -> dict:
    return json.loads((Path(out) / "manifest.json").read_text())


@pytest.mark.slow
def test_an_increment_from_changes_equals_the_diff_of_every_row(spark, tmp_path,
                                                                  monkeypatch):
    from etl.jobs import export as export_job
    from etl.pipeline.runner import run_command, run_pipeline

    photos = tmp_path / "in"
    photos.mkdir()
    _place(photos, {f"p{i}.jpg": i for i in range(24)})
    # An exact copy of p3, ingested with it: the tie goes to the smaller sample_id, so
    # the copy's name is one whose id sorts after p3's (p3 canonical, the copy left out).
    copy_name = next(n for n in (f"c{k}.jpg" for k in range(100))
                     if sample_id_of("photos", n) > sample_id_of("photos", "p3.jpg"))
    (photos / copy_name).write_bytes((photos / "p3.jpg").read_bytes())

    def config(root: Path):
        return make_config(root, sources=[{"name": "photos", "kind": "image_folder",
                                           "path": str(photos)}],
                           exports={"train": {"partitions": 8, "where": None}},
                           dedup={"policy": ["earliest"]}, run={"report": False})

    root, saved, changes = tmp_path / "root", tmp_path / "saved", tmp_path / "changes"
    cfg = config(root)
    run_pipeline(cfg, only=("curate", "dedup", "export"))
    out = tables.export_path(cfg, "train")

    def night(expected: set[str], planned_from: str) -> None:
        """Export both ways from one lakehouse, at the same path (the export's settings
        name its table's path); compare; go on from the increment from changes."""
        shutil.copytree(root, saved)
        run_pipeline(cfg, only=("export",))
        ma, parts = _manifest(out), _parts(out)
        assert {s["sample_id"] for s in read_mds(out)} == expected
        root.rename(changes)
        saved.rename(root)
        with monkeypatch.context() as m:  # the reference: every row diffed
            m.setattr(export_job, "_from_changes", lambda *a, **k: None)
            run_pipeline(cfg, only=("export",))
        mb = _manifest(out)
        assert ma["increment"]["planned_from"] == planned_from
        assert mb["increment"]["planned_from"] == "diff"
        assert ma["samples"] == len(expected)
        assert {k: v for k, v in ma.items() if k != "increment"} == {
            k: v for k, v in mb.items() if k != "increment"}
        assert parts == _parts(out)
        shutil.rmtree(root)
        changes.rename(root)

    ids = {i: sample_id_of("photos", f"p{i}.jpg") for i in range(26)}
    copy = sample_id_of("photos", copy_name)
    assert {s["sample_id"] for s in read_mds(out)} == {ids[i] for i in range(24)}
    # Night 2: p5 removed, p24 new, and p3 removed, so its exact copy (left out until
    # now) becomes canonical and joins.
    (photos / "p5.jpg").unlink()
    (photos / "p3.jpg").unlink()
    _place(photos, {"p24.jpg": 24})
    run_pipeline(cfg, only=("curate", "dedup"))
    kept = set(range(25)) - {3, 5}
    night({ids[i] for i in kept} | {copy}, "changes")
    # Night 3: a takedown of p7 and a new picture: a takedown recorded since the export,
    # so the whole diff runs (what it holds is checked, not compared).
    _place(photos, {"p25.jpg": 25})
    run_command(cfg, "forget", {"sample_ids": [ids[7]], "by": "dpo", "reason": "opt-out"})
    run_pipeline(cfg, only=("curate", "dedup", "export"))
    assert _manifest(out)["increment"]["planned_from"] == "diff"
    assert {s["sample_id"] for s in read_mds(out)} == {ids[i] for i in kept - {7} | {25}} | {
        copy}
