"""Re-encoding fidelity: what JPEG at a given quality costs, measured on real images.

:func:`audit_image` decodes an image once (the reference), then re-encodes it K times
in a row at the configured quality -- as happens when images are re-shared -- and
measures each generation against the reference with PSNR and SSIM, plus the bytes of
generation 1 against a PNG of the reference and against the original file.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

__all__ = ["GenerationScore", "ImageAudit", "audit_image", "summarise"]


@dataclass(frozen=True)
class GenerationScore:
    generation: int
    psnr: float
    ssim: float
    jpeg_bytes: int


@dataclass(frozen=True)
class ImageAudit:
    width: int
    height: int
    original_bytes: int
    png_bytes: int
    generations: tuple[GenerationScore, ...]


def _reference(data: bytes):
    from PIL import Image, ImageOps

    im = Image.open(io.BytesIO(data))
    im.seek(0)
    im = ImageOps.exif_transpose(im)
    if im.mode in ("RGBA", "LA", "P"):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        im = Image.alpha_composite(white, rgba)
    return im.convert("RGB")


def audit_image(data: bytes, *, quality: int, generations: int, subsampling: str) -> ImageAudit:
    from PIL import Image

    from etl.errors import require

    metrics = require("skimage.metrics", "samples", "`lakeshard jpeg-audit` (PSNR/SSIM)")
    peak_signal_noise_ratio = metrics.peak_signal_noise_ratio
    structural_similarity = metrics.structural_similarity

    ref = _reference(data)
    ref_arr = np.asarray(ref)
    png = io.BytesIO()
    ref.save(png, format="PNG")
    scores = []
    current = ref
    for gen in range(1, generations + 1):
        buf = io.BytesIO()
        current.save(buf, format="JPEG", quality=quality, subsampling=subsampling)
        current = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
        arr = np.asarray(current)
        psnr = peak_signal_noise_ratio(ref_arr, arr, data_range=255)
        ssim = structural_similarity(ref_arr, arr, channel_axis=2, data_range=255)
        nbytes = len(buf.getvalue())
        scores.append(GenerationScore(gen, float(min(psnr, 99.0)), float(ssim), nbytes))
    return ImageAudit(ref.width, ref.height, len(data), len(png.getvalue()), tuple(scores))


def summarise(audits: list[ImageAudit]) -> list[dict]:
    """One row per generation: mean/min PSNR and SSIM, and byte ratios of generation 1."""
    rows = []
    for g in range(len(audits[0].generations)):
        psnr = np.array([a.generations[g].psnr for a in audits])
        ssim = np.array([a.generations[g].ssim for a in audits])
        jpeg = np.array([a.generations[g].jpeg_bytes for a in audits], dtype=float)
        png = np.array([a.png_bytes for a in audits], dtype=float)
        orig = np.array([a.original_bytes for a in audits], dtype=float)
        rows.append(
            {
                "generation": g + 1,
                "psnr_mean": float(psnr.mean()),
                "psnr_min": float(psnr.min()),
                "ssim_mean": float(ssim.mean()),
                "ssim_min": float(ssim.min()),
                "png_over_jpeg": float((png / jpeg).mean()),
                "jpeg_over_original": float((jpeg / orig).mean()),
            }
        )
    return rows
