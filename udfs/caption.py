"""VLM re-captioning on Spark executors: model cache, batched generation, per-row errors.

:func:`caption_udf` builds an iterator pandas UDF (``Iterator[pd.Series] ->
Iterator[pd.DataFrame]``, the shape of Spark's ``predict_batch_udf``) over a column of
image bytes. Per Python worker the model loads **once**, from a cache in this importable
module (:func:`get_captioner`; a cache in the driver's ``__main__`` would be re-pickled
with every task), and is reused for every batch of every task the worker runs.

Per row the result is a struct (:data:`CAPTION_TYPE`): the caption, a ``status`` from
:data:`STATUSES` and an ``error``, caption-check ``flags``, the number of generated
tokens, and which worker produced it in which of its batches, with how many model
loads it had done by then (the job
reports loads and batches per worker from that). A bad image gives ``bad_image`` with the reason and
never fails the task; a generation error is isolated row by row (``failed``, retried by
the next run); a CUDA out-of-memory error halves the batch and retries.

Backends (:data:`BACKENDS`): Hugging Face ``transformers`` (chat VLMs such as
Qwen2.5-VL / Qwen3-VL through ``AutoProcessor`` and the chat template, or task-prompt
models such as Florence-2 with ``prompt_format: plain``) and ``vllm`` offline batch
inference, imported only when selected. Heavy libraries load lazily, on the executor.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pandas as pd
from pyspark.sql import types as T
from pyspark.sql.functions import pandas_udf

from etl.config import CaptionVersionConfig

__all__ = [
    "BACKENDS",
    "STATUSES",
    "CHECK_FLAGS",
    "CAPTION_TYPE",
    "CaptionSpec",
    "Generated",
    "Captioner",
    "TransformersCaptioner",
    "VLLMCaptioner",
    "get_captioner",
    "model_loads",
    "load_image",
    "caption_flags",
    "caption_images",
    "caption_udf",
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

CAPTION_TYPE = T.StructType(
    [
        T.StructField("caption", T.StringType(), True),
        T.StructField("status", T.StringType(), False),
        T.StructField("error", T.StringType(), True),
        T.StructField("flags", T.StringType(), True),
        T.StructField("tokens", T.IntegerType(), True),
        T.StructField("worker", T.StringType(), False),
        T.StructField("model_loads", T.IntegerType(), False),
        T.StructField("batch", T.IntegerType(), False),
    ]
)


@dataclass(frozen=True)
class CaptionSpec:
    """Everything an executor needs to caption: the configured version (generation
    settings, exactly as parsed) and where its model was resolved to."""

    settings: CaptionVersionConfig
    # A local folder (also the built smoke-test model) or a hub id.
    model_path: str
    # True when model_path is a local folder: no hub look-up at all.
    local_files_only: bool = False

    def cache_key(self, device: str) -> str:
        """What the loaded model depends on: versions differing only in prompt or
        generation settings share one loaded model per worker."""
        s = self.settings
        key = {"model": self.model_path, "backend": s.backend, "dtype": s.dtype,
               "trust_remote_code": s.trust_remote_code,
               "local_files_only": self.local_files_only, "device": device}
        if s.backend == "vllm":  # vLLM bakes the image size range into the engine
            key.update(min_pixels=s.min_pixels, max_pixels=s.max_pixels)
        return json.dumps(key)


@dataclass(frozen=True)
class Generated:
    text: str
    tokens: int
    hit_limit: bool  # stopped at max_new_tokens without an end-of-sequence token


# ----------------------------------------------------------------------- images


def load_image(data: bytes | None, min_pixels: int, max_pixels: int):
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
        detail = re.sub(r" <[^>]* at 0x[0-9a-f]+>", "", str(exc))
        raise ValueError(f"undecodable image: {type(exc).__name__}: {detail}") from None
    w, h = img.size
    pixels = w * h
    scale = 1.0
    if pixels > max_pixels:
        scale = (max_pixels / pixels) ** 0.5
    elif pixels < min_pixels:
        scale = (min_pixels / pixels) ** 0.5
    if scale != 1.0:
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        img = img.resize(size, Image.Resampling.BICUBIC)
    return img


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


def _task_device(device: str) -> str:
    """`cuda` becomes the GPU Spark assigned to this task (``cuda:<address>``)."""
    if device != "cuda":
        return device
    from pyspark import TaskContext

    ctx = TaskContext.get()
    gpus = ctx.resources().get("gpu") if ctx is not None else None
    if gpus is not None and gpus.addresses:
        return f"cuda:{gpus.addresses[0]}"
    return "cuda:0"


class Captioner:
    """A loaded model; :meth:`generate` captions a batch of PIL images for a spec."""

    def __init__(self, spec: CaptionSpec, device: str):
        self.device = device
        # Set after a CUDA out-of-memory error: the batch size that still fits, for the
        # rest of this worker's life.
        self.batch_limit: int | None = None

    def batch_size(self, spec: CaptionSpec) -> int:
        return min(spec.settings.batch_size, self.batch_limit or spec.settings.batch_size)

    def generate(self, images: list, spec: CaptionSpec) -> list[Generated]:  # pragma: no cover
        raise NotImplementedError

    def release_memory(self) -> None:
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover
            pass


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
                f"caption device is cuda but this executor has no usable GPU "
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
        eos = self.model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tok is not None and tok.eos_token_id is not None:
            self._eos.add(tok.eos_token_id)

    def _pixel_kwargs(self, spec: CaptionSpec) -> dict:
        # Qwen-style processors resize to a pixel range themselves: give them ours.
        if not self._takes_pixels:
            return {}
        return {"min_pixels": spec.settings.min_pixels, "max_pixels": spec.settings.max_pixels}

    def _prompt(self, spec: CaptionSpec) -> str:
        if spec.settings.prompt_format == "plain":
            return spec.settings.prompt
        messages = [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": spec.settings.prompt}]}]
        return self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )

    def generate(self, images: list, spec: CaptionSpec) -> list[Generated]:
        import torch

        s = spec.settings
        inputs = self.processor(
            text=[self._prompt(spec)] * len(images), images=images, padding=True,
            return_tensors="pt", **self._pixel_kwargs(spec),
        ).to(self.device)
        if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
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
            new = out[:, inputs["input_ids"].shape[1]:].cpu()  # after the left-padded prompt
        pad = getattr(self.processor.tokenizer, "pad_token_id", None)
        results = []
        for row in new.tolist():
            # Trailing pads after an early end-of-sequence are not generated tokens.
            ended = next((i for i, t in enumerate(row) if t in self._eos), None)
            used = row[: ended + 1] if ended is not None else row
            if ended is None and pad is not None and pad not in self._eos:
                while used and used[-1] == pad:
                    used = used[:-1]
            text = self.processor.tokenizer.decode(used, skip_special_tokens=True)
            hit = ended is None and len(row) >= s.max_new_tokens
            results.append(Generated(text.strip(), len(used), hit))
        return results


class VLLMCaptioner(Captioner):
    """vLLM offline batch inference (``LLM.generate`` with multi-modal inputs).

    Optional: ``pip install 'lakeshard[vllm]'`` on the executors (it brings its own torch
    build; install it on GPU images only)."""

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
        dtype = "auto" if spec.settings.dtype == "auto" else spec.settings.dtype
        self.llm = LLM(
            model=spec.model_path,
            dtype=dtype,
            trust_remote_code=spec.settings.trust_remote_code,
            seed=spec.settings.seed,
            limit_mm_per_prompt={"image": 1},
            mm_processor_kwargs={"min_pixels": spec.settings.min_pixels,
                                 "max_pixels": spec.settings.max_pixels},
        )
        self.processor = AutoProcessor.from_pretrained(
            spec.model_path, local_files_only=spec.local_files_only,
            trust_remote_code=spec.settings.trust_remote_code,
        )

    def generate(self, images: list, spec: CaptionSpec) -> list[Generated]:
        from vllm import SamplingParams

        s = spec.settings
        if s.prompt_format == "plain":
            prompt = s.prompt
        else:
            messages = [{"role": "user", "content": [
                {"type": "image"}, {"type": "text", "text": s.prompt}]}]
            prompt = self.processor.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
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
        results = []
        for o in outs:
            c = o.outputs[0]
            results.append(Generated(c.text.strip(), len(c.token_ids), c.finish_reason == "length"))
        return results


_BACKEND_CLASSES = {"transformers": TransformersCaptioner, "vllm": VLLMCaptioner}

# The per-Python-worker model cache: spec+device -> loaded captioner.
_CAPTIONERS: dict[str, Captioner] = {}
_LOADS = 0
_BATCHES = 0


def get_captioner(spec: CaptionSpec, device: str | None = None) -> Captioner:
    """The worker's captioner for `spec`, loaded on first use and then reused."""
    global _LOADS
    device = device or _task_device(spec.settings.device)
    key = spec.cache_key(device)
    cap = _CAPTIONERS.get(key)
    if cap is None:
        backend = spec.settings.backend
        if backend not in _BACKEND_CLASSES:
            raise ValueError(f"unknown caption backend {backend!r} (known: {BACKENDS})")
        log.info("loading caption model %s (%s) on %s", spec.model_path, backend, device)
        cap = _BACKEND_CLASSES[backend](spec, device)
        _CAPTIONERS[key] = cap
        _LOADS += 1
        from udfs.worker import settle_imports

        settle_imports()  # torch/transformers + the model: keep per-task GC cheap
    return cap


