"""Benchmark: caption throughput of lakeshard's transformers backend, bare and in Spark.

The model is a *randomly initialised* Qwen2.5-VL built here (no hub): with ``--arch
qwen2_5_vl_7b`` / ``qwen2_5_vl_3b`` the exact architecture of the published checkpoints
(layer counts, widths, vocabulary, vision tower; transcribed from their ``config.json``),
so the compute per image and per token is the real model's; ``mid`` is the same
architecture at 50 M parameters, big enough that generation dominates on a CPU; ``tiny``
is the smoke-test model. The weights are noise, so the text is too; generation runs to a
fixed length (end-of-sequence is set to a token the tokenizer never makes), so every
caption is ``--max-new-tokens`` long. Images are real photos (scikit-image's bundled
ones; synthetic images of the same sizes when scikit-image is not installed -- the
compute depends only on the size) at mixed sizes within ``--max-pixels``.

Two parts:

``--bare`` (a GPU box: needs only torch, transformers and Pillow -- no pyspark, no
project install, no network; run it from a copy of the repository; ``gpu_caption.sh``
is the prepared run). Per batch size, on one model instance, ``caption_images`` (the
stage's own code path) in each of ``--variants`` (:data:`VARIANTS`: ``plain`` generate,
``table`` order, ``static`` KV cache, processor ``ahead``, the ``fast`` path = static +
ahead + compiled on CUDA, and the ``hand`` loop): a warm-up batch per variant that
checks its greedy tokens against plain generate's, then ``--repeats`` passes,
alternating, the order reversed every repeat. Every pass prints where each batch's time
went (``caption_profile.py``: processor, vision tower, prefill, ms per decode step, idle
between batches). ``--copies 1,2,4``: instead, that many processes with a model copy
each sharing the device.

``--spark`` (CPU, local[2], the project installed): the Spark caption stage against a
bare loop over ``caption_images`` on the same images, same model, same windows (one per
Lance fragment), same layout -- one process per task slot, one torch thread each (what
Spark gives a Python worker), the fragments split as the slots take them:

* bare, table order -- ``caption_images`` with batches in table order (padding before);
* bare, grouped     -- grouped by size, the default (padding after);
* Spark stage       -- ``lakeshard caption`` on local[N] with warm workers (each loaded
                       the model in a warm-up run, as on a long run): plan, read keys,
                       take images, generate, statistics, write the columns.

The sides alternate for ``--rounds`` rounds; the best of each is kept.

Run::

    python bench/caption_throughput.py --bare                    # H100/H200: 7B, bf16
    bash bench/gpu_caption.sh                                     # the prepared GPU run
    .venv/bin/python bench/caption_throughput.py --spark          # CPU, ~15 min here
    python bench/caption_throughput.py --bare --arch tiny --device cpu --images 8 \\
        --batch-sizes 4 --max-new-tokens 8 --max-pixels 12544     # a smoke run anywhere

The reference figure for the same job is about 20 images/s per H200 (Qwen3-VL-8B on
vLLM, published).
"""

from __future__ import annotations

import argparse
import atexit
import io
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # caption_profile
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REFERENCE = "~20 images/s per H200 (Qwen3-VL-8B on vLLM, published)"

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
    # The same architecture at 50 M parameters: generation dominates on a CPU.
    "mid": {
        "text": {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408,
                 "num_hidden_layers": 8, "num_attention_heads": 8,
                 "num_key_value_heads": 2, "tie_word_embeddings": True},
        "vision": {**_VISION_25, "depth": 4, "hidden_size": 384, "intermediate_size": 1024,
                   "num_heads": 6, "fullatt_block_indexes": [1, 3], "out_hidden_size": 512},
        "mrope_section": [16, 8, 8],
    },
    "tiny": None,  # etl.tiny_vlm's smoke-test model
}
ARCH_NOTE = {"mid": "50 M parameters", "tiny": "~0.2 M parameters",
             "qwen2_5_vl_7b": "8.29 B parameters", "qwen2_5_vl_3b": "3.75 B parameters"}
PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
          "hubble_deep_field.jpg", "retina.jpg"]
