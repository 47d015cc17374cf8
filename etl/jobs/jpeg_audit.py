"""`lakeshard jpeg-audit`: measure JPEG re-encoding fidelity on a sample of a source."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from datetime import UTC, datetime

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from etl import tables
from etl.config import Config
from etl.sources import adapter_for, finish_ingest
from etl.transforms.fetch import fetch_images
from udfs.jpeg_quality import audit_image, summarise

__all__ = ["jpeg_audit", "format_audit"]


def jpeg_audit(
    spark: SparkSession, cfg: Config, source: str, *, sample: int, generations: int, seed: int = 0
) -> tuple[list[dict], str]:
    """Audit `sample` decodable images of `source`; return the summary rows and the
    report folder (audit.json + audit.png)."""
    src = cfg.source(source)
    adapter = adapter_for(src.kind)
    rows = (
        fetch_images(
            finish_ingest(adapter.read(spark, src), src)
            .where(F.col("read_status") == "ok")
            .orderBy(F.xxhash64("source_key", F.lit(seed)))
            .limit(sample * 3),  # some may not decode; they are skipped, not counted
            cfg.fetch,
            (src,),
        )
        .where(F.col("read_status") == "ok")
        .select("source_key", "image_bytes")
        .collect()
    )
    audits, skipped = [], []
    for row in rows:
        if len(audits) == sample:
            break
        try:
            audits.append(
                audit_image(
                    bytes(row.image_bytes),
                    quality=cfg.prepare.jpeg_quality,
                    generations=generations,
                    subsampling=cfg.prepare.chroma_subsampling,
                )
            )
        except (OSError, ValueError, SyntaxError) as exc:
            skipped.append({"source_key": row.source_key, "error": str(exc)[:200]})
    if not audits:
        raise ValueError(f"source {source!r}: no decodable image to audit")
    summary = summarise(audits)

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = tables.layout(cfg).report_dir(f"jpeg-audit-{source}-{stamp}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "audit.json"), "w", encoding="utf-8") as f:
        json.dump(
            {"source": source, "quality": cfg.prepare.jpeg_quality, "images": len(audits),
             "skipped": skipped, "summary": summary, "per_image": [asdict(a) for a in audits]},
            f, indent=2,
        )
    _plot(summary, cfg.prepare.jpeg_quality, source, os.path.join(out_dir, "audit.png"))
    return summary, out_dir


def _plot(summary: list[dict], quality: int, source: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gens = [r["generation"] for r in summary]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(gens, [r["psnr_mean"] for r in summary], "o-", label="mean")
    ax1.plot(gens, [r["psnr_min"] for r in summary], "s--", label="min")
    ax1.set(xlabel="re-encode generation", ylabel="PSNR (dB)", title="PSNR vs first decode")
    ax1.legend()
    ax2.plot(gens, [r["ssim_mean"] for r in summary], "o-", label="mean")
    ax2.plot(gens, [r["ssim_min"] for r in summary], "s--", label="min")
    ax2.set(xlabel="re-encode generation", ylabel="SSIM", title="SSIM vs first decode")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(gens)
    fig.suptitle(f"JPEG q{quality} re-encoding on source {source!r}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_audit(summary: list[dict], out_dir: str) -> str:
    lines = [
        f"{'gen':>3} {'PSNR mean':>10} {'PSNR min':>9} {'SSIM mean':>10} {'SSIM min':>9}",
    ]
    for r in summary:
        lines.append(
            f"{r['generation']:>3} {r['psnr_mean']:>10.2f} {r['psnr_min']:>9.2f} "
            f"{r['ssim_mean']:>10.4f} {r['ssim_min']:>9.4f}"
        )
    first = summary[0]
    lines += [
        "",
        f"PNG of the same pixels is {first['png_over_jpeg']:.1f}x the JPEG's bytes; "
        f"the JPEG is {first['jpeg_over_original']:.2f}x the original file.",
        f"report: {out_dir}/audit.json, {out_dir}/audit.png",
    ]
    return "\n".join(lines)
