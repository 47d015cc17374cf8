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
    from etl.jobs.run import format_summary, run

    run_id, cur, exports = run(_load(args), export_names=tuple(args.export) or None)
    print(format_summary(run_id, cur, exports))
    return 0


def _cmd_curate(args) -> int:
    from etl.jobs.run import format_summary, run

    run_id, cur, _ = run(_load(args), stages=("curate",))
    print(format_summary(run_id, cur, []))
    return 0


def _cmd_export(args) -> int:
    from etl.jobs.run import format_summary, run

    cfg = _load(args)
    names = tuple(args.name) or tuple(e.name for e in cfg.exports)
    if not names:
        raise ConfigError("exports: no export configured (add one under `exports:`)")
    run_id, _, exports = run(cfg, stages=("export",), export_names=names)
    print(format_summary(run_id, None, exports))
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
    path = cfg.export_path(args.name)
    from etl.writers.remote import is_remote

    if not is_remote(path) and not os.path.isdir(path):
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


def _cmd_caption(args) -> int:
    from etl.jobs.caption import caption, format_caption, plan_caption, write_caption_report
    from etl.session import get_spark

    cfg = _load(args)
    # Config, model, table and the rows to do are checked before Spark starts; with
    # nothing to do, Spark never starts.
    plan = plan_caption(cfg, args.version, force=args.force)
    spark = get_spark(cfg) if plan.todo else None
    result = caption(spark, cfg, args.version, force=args.force, limit=args.limit)
    print(format_caption(result))
    report = write_caption_report(cfg, result)
    if report:
        print(f"report            : {report}")
    return 0


def _cmd_latents(args) -> int:
    from etl.jobs.latents import compute_latents, drop_latents, format_latents

    cfg = _load(args)
    cfg.latents.encoder(args.encoder)  # an unknown encoder fails here, before Spark
    if args.drop:
        version, columns = drop_latents(cfg, args.encoder)
        if not columns:
            print(f"latents {args.encoder}: none in the curated table; nothing dropped")
        else:
            print(f"latents {args.encoder}: dropped {', '.join(columns)} (version {version})")
        return 0
    from etl.session import get_spark

    res = compute_latents(get_spark(cfg), cfg, args.encoder, recompute=args.recompute)
    print(format_latents(res))
    return 0


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

    p = sub.add_parser("run", help="all stages: curate, then every configured export")
    p.add_argument("--export", action="append", default=[], help="only this export (repeatable)")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("curate", help="ingest sources, prepare images, write Lance + rejects")
    p.set_defaults(func=_cmd_curate)

    p = sub.add_parser("export", help="export the curated table to MDS")
    p.add_argument("--name", action="append", default=[], help="export name (repeatable)")
    p.set_defaults(func=_cmd_export)

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


if __name__ == "__main__":
    sys.exit(main())