def model_loads() -> int:
    """How many models this Python worker has loaded so far."""
    return _LOADS


# ----------------------------------------------------------------------- batches


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _generate_rows(cap: Captioner, images: list, spec: CaptionSpec
                   ) -> list[Generated | BaseException]:
    """Generate for `images` in batches of ``spec.settings.batch_size``; never raises for a row.

    Out of memory: halve the batch (for good, in this worker) and retry; at batch size
    1 the row fails. Any other error: retry the batch row by row to isolate the bad one.
    """
    results: list[Generated | BaseException] = []
    i = 0
    while i < len(images):
        size = cap.batch_size(spec)
        chunk = images[i : i + size]
        try:
            results.extend(cap.generate(chunk, spec))
            i += len(chunk)
            continue
        except Exception as exc:  # noqa: BLE001 - becomes the row's status
            if _is_oom(exc):
                cap.release_memory()
                if size > 1:
                    cap.batch_limit = max(1, size // 2)
                    log.warning("CUDA out of memory: caption batch size now %d",
                                cap.batch_limit)
                    continue
                results.append(exc)
                i += 1
                continue
            if len(chunk) == 1:
                results.append(exc)
                i += 1
                continue
        for img in chunk:  # isolate the failing row(s)
            try:
                results.extend(cap.generate([img], spec))
            except Exception as exc:  # noqa: BLE001
                if _is_oom(exc):
                    cap.release_memory()
                results.append(exc)
        i += len(chunk)
    return results


def caption_images(spec: CaptionSpec, images: pd.Series, cap: Captioner | None = None
                   ) -> pd.DataFrame:
    """Caption a Series of image bytes; one row of :data:`CAPTION_TYPE` per input row."""
    global _BATCHES
    _BATCHES += 1
    n = len(images)
    out = {
        "caption": [None] * n, "status": ["failed"] * n, "error": [None] * n,
        "flags": [None] * n, "tokens": [None] * n,
    }
    decoded, where = [], []
    for i, data in enumerate(images):
        try:
            decoded.append(load_image(data, spec.settings.min_pixels, spec.settings.max_pixels))
            where.append(i)
        except ValueError as exc:
            out["status"][i], out["error"][i] = "bad_image", str(exc)
    if decoded:
        cap = cap or get_captioner(spec)
        for i, res in zip(where, _generate_rows(cap, decoded, spec), strict=True):
            if isinstance(res, BaseException):
                out["error"][i] = ("cuda_oom: " if _is_oom(res) else "") + _short(res)
                continue
            out["caption"][i] = res.text
            out["status"][i] = "ok"
            out["tokens"][i] = res.tokens
            out["flags"][i] = ",".join(
                caption_flags(res.text, hit_limit=res.hit_limit, language=spec.settings.language)
            )
    out["worker"] = [f"{socket.gethostname()}:{os.getpid()}"] * n
    out["model_loads"] = [model_loads()] * n
    out["batch"] = [_BATCHES] * n
    frame = pd.DataFrame(out, columns=CAPTION_TYPE.fieldNames())
    frame["tokens"] = pd.array(out["tokens"], dtype="Int32")
    return frame


def caption_udf(spec: CaptionSpec):
    """An iterator pandas UDF: image bytes -> :data:`CAPTION_TYPE` struct."""

    @pandas_udf(CAPTION_TYPE)
    def caption(batches: Iterator[pd.Series]) -> Iterator[pd.DataFrame]:
        for images in batches:
            # The model loads on the first batch with a decodable image, from the
            # worker's cache when an earlier task already loaded it.
            yield caption_images(spec, images)

    return caption
