"""Benchmark: caption throughput (images/s per GPU) of lakeshard's transformers backend.

The model is a *randomly initialised* Qwen2.5-VL with a real checkpoint's exact
architecture (layer counts, widths, vocabulary, vision tower; transcribed below from the
published ``config.json`` of Qwen2.5-VL-3B/7B-Instruct), so the compute per image and per
token is the real model's. The weights are noise, so the text is too; generation is run
to a fixed length (the checkpoint's end-of-sequence id is set to an unused token), which
makes the caption length -- ``--max-new-tokens``, ~150-250 for dense captions -- the
same on every run. Images are real photos (scikit-image's) resized into
``--max-pixels`` (default ~0.6 MP, what long-caption runs typically use).

Side by side in one run, same model instance, same batch size:

* bare      -- a hand-written loop: processor (chat template, left padding) +
               ``model.generate`` on pre-decoded PIL images.
* lakeshard -- ``udfs.caption.caption_images`` on JPEG bytes: decode, resize, the same
               generate, per-row error capture, caption checks.

Run (a GPU machine; ``--arch tiny --device cpu`` is a quick smoke run anywhere)::

    .venv/bin/python bench/caption_throughput.py --arch qwen2_5_vl_7b --device cuda \\
        --images 128 --batch-size 32 --max-new-tokens 200
    .venv/bin/python bench/caption_throughput.py --arch tiny --device cpu --images 8 \\
        --batch-size 4 --max-new-tokens 16 --max-pixels 12544

The reference figure for the same job on vLLM is about 20 images/s per H200 for
Qwen3-VL-8B.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_VISION_25 = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
    "hidden_act": "silu", "in_channels": 3,
}
ARCHS = {
    # Qwen/Qwen2.5-VL-7B-Instruct config.json
    "qwen2_5_vl_7b": {
        "text": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                 "num_hidden_layers": 28, "num_attention_heads": 28,
                 "num_key_value_heads": 4, "tie_word_embeddings": False},
        "vision": {**_VISION_25, "out_hidden_size": 3584},
    },
    # Qwen/Qwen2.5-VL-3B-Instruct config.json
    "qwen2_5_vl_3b": {
        "text": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008,
                 "num_hidden_layers": 36, "num_attention_heads": 16,
                 "num_key_value_heads": 2, "tie_word_embeddings": True},
        "vision": {**_VISION_25, "out_hidden_size": 2048},
    },
    "tiny": None,  # etl.tiny_vlm's smoke-test model
}


def _config_for(arch: str):
    from etl.tiny_vlm import tiny_config

    def make(vocab: int, ids: dict) -> dict:
        cfg = tiny_config(vocab, ids)
        spec = ARCHS[arch]
        if spec is None:
            text_vocab = vocab
        else:
            text_vocab = spec["text"]["vocab_size"]
            cfg["text_config"] = {
                **cfg["text_config"], **spec["text"], "initializer_range": 0.02,
                "max_position_embeddings": 128000, "rope_theta": 1000000.0,
                "rms_norm_eps": 1e-6,
                "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            }
            cfg["vision_config"] = {**spec["vision"], "initializer_range": 0.02}
            cfg["tie_word_embeddings"] = spec["text"]["tie_word_embeddings"]
            cfg["initializer_range"] = 0.02
        # Fixed-length generation: end-of-sequence is a token the tokenizer never makes.
        cfg["text_config"]["eos_token_id"] = text_vocab - 1
        cfg["eos_token_id"] = text_vocab - 1
        return cfg

    return make


def build_checkpoint(arch: str, out: Path, device: str, dtype: str, max_pixels: int) -> Path:
    import json

    from etl.tiny_vlm import build_random_vlm

    if not (out / "config.json").is_file():
        build_random_vlm(out, _config_for(arch), max_pixels=max_pixels, dtype=dtype,
                         device=device)
    gen = json.loads((out / "generation_config.json").read_text())
    eos = json.loads((out / "config.json").read_text())["text_config"]["eos_token_id"]
    gen["eos_token_id"] = eos  # fixed-length generation (see the module docstring)
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def make_images(n: int, max_pixels: int) -> list[bytes]:
    import skimage.data
    from PIL import Image

    names = ["astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "camera"]
    out = []
    for i in range(n):
        img = Image.fromarray(getattr(skimage.data, names[i % len(names)])()).convert("RGB")
        scale = (max_pixels / (img.width * img.height)) ** 0.5 * (0.8 + 0.05 * (i % 5))
        img = img.resize((max(28, int(img.width * scale)), max(28, int(img.height * scale))))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=92)
        out.append(buf.getvalue())
    return out


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bare_loop(cap, spec, images_bytes: list[bytes]) -> tuple[float, int]:
    """Processor + generate, nothing else. Returns (seconds, generated tokens)."""
    import torch
    from PIL import Image

    from udfs.caption import load_image

    s = spec.settings
    pil = [load_image(b, s.min_pixels, s.max_pixels) for b in images_bytes]
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": spec.settings.prompt}]}]
    prompt = cap.processor.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=False)
    assert all(isinstance(p, Image.Image) for p in pil)
    tokens = 0
    _sync(cap.device)
    t0 = time.perf_counter()
    for i in range(0, len(pil), spec.settings.batch_size):
        chunk = pil[i : i + spec.settings.batch_size]
        inputs = cap.processor(text=[prompt] * len(chunk), images=chunk, padding=True,
                               return_tensors="pt", min_pixels=spec.settings.min_pixels,
                               max_pixels=spec.settings.max_pixels).to(cap.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(cap.model.dtype)
        with torch.inference_mode():
            out = cap.model.generate(**inputs, max_new_tokens=spec.settings.max_new_tokens,
                                     do_sample=False)
        tokens += (out.shape[1] - inputs["input_ids"].shape[1]) * len(chunk)
    _sync(cap.device)
    return time.perf_counter() - t0, tokens


def lakeshard_loop(cap, spec, images_bytes: list[bytes]) -> tuple[float, int, dict]:
    import pandas as pd

    from udfs.caption import caption_images

    _sync(cap.device)
    t0 = time.perf_counter()
    out = caption_images(spec, pd.Series(images_bytes), cap)
    _sync(cap.device)
    seconds = time.perf_counter() - t0
    return seconds, int(out["tokens"].fillna(0).sum()), out["status"].value_counts().to_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen2_5_vl_7b")
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--max-pixels", type=int, default=768 * 28 * 28)
    ap.add_argument("--workdir", default=None, help="where the random checkpoint is saved")
    args = ap.parse_args()

    import torch

    from etl.config import CaptionVersionConfig
    from udfs.caption import CaptionSpec, TransformersCaptioner

    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    workdir = Path(args.workdir or tempfile.gettempdir()) / f"lakeshard-bench-{args.arch}-{dtype}"
    t0 = time.perf_counter()
    path = build_checkpoint(args.arch, workdir, args.device, dtype, args.max_pixels)
    settings = CaptionVersionConfig(
        name="bench", model=str(path), max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, min_pixels=28 * 28, max_pixels=args.max_pixels,
        device=args.device.split(":")[0], dtype=dtype,
    )
    spec = CaptionSpec(settings=settings, model_path=str(path), local_files_only=True)
    cap = TransformersCaptioner(spec, args.device)
    params = sum(p.numel() for p in cap.model.parameters()) / 1e9
    print(f"{args.arch}: {params:.2f} B parameters, {dtype} on {args.device} "
          f"({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}); "
          f"checkpoint ready in {time.perf_counter() - t0:.0f} s")
    images = make_images(args.images, args.max_pixels)
    warm = images[: min(len(images), args.batch_size)]
    bare_loop(cap, spec, warm[:2])  # warm-up: kernels, allocator
    rows = []
    b_s, b_tok = bare_loop(cap, spec, images)
    rows.append(("bare processor + generate", b_s, b_tok, {}))
    l_s, l_tok, statuses = lakeshard_loop(cap, spec, images)
    rows.append(("lakeshard caption_images", l_s, l_tok, statuses))
    print(f"\n{args.images} images (~{args.max_pixels / 1e6:.2f} MP), batch {args.batch_size}, "
          f"max_new_tokens {args.max_new_tokens}\n")
    print(f"{'':28}{'images/s':>10}{'tokens/s':>10}{'tokens/img':>12}  statuses")
    for name, s, tok, st in rows:
        print(f"{name:28}{args.images / s:>10.2f}{tok / s:>10.0f}{tok / args.images:>12.1f}  "
              f"{st or ''}")
    print(f"\nratio lakeshard/bare = {b_s / l_s:.2f}")


if __name__ == "__main__":
    main()
