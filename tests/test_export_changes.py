"""An export's increment planned from what changed (the curated table's appended and
deleted rows since the version it was written at, dedup's changed rows since its
version) against the same increment planned by a diff of every row: over nights of
adds, a removal, a dedup role change and a takedown, both give the same manifest (key,
lineage, partitions, checksums) and the same ids in every partition, and the samples
read back are the ones the test expects from the pictures it placed."""

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

    ids = {i: sample_id_of("photos", f"p{i}.jpg") for i in range(28)}
    copy = sample_id_of("photos", "c3.jpg")
    kept = set(range(24))
    # Night 2: two new photos and an exact copy of p3 (p3 earlier: the copy left out).
    _place(photos, {"p24.jpg": 24, "p25.jpg": 25, "c3.jpg": 3})
    run_pipeline(cfg, only=("curate", "dedup"))
    kept |= {24, 25}
    night({ids[i] for i in kept}, "changes")
    # Night 3: p5 removed; p3 removed, so its copy becomes canonical and joins.
    (photos / "p5.jpg").unlink()
    (photos / "p3.jpg").unlink()
    _place(photos, {"p26.jpg": 26})
    run_pipeline(cfg, only=("curate", "dedup"))
    kept = kept - {3, 5} | {26}
    night({ids[i] for i in kept} | {copy}, "changes")
    # Night 4: a takedown of p7 (a takedown recorded since: the whole diff), then one
    # more photo, planned from what changed again.
    run_command(cfg, "forget", {"sample_ids": [ids[7]], "by": "dpo",
                                            "reason": "opt-out"})
    kept.discard(7)
    night({ids[i] for i in kept} | {copy}, "diff")
    _place(photos, {"p27.jpg": 27})
    run_pipeline(cfg, only=("curate", "dedup"))
    kept.add(27)
    night({ids[i] for i in kept} | {copy}, "changes")