# Share of --max-pixels per image, cycled: web images are mostly below the cap.
PIXEL_SHARES = [1.0, 0.12, 0.55, 0.3, 0.85, 0.05, 0.4, 0.2, 0.7, 0.1]


@dataclass(frozen=True)
class BenchSettings:
    """The caption settings the generation core reads (``udfs.captioner.CaptionSettings``);
    lakeshard's own are ``etl.config.CaptionVersionConfig``, which needs pydantic."""

    name: str = "bench"
    backend: str = "transformers"
    prompt: str = ("Describe this image in one dense, faithful paragraph: objects, scene, "
                   "composition, lighting, style, and any visible text.")
    prompt_format: str = "chat"
    max_new_tokens: int = 200
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int = 0
    batch_size: int = 32
    batch_tokens: int | None = None
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    device: str = "cuda:0"
    dtype: str = "bfloat16"
    language: str | None = None
    trust_remote_code: bool = False
    gpu_memory_utilization: float | None = None
    kv_cache: str = "dynamic"
    compile: bool = False
    cache_bucket: int = 256
    prepare_ahead: bool = False
    vision_attention: str | None = None


# ----------------------------------------------------------------------- inputs


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
                "rope_scaling": {"type": "mrope",
                                 "mrope_section": spec.get("mrope_section", [16, 24, 24])},
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
    """The random checkpoint, saved once to `out` (reused by later runs)."""
    from etl.tiny_vlm import build_random_vlm

    if not (out / "config.json").is_file():
        build_random_vlm(out, _config_for(arch), max_pixels=max_pixels, dtype=dtype,
                         device=device)
    gen = json.loads((out / "generation_config.json").read_text())
    eos = json.loads((out / "config.json").read_text())["text_config"]["eos_token_id"]
    gen["eos_token_id"] = eos  # fixed-length generation (see the module docstring)
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def _photos() -> list | None:
    """scikit-image's bundled photos as PIL images, or None without scikit-image."""
    import importlib.util

    from PIL import Image

    if importlib.util.find_spec("skimage") is None:
        return None
    from importlib import resources

    data = resources.files("skimage").joinpath("data")
    return [Image.open(io.BytesIO(data.joinpath(n).read_bytes())).convert("RGB")
            for n in PHOTOS]


