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
   it then hands the batch to the backend's ``prepare_ahead`` (the transformers backend
   runs its processor there when the version sets ``prepare_ahead``);
4. results go back to their input rows; every row gets a status, and the batch's padding
   is counted (:attr:`Captioned.padding_share`).

Per row: undecodable bytes are ``bad_image`` (never generated); an exception is retried
row by row so only the bad row is ``failed``; CUDA out-of-memory halves the batch size
for the rest of the worker's life and retries. A backend that returns the wrong number
of outputs is a bug and raises.

The models themselves -- settings, spec, the ``vllm`` backend -- are
:mod:`udfs.caption_models`, the ``transformers`` backend (and its fast generation path)
:mod:`udfs.caption_transformers`; this module keeps one loaded backend per Python worker
(:func:`get_captioner`).
"""

from __future__ import annotations

import io
import logging
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from udfs.caption_models import (
    BACKENDS,
    Captioner,
    CaptionSettings,
    CaptionSpec,
    Generated,
    VLLMCaptioner,
    is_oom,
    release_gpu_memory,
)
from udfs.caption_transformers import TransformersCaptioner

if TYPE_CHECKING:
    from PIL.Image import Image

__all__ = [
    "BACKENDS",
    "BACKEND_CLASSES",
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

# ok: captioned. bad_image: the bytes do not decode (permanent, not retried).
# failed: generation raised for this row (retried by the next run).
STATUSES = ("ok", "bad_image", "failed")
# Caption checks: flags, never deletion.
#   empty        nothing but whitespace was generated
#   truncated    generation stopped at max_new_tokens, not at end-of-sequence
#   repetition   a phrase repeats back to back (a generation loop)
#   language_mismatch  the text is mostly not in the expected language's script
CHECK_FLAGS = ("empty", "truncated", "repetition", "language_mismatch")
# The backend a version's `backend` names.
BACKEND_CLASSES: dict[str, type[Captioner]] = {
    "transformers": TransformersCaptioner, "vllm": VLLMCaptioner}


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


# ----------------------------------------------------------------------- the worker's model

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
    release_gpu_memory()


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
        if s.backend not in BACKEND_CLASSES:
            raise ValueError(f"unknown caption backend {s.backend!r} (known: {BACKENDS})")
        _evict_all()
        log.info("loading caption model %s (%s) on %s", spec.model_path, s.backend, device)
        cap = BACKEND_CLASSES[s.backend](spec, device)
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
            oom = is_oom(exc)
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
        # The backend's CPU work for the batch as generate() will get it (the decoded
        # images in plan order), here while the previous batch generates.
        cap.prepare_ahead([im for im in got.values() if not isinstance(im, ValueError)], spec)
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
