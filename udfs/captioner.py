"""VLM captioning without Spark: decode, size-grouped batches, generation, per-row errors.

The generation core that :mod:`udfs.caption` runs inside Spark tasks and that
``bench/caption_throughput.py --bare`` runs on a bare GPU box. At module level it
imports only the standard library; torch, transformers and Pillow load where used --
never pyspark, pandas, pyarrow or pydantic. Settings are duck-typed: any object with the
attributes of :class:`CaptionSettings` (in lakeshard, ``etl.config.CaptionVersionConfig``).

:func:`caption_images` captions a list of encoded images (one *window*):

1. each image's size is read from its header, without decoding, and turned into the
   number of image tokens the model will see after the resize into
   ``[min_pixels, max_pixels]``;
2. images are grouped by that count (largest first) into batches of at most
   ``batch_size`` images and, with ``batch_tokens``, at most that many padded image
   tokens -- so one large image no longer pads a batch of thumbnails;
3. a background thread decodes and resizes the next batch while the current one
   generates (Pillow releases the GIL), so the accelerator does not wait on JPEG decode;
4. results go back to their input rows; every row gets a status, and the batch's padding
   is counted (:attr:`Captioned.padding_share`).

Per row: undecodable bytes are ``bad_image`` (never generated); an exception is retried
row by row so only the bad row is ``failed``; CUDA out-of-memory halves the batch size
for the rest of the worker's life and retries. A backend that returns the wrong number
of outputs is a bug and raises.

Backends (:data:`BACKENDS`): Hugging Face ``transformers`` (chat VLMs such as
Qwen2.5-VL / Qwen3-VL through ``AutoProcessor`` and the chat template, or task-prompt
models such as Florence-2 with ``prompt_format: plain``) and ``vllm`` offline inference
(one ``LLM.generate`` per window: vLLM batches continuously itself), imported only when
selected.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from PIL.Image import Image

__all__ = [
    "BACKENDS",
    "STATUSES",
    "CHECK_FLAGS",
    "CaptionSettings",
    "CaptionSpec",
    "Generated",
    "Captioned",
    "Captioner",
    "TransformersCaptioner",
    "VLLMCaptioner",
    "get_captioner",
    "model_loads",
    "image_size",
    "target_size",
    "load_image",
    "plan_batches",
    "caption_flags",
    "caption_images",
]

log = logging.getLogger(__name__)

BACKENDS = ("transformers", "vllm")
# ok: captioned. bad_image: the bytes do not decode (permanent, not retried).
# failed: generation raised for this row (retried by the next run).
STATUSES = ("ok", "bad_image", "failed")
# Caption checks: flags, never deletion.
#   empty        nothing but whitespace was generated
#   truncated    generation stopped at max_new_tokens, not at end-of-sequence
#   repetition   a phrase repeats back to back (a generation loop)
#   language_mismatch  the text is mostly not in the expected language's script
CHECK_FLAGS = ("empty", "truncated", "repetition", "language_mismatch")


class CaptionSettings(Protocol):
    """What generation reads from a caption version (``etl.config.CaptionVersionConfig``
    in lakeshard; any object with these attributes elsewhere, e.g. the bare bench)."""

    name: str
    backend: str
    prompt: str
    prompt_format: str
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int
    batch_size: int
    batch_tokens: int | None
    min_pixels: int
    max_pixels: int
    device: str
    dtype: str
    language: str | None
    trust_remote_code: bool
    gpu_memory_utilization: float | None


@dataclass(frozen=True)
class CaptionSpec:
    """Everything an executor needs to caption: the configured version (generation
    settings, exactly as parsed) and where its model was resolved to."""

    settings: CaptionSettings
    # A local folder (also the built smoke-test model) or a hub id.
    model_path: str
    # True when model_path is a local folder: no hub look-up at all.
    local_files_only: bool = False
    # The share of a GPU each task holds (spark.task.resource.gpu.amount): how much of
    # its memory one vLLM engine may take.
    gpu_share: float = 1.0

    def cache_key(self, device: str) -> str:
        """What the loaded model depends on: versions differing only in prompt or
        generation settings share one loaded model per worker."""
        s = self.settings
        key = {"model": self.model_path, "backend": s.backend, "dtype": s.dtype,
               "trust_remote_code": s.trust_remote_code,
               "local_files_only": self.local_files_only, "device": device}
        if s.backend == "vllm":  # vLLM bakes these into the engine
            key.update(min_pixels=s.min_pixels, max_pixels=s.max_pixels,
                       gpu_memory=_vllm_memory_share(self))
        return json.dumps(key)


@dataclass(frozen=True)
class Generated:
    text: str
    tokens: int
    hit_limit: bool  # stopped at max_new_tokens without an end-of-sequence token
    image_tokens: int = 0  # the image's tokens in the prompt
    padding: int = 0  # pad tokens added to this row's prompt to match its batch


# ----------------------------------------------------------------------- images


def _undecodable(exc: BaseException) -> ValueError:
    detail = re.sub(r" <[^>]* at 0x[0-9a-f]+>", "", str(exc))
    return ValueError(f"undecodable image: {type(exc).__name__}: {detail}")


def image_size(data: bytes | None) -> tuple[int, int]:
    """(width, height) from the image's header, without decoding its pixels.

    Raises ValueError for missing bytes or an unrecognised format."""
    from PIL import Image

    if data is None or len(data) == 0:
        raise ValueError("missing image bytes")
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.size
    except Exception as exc:  # PIL raises many types for bad data
        raise _undecodable(exc) from None


def target_size(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size :func:`load_image` resizes to: the aspect ratio kept, the pixel count
    moved into [min_pixels, max_pixels]."""
    pixels = width * height
    scale = 1.0
    if pixels > max_pixels:
        scale = (max_pixels / pixels) ** 0.5
    elif pixels < min_pixels:
        scale = (min_pixels / pixels) ** 0.5
    if scale == 1.0:
        return width, height
    return max(1, round(width * scale)), max(1, round(height * scale))


