"""`lakeshard forget`: the request as typed (arguments, a file, what is refused before
Spark), report thumbnails, and one takedown end to end -- by URL and by image hash, the
records out of every table and their bytes out of the Lance files, the export after it,
and the same bytes back under other names the next night, refused."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from datetime import datetime

import lance
import pytest
import yaml
from conftest import JARS_DIR, files_holding, make_config
from httpserver import Server

from etl import tables
from etl.errors import ConfigError
from etl.jobs.curate import CurateResult
from etl.jobs.export import ExportRun
from etl.jobs.forget import ForgetResult
from etl.schema import TAKEDOWNS_SCHEMA, sample_id_of

# ----------------------------------------------------------------------- the request


def test_identifiers_from_arguments_and_a_file(tmp_path):
    from etl.jobs.forget import Identifier, parse_request

    ids = tmp_path / "ids.txt"
    ids.write_text("# ticket 17\n\nurl https://x.test/a.jpg\nKEY photos:2024/b c.jpg\n"
                   f"image_sha256 {'AB' * 32}\nsample-id {'0f' * 16}\n")
    req = parse_request({"sample_ids": ["1" * 32], "keys": ["photos:a.jpg"],
                         "file": str(ids), "by": "dpo@example.org", "reason": "opt-out",
                         "request_id": "DPO-2026/17"})
    assert req.request_id == "DPO-2026/17" and req.requested_by == "dpo@example.org"
    assert req.identifiers == (
        Identifier("sample_id", "1" * 32),
        Identifier("key", "photos:a.jpg", sample_id_of("photos", "a.jpg"), "photos"),
        Identifier("url", "https://x.test/a.jpg"),
        Identifier("key", "photos:2024/b c.jpg", sample_id_of("photos", "2024/b c.jpg"),
                   "photos"),
        Identifier("image_sha256", "ab" * 32),
        Identifier("sample_id", "0f" * 16),
    )


def test_a_key_names_the_same_sample_id_spark_computes(spark):
    from pyspark.sql import functions as F

    from etl.schema import sample_id_col

    row = spark.createDataFrame([("photos", "2024/b c.jpg")], "s string, k string").select(
        sample_id_col(F.col("s"), F.col("k")).alias("id")).first()
    assert row.id == sample_id_of("photos", "2024/b c.jpg")


@pytest.mark.parametrize("options, message", [
    ({}, "name at least one record"),
    ({"sample_ids": ["xyz"]}, "--sample-id: 'xyz' is not a sample id"),
    ({"hashes": ["ab" * 31]}, "is not a sha256"),
    ({"keys": ["no-colon"]}, "is not SOURCE:KEY"),
    ({"keys": ["bad name:k"]}, "is not SOURCE:KEY"),
    ({"urls": ["http://a b"]}, "a URL has no whitespace"),
    ({"urls": ["https://x.test/a.jpg"], "by": ""}, "--by (who asked) and --reason"),
    ({"urls": ["https://x.test/a.jpg"], "request_id": "a b"}, "--request-id"),
])
def test_a_bad_request_is_refused_naming_what_is_wrong(options, message):
    from etl.jobs.forget import parse_request

    opts = {"by": "dpo", "reason": "opt-out", **options}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_request(opts)


def test_a_bad_file_line_is_named(tmp_path):
    from etl.jobs.forget import parse_request

    f = tmp_path / "ids.txt"
    f.write_text("url https://x.test/a.jpg\nphash 123\n")
    with pytest.raises(ConfigError, match=r"ids.txt line 2: the line does not start with "
                       r"a kind \(one of") as err:
        parse_request({"file": str(f), "by": "dpo", "reason": "r"})
    assert "phash" not in str(err.value)  # the file's contents are not quoted


def test_the_command_line_maps_to_the_request():
    from etl.cli import build_parser

    args = build_parser().parse_args([
        "forget", "--url", "https://x.test/a.jpg", "--url", "https://x.test/b.jpg",
        "--image-sha256", "ab" * 32, "--by", "dpo", "--reason", "licence withdrawn",
        "--request-id", "T-1", "--dry-run"])
    assert (args.url, args.image_sha256, args.by, args.reason, args.request_id,
            args.dry_run) == (["https://x.test/a.jpg", "https://x.test/b.jpg"], ["ab" * 32],
                              "dpo", "licence withdrawn", "T-1", True)
    with pytest.raises(SystemExit):  # who and why are part of the record
        build_parser().parse_args(["forget", "--url", "https://x.test/a.jpg"])


def test_report_thumbnails_of_removed_records_are_deleted(tmp_path):
    from etl.report import scrub_reports

    cfg = make_config(tmp_path)
    run = tmp_path / "reports" / "r1"
    (run / "thumbs").mkdir(parents=True)
    for sid in ("a", "b", "c"):
        (run / "thumbs" / f"{sid}.jpg").write_bytes(b"jpeg")
    (run / "contact_kept.png").write_bytes(b"png")
    (run / "contact_flagged.png").write_bytes(b"png")
    (run / "report.json").write_text(json.dumps({"contact_kept": ["a", "b"],
                                                 "contact_flagged": ["c"]}))
    assert scrub_reports(cfg, {"b", "zz"}) == 1
    assert sorted(p.name for p in (run / "thumbs").iterdir()) == ["a.jpg", "c.jpg"]
    assert not (run / "contact_kept.png").exists() and (run / "contact_flagged.png").exists()
    assert json.loads((run / "report.json").read_text())["contact_kept"] == ["a"]

    # The duplicates' sheet too: a taken-down member leaves its cluster, and a cluster
    # left empty leaves the sheet.
    for sid in ("d", "e", "f"):
        (run / "thumbs" / f"{sid}.jpg").write_bytes(b"jpeg")
    (run / "contact_duplicates.png").write_bytes(b"png")
    meta = json.loads((run / "report.json").read_text())
    meta["dedup"] = {"clusters": 2, "contact_clusters": [["a", "d"], ["e"], ["f"]]}
    (run / "report.json").write_text(json.dumps(meta))
    assert scrub_reports(cfg, {"d", "e"}) == 2
    assert sorted(p.name for p in (run / "thumbs").iterdir()) == ["a.jpg", "c.jpg", "f.jpg"]
    assert not (run / "contact_duplicates.png").exists()
    dedup = json.loads((run / "report.json").read_text())["dedup"]
    assert dedup == {"clusters": 2, "contact_clusters": [["a"], ["f"]]}


# ------------------------------------------------------------------------ end to end


def _img(i: int) -> bytes:
    from PIL import Image

    rng = random.Random(100 + i)
    w, h = 80 + 4 * i, 64
    im = Image.frombytes("RGB", (w, h), bytes(rng.randrange(256) for _ in range(w * h * 3)))
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _as_png(jpeg: bytes) -> bytes:
    """The same picture saved as PNG: other bytes, the very same pixels."""
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(jpeg)).save(buf, format="PNG")
    return buf.getvalue()


def _urls(root, server, keys):
    (root / "urls.jsonl").write_text("".join(
        json.dumps({"id": k, "url": f"{server.url}/img/{k}.jpg", "text": f"url {k}"}) + "\n"
        for k in keys))


@pytest.mark.slow
def test_forget_by_url_and_image_hash_then_the_same_bytes_return_under_other_names(
        spark, tmp_path, capsys):
    from pyspark.sql import functions as F

    from etl.cli import main
    from etl.jobs.forget import format_forget
    from etl.jobs.verify_export import verify_export
    from etl.pipeline.runner import run_command, run_pipeline

    with Server() as server:
        inp = tmp_path / "in"
        (inp / "photos").mkdir(parents=True)
        for i in range(4):
            (inp / "photos" / f"p{i}.jpg").write_bytes(_img(i))
            (inp / "photos" / f"p{i}.txt").write_text(f"photo {i}")
        server.files.update({f"u{i}.jpg": _img(10 + i) for i in range(3)})
        _urls(inp, server, ["u0", "u1", "u2", "gone"])  # /img/gone.jpg: 404, a reject
        sources = [
            {"name": "photos", "kind": "image_folder", "path": str(inp / "photos")},
            {"name": "urls", "kind": "table", "path": str(inp / "urls.jsonl"),
             "columns": {"key": "id", "url": "url", "caption": "text"}},
        ]
        extra = {"fetch": {"retries": 0, "timeout_s": 5, "allow_networks": ["127.0.0.1/32"]},
                 "exports": {"train": {"partitions": 2, "where": None}},
                 "run": {"report": False}}
        cfg = make_config(tmp_path / "root", sources=sources, **extra)
        conf = tmp_path / "conf.yaml"  # the same settings, for the command line
        conf.write_text(yaml.safe_dump({
            "storage": {"root": str(tmp_path / "root")}, "sources": sources, **extra,
            "spark": {"master": "local[2]", "jars_dir": str(JARS_DIR),
                      "conf": {"spark.sql.shuffle.partitions": "2"}}}))
        paths = tables.layout(cfg)
        first = run_pipeline(cfg, only=("curate", "dedup", "export"))
        assert first.detail("curate", CurateResult).curated_rows == 7
        (old_export,) = first.detail("export", ExportRun).exports
        assert verify_export(old_export.path, loader_workers=0, loader_samples=4).ok
        old_key = json.loads(open(os.path.join(old_export.path, "manifest.json")).read())[
            "export_key"]

        u1, p2 = sample_id_of("urls", "u1"), sample_id_of("photos", "p2.jpg")
        gone = sample_id_of("urls", "gone")
        stored = {r["sample_id"]: r["image"] for r in lance.dataset(paths.curated).to_table(
            columns=["sample_id", "image"], filter=f"sample_id IN ('{u1}', '{p2}')").to_pylist()}
        for data in stored.values():
            assert files_holding(paths.curated, data)  # the search sees them now
        old_version = lance.dataset(paths.curated).version
        p2_file_hash = hashlib.sha256(_img(2)).hexdigest()  # what a requester holds

        # What a request would match, from the command line: nothing changes.
        capsys.readouterr()
        assert main(["--conf", str(conf), "forget", "--dry-run", "--by", "dpo",
                     "--reason", "check", "--image-sha256", p2_file_hash]) == 0
        printed = capsys.readouterr().out
        assert "match 1 record(s); nothing changed" in printed and p2 in printed
        assert lance.dataset(paths.curated).version == old_version

        # The takedown: a URL (u1), a file's hash (p2), and a URL that only ever failed.
        out = run_command(cfg, "forget", {
            "urls": [f"{server.url}/img/u1.jpg", f"{server.url}/img/gone.jpg"],
            "hashes": [p2_file_hash], "by": "dpo@example.org", "reason": "opt-out request",
            "request_id": "DPO-17"})
        res = out.detail("forget", ForgetResult)
        assert sorted(sid for sid, _ in res.matched) == sorted([u1, p2, gone])
        assert (res.removed_from("curated"), res.removed_from("rejects")) == (2, 1)
        assert res.purge is not None and res.purge.done
        assert res.stale_exports == ("train",)
        text = format_forget(res)
        assert "gone from storage now" in text and "export train" in text

        # Out of every table.
        left = set(lance.dataset(paths.curated).to_table(columns=["sample_id"])["sample_id"]
                   .to_pylist())
        assert not {u1, p2} & left and len(left) == 5
        assert spark.read.format("delta").load(paths.dedup).where(
            F.col("sample_id").isin(u1, p2)).count() == 0
        assert spark.read.format("delta").load(paths.rejects).where(
            F.col("sample_id") == gone).count() == 0
        manifest = {r.sample_id: r for r in spark.read.format("delta").load(paths.manifest)
                    .where(F.col("sample_id").isin(u1, p2, gone)).collect()}
        assert {(s, r.status, r.stage, r.reason) for s, r in manifest.items()} == {
            (u1, "removed", "curated", "taken_down"), (p2, "removed", "curated", "taken_down"),
            (gone, "removed", "rejects", "taken_down")}
        assert manifest[p2].caption_original is None  # what the source said, cleared
        assert manifest[p2].original_sha256 == p2_file_hash  # what it is known by, kept
        acc = spark.read.format("delta").load(paths.accounting).where(
            F.col("run_id") == out.run_id)
        assert {(r.source, r.status, r.stage, r.reason): r["count"] for r in acc.collect()} \
            == {("photos", "removed", "curated", "taken_down"): 1,
                ("urls", "removed", "curated", "taken_down"): 1,
                ("urls", "removed", "rejects", "taken_down"): 1}
        td = spark.read.format("delta").load(paths.takedowns).collect()
        assert {(r.request_id, r.requested_by, r.request_reason) for r in td} == {
            ("DPO-17", "dpo@example.org", "opt-out request")}
        assert {(r.origin, r.kind, r.value) for r in td if r.origin == "given"} == {
            ("given", "url", f"{server.url}/img/u1.jpg"),
            ("given", "url", f"{server.url}/img/gone.jpg"),
            ("given", "image_sha256", p2_file_hash)}
        matched = {(r.kind, r.sample_id) for r in td if r.origin == "matched"}
        assert {("sample_id", u1), ("url", u1), ("image_sha256", u1), ("sample_id", p2),
                ("image_sha256", p2)} <= matched
        assert all(r.applied_at is not None and r.purged_at is not None for r in td)

        # Bytes: in no file of the Lance dataset; time travel to before is refused.
        for data in stored.values():
            assert files_holding(paths.curated, data) == []
        with pytest.raises((ValueError, OSError)):
            lance.dataset(paths.curated, version=old_version)

        # The export written before still holds them: verify-export says so.
        taken = frozenset(r.sample_id for r in td if r.sample_id) | {u1, p2}
        stale = verify_export(old_export.path, loader_workers=0, loader_samples=4,
                              taken_down=taken)
        assert any("named by a takedown" in p for p in stale.problems)
        assert any("no longer exists" in p for p in stale.problems)

        # A second request that a forget recorded and then died before applying (the
        # state its first commit leaves): p3 is still in the table.
        p3 = sample_id_of("photos", "p3.jpg")
        spark.createDataFrame(
            [("DPO-18", datetime(2026, 11, 30), "dpo", "licence", "sample_id", p3, "given",
              p3, None, "dead-run", None, None, None, None)], TAKEDOWNS_SCHEMA) \
            .write.format("delta").mode("append").save(paths.takedowns)
        taken |= {p3}

        # The next export leaves all three out (p3 too, though still in the table), its
        # key changed, and it verifies.
        after = run_pipeline(cfg, only=("export",))
        (exp,) = after.detail("export", ExportRun).exports
        assert exp.samples == 4 and exp.resumed_partitions == 0
        manifest_json = json.loads(open(os.path.join(exp.path, "manifest.json")).read())
        assert manifest_json["export_key"] != old_key
        assert manifest_json["removals"] == {
            "removed": 2, "by_reason": {"taken_down": 2},
            "fingerprint": manifest_json["removals"]["fingerprint"], "excluded_taken_down": 1}
        report = verify_export(exp.path, loader_workers=0, loader_samples=4, taken_down=taken)
        assert report.ok, report.problems

        # The next night: the same bytes come back under other names -- the file copied
        # (same bytes), the picture saved as PNG (other bytes, the same stored JPEG once
        # prepared), u1's image at a new URL -- and u1's row is still in the list.
        hits_u1 = server.hits.get("/img/u1.jpg")
        (inp / "photos" / "copy.jpg").write_bytes(_img(2))
        (inp / "photos" / "relabelled.png").write_bytes(_as_png(_img(2)))
        server.files["u9.jpg"] = _img(11)
        _urls(inp, server, ["u0", "u1", "u2", "gone", "u9"])
        night = run_pipeline(cfg, only=("curate", "dedup", "export"))
        by = {c.source: c for c in night.detail("curate", CurateResult).counts}
        assert (by["photos"].seen, by["photos"].rejected, by["photos"].reasons) == (
            2, 2, {"taken_down": 2})
        # ... and the request the dead run left is finished: p3 out of every table.
        assert by["photos"].removed == {"taken_down": 1}
        assert p3 not in lance.dataset(paths.curated).to_table(columns=["sample_id"])[
            "sample_id"].to_pylist()
        assert spark.read.format("delta").load(paths.takedowns).where(
            "applied_at IS NULL").count() == 0
        assert (by["urls"].seen, by["urls"].rejected, by["urls"].reasons) == (
            1, 1, {"taken_down": 1})
        assert server.hits.get("/img/u1.jpg") == hits_u1  # not fetched again
        rejects = {r.source_key: (r.stage, r.reason, r.detail) for r in spark.read.format(
            "delta").load(paths.rejects).where(F.col("reason") == "taken_down").collect()}
        assert rejects == {
            "copy.jpg": ("ingest", "taken_down", "takedown DPO-17: same image sha256"),
            "relabelled.png": ("prepare", "taken_down", "takedown DPO-17: same image sha256"),
            "u9": ("ingest", "taken_down", "takedown DPO-17: same image sha256"),
        }
        (exp,) = night.detail("export", ExportRun).exports
        assert exp.samples == 4 and exp.resumed_partitions == 0  # p3's delete: a new version
        assert verify_export(exp.path, loader_workers=0, loader_samples=4,
                             taken_down=taken).ok
