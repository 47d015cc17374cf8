"""The `lakeshard` command.

Every command loads the config and checks it against the registries before anything
else. Commands that change a table (`run`, `curate`, `export`, `dedup`, `caption`,
`latents`, `features add`, `embed`, `compact`, `forget`) run through
:mod:`etl.pipeline.runner`:
under the root's run lock, recorded in the run ledger. The others only read.

The console (:func:`etl.runtime.progress.console`): the command's summary on stdout;
stage and progress lines, warnings and errors on stderr (``-v``: every log record and
event; ``--log-format json``: events and log records as JSON lines, for log shippers).
Exit codes: 0 done; 1 a stage failed on an exception (traceback, with where it is
recorded); 2 bad configuration, arguments or a missing input, before any work;
3 another run holds the root's lock; 4 a stage exceeded its failure budget
(``run.budgets``); `verify-export` exits 1 when it finds a problem.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from etl.config import Config, load_config
from etl.errors import BudgetExceededError, ConfigError, JarsMissingError, RunLockedError
from etl.runtime.progress import console, console_mode

__all__ = ["main", "build_parser"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _load(args) -> Config:
    """The config, parsed and checked against the registries; errors name the file."""
    from etl.pipeline.preflight import check_config

    cfg = load_config(args.conf)
    try:
        return check_config(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{args.conf or 'embedded conf/local.yaml'}: {exc}") from None


# ------------------------------------------------------------------ table-changing


def _pipeline(cfg: Config, **kw) -> int:
    """A pipeline run and its summary -- printed also when a stage is over its failure
    budget (what was done up to there), before the error."""
    from etl.pipeline.runner import run_pipeline
    from etl.pipeline.summary import format_outcome

    try:
        out = run_pipeline(cfg, **kw)
    except BudgetExceededError as exc:
        if exc.outcome is not None:
            print(format_outcome(exc.outcome))
        raise
    print(format_outcome(out))
    return 0


def _cmd_run(args) -> int:
    return _pipeline(_load(args), only=args.only, skip=args.skip,
                     export_names=tuple(args.export) or None, run_id=args.run_id)


def _cmd_curate(args) -> int:
    return _pipeline(_load(args), only=("curate",), run_id=args.run_id)


def _cmd_export(args) -> int:
    cfg = _load(args)
    names = tuple(args.name) or tuple(cfg.exports)
    if not names:
        raise ConfigError("exports: no export configured (add one under `exports:`)")
    return _pipeline(cfg, only=("export",), export_names=names, run_id=args.run_id)


def _cmd_dedup(args) -> int:
    from etl.jobs.dedup import format_dedup
    from etl.pipeline.runner import run_command

    out = run_command(_load(args), "dedup", {"full": args.full}, run_id=args.run_id)
    print(format_dedup(out.detail("dedup")))
    return 0


def _cmd_caption(args) -> int:
    from etl.jobs.caption import format_caption, write_caption_report
    from etl.pipeline.runner import run_command

    cfg = _load(args)
    over_budget = None
    try:
        out = run_command(cfg, "caption", {"version": args.version, "force": args.force,
                                           "limit": args.limit}, run_id=args.run_id)
    except BudgetExceededError as exc:  # what was captioned is committed: say so first
        over_budget, out = exc, exc.outcome
    result = out.detail("caption") if out is not None else None
    if result is None:  # no caption versions configured
        if over_budget is not None:
            raise over_budget
        print(f"caption: {out.results['caption'].note}")
        return 0
    print(format_caption(result))
    report = write_caption_report(cfg, result)
    if report:
        print(f"report            : {report}")
    if over_budget is not None:
        raise over_budget
    return 0


def _cmd_latents(args) -> int:
    from etl.jobs.latents import format_latents
    from etl.pipeline.runner import run_command

    out = run_command(_load(args), "latents", {
        "encoder": args.encoder, "recompute": args.recompute, "drop": args.drop,
    }, run_id=args.run_id)
    if args.drop:
        version, columns = out.detail("latents")
        if not columns:
            print(f"latents {args.encoder}: none in the curated table; nothing dropped")
        else:
            print(f"latents {args.encoder}: dropped {', '.join(columns)} (version {version})")
        return 0
    print(format_latents(out.detail("latents")))
    return 0


def _cmd_features(args) -> int:
    from etl import tables
    from etl.lakehouse.features import FEATURES

    cfg = _load(args)
    if args.action == "list":
        have = set(tables.open_curated(cfg).schema.names)
        for f in FEATURES.values():
            state = "present" if f.name in have else "-"
            print(f"{f.name:<16} {f.spark_type:<8} {state:<8} {f.doc}")
        return 0
    from etl.pipeline.runner import run_command

    out = run_command(cfg, "features", {"names": list(args.names),
                                        "only_missing": args.only_missing},
                      run_id=args.run_id)
    r = out.detail("features")
    print(
        f"{', '.join(r.names)}: {r.rows} rows -> version {r.version}; "
        f"wrote {r.bytes_written} bytes = {r.ratio:.5f} of the table's {r.table_bytes} "
        f"bytes; image data files {'unchanged' if r.image_files_unchanged else 'CHANGED'}"
    )
    return 0


def _cmd_embed(args) -> int:
    from etl.pipeline.runner import run_command

    cfg = _load(args)
    r = run_command(cfg, "embed", {"all": args.all}, run_id=args.run_id).detail("embed")
    emb = cfg.lakehouse.embedding
    print(
        f"{emb.column}: embedded {r.rows} captions in {r.fragments} fragment(s), "
        f"{r.bytes_written} bytes written; vector index {r.index_type or 'none'}; "
        f"version {r.version}"
    )
    return 0


def _cmd_compact(args) -> int:
    from etl import tables
    from etl.pipeline.runner import run_command

    cfg = _load(args)
    r = run_command(cfg, "compact", run_id=args.run_id).detail("compact")
    print(
        f"{tables.layout(cfg).curated}: {r.fragments_before} -> {r.fragments_after} "
        f"fragment(s) ({r.fragments_rewritten} rewritten); version {r.version_before} -> "
        f"{r.version_after}; removed {r.versions_removed} old version(s), "
        f"{r.bytes_removed} bytes; oldest readable version {r.oldest_version}"
    )
    return 0


def _cmd_forget(args) -> int:
    from etl.jobs.forget import format_forget
    from etl.pipeline.runner import run_command

    out = run_command(_load(args), "forget", {
        "sample_ids": args.sample_id, "keys": args.key, "urls": args.url,
        "hashes": args.image_sha256, "file": args.file, "by": args.by,
        "reason": args.reason, "request_id": args.request_id, "dry_run": args.dry_run,
    }, run_id=args.run_id)
    print(format_forget(out.detail("forget")))
    return 0


# ------------------------------------------------------------------------ read-only


def _cmd_runs(args) -> int:
    from etl import tables
    from etl.ledger import recent_runs, recent_runs_local
    from etl.pipeline.summary import format_runs

    cfg = _load(args)
    path = tables.layout(cfg).runs
    rows = recent_runs_local(path, limit=args.limit)  # no Spark session to start
    if rows is None:  # a ledger delta-rs does not read
        from etl.session import get_spark

        rows = recent_runs(get_spark(cfg), path, limit=args.limit)
    print(format_runs(rows, path, stages=args.stages))
    return 0


def _cmd_samples(args) -> int:
    from etl.sample_sources import ensure_samples

    cfg = _load(args)
    built = ensure_samples(cfg)
    for src in cfg.sources:
        if src.sample:
            state = "built" if src in built else "exists"
            print(f"{src.name:<20} {state:<7} {src.path}")
    return 0


def _cmd_sql(args) -> int:
    from etl.lakehouse.readonly import refusal
    from etl.lakehouse.views import register_views
    from etl.session import get_spark

    cfg = _load(args)
    spark = get_spark(cfg)
    refused = refusal(spark, args.query)  # parsed, not run
    if refused is not None:
        return _fail(f"lakeshard sql: refused: the statement is {refused}, which is not "
                     "read-only; lakeshard sql runs a query, EXPLAIN, SHOW or DESCRIBE "
                     "only (docs/sql.md#read-only)", 2)
    views = register_views(spark, cfg)
    logging.getLogger("lakeshard").info("views: %s", ", ".join(views) or "none")
    spark.sql(args.query).show(args.limit, truncate=not args.no_truncate)
    return 0


def _cmd_jpeg_audit(args) -> int:
    from etl.jobs.jpeg_audit import format_audit, jpeg_audit
    from etl.sample_sources import ensure_samples
    from etl.session import get_spark
    from etl.sources import adapter_for

    cfg = _load(args)
    src = cfg.source(args.source)  # an unknown name, a missing path: fail before Spark
    ensure_samples(cfg)
    adapter_for(src.kind).check_inputs(src)
    summary, out_dir = jpeg_audit(
        get_spark(cfg), cfg, args.source, sample=args.sample, generations=args.generations
    )
    print(format_audit(summary, out_dir))
    return 0


def _cmd_verify_export(args) -> int:
    from etl import tables
    from etl.jobs.verify_export import taken_down_ids, verify_export

    cfg = _load(args)
    path = tables.export_path(cfg, args.name)
    if "://" not in path and not os.path.isdir(path):
        raise FileNotFoundError(f"no export at {path}: run `lakeshard export --name {args.name}`")
    taken_down = taken_down_ids(cfg)
    report = verify_export(path, taken_down=taken_down)
    print(
        f"{path}: {report.samples} samples in {report.shards} shard(s); "
        f"{report.images_decoded} images decoded; {report.loader_samples} read through "
        "a shuffled DataLoader with 2 workers"
    )
    if taken_down is not None:
        print(f"takedowns: every sample checked against {len(taken_down)} taken-down id(s)")
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    print("OK" if report.ok else f"FAILED: {len(report.problems)} problem(s)")
    return 0 if report.ok else 1


def _cmd_search(args) -> int:
    from etl import tables
    from etl.lakehouse.embeddings import search

    cfg = _load(args)
    tables.open_curated(cfg)
    hits = search(tables.layout(cfg).curated, args.query, cfg.lakehouse.embedding, k=args.k,
                  where=args.where)
    for rank, h in enumerate(hits, 1):
        text = (h.text or "").replace("\n", " ")
        print(f"{rank:>3}  {h.distance:.4f}  {h.sample_id}  {h.source:<16} {text[:100]}")
    if not hits:
        print("no matches (no embedded rows pass the filter)")
    return 0


def _cmd_versions(args) -> int:
    from etl import tables
    from etl.lakehouse.maintenance import table_versions

    cfg = _load(args)
    tables.open_curated(cfg)
    print(f"{'version':>7}  {'timestamp (UTC)':<26} {'rows':>9} {'fragments':>9} {'bytes':>12}")
    for v in table_versions(tables.layout(cfg).curated):
        print(f"{v.version:>7}  {v.timestamp.isoformat():<26} {v.rows:>9} {v.fragments:>9} "
              f"{v.data_bytes:>12}")
    return 0


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lakeshard",
        description="Image-caption sources -> curated Lance table -> MDS shards.",
    )
    parser.add_argument(
        "--conf", help="YAML config (default: the embedded conf/local.yaml)", default=None
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show everything: debug logs and every event, with timestamps")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="json: every event and log record as one JSON object per line "
                        "on stderr (for log shippers); default: lines for people")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="the configured stages in order (default: all), "
                       "under the run lock, into the ledger, then the report")
    p.add_argument("--export", action="append", default=[], help="only this export (repeatable)")
    p.add_argument("--only", action="append", default=[], metavar="STAGE",
                   help="run only this stage (repeatable; overrides run.stages)")
    p.add_argument("--skip", action="append", default=[], metavar="STAGE",
                   help="skip this stage (repeatable)")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("curate", help="ingest sources, prepare images, write Lance + rejects")
    p.set_defaults(func=_cmd_curate)

    p = sub.add_parser("export", help="export the curated table to MDS")
    p.add_argument("--name", action="append", default=[], help="export name (repeatable)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser(
        "dedup", help="annotate exact and near duplicates of the curated table (Delta dedup)"
    )
    p.add_argument(
        "--full", action="store_true",
        help="recompare every row (default: new rows against everything)",
    )
    p.set_defaults(func=_cmd_dedup)

    p = sub.add_parser(
        "caption", help="add a caption version (VLM re-captioning) to the curated table"
    )
    p.add_argument("--version", default=None,
                   help="caption version under `caption.versions` (default: caption.default)")
    p.add_argument("--force", action="store_true",
                   help="recaption every selected row, not only those lacking the version")
    p.add_argument("--limit", type=_positive, default=None, help="caption at most N rows")
    p.set_defaults(func=_cmd_caption)

    p = sub.add_parser(
        "latents", help="precompute a text encoder's latents per caption into the curated table"
    )
    p.add_argument("--encoder", required=True, help="encoder name under `latents.encoders`")
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--recompute", action="store_true", help="replace existing latents of this encoder"
    )
    what.add_argument("--drop", action="store_true", help="drop this encoder's columns")
    p.set_defaults(func=_cmd_latents)

    p = sub.add_parser("features", help="list or add feature columns (no image rewrite)")
    p.add_argument("action", choices=["list", "add"])
    p.add_argument("names", nargs="*", help="feature names (see `features list`)")
    p.add_argument("--only-missing", action="store_true", help="only rows without a value")
    p.set_defaults(func=_cmd_features)

    p = sub.add_parser("embed", help="embed captions into the vector column + vector index")
    p.add_argument("--all", action="store_true", help="re-embed every caption, not only new")
    p.set_defaults(func=_cmd_embed)

    p = sub.add_parser("compact", help="compact fragments, clean versions past retention")
    p.set_defaults(func=_cmd_compact)

    p = sub.add_parser(
        "forget", help="a takedown request: remove the records it names from every table "
        "and refuse them from then on",
        description="Remove every record the identifiers name from the curated, dedup, "
        "rejects and manifest tables, purge their image bytes, and record the request in "
        "the Delta takedowns table so that later runs refuse them (by key, URL and image "
        "hash). A --file holds one `KIND VALUE` per line (KIND: sample-id, key, url, "
        "image-sha256; # comments).",
    )
    p.add_argument("--sample-id", action="append", default=[], metavar="ID",
                   help="a record's sample id (repeatable)")
    p.add_argument("--key", action="append", default=[], metavar="SOURCE:KEY",
                   help="a record's key in a source, e.g. photos:2024/a.jpg (repeatable)")
    p.add_argument("--url", action="append", default=[],
                   help="the image's URL or file URI (repeatable)")
    p.add_argument("--image-sha256", action="append", default=[], metavar="HASH",
                   help="sha256 of the image file, or of the stored JPEG (repeatable)")
    p.add_argument("--file", default=None, help="more identifiers, one `KIND VALUE` a line")
    p.add_argument("--by", required=True, help="who asked (recorded with the request)")
    p.add_argument("--reason", required=True, help="why (recorded with the request)")
    p.add_argument("--request-id", default=None,
                   help="the request's id, e.g. a ticket number (default: the run id)")
    p.add_argument("--dry-run", action="store_true",
                   help="list what the request matches; change nothing")
    p.set_defaults(func=_cmd_forget)

    for name in ("run", "curate", "export", "dedup", "caption", "latents", "features",
                 "embed", "compact", "forget"):
        sub.choices[name].add_argument(
            "--run-id", default=None,
            help="use this run id (e.g. the scheduler's) instead of a new one",
        )

    p = sub.add_parser("runs", help="recent runs from the run ledger (Delta `runs` table)")
    p.add_argument("--limit", type=_positive, default=10, help="how many runs")
    p.add_argument("--stages", action="store_true", help="one line per stage too")
    p.set_defaults(func=_cmd_runs)

    p = sub.add_parser("verify-export", help="check an export: counts, hashes, every image")
    p.add_argument("name", help="export name under `exports:`")
    p.set_defaults(func=_cmd_verify_export)

    p = sub.add_parser("samples", help="build the bundled sample sources if missing")
    p.set_defaults(func=_cmd_samples)

    p = sub.add_parser(
        "jpeg-audit", help="measure PSNR/SSIM of repeated JPEG re-encoding on a source sample"
    )
    p.add_argument("--source", required=True, help="configured source name")
    p.add_argument("--sample", type=_positive, default=50, help="images to audit")
    p.add_argument("--generations", type=_positive, default=5, help="re-encodes in a row")
    p.set_defaults(func=_cmd_jpeg_audit)

    p = sub.add_parser("sql", help="run a read-only Spark SQL statement (a query, EXPLAIN, "
                       "SHOW, DESCRIBE) over the Lance tables (views by name)")
    p.add_argument("query")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--no-truncate", action="store_true")
    p.set_defaults(func=_cmd_sql)

    p = sub.add_parser("search", help="semantic search over caption embeddings")
    p.add_argument("query")
    p.add_argument("-k", type=_positive, default=10, help="results")
    p.add_argument("--where", default=None, help="Lance SQL prefilter, e.g. keep")
    p.set_defaults(func=_cmd_search)

    p = sub.add_parser("versions", help="list the curated table's versions (time travel)")
    p.set_defaults(func=_cmd_versions)

    for sp in sub.choices.values():
        # Accept the global options after the subcommand too: `lakeshard run --conf x.yaml`.
        sp.add_argument("--conf", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        sp.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)
        sp.add_argument("--log-format", choices=("text", "json"), default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)
    return parser


def _fail(message: str, code: int) -> int:
    """An error for people (or, with --log-format json, as a JSON line); the exit code."""
    if console_mode().format == "json":
        print(json.dumps({"event": "error", "message": message, "exit_code": code}),
              file=sys.stderr, flush=True)
    else:
        print(message, file=sys.stderr, flush=True)
    return code


def _budget_message(exc: BudgetExceededError) -> str:
    out = exc.outcome
    lines = [f"lakeshard: run {out.run_id if out else '?'} FAILED: {exc}"]
    if out is not None:
        lines.append("Recorded as failed in the run ledger (`lakeshard runs --stages`)"
                     + (f"; report: {out.report}" if out.report else "")
                     + (f"; events: {out.events}" if out.events else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with console(args.log_format, args.verbose):
        try:
            return args.func(args)
        except ConfigError as exc:
            return _fail(f"lakeshard: config error: {exc}", 2)
        except (FileNotFoundError, JarsMissingError) as exc:
            return _fail(f"lakeshard: {exc}", 2)
        except RunLockedError as exc:
            return _fail(f"lakeshard: refused: {exc}", 3)
        except BudgetExceededError as exc:
            return _fail(_budget_message(exc), 4)
        except Exception as exc:
            if console_mode().format != "json":
                raise  # a bug or an outage: the traceback, with where the run is recorded
            import traceback

            return _fail("".join(traceback.format_exception(exc)).rstrip(), 1)


if __name__ == "__main__":
    sys.exit(main())