def load_image(data: bytes | None, min_pixels: int, max_pixels: int) -> Image:
    """Decode to RGB and resize (keeping the aspect ratio) into [min_pixels, max_pixels].

    Raises ValueError for missing or undecodable bytes."""
    from PIL import Image

    if data is None or len(data) == 0:
        raise ValueError("missing image bytes")
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            img = im.convert("RGB")
    except Exception as exc:  # PIL raises many types for bad data
        raise _undecodable(exc) from None
    size = target_size(*img.size, min_pixels, max_pixels)
    if size != img.size:
        img = img.resize(size, Image.Resampling.BICUBIC)
    return img


def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                  ) -> tuple[int, int]:
    """Qwen2-VL's resize rule (multiples of `factor` within the pixel range)."""
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# ----------------------------------------------------------------------- batches


def plan_batches(tokens: Sequence[int], max_count: int, max_tokens: int | None = None,
                 *, by_size: bool = True) -> list[list[int]]:
    """Indices of `tokens` grouped into generate() batches.

    `by_size`: largest first, so each batch holds images of similar token counts (and a
    batch that runs out of memory is met first); otherwise in input order. A batch holds
    at most `max_count` images and, with `max_tokens`, at most that many padded image
    tokens (its size x its largest count); an image over the budget goes alone."""
    if max_count < 1:
        raise ValueError(f"max_count must be >= 1, got {max_count}")
    order = (sorted(range(len(tokens)), key=lambda i: -tokens[i]) if by_size
             else list(range(len(tokens))))
    batches: list[list[int]] = []
    current: list[int] = []
    largest = 0
    for i in order:
        widest = max(largest, tokens[i])
        full = len(current) >= max_count or (
            max_tokens is not None and widest * (len(current) + 1) > max_tokens)
        if current and full:
            batches.append(current)
            current, widest = [], tokens[i]
        current.append(i)
        largest = widest
    if current:
        batches.append(current)
    return batches


# ----------------------------------------------------------------------- checks

_SCRIPTS = {
    # language -> (characters of its script, min share among letters)
    "en": (lambda c: c.isascii(), 0.9),
    "zh": (lambda c: "\u4e00" <= c <= "\u9fff", 0.5),
}
_CHAR_LOOP = re.compile(r"(.{1,30}?)\1{4,}", re.S)


def _word_loop(words: list[str]) -> bool:
    """An n-gram (n <= 12 words) repeated back to back: 3 times, or 4 for a single word
    ("very very very" happens in real text; "red red red red" does not)."""
    for n in range(1, 13):
        repeats = 4 if n == 1 else 3
        if n * repeats > len(words):
            break
        for start in range(len(words) - n * repeats + 1):
            gram = words[start : start + n]
            if all(words[start + k * n : start + (k + 1) * n] == gram for k in range(1, repeats)):
                return True
    return False


