"""Hostile files in every source kind, read by the adapters (and the fetch that curate
runs on their references): a source never reads outside its root, and each hostile
record ends as a reason on that record. A secret file sits beside every source root;
its bytes must come out of no row."""

from __future__ import annotations

import json
import os
import tarfile
import threading

import pytest
from conftest import jpeg_bytes, png_bytes, tar_bytes

from etl.config import SourceConfig
from etl.sources import adapter_for, finish_ingest
from udfs.fetch import fetch_ref, rules_for

SECRET = b"SECRET-OUTSIDE-THE-ROOT root:x:0:0"
INSIDE = jpeg_bytes(color=(1, 2, 3))


def _read(spark, src: SourceConfig) -> dict:
    adapter = adapter_for(src.kind)
    adapter.check_inputs(src)
    return {r.source_key: r for r in finish_ingest(adapter.read(spark, src), src).collect()}


def _image(row, src: SourceConfig):
    """What curate's fetch reads for `row` (under its source's rules)."""
    if row.image_bytes is not None:
        return row.image_bytes
    return fetch_ref(row.image_ref, row.image_offset, row.image_length,
                     rules=rules_for(src)).data


def _reason(row) -> tuple[str, str]:
    return row.read_status, row.read_reason


def _no_secret(rows: dict, src: SourceConfig) -> None:
    for r in rows.values():
        text = json.dumps([r.caption_original, r.metadata_json, r.license])
        assert SECRET.decode() not in text, r.source_key
        data = _image(r, src) if r.read_status == "ok" else None
        assert data is None or SECRET not in data, r.source_key


