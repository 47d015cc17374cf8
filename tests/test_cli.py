"""The `lakeshard` command as users run it (a real subprocess)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import yaml
from conftest import JARS_DIR


def _lakeshard(*args, cwd=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "etl.cli", *args],
        capture_output=True, text=True, cwd=cwd, timeout=timeout,
    )


def _write_conf(tmp_path, **over):
    conf = {
        "storage": {"root": str(tmp_path / "data")},
        "spark": {"master": "local[2]", "jars_dir": str(JARS_DIR),
                  "conf": {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"}},
        "sources": [
            {"name": "pics", "kind": "image_folder", "path": str(tmp_path / "pics"),
             "sample": True},
        ],
        "exports": {"default": {"partitions": 2}},
    }
    conf.update(over)
    path = tmp_path / "conf.yaml"
    path.write_text(yaml.safe_dump(conf))
    return path


def test_bad_config_fails_fast_naming_the_field(tmp_path):
    conf = _write_conf(tmp_path)
    raw = yaml.safe_load(conf.read_text())
    raw["sources"][0]["kind"] = "ftp"
    conf.write_text(yaml.safe_dump(raw))
    t0 = time.monotonic()
    res = _lakeshard("run", "--conf", str(conf))
    assert res.returncode == 2
    assert "sources[0] (pics).kind: unknown kind 'ftp'" in res.stderr
    assert "SparkSession" not in res.stderr and time.monotonic() - t0 < 30


def test_missing_source_path_fails_before_spark(tmp_path):
    conf = _write_conf(tmp_path)
    raw = yaml.safe_load(conf.read_text())
    raw["sources"][0].update(sample=False, path=str(tmp_path / "nowhere"))
    conf.write_text(yaml.safe_dump(raw))
    res = _lakeshard("curate", "--conf", str(conf))
    assert res.returncode == 2
    assert "'pics': path" in res.stderr and "does not exist" in res.stderr
    assert not (tmp_path / "data").exists()


def test_missing_jars_say_which_command_fixes_it(tmp_path):
    conf = _write_conf(tmp_path)
    raw = yaml.safe_load(conf.read_text())
    raw["spark"]["jars_dir"] = str(tmp_path / "nojars")
    conf.write_text(yaml.safe_dump(raw))
    res = _lakeshard("curate", "--conf", str(conf))
    assert res.returncode == 2 and "make jars" in res.stderr


def test_unknown_export_name_is_refused(tmp_path):
    res = _lakeshard("export", "--conf", str(_write_conf(tmp_path)), "--name", "nope")
    assert res.returncode == 2 and "no export named 'nope'" in res.stderr


@pytest.mark.slow
def test_run_prints_the_per_source_table_and_outputs(tmp_path):
    res = _lakeshard("run", "--conf", str(_write_conf(tmp_path)))
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "pics" in out and "seen" in out and "accepted" in out
    assert "curated (Lance)" in out and "export (MDS)" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("pics"))
    seen, accepted, rejected = (int(x) for x in line.split()[1:4])
    assert seen == accepted + rejected and accepted == 7 and rejected == 3
    assert (tmp_path / "data" / "mds" / "default" / "index.json").exists()
    # The console is for people: stage lines and the summary, no JSON events; the run's
    # events.jsonl holds them all.
    assert "lakeshard.events" not in res.stderr and '{"event"' not in res.stderr
    assert "[lakeshard] curate: started" in res.stderr
    assert "[lakeshard] export: done in" in res.stderr
    (run_id,) = re.findall(r"^lakeshard run (\S+)$", out, re.M)
    events_file = tmp_path / "data" / "reports" / run_id / "events.jsonl"
    events = [json.loads(ln) for ln in events_file.read_text().splitlines()]
    names = [e["event"] for e in events]
    assert names[0] == "run_start" and names[-1] == "run_end"
    for stage in ("curate", "dedup", "caption", "export"):
        assert ("stage_start", stage) in [(e["event"], e.get("stage")) for e in events]
        assert ("stage_end", stage) in [(e["event"], e.get("stage")) for e in events]
    # Curate's named steps, each timed, in order, inside the stage.
    steps = [e for e in events if e["event"] == "step_end"]
    assert [(e["stage"], e["step"]) for e in steps] == [("curate", s) for s in (
        "finish pending takedowns", "list sources, compare with the manifest",
        "fetch + prepare new records, write them to Lance", "commit Lance curated",
        "merge Delta rejects, manifest, accounting")]
    curate_end = names.index("stage_end")  # curate's: the first stage
    assert events[curate_end]["stage"] == "curate"
    assert all(events.index(e) < curate_end and e["run_id"] == run_id for e in steps)
    assert 0 <= sum(e["seconds"] for e in steps) <= events[curate_end]["seconds"]

    # Again, nothing new: nothing to warn about (dedup covers every row).
    res = _lakeshard("run", "--conf", str(_write_conf(tmp_path)))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "dedup covers" not in res.stderr, res.stderr
    # No warning of lakeshard's own (the JVM's start-up lines come before any setting).
    assert not re.search(r"^WARNING (etl|udfs|lakeshard)", res.stderr, re.M), res.stderr
    assert "[lakeshard] dedup: done in" in res.stderr

    res = _lakeshard("verify-export", "--conf", str(_write_conf(tmp_path)), "default")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.strip().endswith("OK") and "7 images decoded" not in res.stdout
    assert "6 images decoded" in res.stdout  # the 7th accepted image is flagged, not exported

    res = _lakeshard("sql", "--conf", str(_write_conf(tmp_path)),
                     "SELECT count(*) AS n FROM curated")
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"^\|\s*7\|$", res.stdout, re.M), res.stdout


@pytest.mark.slow
def test_jpeg_audit_on_the_sample_source(tmp_path):
    conf = _write_conf(tmp_path)
    res = _lakeshard("jpeg-audit", "--conf", str(conf), "--source", "pics", "--sample", "3",
                     "--generations", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    gens = [ln.split() for ln in lines if ln.strip()[:1].isdigit()]
    assert [g[0] for g in gens] == ["1", "2"]
    assert all(float(g[1]) > 30 for g in gens)  # mean PSNR in dB
    (report,) = (tmp_path / "data" / "reports").glob("jpeg-audit-pics-*")
    assert (report / "audit.png").stat().st_size > 1000
    assert (report / "audit.json").exists()
    assert _lakeshard("jpeg-audit", "--conf", str(conf), "--source", "nope").returncode == 2


# ------------------------------------------------------------ commands declared once
# Each command's flags are the fields of its typed options (etl/runtime/options.py),
# declared beside its stage; the parser is built from the stage registry.

# The flags every command took before the parser was built from the registry (from the
# hand-written parser), written out here so that a lost or renamed flag fails.
_FLAGS = {
    "run": {"--export", "--only", "--skip", "--run-id"},
    "curate": {"--run-id"},
    "export": {"--name", "--run-id"},
    "dedup": {"--full", "--run-id"},
    "caption": {"--version", "--force", "--limit", "--run-id"},
    "latents": {"--encoder", "--recompute", "--drop", "--run-id"},
    "features": {"action", "names", "--only-missing", "--run-id"},
    "embed": {"--all", "--run-id"},
    "compact": {"--run-id"},
    "forget": {"--sample-id", "--key", "--url", "--image-sha256", "--file", "--by",
               "--reason", "--request-id", "--dry-run", "--run-id"},
    "runs": {"--limit", "--stages"},
    "verify-export": {"name"},
    "samples": set(),
    "jpeg-audit": {"--source", "--sample", "--generations"},
    "sql": {"query", "--limit", "--no-truncate"},
    "sql-server": {"--host", "--port"},
    "search": {"query", "-k", "--where"},
    "versions": set(),
}


def _subparsers():
    import argparse

    from etl.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub


def test_every_command_keeps_its_flags_and_the_registry_is_the_source():
    from etl.pipeline.stages import COMMANDS, STAGES

    sub = _subparsers()
    assert list(sub.choices) == list(_FLAGS)  # the order `lakeshard --help` lists them in
    for name, p in sub.choices.items():
        shown = {s for a in p._actions if a.help != "==SUPPRESS==" and a.dest != "help"
                 for s in (a.option_strings or [a.dest])}
        assert shown == _FLAGS[name], name
    # A registered stage's one-line description is its command's --help line.
    help_lines = {a.dest: a.help for a in sub._choices_actions}
    for stage in (*STAGES, *COMMANDS):
        assert help_lines[stage.name] == stage.description


@pytest.mark.parametrize("argv, expected", [
    (["dedup"], ("etl.jobs.dedup", "DedupOptions", {"full": False})),
    (["dedup", "--full"], ("etl.jobs.dedup", "DedupOptions", {"full": True})),
    (["caption", "--version", "v2", "--force", "--limit", "3"],
     ("etl.jobs.caption", "CaptionOptions", {"version": "v2", "force": True, "limit": 3})),
    (["latents", "--encoder", "t5", "--drop"],
     ("etl.jobs.latents", "LatentsOptions", {"encoder": "t5", "recompute": False,
                                             "drop": True})),
    (["features", "add", "megapixels", "aspect", "--only-missing"],
     ("etl.jobs.lakehouse", "FeaturesOptions",
      {"action": "add", "names": ("megapixels", "aspect"), "only_missing": True})),
    (["features", "list"], ("etl.jobs.lakehouse", "FeaturesOptions",
                            {"action": "list", "names": (), "only_missing": False})),
    (["embed", "--all"], ("etl.jobs.lakehouse", "EmbedOptions", {"all": True})),
    (["forget", "--sample-id", "1" * 32, "--key", "p:a.jpg", "--url", "u1", "--url", "u2",
      "--image-sha256", "ab" * 32, "--file", "ids.txt", "--by", "dpo", "--reason", "why",
      "--request-id", "T-1", "--dry-run"],
     ("etl.jobs.forget", "ForgetOptions",
      {"sample_ids": ("1" * 32,), "keys": ("p:a.jpg",), "urls": ("u1", "u2"),
       "hashes": ("ab" * 32,), "file": "ids.txt", "by": "dpo", "reason": "why",
       "request_id": "T-1", "dry_run": True})),
    (["run", "--only", "curate", "--only", "dedup", "--skip", "export", "--export", "x"],
     ("etl.cli.commands", "RunOptions", {"only": ("curate", "dedup"), "skip": ("export",),
                                "export": ("x",)})),
    (["export", "--name", "a", "--name", "b"], ("etl.cli.commands", "ExportOptions",
                                               {"names": ("a", "b")})),
    (["runs"], ("etl.cli.queries", "RunsOptions", {"limit": 10, "stages": False})),
    (["jpeg-audit", "--source", "pics"],
     ("etl.cli.queries", "JpegAuditOptions", {"source": "pics", "sample": 50, "generations": 5})),
    (["sql", "SELECT 1", "--limit", "5", "--no-truncate"],
     ("etl.cli.queries", "SqlOptions", {"query": "SELECT 1", "limit": 5, "no_truncate": True})),
    (["search", "a red bus", "-k", "3", "--where", "keep"],
     ("etl.cli.queries", "SearchOptions", {"query": "a red bus", "k": 3, "where": "keep"})),
    (["verify-export", "default"], ("etl.cli.queries", "VerifyExportOptions", {"name": "default"})),
])
def test_the_command_line_becomes_the_commands_typed_options(argv, expected):
    from dataclasses import asdict
    from importlib import import_module

    from etl.cli import parse

    module, cls, fields = expected
    _, command, options = parse(argv)
    assert command.name == argv[0]
    assert type(options) is getattr(import_module(module), cls)
    assert asdict(options) == fields


@pytest.mark.parametrize("argv", [
    ["caption", "--limit", "0"],  # >= 1
    ["latents", "--encoder", "t5", "--recompute", "--drop"],  # one or the other
    ["latents"],  # --encoder is required
    ["forget", "--url", "u"],  # who and why are required
    ["features", "remove"],  # list | add
    ["dedup", "--fulll"],  # argparse refuses a misspelt flag
    ["runs", "--run-id", "r"],  # a command that only reads takes no run id
])
def test_a_bad_command_line_exits_2(argv, capsys):
    from etl.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "usage: lakeshard" in capsys.readouterr().err


def test_a_misspelt_option_key_is_an_error_before_any_work(tmp_path):
    from conftest import make_config

    from etl.jobs.caption import CaptionOptions
    from etl.pipeline.runner import run_command

    cfg = make_config(tmp_path / "root")
    with pytest.raises(TypeError, match=r"DedupOptions: unknown option\(s\) 'ful' "
                       r"\(known: full\)"):
        run_command(cfg, "dedup", {"ful": True})
    with pytest.raises(TypeError, match="takes DedupOptions"):
        run_command(cfg, "dedup", CaptionOptions(force=True))
    with pytest.raises(TypeError, match="stage 'compact' takes no options"):
        run_command(cfg, "compact", {"all": True})
    assert not (tmp_path / "root").exists()  # no lock, no ledger, no Spark


def test_a_run_context_holds_typed_options_only():
    from etl.jobs.caption import CaptionOptions
    from etl.jobs.dedup import DedupOptions
    from etl.runtime.stage import RunContext

    ctx = RunContext(run_id="r", options=(DedupOptions(full=True),))
    assert ctx.options_for(DedupOptions).full is True
    # A stage the run gave nothing gets its defaults (a `lakeshard run` captions the
    # default version of rows lacking it).
    assert ctx.options_for(CaptionOptions) == CaptionOptions(None, False, None)
    with pytest.raises(AttributeError):
        ctx.options_for(DedupOptions).ful  # noqa: B018  (a misspelt field)
    with pytest.raises(TypeError, match="is not a typed options object"):
        RunContext(run_id="r", options=({"dedup": {"full": True}},))
    with pytest.raises(TypeError, match="holds one twice"):
        RunContext(run_id="r", options=(DedupOptions(), DedupOptions(full=True)))
    with pytest.raises(TypeError, match="frozen dataclass"):
        ctx.options_for(dict)


def test_options_from_a_mapping_names_unknown_keys_and_keeps_tuples():
    from etl.jobs.forget import ForgetOptions
    from etl.runtime.options import flag, options_from

    opts = options_from(ForgetOptions, {"urls": ["a", "b"], "by": "x", "reason": "y"})
    assert opts.urls == ("a", "b") and opts.sample_ids == () and opts.dry_run is False
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'url', 'why'"):
        options_from(ForgetOptions, {"url": ["a"], "why": "y"})
    with pytest.raises(TypeError, match="default is a tuple"):
        flag([], "a list default would be shared between instances")


def test_what_the_lakehouse_and_latents_commands_print():
    """Each command's output comes from its job's render function: the lines written
    out here are the ones the CLI printed before the renderers moved beside the stages."""
    from pathlib import Path
    from types import SimpleNamespace as NS

    from conftest import make_config

    from etl import tables
    from etl.jobs.lakehouse import (
        Compacted,
        Embedded,
        EmbedOptions,
        FeaturesAdded,
        FeaturesOptions,
        render_compact,
        render_embed,
        render_features,
    )
    from etl.jobs.latents import LatentsDropped, LatentsOptions, render
    from etl.runtime.stage import StageResult

    cfg = make_config(Path("/nonexistent-root"))
    feats = NS(names=["megapixels", "aspect"], rows=7, version=3, bytes_written=120,
               ratio=0.000123456, table_bytes=972000, image_files_unchanged=True)
    assert render_features(cfg, FeaturesOptions(), StageResult(detail=FeaturesAdded(feats))) == (
        "megapixels, aspect: 7 rows -> version 3; wrote 120 bytes = 0.00012 of the "
        "table's 972000 bytes; image data files unchanged")
    emb = NS(rows=5, fragments=2, bytes_written=4096, index_type=None, version=9)
    assert render_embed(cfg, EmbedOptions(), StageResult(detail=Embedded(emb))) == (
        f"{cfg.lakehouse.embedding.column}: embedded 5 captions in 2 fragment(s), 4096 "
        "bytes written; vector index none; version 9")
    comp = NS(fragments_before=4, fragments_after=1, fragments_rewritten=4,
              version_before=6, version_after=7, versions_removed=5, bytes_removed=333,
              oldest_version=7)
    assert render_compact(cfg, None, StageResult(detail=Compacted(comp))) == (
        f"{tables.layout(cfg).curated}: 4 -> 1 fragment(s) (4 rewritten); "
        "version 6 -> 7; removed 5 old version(s), 333 bytes; oldest readable version 7")
    drop = LatentsOptions(encoder="t5", drop=True)
    assert render(cfg, drop, StageResult(
        detail=LatentsDropped(4, ("latents_t5_a", "latents_t5_b")))) == \
        "latents t5: dropped latents_t5_a, latents_t5_b (version 4)"
    assert render(cfg, drop, StageResult(detail=LatentsDropped(4, ()))) == \
        "latents t5: none in the curated table; nothing dropped"