def make_images(n: int, max_pixels: int) -> tuple[list[bytes], str]:
    """`n` JPEGs (q92) at mixed sizes up to `max_pixels`, and what they are."""
    from PIL import Image

    photos = _photos()
    out = []
    for i in range(n):
        share = PIXEL_SHARES[i % len(PIXEL_SHARES)]
        if photos is not None:
            src = photos[i % len(photos)]
        else:  # same sizes; the compute does not depend on the pixels
            import numpy as np

            side = 768 if i % 2 else 1024
            rng = np.random.default_rng(i)
            src = Image.fromarray(rng.integers(0, 256, (side * 3 // 4, side, 3), np.uint8))
        scale = (share * max_pixels / (src.width * src.height)) ** 0.5
        img = src.resize((max(28, int(src.width * scale)), max(28, int(src.height * scale))),
                         Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=92)
        out.append(buf.getvalue())
    what = "scikit-image photos" if photos is not None else (
        "synthetic images (scikit-image not installed; same sizes)")
    return out, what


# ----------------------------------------------------------------------- loops


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hand_loop(cap, spec, images: list[bytes]) -> tuple[float, int]:
    """Processor + generate in table order, nothing else. (seconds, generated tokens)."""
    import torch

    from udfs.caption_models import pixel_range_kwargs
    from udfs.captioner import load_image

    s = spec.settings
    pil = [load_image(b, s.min_pixels, s.max_pixels) for b in images]
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": s.prompt}]}]
    prompt = cap.processor.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=False)
    tokens = 0
    _sync(cap.device)
    t0 = time.perf_counter()
    for i in range(0, len(pil), s.batch_size):
        chunk = pil[i : i + s.batch_size]
        inputs = cap.processor(text=[prompt] * len(chunk), images=chunk, padding=True,
                               return_tensors="pt", **pixel_range_kwargs(
                                   cap.processor.image_processor, s.min_pixels,
                                   s.max_pixels)).to(cap.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(cap.model.dtype)
        with torch.inference_mode():
            out = cap.model.generate(**inputs, max_new_tokens=s.max_new_tokens,
                                     do_sample=False)
        tokens += (out.shape[1] - inputs["input_ids"].shape[1]) * len(chunk)
    _sync(cap.device)
    return time.perf_counter() - t0, tokens


@dataclass
class Pass:
    seconds: float
    images: int
    tokens: int
    padding_share: float | None = None
    statuses: dict | None = None


def lakeshard_loop(cap, spec, windows: list[list[bytes]], by_size: bool) -> Pass:
    """``caption_images`` over `windows` (lists of encoded images), timed."""
    from udfs.captioner import caption_images

    _sync(cap.device)
    t0 = time.perf_counter()
    results = [caption_images(spec, w, cap, by_size=by_size) for w in windows]
    _sync(cap.device)
    seconds = time.perf_counter() - t0
    pad = sum(p or 0 for r in results for p in r.padding)
    real = sum(t or 0 for r in results for t in r.image_tokens)
    statuses: dict[str, int] = {}
    for r in results:
        for st in r.status:
            statuses[st] = statuses.get(st, 0) + 1
    return Pass(seconds, sum(len(w) for w in windows),
                sum(t or 0 for r in results for t in r.tokens),
                pad / (pad + real) if pad + real else 0.0, statuses)


def _row(name: str, p: Pass, runs: str = "") -> str:
    pad = f"{100 * p.padding_share:5.1f} %" if p.padding_share is not None else "      -"
    return (f"{name:40}{p.images / p.seconds:>10.2f}{p.tokens / p.seconds:>10.0f}"
            f"{p.tokens / p.images:>12.1f}{pad:>10}  {p.statuses or ''}{runs}")


_HEADER = f"{'':40}{'images/s':>10}{'tokens/s':>10}{'tokens/img':>12}{'padding':>10}  statuses"


# ----------------------------------------------------------------------- --bare

# What each --variants name runs: caption_images (grouped by size unless said) with
# these settings; "hand" is the hand-written processor + generate loop.
VARIANTS = {
    "plain": {},  # generate with its dynamic cache: today's default
    "table": {},  # the same, batches in table order (by_size=False)
    "static": {"kv_cache": "static"},
    "ahead": {"prepare_ahead": True},
    "fast": {"kv_cache": "static", "prepare_ahead": True, "compile": "cuda"},
    "hand": {},
}
LABELS = {
    "hand": "hand loop (table order)",
    "table": "caption_images, table order",
    "plain": "caption_images, grouped by size",
    "static": "  + static KV cache",
    "ahead": "  + processor ahead",
    "fast": "  + static, ahead, compiled (cuda)",
}


def variant_settings(name: str, settings: BenchSettings) -> BenchSettings:
    """The settings of variant `name` (compile only on a GPU)."""
    extra = dict(VARIANTS[name])
    if extra.get("compile") == "cuda":
        extra["compile"] = settings.device.startswith("cuda")
    return replace(settings, **extra)


def _load_bare(args):
    """Build (once) and load the bench checkpoint: (captioner, spec, what was loaded)."""
    import torch
    from caption_profile import ProfiledCaptioner

    from udfs.captioner import CaptionSpec

    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    workdir = Path(args.workdir or tempfile.gettempdir()) / f"lakeshard-bench-{args.arch}-{dtype}"
    t0 = time.perf_counter()
    path = build_checkpoint(args.arch, workdir, args.device, dtype, args.max_pixels)
    built = time.perf_counter() - t0
    settings = BenchSettings(max_new_tokens=args.max_new_tokens, min_pixels=args.min_pixels,
                             max_pixels=args.max_pixels, device=args.device, dtype=dtype,
                             vision_attention=args.vision_attention,
                             cache_bucket=args.cache_bucket)
    spec = CaptionSpec(settings=settings, model_path=str(path), local_files_only=True)
    cap = ProfiledCaptioner(spec, args.device)
    params = sum(p.numel() for p in cap.model.parameters())
    size = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else (
        f"cpu, {torch.get_num_threads()} torch threads")
    cfg = cap.model.config
    attn = (f"text {getattr(cfg.get_text_config(), '_attn_implementation', '?')}, vision "
            f"{getattr(getattr(cfg, 'vision_config', None), '_attn_implementation', '?')}")
    import transformers

    print(f"{args.arch}: {size} parameters, {dtype}, attention {attn}, on {args.device} "
          f"({gpu}); torch {torch.__version__}, transformers {transformers.__version__}; "
          f"checkpoint ready in {built:.0f} s, loaded in {time.perf_counter() - t0 - built:.0f} s",
          flush=True)
    return cap, spec


def _profiled_pass(cap, spec, images: list[bytes], variant: str, show: bool) -> Pass:
    """One timed pass of `variant` over `images`, its batches printed when `show`."""
    from caption_profile import format_profile, take_decode_seconds

    if variant == "hand":
        secs, toks = hand_loop(cap, spec, images)
        return Pass(secs, len(images), toks)
    cap.reset()
    p = lakeshard_loop(cap, replace(spec, settings=variant_settings(variant, spec.settings)),
                       [images], by_size=variant != "table")
    if show:
        for line in format_profile(cap.batches, take_decode_seconds(), p.seconds):
            print("    " + line)
    return p


def _warm(cap, spec, images: list[bytes], variants: list[str]) -> list[str]:
    """One untimed batch per variant at this batch size (kernels, the allocator, the
    decode step a static cache compiles per batch shape), straight through the backend
    so that an error is one line, not a batch retried row by row. Prints each variant's
    greedy tokens against plain generate's on that batch; returns the variants that ran."""
    from udfs.captioner import load_image

    s = spec.settings
    pil = [load_image(b, s.min_pixels, s.max_pixels) for b in images[: s.batch_size]]
    tokens, ok = {}, []
    for v in variants:
        if v in ("hand", "table"):  # plain's code path
            ok.append(v)
            continue
        t0 = time.perf_counter()
        cap.reset()
        try:
            cap.generate(pil, replace(spec, settings=variant_settings(v, s)))
        except Exception as exc:  # noqa: BLE001 - reported, the variant is dropped
            print(f"  warm-up {v}: {type(exc).__name__}: {str(exc)[:300]} -- left out",
                  flush=True)
            cap.release_memory()
            continue
        tokens[v] = [row for b in cap.batches for row in b.tokens]
        ok.append(v)
        print(f"  warm-up {v}: {len(pil)} images in {time.perf_counter() - t0:.1f} s",
              flush=True)
    for v, rows in tokens.items():
        if v != "plain" and "plain" in tokens:
            same = sum(a == b for a, b in zip(rows, tokens["plain"], strict=True))
            where = sorted(next(k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
                           for a, b in zip(rows, tokens["plain"], strict=True) if a != b)
            print(f"  tokens {v} vs plain: {same} of {len(rows)} rows identical"
                  + (f"; the others diverge at steps {where[:8]}" if where else ""), flush=True)
    return ok


def run_bare(args) -> None:
    import caption_profile
    import torch

    import udfs.captioner

    udfs.captioner.load_image = caption_profile.profiled_load_image  # decode time, per pass
    cap, spec = _load_bare(args)
    images, what = make_images(args.images, args.max_pixels)
    print(f"{args.images} {what}, {args.min_pixels}-{args.max_pixels} pixels, "
          f"max_new_tokens {args.max_new_tokens}, variants {','.join(args.variants)}, "
          f"{args.repeats} repeat(s), order reversed every repeat; reference {REFERENCE}",
          flush=True)
    for batch in args.batch_sizes:
        s = replace(spec, settings=replace(spec.settings, batch_size=batch))
        print(f"\nbatch size {batch}", flush=True)
        variants = _warm(cap, s, images, args.variants)
        passes: dict[str, list[Pass]] = {v: [] for v in variants}
        for r in range(args.repeats):
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                print(f"  repeat {r + 1}, {v}:", flush=True)
                try:
                    passes[v].append(_profiled_pass(cap, s, images, v, show=True))
                except torch.OutOfMemoryError:
                    print("    out of memory", flush=True)
                    cap.release_memory()
                if cap.batch_limit:
                    print(f"    (out of memory: batch size lowered to {cap.batch_limit})")
                    cap.batch_limit = None
        print(f"batch size {batch}, best of {args.repeats}:\n{_HEADER}")
        for v, ps in passes.items():
            if ps:
                runs = ", ".join(f"{p.images / p.seconds:.2f}" for p in ps)
                print(_row(f"{LABELS[v]} [{v}]", min(ps, key=lambda p: p.seconds),
                           f"  runs: {runs} images/s"), flush=True)


def _copy_worker(args_dict: dict, share: list[bytes], variant: str, batch: int, barrier,
                 results) -> None:
    """One model copy in its own process: load, warm up, then one timed pass over its
    share of the images, started together with the other copies."""
    import argparse as _argparse

    import torch

    args = _argparse.Namespace(**args_dict)
    if args.threads:
        torch.set_num_threads(args.threads)
    cap, spec = _load_bare(args)
    s = replace(spec, settings=replace(spec.settings, batch_size=batch))
    _warm(cap, s, share, [variant])
    barrier.wait()
    try:
        p = _profiled_pass(cap, s, share, variant, show=False)
    except torch.OutOfMemoryError:
        p = None
    results.put(p)
    barrier.wait()


def run_copies(args) -> None:
    """`--copies N,...`: N processes, each with its own model copy on the same device,
    splitting the images; images/s of the device = all images / the slowest copy."""
    import multiprocessing as mp

    images, what = make_images(args.images, args.max_pixels)
    batch, variant = args.batch_sizes[0], args.copies_variant
    print(f"copies per device on {args.device}: {args.images} {what}, batch size {batch}, "
          f"variant {variant}, max_new_tokens {args.max_new_tokens}", flush=True)
    ctx = mp.get_context("spawn")
    for n in args.copies:
        barrier, results = ctx.Barrier(n + 1), ctx.Queue()
        procs = [ctx.Process(target=_copy_worker, args=(
            vars(args), images[k::n], variant, batch, barrier, results)) for k in range(n)]
        for p in procs:
            p.start()
        barrier.wait()  # all loaded and warm
        t0 = time.perf_counter()
        passes = [results.get() for _ in procs]
        seconds = time.perf_counter() - t0
        barrier.wait()
        for p in procs:
            p.join()
        if any(p is None for p in passes):
            print(f"  {n} copies: out of memory", flush=True)
            continue
        tokens = sum(p.tokens for p in passes)
        print(f"  {n} copies: {len(images) / seconds:.2f} images/s, {tokens / seconds:.0f} "
              f"tokens/s per device ({seconds:.1f} s)", flush=True)


# ----------------------------------------------------------------------- --spark


def _bare_worker(model: str, settings: dict, windows, rounds: int, barrier, results) -> None:
    """One bare process with one torch thread (as a Spark worker has): load, warm up,
    then per round caption its windows in table order, then grouped by size, each pass
    started together with the other processes."""
    import torch

    torch.set_num_threads(1)
    from udfs.captioner import CaptionSpec, TransformersCaptioner

    spec = CaptionSpec(settings=BenchSettings(**settings), model_path=model,
                       local_files_only=True)
    cap = TransformersCaptioner(spec, "cpu")
    lakeshard_loop(cap, spec, [windows[0][:2]], by_size=True)
    for _ in range(rounds):
        for by_size in (False, True):
            barrier.wait()
            results.put((by_size, lakeshard_loop(cap, spec, windows, by_size=by_size)))
            barrier.wait()


def _combine(passes: list[Pass], seconds: float) -> Pass:
    images = sum(p.images for p in passes)
    statuses: dict[str, int] = {}
    for p in passes:
        for k, v in (p.statuses or {}).items():
            statuses[k] = statuses.get(k, 0) + v
    return Pass(seconds, images, sum(p.tokens for p in passes),
                sum(p.padding_share * p.images for p in passes) / images, statuses)


class _BareProcesses:
    """One process per Spark task slot, each with the windows that slot would take."""

    def __init__(self, model: str, settings: BenchSettings, slots: list[list], rounds: int):
        import multiprocessing as mp
        from dataclasses import asdict

        ctx = mp.get_context("spawn")
        self.barrier, self.results = ctx.Barrier(len(slots) + 1), ctx.Queue()
        self.procs = [ctx.Process(target=_bare_worker, args=(
            model, asdict(settings), windows, rounds, self.barrier, self.results))
            for windows in slots]
        for p in self.procs:
            p.start()

    def run(self) -> dict[bool, Pass]:
        """One round: table order, then grouped by size; {by_size: pass}."""
        out = {}
        for by_size in (False, True):
            self.barrier.wait()  # all loaded and warm: start together
            t0 = time.perf_counter()
            passes = [self.results.get() for _ in self.procs]
            seconds = time.perf_counter() - t0
            self.barrier.wait()
            assert all(b == by_size for b, _ in passes)
            out[by_size] = _combine([p for _, p in passes], seconds)
        return out

    def close(self) -> None:
        for p in self.procs:
            p.join()


def run_spark(args) -> None:
    import lance
    import pyarrow as pa

    from etl import tables
    from etl.config import parse_config
    from etl.jobs.caption import caption
    from etl.pipeline.preflight import check_config
    from etl.session import get_spark

    cores = args.slots
    work = Path(args.workdir or tempfile.mkdtemp(prefix="lakeshard-caption-bench-"))
    if args.workdir is None:  # the checkpoint and tables of a temporary folder
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    path = build_checkpoint(args.arch, work / f"model-{args.arch}", "cpu", "float32",
                            args.max_pixels)
    settings = BenchSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_sizes[0],
                             min_pixels=args.min_pixels, max_pixels=args.max_pixels,
                             device="cpu", dtype="float32", language="en")
    images, what = make_images(args.images, args.max_pixels)
    per = len(images) // args.fragments
    windows = [images[f * per : (f + 1) * per] for f in range(args.fragments)]
    images = [b for w in windows for b in w]
    print(f"{args.arch} ({ARCH_NOTE.get(args.arch, '')}), float32 on cpu; {len(images)} "
          f"{what} in {args.fragments} fragments, {args.min_pixels}-{args.max_pixels} "
          f"pixels, batch size {settings.batch_size}, max_new_tokens "
          f"{settings.max_new_tokens}; local[{cores}]; best of {args.rounds} alternating "
          f"rounds; load average {os.getloadavg()[0]:.1f}", flush=True)

    root = work / "root"
    table = pa.table({"sample_id": [f"id_{i:04d}" for i in range(len(images))],
                      "image": images, "keep": [True] * len(images)})
    lance.write_dataset(table, str(root / "lance/default/curated.lance"), mode="overwrite",
                        max_rows_per_file=per)
    version = {"model": str(path), "max_new_tokens": settings.max_new_tokens,
               "batch_size": settings.batch_size, "min_pixels": settings.min_pixels,
               "max_pixels": settings.max_pixels, "prompt": settings.prompt}
    first = {f"id_{f * per:04d}" for f in range(args.fragments)}
    warm_where = "sample_id IN ({})".format(", ".join(f"'{s}'" for s in sorted(first)))
    versions = {}
    for r in range(args.rounds):
        versions.update({f"warm{r}": {**version, "where": warm_where}, f"timed{r}": version})
    cfg = check_config(parse_config({
        "storage": {"root": str(root)},
        "spark": {"master": f"local[{cores}]", "jars_dir": str(REPO / ".jars"),
                  "conf": {"spark.ui.enabled": "false",
                           "spark.ui.showConsoleProgress": "false"}},
        "sources": [{"name": "none", "kind": "image_folder", "path": str(work)}],
        "caption": {"versions": versions},
    }))
    assert tables.layout(cfg).curated == str(root / "lance/default/curated.lance")

    # Spark's slots take fragments in turn: slot k gets fragments k, k + slots, ...
    bare = _BareProcesses(str(path), settings, [windows[k::cores] for k in range(cores)],
                          args.rounds)
    spark = get_spark(cfg)
    best: dict[str, Pass] = {}

    def keep(name: str, p: Pass) -> None:
        print(_row(name, p), flush=True)
        if name not in best or p.seconds < best[name].seconds:
            best[name] = p

    names = (f"bare, {cores} processes, table order", f"bare, {cores} processes, grouped",
             f"Spark caption stage, local[{cores}]")
    print(_HEADER)
    loads = []
    for r in range(args.rounds):
        passes = bare.run()
        keep(names[0], passes[False])
        keep(names[1], passes[True])
        # Right before the timed run (Spark stops workers idle for a minute): one row
        # per fragment, so every slot's worker loads the model.
        warm = caption(spark, cfg, f"warm{r}")
        timed = caption(spark, cfg, f"timed{r}")
        loads.append((warm.model_loads, timed.model_loads))
        keep(names[2], Pass(timed.seconds, timed.captioned, timed.tokens,
                            timed.padding_share, timed.statuses))
    bare.close()
    spark.stop()

    print(f"\nbest of {args.rounds}:\n{_HEADER}")
    for name in names:
        print(_row(name, best[name]))
    rate = {k: p.images / p.seconds for k, p in best.items()}
    print(f"\nmodel loads (warm-up, timed) per round: {loads}")
    print(f"padding share: table order {100 * best[names[0]].padding_share:.1f} % -> grouped "
          f"by size {100 * best[names[1]].padding_share:.1f} %")
    print(f"ratio Spark stage / bare (grouped, same layout) = "
          f"{rate[names[2]] / rate[names[1]]:.2f} (target >= 0.9)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--bare", action="store_true", help="no Spark: the GPU bench")
    mode.add_argument("--spark", action="store_true", help="Spark stage vs bare loop (CPU)")
    ap.add_argument("--arch", choices=sorted(ARCHS), default=None,
                    help="default: qwen2_5_vl_7b with --bare, mid with --spark")
    ap.add_argument("--device", default="cuda:0", help="--bare: cuda:N or cpu")
    ap.add_argument("--dtype", default=None, help="--bare: default bfloat16 on cuda")
    ap.add_argument("--images", type=int, default=None, help="default: 256 bare, 64 spark")
    ap.add_argument("--batch-sizes", type=_ints, default=None,
                    help="comma-separated; default 8,16,32,64 bare, 4 spark")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="default: 200 bare, 24 spark")
    ap.add_argument("--min-pixels", type=int, default=4 * 28 * 28)
    ap.add_argument("--max-pixels", type=int, default=None,
                    help="default: 768*28*28 (~0.6 MP) bare, 128*28*28 spark")
    ap.add_argument("--fragments", type=int, default=4, help="--spark: Lance fragments")
    ap.add_argument("--slots", type=int, default=2, help="--spark: local[N]")
    ap.add_argument("--rounds", type=int, default=2, help="--spark: best of, alternating")
    ap.add_argument("--workdir", default=None, help="where checkpoints (and tables) go")
    ap.add_argument("--variants", type=lambda t: [v for v in t.split(",") if v],
                    default=["plain", "fast"],
                    help=f"--bare: comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=2,
                    help="--bare: timed passes per variant, alternating (order reversed "
                         "every repeat)")
    ap.add_argument("--copies", type=_ints, default=None,
                    help="--bare: instead, N processes with a model copy each on the "
                         "device, for each N (e.g. 1,2,4); first batch size")
    ap.add_argument("--copies-variant", default="plain", help="--bare --copies: variant")
    ap.add_argument("--vision-attention", default=None,
                    help="--bare: the vision tower's attention (sdpa, eager, flash_attention_2)")
    ap.add_argument("--cache-bucket", type=int, default=256,
                    help="--bare: static cache lengths rounded up to this")
    ap.add_argument("--threads", type=int, default=None, help="--bare: torch threads (cpu)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {unknown} (known: {', '.join(VARIANTS)})")
    bare = args.bare
    args.arch = args.arch or ("qwen2_5_vl_7b" if bare else "mid")
    args.images = args.images or (256 if bare else 64)
    args.batch_sizes = args.batch_sizes or ([8, 16, 32, 64] if bare else [4])
    args.max_new_tokens = args.max_new_tokens or (200 if bare else 24)
    args.max_pixels = args.max_pixels or ((768 if bare else 128) * 28 * 28)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if bare and args.copies:
        run_copies(args)
    elif bare:
        run_bare(args)
    else:
        run_spark(args)


if __name__ == "__main__":
    main()