@pytest.fixture
def outside(tmp_path):
    """A folder beside the source's root holding the secret, as text and as an image."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret.txt").write_bytes(SECRET)
    (d / "secret.png").write_bytes(png_bytes() + SECRET)
    (d / "secret.jpg").write_bytes(jpeg_bytes() + SECRET)
    return d


def test_image_folder_names_are_paths_not_urls(spark, tmp_path, outside):
    root = tmp_path / "photos"
    (root / "sub").mkdir(parents=True)
    # Parsed as URLs these names climb out of the folder (%2F -> /, # cuts the rest).
    climb = "sub%2F..%2F..%2Foutside%2Fsecret.png#.png"
    (root / climb).write_bytes(INSIDE)
    passwd = "x%2F..%2F..%2Foutside%2Fsecret.txt#"
    (root / f"{passwd}.jpg").write_bytes(INSIDE)
    (root / f"{passwd}.txt").write_text("the caption inside")
    # TAB, CR and LF are part of a name: read the exact file, not "ab.jpg".
    (root / "a\tb.jpg").write_bytes(INSIDE)
    (root / "ab.jpg").write_bytes(jpeg_bytes(color=(250, 250, 250)))
    (root / "new\nline.jpg").write_bytes(INSIDE)
    (root / "cr\rname.jpg").write_bytes(INSIDE)
    (root / "cr\rname.txt").write_text("carriage")
    src = SourceConfig(name="photos", kind="image_folder", path=str(root))
    rows = _read(spark, src)
    assert set(rows) == {climb, f"{passwd}.jpg", "a\tb.jpg", "ab.jpg", "new\nline.jpg",
                         "cr\rname.jpg"}
    for key in (climb, f"{passwd}.jpg", "a\tb.jpg", "new\nline.jpg", "cr\rname.jpg"):
        assert _reason(rows[key]) == ("ok", None), key
        assert _image(rows[key], src) == INSIDE, key
    assert rows[f"{passwd}.jpg"].caption_original == "the caption inside"
    assert rows["cr\rname.jpg"].caption_original == "carriage"
    _no_secret(rows, src)


def test_image_folder_links_special_files_and_deep_sidecars(spark, tmp_path, outside):
    root = tmp_path / "photos"
    root.mkdir()
    (root / "ok.jpg").write_bytes(INSIDE)
    (root / "cap.jpg").write_bytes(INSIDE)
    os.symlink(outside / "secret.txt", root / "cap.txt")        # caption -> /etc/passwd
    os.symlink(outside / "secret.png", root / "x.png")          # image outside
    os.symlink(root / "ok.jpg", root / "inner.jpg")             # a link inside the root
    os.symlink(tmp_path / "gone.jpg", root / "dangling.jpg")
    os.mkfifo(root / "pipe.jpg")                                # blocks an open() for ever
    (root / "pside.jpg").write_bytes(INSIDE)
    os.mkfifo(root / "pside.txt")
    (root / "deep.jpg").write_bytes(INSIDE)
    (root / "deep.json").write_text("[" * 200_000)
    (root / "deep900.jpg").write_bytes(INSIDE)
    (root / "deep900.json").write_text('{"caption": "c", "x": ' + "[" * 900 + "]" * 900 + "}")
    (root / "linkdir").symlink_to(outside, target_is_directory=True)

    def read(follow):
        src = SourceConfig(name="photos", kind="image_folder", path=str(root),
                           follow_symlinks=follow)
        done: dict = {}
        t = threading.Thread(target=lambda: done.update(rows=_read(spark, src)), daemon=True)
        t.start()
        t.join(120)  # a FIFO opened for reading would hang here for ever
        assert not t.is_alive(), "the read hung"
        if follow != "anywhere":
            _no_secret(done["rows"], src)
        return done["rows"], src

    rows, src = read(False)
    reasons = {k: _reason(r) for k, r in rows.items()}
    assert reasons == {
        "ok.jpg": ("ok", None), "cap.jpg": ("rejected", "symlink"),
        "x.png": ("rejected", "symlink"), "inner.jpg": ("rejected", "symlink"),
        "dangling.jpg": ("rejected", "symlink"), "pipe.jpg": ("rejected", "not_a_file"),
        "pside.jpg": ("rejected", "not_a_file"), "deep.jpg": ("rejected", "invalid_sidecar"),
        "deep900.jpg": ("rejected", "invalid_sidecar"),
    }
    assert "cap.txt" in json.loads(rows["cap.jpg"].metadata_json)["detail"]
    assert "deeper than 64" in json.loads(rows["deep.jpg"].metadata_json)["detail"]

    # Followed, a link must stay inside the root; "anywhere" lifts that.
    rows, src = read(True)
    reasons = {k: _reason(r) for k, r in rows.items()}
    assert reasons["inner.jpg"] == ("ok", None) and _image(rows["inner.jpg"], src) == INSIDE
    assert reasons["cap.jpg"] == reasons["x.png"] == ("rejected", "outside_source")
    assert reasons["dangling.jpg"] == ("rejected", "dangling_link")
    assert not any(k.startswith("linkdir/") for k in rows)  # a folder link leading out
    rows, src = read("anywhere")
    assert _reason(rows["x.png"]) == ("ok", None)
    assert _image(rows["x.png"], src) == png_bytes() + SECRET  # as configured: read
    assert rows["cap.jpg"].caption_original == SECRET.decode()
    assert "linkdir/secret.png" in rows


def test_a_file_swapped_for_a_link_after_listing_is_not_followed(tmp_path, outside):
    root = tmp_path / "photos"
    root.mkdir()
    os.symlink(outside / "secret.jpg", root / "a.jpg")
    src = SourceConfig(name="photos", kind="image_folder", path=str(root))
    res = fetch_ref("file:" + str(root / "a.jpg"), rules=rules_for(src))
    assert (res.status, res.data) == ("symlink", None)
    os.mkfifo(root / "p.jpg")
    res = fetch_ref("file:" + str(root / "p.jpg"), rules=rules_for(src))
    assert (res.status, res.data) == ("not_a_file", None)


def test_tar_members_bounded_and_never_followed(spark, tmp_path, outside):
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.tar").write_bytes(tar_bytes([
        ("good.jpg", INSIDE), ("good.txt", b"fine"),
        ("bomb.jpg", INSIDE), ("bomb.json", b"[" * 200_000),
        ("deep.jpg", INSIDE), ("deep.json", b'{"caption": ' + b"[" * 900 + b"]" * 900 + b"}"),
        ("long.jpg", INSIDE), ("long.txt", b"w" * 5000),
        ("link.jpg", (tarfile.SYMTYPE, str(outside / "secret.jpg"))),
        ("hard.jpg", INSIDE), ("hard.txt", (tarfile.LNKTYPE, "good.txt")),
        ("fifo.jpg", (tarfile.FIFOTYPE, "")),
    ]))
    os.symlink(outside / "secret.txt", shards / "b.tar")  # a shard link found by the glob
    src = SourceConfig(name="tars", kind="webdataset", path=str(shards / "*.tar"),
                       max_caption_chars=1000)
    rows = _read(spark, src)
    assert {k: _reason(r) for k, r in rows.items()} == {
        "good": ("ok", None), "bomb": ("rejected", "invalid_sidecar"),
        "deep": ("rejected", "invalid_sidecar"), "long": ("rejected", "caption_too_long"),
        "link": ("rejected", "symlink"), "hard": ("rejected", "symlink"),
        "fifo": ("rejected", "not_a_file"), "b.tar#unreadable": ("rejected", "unreadable_file"),
    }
    assert json.loads(rows["b.tar#unreadable"].metadata_json)["detail"].startswith("symlink:")
    assert _image(rows["good"], src) == INSIDE and rows["good"].caption_original == "fine"
    assert rows["long"].caption_original is None
    _no_secret(rows, src)


def test_jsonl_a_deep_line_is_one_reject_and_the_rest_is_read(spark, tmp_path, outside):
    root = tmp_path / "table"
    (root / "imgs").mkdir(parents=True)
    (root / "imgs" / "a.jpg").write_bytes(INSIDE)
    os.symlink(outside / "secret.jpg", root / "imgs" / "link.jpg")
    lines = [json.dumps({"id": "k0", "u": "imgs/a.jpg", "c": "first"}),
             '{"id": "deep", "x": ' + "[" * 950 + "]" * 950 + "}",   # among the first 100
             "[" * 200_000,
             json.dumps({"id": "k1", "u": "imgs/a.jpg", "c": "after"}),
             json.dumps({"id": "up", "u": "../outside/secret.jpg", "c": "climb"}),
             json.dumps({"id": "up2", "u": "imgs/../../../outside/secret.jpg", "c": "climb"}),
             json.dumps({"id": "viaLink", "u": "imgs/link.jpg", "c": "link"}),
             json.dumps({"id": "long", "u": "imgs/a.jpg", "c": "y" * 200})]
    (root / "list.jsonl").write_text("\n".join(lines) + "\n")
    src = SourceConfig(name="t", kind="table", path=str(root / "list.jsonl"),
                       columns={"key": "id", "url": "u", "caption": "c"}, allow_local=True,
                       max_caption_chars=100)
    rows = _read(spark, src)  # check_inputs peeks at the first lines: no crash
    assert {k: _reason(r) for k, r in rows.items()} == {
        "k0": ("ok", None), "k1": ("ok", None), "list.jsonl#line2": ("rejected", "malformed_row"),
        "list.jsonl#line3": ("rejected", "malformed_row"),
        "up": ("rejected", "outside_source"), "up2": ("rejected", "outside_source"),
        "viaLink": ("rejected", "symlink"), "long": ("rejected", "caption_too_long"),
    }
    assert _image(rows["k1"], src) == INSIDE
    _no_secret(rows, src)


def test_table_folder_with_special_files_and_a_huge_csv_caption(spark, tmp_path):
    root = tmp_path / "tables"
    root.mkdir()
    (root / "a.csv").write_text(f"id,cap,img\nok,fine,x\nbig,{'z' * 300_000},y\n")
    os.mkfifo(root / "b.csv")
    src = SourceConfig(name="t", kind="table", path=str(root),
                       columns={"key": "id", "image": "img", "caption": "cap"})
    done: dict = {}
    t = threading.Thread(target=lambda: done.update(rows=_read(spark, src)), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the read hung on a FIFO"
    rows = done["rows"]
    assert {k: _reason(r) for k, r in rows.items()} == {
        "ok": ("ok", None), "big": ("rejected", "caption_too_long"),
        "b.csv#unreadable": ("rejected", "unreadable_file")}
    # Not opened, and why; an unreadable file defers the source's removals.
    assert json.loads(rows["b.csv#unreadable"].metadata_json)["detail"].startswith(
        "not_a_file: a named pipe (FIFO)")


def test_sidecar_captions_over_the_limit_are_one_reason_everywhere(spark, tmp_path):
    root = tmp_path / "photos"
    root.mkdir()
    for stem in ("txt", "json", "huge", "short"):
        (root / f"{stem}.jpg").write_bytes(INSIDE)
    (root / "txt.txt").write_text("a" * 101)
    (root / "json.json").write_text(json.dumps({"caption": "b" * 101}))
    (root / "huge.txt").write_bytes(b"c" * (2 << 20))  # over the read cap: not read whole
    (root / "short.txt").write_text("d" * 100)
    src = SourceConfig(name="photos", kind="image_folder", path=str(root),
                       max_caption_chars=100)
    rows = _read(spark, src)
    assert {k: _reason(r) for k, r in rows.items()} == {
        "txt.jpg": ("rejected", "caption_too_long"), "json.jpg": ("rejected", "caption_too_long"),
        "huge.jpg": ("rejected", "caption_too_long"), "short.jpg": ("ok", None)}
    assert rows["short.jpg"].caption_original == "d" * 100
