"""Derived state (etl/lakehouse/derived.py): one mechanism, the same rules for every use.

A document is used only at the kind, format and key it was written with; missing,
damaged, foreign or stale it reads as None, and each owner then computes its figures
again (tested here for the curate's source versions and quiet-night document, an
export's memos and the kept counts; their end-to-end uses are in test_incremental,
test_pipeline_e2e, test_dedup and test_counts)."""

from __future__ import annotations

import json
import os

import pytest

from etl.lakehouse.derived import DerivedState


def _raw(path) -> dict:
    return json.loads(open(path).read())


def test_a_document_is_used_only_at_its_kind_format_and_key(tmp_path):
    path = str(tmp_path / "meta" / "x.json")
    state = DerivedState(path, "thing")
    assert state.load() is None and state.load({"v": 1}) is None  # nothing written yet
    state.save({"v": 1, "where": None}, {"n": 3, "ids": ("a", "b")})
    raw = _raw(path)
    assert raw == {"kind": "thing", "format": 1, "key": {"v": 1, "where": None},
                   "payload": {"n": 3, "ids": ["a", "b"]}}
    assert state.load({"where": None, "v": 1}) == {"n": 3, "ids": ["a", "b"]}
    assert state.load() == {"n": 3, "ids": ["a", "b"]}  # any key
    assert state.load({"v": 2, "where": None}) is None  # stale
    assert DerivedState(path, "other").load() is None  # foreign kind
    assert DerivedState(path, "thing", format=2).load() is None  # another format


@pytest.mark.parametrize("body", ["", "{", "[1, 2]", '{"kind": "thing", "format": 1}',
                                  '{"kind": "thing", "format": 1, "key": null, "payload": 3}',
                                  "\x00\xff"])
def test_a_damaged_document_reads_as_none(tmp_path, body):
    path = tmp_path / "x.json"
    path.write_bytes(body.encode("latin-1"))
    assert DerivedState(str(path), "thing").load() is None


def test_an_unchanged_document_is_not_rewritten_and_an_unwritable_one_is_not_an_error(
        tmp_path, caplog):
    path = tmp_path / "x.json"
    state = DerivedState(str(path), "thing")
    state.save({"v": 1}, {"n": 1})
    os.utime(path, (1, 1))
    state.save({"v": 1}, {"n": 1})
    assert path.stat().st_mtime == 1  # the same document: no write
    state.save({"v": 2}, {"n": 1})
    assert _raw(path)["key"] == {"v": 2}
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    DerivedState(str(blocked / "x.json"), "thing").save(None, {"n": 1})  # logged only
    assert "could not write" in caplog.text


def _cfg(tmp_path):
    from etl.config import parse_config

    return parse_config({"storage": {"root": str(tmp_path)},
                         "sources": [{"name": "s", "kind": "delta", "path": str(tmp_path / "t"),
                                      "columns": {"key": "k", "image": "b"}}]})


def _curate_state(cfg):
    from etl import tables
    from etl.lakehouse.curate_state import CurateState

    return CurateState.of(tables.layout(cfg))


def test_curate_source_versions_follow_the_rules(tmp_path):
    cfg = _cfg(tmp_path)
    state = _curate_state(cfg)
    assert state.source_versions() == {}
    state.record_versions({"source:s:abc": 4})
    assert state.source_versions() == {"source:s:abc": 4}
    path = tmp_path / "_lakeshard" / "source_versions.json"
    assert _raw(path)["kind"] == "source_versions"
    path.write_text('{"source:s:abc": 4}')  # an older, bare document: compared in full
    assert state.source_versions() == {}
    path.write_text('{"kind": "source_versions", "format": 1, "key": null, '
                    '"payload": {"source:s:abc": "four"}}')
    assert state.source_versions() == {}