def caption_flags(text: str, *, hit_limit: bool, language: str | None) -> list[str]:
    """The caption checks (:data:`CHECK_FLAGS`) that apply to `text`."""
    flags = []
    stripped = text.strip()
    if not stripped:
        flags.append("empty")
    if hit_limit:
        flags.append("truncated")
    words = [w.strip(".,;:!?\"'()").lower() for w in stripped.split()]
    if stripped and (_word_loop([w for w in words if w]) or _CHAR_LOOP.search(stripped)):
        flags.append("repetition")
    if language in _SCRIPTS:
        in_script, share = _SCRIPTS[language]
        letters = [c for c in stripped if c.isalpha()]
        if len(letters) >= 20 and sum(map(in_script, letters)) < share * len(letters):
            flags.append("language_mismatch")
    return flags


# ----------------------------------------------------------------------- backends


def _is_oom(exc: BaseException) -> bool:
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return "out of memory" in str(exc).lower()


def _release_gpu_memory() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


def _vllm_memory_share(spec: CaptionSpec) -> float:
    configured = getattr(spec.settings, "gpu_memory_utilization", None)
    return configured if configured else round(0.9 * spec.gpu_share, 3)


def _chat_prompt(processor, settings: CaptionSettings) -> str:
    if settings.prompt_format == "plain":
        return settings.prompt
    messages = [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": settings.prompt}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class Captioner:
    """A loaded model; :meth:`generate` captions a batch of PIL images for a spec."""

    # Image tokens per pixel when the processor's rule is unknown (28 x 28 per token).
    _PIXELS_PER_TOKEN = 28 * 28

    def __init__(self, spec: CaptionSpec, device: str):
        self.device = device
        # Set after a CUDA out-of-memory error: the batch size that still fits, for the
        # rest of this worker's life.
        self.batch_limit: int | None = None

    def batch_size(self, spec: CaptionSpec) -> int:
        return min(spec.settings.batch_size, self.batch_limit or spec.settings.batch_size)

    def max_batch(self, spec: CaptionSpec, window: int) -> int:
        """Images per generate() call for a window of `window` images."""
        return self.batch_size(spec)

    def token_budget(self, spec: CaptionSpec) -> int | None:
        return getattr(spec.settings, "batch_tokens", None)

    def image_tokens(self, width: int, height: int, spec: CaptionSpec) -> int:
        """The image tokens an image of this (already resized) size becomes."""
        return max(1, (width * height) // self._PIXELS_PER_TOKEN)

    def generate(self, images: list, spec: CaptionSpec) -> list[Generated]:  # pragma: no cover
        raise NotImplementedError

    def release_memory(self) -> None:
        _release_gpu_memory()


def _offline_if_local(spec: CaptionSpec) -> None:
    if spec.local_files_only:
        # Before transformers / huggingface_hub are imported in this worker.
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _torch_dtype(spec: CaptionSpec, device: str):
    import torch

    name = spec.settings.dtype
    if name == "auto":
        name = "bfloat16" if device.startswith("cuda") else "float32"
    return getattr(torch, name)


class TransformersCaptioner(Captioner):
    """``AutoProcessor`` + ``AutoModelForImageTextToText``; left-padded batched ``generate``."""

    def __init__(self, spec: CaptionSpec, device: str):
        super().__init__(spec, device)
        _offline_if_local(spec)
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(
                f"caption device is {device} but this machine has no usable GPU "
                f"(torch {torch.__version__}, CUDA available: False)"
            )
        kw = {"local_files_only": spec.local_files_only,
              "trust_remote_code": spec.settings.trust_remote_code}
        self.processor = AutoProcessor.from_pretrained(spec.model_path, **kw)
        tok = getattr(self.processor, "tokenizer", None)
        if tok is not None:
            tok.padding_side = "left"  # decoder-only generation needs left padding
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
        self.model = AutoModelForImageTextToText.from_pretrained(
            spec.model_path, dtype=_torch_dtype(spec, device), **kw
        ).to(device).eval()
        ip = getattr(self.processor, "image_processor", None)
        self._takes_pixels = ip is not None and hasattr(ip, "min_pixels")
        # Qwen-style processors: multiples of patch x merge pixels per side, one token each.
        patch, merge = getattr(ip, "patch_size", None), getattr(ip, "merge_size", None)
        self._factor = patch * merge if isinstance(patch, int) and isinstance(merge, int) else None
        self._image_token_id = getattr(self.model.config, "image_token_id", None)
        eos = self.model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tok is not None and tok.eos_token_id is not None:
            self._eos.add(tok.eos_token_id)

    def image_tokens(self, width: int, height: int, spec: CaptionSpec) -> int:
        if self._factor is None:
            return super().image_tokens(width, height, spec)
        s = spec.settings
        h, w = _smart_resize(height, width, self._factor, s.min_pixels, s.max_pixels)
        return (h // self._factor) * (w // self._factor)

    def _pixel_kwargs(self, spec: CaptionSpec) -> dict:
        # Qwen-style processors resize to a pixel range themselves: give them ours.
        if not self._takes_pixels:
            return {}
        return {"min_pixels": spec.settings.min_pixels, "max_pixels": spec.settings.max_pixels}

    def generate(self, images: list, spec: CaptionSpec) -> list[Generated]:
        import torch

        s = spec.settings
        inputs = self.processor(
            text=[_chat_prompt(self.processor, s)] * len(images), images=images,
            padding=True, return_tensors="pt", **self._pixel_kwargs(spec),
        ).to(self.device)
        if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        padding = ((mask == 0).sum(1).tolist() if mask is not None else [0] * len(images))
        if self._image_token_id is not None:
            image_tokens = (ids == self._image_token_id).sum(1).tolist()
        else:
            image_tokens = [self.image_tokens(*im.size, spec) for im in images]
        gen = {"max_new_tokens": s.max_new_tokens, "do_sample": s.do_sample}
        if s.do_sample:
            gen.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
            torch.manual_seed(s.seed)
        if s.repetition_penalty != 1.0:
            gen["repetition_penalty"] = s.repetition_penalty
        with torch.inference_mode():
            out = self.model.generate(**inputs, **gen)
        if getattr(self.model.config, "is_encoder_decoder", False):
            new = out[:, 1:].cpu()  # Florence-2 style: only the decoder start precedes
        else:
            new = out[:, ids.shape[1]:].cpu()  # after the left-padded prompt
        pad = getattr(self.processor.tokenizer, "pad_token_id", None)
        results = []
        for row, n_img, n_pad in zip(new.tolist(), image_tokens, padding, strict=True):
            # Trailing pads after an early end-of-sequence are not generated tokens.
            ended = next((i for i, t in enumerate(row) if t in self._eos), None)
            used = row[: ended + 1] if ended is not None else row
            if ended is None and pad is not None and pad not in self._eos:
                while used and used[-1] == pad:
                    used = used[:-1]
            text = self.processor.tokenizer.decode(used, skip_special_tokens=True)
            hit = ended is None and len(row) >= s.max_new_tokens
            results.append(Generated(text.strip(), len(used), hit, int(n_img), int(n_pad)))
        return results


class VLLMCaptioner(Captioner):
    """vLLM offline inference: ``LLM.generate`` with the image as multi-modal input.

    A window's images go to vLLM in one call (its scheduler batches continuously; there
    is no padding to count). Optional: ``pip install 'lakeshard[vllm]'`` on the
    executors (it brings its own torch build; install it on GPU images only)."""

    def __init__(self, spec: CaptionSpec, device: str):
        super().__init__(spec, device)
        _offline_if_local(spec)
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError(
                "caption backend 'vllm' needs the vllm package on the executors: "
                "pip install 'lakeshard[vllm]'"
            ) from exc
        from transformers import AutoProcessor

        if device.startswith("cuda:"):
            # vLLM places itself on the visible devices: show it only the task's GPU.
            os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        s = spec.settings
        self.llm = LLM(
            model=spec.model_path,
            dtype=s.dtype,
            trust_remote_code=s.trust_remote_code,
            seed=s.seed,
            limit_mm_per_prompt={"image": 1},
            mm_processor_kwargs={"min_pixels": s.min_pixels, "max_pixels": s.max_pixels},
            gpu_memory_utilization=_vllm_memory_share(spec),
        )
        self.processor = AutoProcessor.from_pretrained(
            spec.model_path, local_files_only=spec.local_files_only,
            trust_remote_code=s.trust_remote_code,
        )
        ip = getattr(self.processor, "image_processor", None)
        patch, merge = getattr(ip, "patch_size", None), getattr(ip, "merge_size", None)
        self._factor = patch * merge if isinstance(patch, int) and isinstance(merge, int) else None

    def max_batch(self, spec: CaptionSpec, window: int) -> int:
        return min(window, self.batch_limit or window)

    def token_budget(self, spec: CaptionSpec) -> int | None:
        return None  # vLLM's scheduler bounds its own batches

    def image_tokens(self, width: int, height: int, spec: CaptionSpec) -> int:
        if self._factor is None:
            return super().image_tokens(width, height, spec)
        s = spec.settings
        h, w = _smart_resize(height, width, self._factor, s.min_pixels, s.max_pixels)
        return (h // self._factor) * (w // self._factor)

    def generate(self, images: list, spec: CaptionSpec) -> list[Generated]:
        from vllm import SamplingParams

        s = spec.settings
        prompt = _chat_prompt(self.processor, s)
        params = SamplingParams(
            max_tokens=s.max_new_tokens,
            temperature=s.temperature if s.do_sample else 0.0,
            top_p=s.top_p if s.do_sample else 1.0,
            top_k=(s.top_k or -1) if s.do_sample else -1,
            repetition_penalty=s.repetition_penalty,
            seed=s.seed,
        )
        outs = self.llm.generate(
            [{"prompt": prompt, "multi_modal_data": {"image": im}} for im in images],
            params, use_tqdm=False,
        )
        image_tokens = [self.image_tokens(*im.size, spec) for im in images]
        results = []
        for k, o in enumerate(outs):  # vLLM returns outputs in prompt order
            c = o.outputs[0]
            n_img = image_tokens[k] if k < len(image_tokens) else 0
            results.append(Generated(c.text.strip(), len(c.token_ids),
                                     c.finish_reason == "length", n_img, 0))
        return results


_BACKEND_CLASSES = {"transformers": TransformersCaptioner, "vllm": VLLMCaptioner}

# The per-Python-worker model cache: one loaded captioner (a worker holds one model
# copy; a different model replaces it).
_CAPTIONERS: dict[str, Captioner] = {}
_LOADS = 0
_BATCHES = 0


def _evict_all() -> None:
    if not _CAPTIONERS:
        return
    import gc

    _CAPTIONERS.clear()
    gc.collect()
    _release_gpu_memory()


def get_captioner(spec: CaptionSpec, device: str | None = None) -> Captioner:
    """The worker's captioner for `spec`, loaded on first use and then reused.

    `device` defaults to the version's device as this task resolves it
    (:func:`udfs.worker.task_device`). A worker keeps one model: loading another one
    releases the previous copy first."""
    global _LOADS
    from udfs.worker import settle_imports, task_device

    s = spec.settings
    device = device or task_device(s.device, f"caption.versions.{s.name}.device")
    key = spec.cache_key(device)
    cap = _CAPTIONERS.get(key)
    if cap is None:
        if s.backend not in _BACKEND_CLASSES:
            raise ValueError(f"unknown caption backend {s.backend!r} (known: {BACKENDS})")
        _evict_all()
        log.info("loading caption model %s (%s) on %s", spec.model_path, s.backend, device)
        cap = _BACKEND_CLASSES[s.backend](spec, device)
        _CAPTIONERS[key] = cap
        _LOADS += 1
        settle_imports()  # torch/transformers + the model: keep per-task GC cheap
    return cap


def model_loads() -> int:
    """How many models this Python worker has loaded so far."""
    return _LOADS


# ----------------------------------------------------------------------- a window


@dataclass
class Captioned:
    """One row per input image (in input order), and what generation cost."""

    caption: list[str | None]
    status: list[str | None]  # every row has one once caption_images returns
    error: list[str | None]
    flags: list[str | None]
    tokens: list[int | None]
    image_tokens: list[int | None]
    padding: list[int | None]
    # The worker-local number of the generate() call that captioned the row.
    batch: list[int | None]
    device: str | None = None
    batches: int = 0  # successful generate() calls
    calls: list[int] = field(default_factory=list)  # images per generate() call tried

    @classmethod
    def empty(cls, n: int) -> Captioned:
        return cls(*([None] * n for _ in range(8)))

    @property
    def padding_share(self) -> float:
        """Pad tokens / (pad + image tokens) over the captioned rows: the share of the
        image-token positions of the batches that carried no image."""
        pad = sum(p for p in self.padding if p)
        real = sum(t for t in self.image_tokens if t)
        return pad / (pad + real) if pad + real else 0.0


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _generate_batch(cap: Captioner, spec: CaptionSpec, rows: list[int],
                    decoded: dict[int, Image], out: Captioned) -> None:
    """Caption `rows` (their decoded images in `decoded`); never raises for a row.

    Out of memory: halve the batch (for good, in this worker) and retry; at batch size
    1 the row fails. Any other error: retry row by row to isolate the bad one."""
    global _BATCHES
    todo = deque([rows])
    while todo:
        chunk = todo.popleft()
        limit = cap.max_batch(spec, len(rows))
        if len(chunk) > limit:
            todo.extendleft(reversed([chunk[j : j + limit] for j in range(0, len(chunk), limit)]))
            continue
        out.calls.append(len(chunk))
        try:
            results = cap.generate([decoded[i] for i in chunk], spec)
        except Exception as exc:  # noqa: BLE001 - becomes the row's status
            oom = _is_oom(exc)
            if oom:
                cap.release_memory()
                if len(chunk) > 1:
                    cap.batch_limit = max(1, len(chunk) // 2)
                    log.warning("CUDA out of memory: caption batch size now %d", cap.batch_limit)
                    todo.appendleft(chunk)
                    continue
            if len(chunk) == 1:
                out.status[chunk[0]] = "failed"
                out.error[chunk[0]] = ("cuda_oom: " if oom else "") + _short(exc)
                continue
            todo.extendleft(reversed([[i] for i in chunk]))  # isolate the bad row(s)
            continue
        if len(results) != len(chunk):
            raise RuntimeError(
                f"{type(cap).__name__}.generate returned {len(results)} outputs for "
                f"{len(chunk)} images"
            )
        _BATCHES += 1
        out.batches += 1
        for i, res in zip(chunk, results, strict=True):
            out.caption[i], out.status[i], out.tokens[i] = res.text, "ok", res.tokens
            out.image_tokens[i], out.padding[i], out.batch[i] = (
                res.image_tokens, res.padding, _BATCHES)
            out.flags[i] = ",".join(
                caption_flags(res.text, hit_limit=res.hit_limit, language=spec.settings.language)
            )


def caption_images(spec: CaptionSpec, images: Sequence[bytes | None],
                   cap: Captioner | None = None, *, by_size: bool = True) -> Captioned:
    """Caption encoded images (one window); one row per input, in input order.

    `by_size`: group images of similar token counts into batches (the default; False
    keeps input order, which pads every batch to its largest image)."""
    from concurrent.futures import ThreadPoolExecutor

    s = spec.settings
    out = Captioned.empty(len(images))
    sizes: dict[int, tuple[int, int]] = {}
    for i, data in enumerate(images):
        try:
            sizes[i] = target_size(*image_size(data), s.min_pixels, s.max_pixels)
        except ValueError as exc:
            out.status[i], out.error[i] = "bad_image", str(exc)
    if not sizes:
        return out
    cap = cap or get_captioner(spec)
    out.device = cap.device
    rows = list(sizes)
    tokens = [cap.image_tokens(*sizes[i], spec) for i in rows]
    plan = [[rows[j] for j in batch] for batch in plan_batches(
        tokens, cap.max_batch(spec, len(rows)), cap.token_budget(spec), by_size=by_size)]

    def decode(batch: list[int]) -> dict[int, Image | ValueError]:
        got: dict[int, Image | ValueError] = {}
        for i in batch:
            try:
                got[i] = load_image(images[i], s.min_pixels, s.max_pixels)
            except ValueError as exc:  # a header that parses over bytes that do not
                got[i] = exc
        return got

    with ThreadPoolExecutor(1, thread_name_prefix="caption-decode") as pool:
        ahead = pool.submit(decode, plan[0])
        for k in range(len(plan)):
            decoded = ahead.result()
            if k + 1 < len(plan):  # decode the next batch while this one generates
                ahead = pool.submit(decode, plan[k + 1])
            good = {}
            for i, img in decoded.items():
                if isinstance(img, ValueError):
                    out.status[i], out.error[i] = "bad_image", str(img)
                else:
                    good[i] = img
            if good:
                _generate_batch(cap, spec, list(good), good, out)
    missing = [i for i, st in enumerate(out.status) if st is None]
    if missing:  # a bug here, not a bad row
        raise RuntimeError(f"caption_images left rows {missing[:5]} without a status")
    return out
