"""One night over hostile sources, as `lakeshard run` does it (in-process): every
hostile record ends as a reason, the run completes with seen = accepted + rejected,
nothing outside the sources' roots is read, the report draws captions full of `$` as
text; `lakeshard sql` refuses to write; and a report that cannot be drawn leaves the
run `ok`, with the failure recorded."""

from __future__ import annotations

import html
import json
import os
import re

import pytest
import yaml
from conftest import JARS_DIR, files_holding, jpeg_bytes, make_config, tar_bytes

from etl import tables
from etl.jobs.curate import CurateResult
from etl.ledger import recent_runs_local

pytestmark = pytest.mark.slow

SECRET = b"SECRET-OUTSIDE-THE-ROOT root:x:0:0"
MATH = ["Earn $100 #1 tip $5", "Only $9.99 ^_^ sale $20", "<b>bold</b> & $x^2$ \\frac{1}{0}"]


def _sources(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    (outside / "secret.png").write_bytes(jpeg_bytes(size=(90, 90)))

    photos = tmp_path / "photos"
    (photos / "sub").mkdir(parents=True)
    for i, caption in enumerate(MATH):
        (photos / f"math{i}.jpg").write_bytes(jpeg_bytes(size=(96, 96), color=(40 * i, 9, 9)))
        (photos / f"math{i}.txt").write_text(caption)
    climb = "x%2F..%2F..%2Foutside%2Fsecret.txt#"
    (photos / f"{climb}.jpg").write_bytes(jpeg_bytes(size=(96, 96), color=(9, 200, 9)))
    (photos / f"{climb}.txt").write_text("inside caption")
    (photos / "a\tb.jpg").write_bytes(jpeg_bytes(size=(96, 96), color=(9, 9, 200)))
    (photos / "cap.jpg").write_bytes(jpeg_bytes(size=(96, 96)))
    os.symlink(outside / "secret.txt", photos / "cap.txt")
    os.symlink(outside / "secret.png", photos / "x.png")
    os.symlink(tmp_path / "nowhere.jpg", photos / "dangling.jpg")
    os.mkfifo(photos / "pipe.jpg")
    (photos / "deep.jpg").write_bytes(jpeg_bytes(size=(96, 96)))
    (photos / "deep.json").write_text('{"caption": "c", "x": ' + "[" * 900 + "]" * 900 + "}")
    (photos / "long.jpg").write_bytes(jpeg_bytes(size=(96, 96)))
    (photos / "long.txt").write_text("w" * 1001)

    table = tmp_path / "table"
    (table / "imgs").mkdir(parents=True)
    (table / "imgs" / "t.jpg").write_bytes(jpeg_bytes(size=(96, 96), color=(200, 200, 9)))
    lines = [json.dumps({"id": "k0", "u": "imgs/t.jpg", "c": "first"}),
             '{"id": "deep", "x": ' + "[" * 950 + "]" * 950 + "}",
             json.dumps({"id": "k1", "u": "imgs/t.jpg", "c": "second"}),
             json.dumps({"id": "up", "u": "../outside/secret.png", "c": "climb"})]
    (table / "list.jsonl").write_text("\n".join(lines) + "\n")

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.tar").write_bytes(tar_bytes([
        ("good.jpg", jpeg_bytes(size=(96, 96), color=(9, 99, 99))), ("good.txt", b"tar ok"),
        ("bomb.jpg", jpeg_bytes(size=(96, 96))), ("bomb.json", b"[" * 200_000)]))
    return [
        {"name": "photos", "kind": "image_folder", "path": str(photos),
         "max_caption_chars": 1000},
        {"name": "list", "kind": "table", "path": str(table / "list.jsonl"),
         "columns": {"key": "id", "url": "u", "caption": "c"}, "allow_local": True},
        {"name": "tars", "kind": "webdataset", "path": str(shards / "*.tar")},
    ]