def test_an_export_memo_is_keyed_by_the_versions_it_counted_at(tmp_path):
    from etl.jobs import export

    cfg = _cfg(tmp_path)
    memo = export._Memo(cfg, "train")
    inputs = {"table_version": 7, "where": None, "dedup_version": 3}
    assert memo.dedup(inputs) is None and memo.removals(5) is None
    dedup = {"include_duplicates": False, "excluded_duplicates": 2,
             "duplicates_fingerprint": 99}
    removals = {"removed": 1, "by_reason": {"source_removed": 1}, "fingerprint": 12}
    memo.save(inputs, 10, dedup, 5, removals)
    again = export._Memo(cfg, "train")
    assert again.dedup(inputs) == (10, 2, 99)
    assert again.dedup({**inputs, "dedup_version": 4}) is None  # dedup ran since
    assert again.dedup({**inputs, "table_version": 8}) is None  # the table changed
    assert again.removals(5) == removals
    assert again.removals(6) is None and again.removals(None) is None
    # No dedup table (inputs None) and no manifest: nothing is kept for them.
    other = export._Memo(cfg, "other")
    other.save(None, 10, {"include_duplicates": True}, None, removals)
    assert not (tmp_path / "_lakeshard" / "exports" / "other.dedup.json").exists()
    assert not (tmp_path / "_lakeshard" / "exports" / "other.removals.json").exists()


def test_an_export_key_is_kept_only_for_the_export_in_place(tmp_path):
    from etl import tables
    from etl.config import parse_config
    from etl.jobs import export

    cfg = parse_config({"storage": {"root": str(tmp_path)}, "exports": {"train": {}},
                        "sources": [{"name": "s", "kind": "image_folder",
                                     "path": str(tmp_path / "in")}]})
    memo = export._Memo(cfg, "train")
    inputs = {"version": 7, "dedup": 3, "manifest": 5, "takedowns": None}
    out = tables.export_path(cfg, "train")
    memo.save_key(inputs, out)  # no export there: nothing to remember
    assert memo.export_key(inputs) is None
    os.makedirs(out)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump({"export_key": "abc123", "samples": 3, "shards": 1, "bytes": 10,
                   "checksum": "c"}, f)
    memo.save_key(inputs, out)
    assert export._Memo(cfg, "train").export_key(inputs) == "abc123"
    assert memo.export_key({**inputs, "manifest": 6}) is None  # a removal since
    assert memo.export_key(None) is None  # dedup behind the table: never kept
    assert export._in_place(cfg, "train", "abc123").unchanged
    assert export._in_place(cfg, "train", "other") is None  # rewritten since


def test_the_quiet_night_document_is_cleared_not_trusted(tmp_path):
    cfg = _cfg(tmp_path)
    state = _curate_state(cfg).quiet
    key = {"sources": {"s": ["cfg", "version 3"]}, "manifest": 4, "takedowns": None,
           "code": "x"}
    state.save(key, {"unchanged": {"s": 2}, "scans": {"s": "listing"}, "versions": {}})
    assert state.load(key)["unchanged"] == {"s": 2}
    assert state.load({**key, "manifest": 5}) is None  # the manifest moved on
    state.clear()
    assert state.load(key) is None and _raw(state.path)["key"] is None


def test_kept_counts_are_a_document_of_their_columns(tmp_path):
    import lance
    import pyarrow as pa

    from etl.lakehouse.counts import lance_counts

    path, cache = str(tmp_path / "t.lance"), str(tmp_path / "meta" / "t.json")
    lance.write_dataset(pa.table({"source": ["a", "a", "b"], "keep": [True, False, True]}),
                        path)
    got = lance_counts(lance.dataset(path), ("source",), cache)
    assert dict(zip(got["source"], got["count"], strict=True)) == {"a": 2, "b": 1}
    raw = _raw(cache)
    assert raw["kind"] == "counts" and raw["key"] == {"columns": ["source"]}
    assert len(raw["payload"]["parts"]) == 1  # one fragment
    # Stale (other columns): counted again, and the document now names the new columns.
    got = lance_counts(lance.dataset(path), ("keep",), cache)
    assert dict(zip(got["keep"], got["count"], strict=True)) == {True: 2, False: 1}
    assert _raw(cache)["key"] == {"columns": ["keep"]}
