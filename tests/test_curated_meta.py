"""curated_meta (etl.lakehouse.curated_meta) follows the curated Lance table row for row
through a run, a removal, a takedown, a caption run and a compact.

The expectation is read here from Lance with pylance (every column but the image bytes
and vectors: binary and fixed-size-list columns), each row with its duplicate cluster
and role from the dedup table (delta-rs), and compared with delta-rs's read of
curated_meta, whatever the code under test decided to write.
"""

from __future__ import annotations

import lance
import pyarrow as pa
from conftest import make_config
from deltalake import DeltaTable
from support import photo_folder

from etl import tables
from etl.pipeline.runner import run_command, run_pipeline
from etl.schema import sample_id_of

_ROLE = ("dup_cluster_id", "is_canonical", "dup_kind", "cluster_size")


def _expected(paths) -> dict[str, dict]:
    ds = lance.dataset(paths.curated)
    keep = [f.name for f in ds.schema
            if f.name != "image" and not pa.types.is_binary(f.type)
            and not pa.types.is_large_binary(f.type)
            and not pa.types.is_fixed_size_list(f.type)]
    roles = {}
    if DeltaTable.is_deltatable(paths.dedup):
        for r in DeltaTable(paths.dedup).to_pyarrow_table().to_pylist():
            roles[r["sample_id"]] = {c: r[c] for c in _ROLE}
    none = dict.fromkeys(_ROLE)
    return {r["sample_id"]: {**r, **roles.get(r["sample_id"], none)}
            for r in ds.to_table(columns=keep).to_pylist()}


def _meta(path: str) -> dict[str, dict]:
    rows = DeltaTable(path).to_pyarrow_table().drop_columns(["lance_fragment"]).to_pylist()
    out = {r["sample_id"]: r for r in rows}
    assert len(out) == len(rows), "a sample appears twice in curated_meta"
    return out


def _same(paths) -> dict[str, dict]:
    want, got = _expected(paths), _meta(paths.curated_meta)
    assert got == want
    return got


def _last_write(path: str) -> dict:
    return DeltaTable(path).history(1)[0]


def test_curated_meta_follows_lance_through_removal_takedown_caption_and_compact(
        spark, tmp_path, tmp_path_factory):
    from test_caption import shared_tiny_model

    photos = photo_folder(tmp_path / "photos", 8)
    model = shared_tiny_model(tmp_path_factory)
    cfg = make_config(
        tmp_path / "root", sources=[{"name": "photos", "kind": "image_folder",
                                     "path": str(photos)}],
        catalog={"publish_curated_meta": True}, run={"report": False},
        caption={"default": "smoke", "versions": {"smoke": {
            "model": model, "max_new_tokens": 4, "batch_size": 4, "min_pixels": 28 * 28,
            "max_pixels": 56 * 56 * 2}}})
    paths = tables.layout(cfg)

    run_pipeline(cfg, only=("curate", "dedup"))
    first = _same(paths)
    assert len(first) == 8
    assert all(r["dup_kind"] is not None for r in first.values())  # dedup ran
    assert not any(k.endswith("image") for k in next(iter(first.values())))

    # A record leaves its source: its row leaves curated_meta in the same run, and only
    # the fragment that held it is rewritten.
    gone = photos / "p3.jpg"
    gone.unlink()
    run_pipeline(cfg, only=("curate",))
    after = _same(paths)
    assert sample_id_of("photos", gone.name) not in after and len(after) == 7
    assert "predicate" in _last_write(paths.curated_meta)["operationParameters"]

    # A takedown.
    taken = sorted(after)[0]
    run_command(cfg, "forget", {"sample_ids": [taken], "by": "dpo", "reason": "test"})
    assert taken not in _same(paths)

    # Captions: new columns, in curated_meta too.
    run_command(cfg, "caption", {})
    captioned = _same(paths)
    assert all(r["caption_smoke_status"] is not None for r in captioned.values())

    # Compaction rewrites fragments: the same rows, under their new fragments.
    run_command(cfg, "compact")
    assert _same(paths) == captioned