def test_a_night_over_hostile_sources(spark, tmp_path, capsys):
    from etl.cli import main
    from etl.pipeline.runner import run_pipeline

    root = tmp_path / "lake"
    sources = _sources(tmp_path)
    cfg = make_config(root, sources=sources, run={"report_samples": 12})
    out = run_pipeline(cfg, only=("curate",), run_id="hostile-1")
    assert out.status == "ok" and out.report_error is None

    expected = {
        "photos": (5, {"symlink": 3, "not_a_file": 1, "invalid_sidecar": 1,
                       "caption_too_long": 1}),
        "list": (2, {"malformed_row": 1, "outside_source": 1}),
        "tars": (1, {"invalid_sidecar": 1}),
    }
    counts = {c.source: c for c in out.detail("curate", CurateResult).counts}
    for name, (accepted, reasons) in expected.items():
        c = counts[name]
        assert (c.accepted, c.reasons) == (accepted, dict(sorted(reasons.items()))), name
        assert c.seen == c.accepted + c.rejected, name

    # Nothing outside a root was read: the secret is in no table, no report, no file.
    assert files_holding(root, SECRET) == []
    assert files_holding(root, b"SECRET-OUTSIDE") == []

    # The report: written, every caption drawn as text and escaped in the HTML.
    index = (root / "reports" / "hostile-1" / "index.html").read_text()
    for caption in MATH:
        assert html.escape(caption) in index
    assert "<b>bold</b>" not in index
    assert (root / "reports" / "hostile-1" / "summary.json").exists()
    runs = recent_runs_local(tables.layout(cfg).runs, limit=5)
    assert [(r["run_id"], r["status"]) for r in runs if r["stage"] == "run"] == \
        [("hostile-1", "ok")]

    # lakeshard sql: read-only statements only, refused before Spark runs them.
    conf = tmp_path / "conf.yaml"
    conf.write_text(yaml.safe_dump({
        "storage": {"root": str(root)},
        "spark": {"master": "local[2]", "jars_dir": str(JARS_DIR),
                  "conf": {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"}},
        "sources": sources,
    }))
    rejects = tables.layout(cfg).rejects
    n_rejects = spark.read.format("delta").load(rejects).count()
    elsewhere = tmp_path / "elsewhere"
    for sql, kind in [
        (f"DELETE FROM delta.`{rejects}` WHERE reason = 'symlink'", "DELETE (DeleteFromTable)"),
        (f"CREATE TABLE t USING delta LOCATION '{elsewhere}' AS SELECT * FROM "
         f"delta.`{rejects}`", "CREATE TABLE AS SELECT"),
        (f"WITH r AS (SELECT 1 AS a) INSERT INTO delta.`{rejects}` SELECT * FROM r",
         "INSERT (InsertIntoStatement)"),
        (f"EXPLAIN UPDATE delta.`{rejects}` SET reason = 'x'", "UPDATE"),
        (f"ALTER TABLE delta.`{rejects}` SET LOCATION '{elsewhere}'", "SET LOCATION"),
        ("SET spark.sql.warehouse.dir=/tmp/x", "SET (SetCommand)"),
        (f"VACUUM delta.`{rejects}` RETAIN 0 HOURS", "VACUUM"),
    ]:
        capsys.readouterr()
        assert main(["sql", "--conf", str(conf), sql]) == 2, sql
        err = capsys.readouterr().err
        assert "refused" in err and kind in err, (sql, err)
    assert spark.read.format("delta").load(rejects).count() == n_rejects
    assert not elsewhere.exists()
    capsys.readouterr()
    assert main(["sql", "--conf", str(conf),
                 f"SELECT reason, count(*) AS n FROM delta.`{rejects}` "
                 "WHERE reason = 'outside_source' GROUP BY reason"]) == 0
    assert re.search(r"^\|outside_source\|\s*1\|$", capsys.readouterr().out, re.M)
    assert main(["sql", "--conf", str(conf), f"DESCRIBE HISTORY delta.`{rejects}`"]) == 0

    # A report that cannot be written (its thumbnails folder is a file) fails nothing:
    # the run is ok, the error is in summary.json and the ledger, the row not `running`.
    report_dir = root / "reports" / "hostile-2"
    report_dir.mkdir(parents=True)
    (report_dir / "thumbs").write_text("not a folder")
    out = run_pipeline(cfg, only=("curate",), run_id="hostile-2")
    assert out.status == "ok"
    assert out.report_error is not None and "FileExistsError" in out.report_error
    summary = json.loads((report_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and "FileExistsError" in summary["report_error"]
    runs = recent_runs_local(tables.layout(cfg).runs, limit=5)
    run2 = [r for r in runs if r["run_id"] == "hostile-2" and r["stage"] == "run"]
    assert [r["status"] for r in run2] == ["ok"]
    assert run2[0]["note"].startswith("report failed: FileExistsError")
