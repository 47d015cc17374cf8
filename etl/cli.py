"""The `lakeshard` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from etl.config import Config, ConfigError, load_config

__all__ = ["main"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _load(args) -> Config:
    return load_config(args.conf)


def _cmd_run(args) -> int:
    from etl.jobs.run import format_outcome, run_stages

    out = run_stages(
        _load(args), only=tuple(args.only), skip=tuple(args.skip),
        export_names=tuple(args.export) or None, run_id=args.run_id,
    )
    print(format_outcome(out))
    return 0


def _cmd_curate(args) -> int:
    from etl.jobs.run import format_outcome, run_stages

    print(format_outcome(run_stages(_load(args), only=("curate",), run_id=args.run_id)))
    return 0


def _cmd_export(args) -> int:
    from etl.jobs.run import format_outcome, run_stages

    cfg = _load(args)
    names = tuple(args.name) or tuple(e.name for e in cfg.exports)
    if not names:
        raise ConfigError("exports: no export configured (add one under `exports:`)")
    out = run_stages(cfg, only=("export",), export_names=names, run_id=args.run_id)
    print(format_outcome(out))
    return 0


def _cmd_runs(args) -> int:
    from etl.jobs.runs import format_runs
    from etl.ledger import RUNS_TABLE, recent_runs
    from etl.session import get_spark

    cfg = _load(args)
    path = cfg.storage.delta_table(RUNS_TABLE)
    rows = recent_runs(get_spark(cfg), path, limit=args.limit)
    print(format_runs(rows, path, stages=args.stages))
    return 0


def _cmd_samples(args) -> int:
    from etl.samples import ensure_samples

    cfg = _load(args)
    built = ensure_samples(cfg)
    for src in cfg.sources:
        if src.sample:
            state = "built" if src in built else "exists"
            print(f"{src.name:<20} {state:<7} {src.path}")
    return 0


def _cmd_sql(args) -> int:
    from etl.session import get_spark, register_lance_views

    cfg = _load(args)
    spark = get_spark(cfg)
    views = register_lance_views(spark, cfg)
    logging.getLogger("lakeshard").info("views: %s", ", ".join(views) or "none")
    spark.sql(args.query).show(args.limit, truncate=not args.no_truncate)
    return 0


def _cmd_jpeg_audit(args) -> int:
    from etl.jobs.jpeg_audit import format_audit, jpeg_audit
    from etl.samples import ensure_samples
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
    from etl.jobs.verify_export import verify_export

    cfg = _load(args)
    cfg.export(args.name)
    path = cfg.storage.export_dir(args.name)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no export at {path}: run `lakeshard export --name {args.name}`")
    report = verify_export(path)
    print(
        f"{path}: {report.samples} samples in {report.shards} shard(s); "
        f"{report.images_decoded} images decoded; {report.loader_samples} read through "
        "a shuffled DataLoader with 2 workers"
    )
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    print("OK" if report.ok else f"FAILED: {len(report.problems)} problem(s)")
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lakeshard",
        description="Image-caption sources -> curated Lance table -> MDS shards.",
    )
    parser.add_argument(
        "--conf", help="YAML config (default: the embedded conf/local.yaml)", default=None
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
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

    for sp in (sub.choices["run"], sub.choices["curate"], sub.choices["export"]):
        sp.add_argument("--run-id", default=None,
                        help="use this run id (e.g. the scheduler's) instead of a new one")

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

    p = sub.add_parser("sql", help="run Spark SQL over the Lance tables (views by name)")
    p.add_argument("query")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--no-truncate", action="store_true")
    p.set_defaults(func=_cmd_sql)

    for _name, sp in sub.choices.items():
        # Accept --conf after the subcommand too: `lakeshard run --conf x.yaml`.
        sp.add_argument("--conf", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    from etl.lock import RunLockedError
    from etl.session import JarsMissingError

    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"lakeshard: config error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, JarsMissingError) as exc:
        print(f"lakeshard: {exc}", file=sys.stderr)
        return 2
    except RunLockedError as exc:
        print(f"lakeshard: refused: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
